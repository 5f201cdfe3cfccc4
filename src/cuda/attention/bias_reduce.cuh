// One entry of flash_attention's bias gradient: the sum, in a fixed order, of the fp32 contributions that the dK/dV
// kernels wrote to the workspace (layout: bias_gradient.h, BiasGradientSink in score_terms.cuh). Host-and-device
// code without CUDA intrinsics, so that the index arithmetic can be checked on the host.
#pragma once

#include <cstdint>

namespace sparseattn::cuda::attention {

struct BiasReduceArgs {
  void* out;  // dbias, of the bias's shape and strides
  int rank;
  std::int64_t shape[4], stride[4];
  const float* workspace;
  bool key_sums;
  int workspace_heads, q_heads, kv_heads, group;
  std::int64_t head_stride, batch_stride, row_stride;
  std::int64_t batch;                               // B (batched) or the sequence count (packed)
  const std::int32_t *cu_seqlens_q, *cu_seqlens_k;  // packed only
};

// Whether workspace head w feeds bias head hb of a bias with `heads` heads (Hq, Hkv or 1; read as Hq first).
__host__ __device__ inline bool bias_head_feeds(const BiasReduceArgs& a, int w, int heads, std::int64_t hb) {
  if (a.workspace_heads == a.q_heads) {  // per query head
    const int mapped = heads == a.q_heads ? w : heads == a.kv_heads ? w / a.group : 0;
    return mapped == hb;
  }
  return heads == 1 || w == hb;  // per KV head: the bias has Hkv heads or 1
}

// Entry `index` (row-major over dbias's shape): its element offset and its sum over the batch rows or sequences
// (ascending), then the workspace heads (ascending) that read it. False for a packed entry that no sequence reads
// (left untouched).
__host__ __device__ inline bool bias_gradient_entry(const BiasReduceArgs& a, std::int64_t index,
                                                    std::int64_t& offset, float& sum) {
  using i64 = std::int64_t;
  i64 c[4] = {0, 0, 0, 0};
  i64 rest = index;
  offset = 0;
  for (int d = a.rank - 1; d >= 0; --d) {
    c[d] = rest % a.shape[d];
    rest /= a.shape[d];
    offset += c[d] * a.stride[d];
  }
  const int heads = static_cast<int>(a.rank == 4 ? a.shape[1] : a.shape[0]);
  const i64 hb = a.rank == 4 ? c[1] : c[0];
  sum = 0.f;
  if (a.rank == 4) {  // batched [Bb, Hb, Tb, S]
    const i64 b_begin = a.shape[0] == 1 ? 0 : c[0], b_end = a.shape[0] == 1 ? a.batch : c[0] + 1;
    for (i64 b = b_begin; b < b_end; ++b) {
      for (int w = 0; w < a.workspace_heads; ++w) {
        if (!bias_head_feeds(a, w, heads, hb)) continue;
        sum += a.key_sums ? a.workspace[w * a.head_stride + b * a.batch_stride + c[3]]
                          : a.workspace[b * a.batch_stride + w * a.head_stride + c[2] * a.row_stride + c[3]];
      }
    }
    return true;
  }
  if (a.rank == 2) {  // key form [Hb, Nk]: entries of the sequences' keys
    const i64 m = c[1];
    if (m < a.cu_seqlens_k[0] || m >= a.cu_seqlens_k[a.batch]) return false;
    for (int w = 0; w < a.workspace_heads; ++w) {
      if (bias_head_feeds(a, w, heads, hb)) sum += a.workspace[w * a.head_stride + m];
    }
    return true;
  }
  if (a.shape[1] == 1) {  // row form shared by every query [Hb, 1, Lk]: column j of every sequence that has key j
    const i64 j = c[2];
    bool read = false;
    for (i64 b = 0; b < a.batch; ++b) {
      const i64 k_begin = a.cu_seqlens_k[b], keys = i64{a.cu_seqlens_k[b + 1]} - k_begin;
      if (j >= keys) continue;
      read = true;
      for (int w = 0; w < a.workspace_heads; ++w) {
        if (bias_head_feeds(a, w, heads, hb)) sum += a.workspace[w * a.head_stride + k_begin + j];
      }
    }
    return read;
  }
  // Row form [Hb, Nq, Lk]: packed query row n of sequence b (the last with cu_seqlens_q[b] <= n), column j.
  const i64 n = c[1], j = c[2];
  if (a.batch <= 0 || n < a.cu_seqlens_q[0] || n >= a.cu_seqlens_q[a.batch]) return false;
  i64 lo = 0, hi = a.batch;
  while (hi - lo > 1) {
    const i64 mid = (lo + hi) / 2;
    if (a.cu_seqlens_q[mid] <= n) lo = mid; else hi = mid;
  }
  if (j >= i64{a.cu_seqlens_k[lo + 1]} - a.cu_seqlens_k[lo]) return false;
  for (int w = 0; w < a.workspace_heads; ++w) {
    if (bias_head_feeds(a, w, heads, hb)) sum += a.workspace[w * a.head_stride + n * a.row_stride + j];
  }
  return true;
}

}  // namespace sparseattn::cuda::attention
