// selected_attention backward on tensor cores (mma.sync m16n8k16, fp32 accumulation).
//
// dQ has two paths, picked on the host from shapes by selection::use_kv_outer_dq (backward_plan.h):
//  - query-outer (query_outer.cu, like the query-outer forward): one warp per (token t, KV head h, chunk of 16
//    query heads of the group), the heads its 16 mma rows, so small groups waste most of the tile and every token
//    re-reads its n blocks' K and V. (It replaced a kernel of four warps per token that split each 64-key tile's
//    keys and dQ's columns among them, exchanged dS through shared memory and waited for every tile's K and V
//    right after issuing their copies: H100, D = 128, 64/4, T = 64K: 21.3 -> 16.4 ms, T = 8K: 2.33 -> 1.73 ms;
//    192/128, 64K: 29.7 -> 27.4 ms);
//  - KV-block-outer (dq_kv.cu, the FSA forward's design): per selected block, gathered query rows of many
//    tokens, compact partial dQ per (token, query head, slot), merged in slot order. H100, bf16, D = 128,
//    T = 64K, n = 16, block 64, NSA-like indices, dQ time query-outer -> KV-block-outer (sort + kernel +
//    merge): G = 1 (Hq/Hkv 32/32) 225.9 -> 40.2 ms, G = 2 (16/8) 56.2 -> 13.7, G = 4 (16/4) 28.7 -> 11.9,
//    G = 8 (32/4) 28.9 -> 23.1, G = 16 (64/4) 29.3 -> 44.9 (slower). With swizzled tiles (tile.cuh) the
//    query-outer dQ got 1.4x faster; on wgmma (dq_kv_wgmma.cuh, sm_90a) the KV-block-outer one wins up to
//    G = 8 (backward_plan.h) and runs there.
//
// dK/dV are KV-block-outer (the FSA idea): an inverse index (for each sequence, KV head and selection block, the
// ascending tokens whose index row lists it; inverse_index.h) is built in the workspace by a stable radix sort. Its
// segments are cut into chunks of at most C tokens (chunks.cuh; C is dkv_chunk_tokens of backward_plan.h): block 0,
// which NSA forces into every row, is selected by every token, and one CTA walking it alone set the kernel time (H100,
// 64/4 as above: 144.7 ms before, 33.6 ms chunked; 32/32: 29.7 -> 20.9 ms). One CTA per (chunk, 64-key tile of the
// block, Dqk/Dv half for head dims > 128) gathers its tokens' query rows (all G heads, 32 (token, head) rows at a time)
// and accumulates dK and dV in registers: warp w owns keys [16w, 16w+16) of the tile and computes S^T = K Q^T and dP^T
// = V dO^T directly in key-major form, so no reduction across warps is needed. On sm_90a at 64/64, 128/128 and 192/128
// the same task runs on warpgroup MMAs with 64-row gathers (32 at 192/128; dkv_wgmma.cuh; H100, 64/4, T = 64K: 27.2 ->
// 16.3 ms, 32/32: 17.2 -> 12.4 ms, 64/4 at 192/128: 62.1 -> 15.7 ms); the two kernels share the task and the epilogue
// (dkv.cuh). A segment that fits one chunk writes dK/dV directly; the chunks of a longer one write fp32 partials to
// their own workspace slots and dkv_reduce_kernel sums them in chunk order. No float atomics anywhere: the backward
// is deterministic.
//
// Workspace (shapes only): delta, the inverse index (4 x 4 bytes per (token, KV head, slot) entry + the
// radix sort's scratch), the chunk table (16 bytes per (KV head, block)), the dK/dV partials (at most
// kDkvPartialCap = 256 MB, see dkv_chunk_tokens) and, on the KV-block-outer dQ path, its partials (at most
// about kDqKvPartialCap = 256 MB: (KV head, token) pairs go in chunks, dq_kv_chunk_pairs; a chunk holds at
// least one pair).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <stdexcept>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"
#include "cuda/selection/chunks.cuh"
#include "cuda/selection/common.cuh"
#include "cuda/selection/dkv.cuh"
#include "cuda/selection/dkv_wgmma.cuh"
#include "cuda/selection/dq_kv.h"
#include "cuda/selection/inverse_index.h"
#include "cuda/selection/kernels.h"
#include "cuda/selection/launch.cuh"
#include "cuda/selection/ops.h"
#include "cuda/selection/tile.cuh"

namespace sparseattn::cuda {

namespace {

using selection::DkvConfig;
using selection::IndexView;
using selection::kLog2e;
using selection::SeqTable;
using selection::SmemTile;

constexpr int kThreads = 128;
constexpr int kKeys = 64;     // keys per tile (16 per warp)
constexpr int kGather = 32;   // (token, head) rows per gathered chunk in the dK/dV kernel

// delta[row_g, hq] = sum_d dO * O in fp32 (one warp per (row, head)); row_g = batch * rows + row.
template <class T>
__global__ void delta_kernel(Tokens<const T> o, Tokens<const T> d_o, float* delta, std::int64_t rows,
                             std::int64_t total_rows, std::int64_t heads, std::int64_t dim) {
  const std::int64_t item = std::int64_t{blockIdx.x} * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= total_rows * heads) return;
  const std::int64_t row_g = item / heads, hq = item % heads;
  const std::int64_t b = row_g / rows, r = row_g % rows;
  const T* op = o.row(b, r, hq);
  const T* dp = d_o.row(b, r, hq);
  float sum = 0.f;
  for (std::int64_t d = threadIdx.x % 32; d < dim; d += 32) sum += to_float(op[d]) * to_float(dp[d]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (threadIdx.x % 32 == 0) delta[item] = sum;
}

// ------------------------------------------------------------------------------------------------ dK / dV

template <class T, int DQK, int DV>
struct DkvSmem {
  using K = SmemTile<T, kKeys, DQK>;
  using V = SmemTile<T, kKeys, DV>;
  using Q = SmemTile<T, kGather, DQK>;
  using DO = SmemTile<T, kGather, DV>;
  static constexpr std::size_t kElements = K::kElements + V::kElements + Q::kElements + DO::kElements;
  static constexpr std::size_t kBytes = kElements * sizeof(T) + 4 * kGather * sizeof(float);
};

template <class T, int DQK, int DV, int SPLIT>
__global__ void __launch_bounds__(kThreads) selected_dkv_kernel(
    Tokens<const T> q, Tokens<const T> k, Tokens<const T> v, LseView<const float> lse, Tokens<const T> d_o,
    LseView<const float> delta, LseView<const float> p_scale, const std::int32_t* offsets,
    const std::int32_t* seg_begin, const std::int32_t* seg_end, const std::int32_t* tokens,
    const std::uint64_t* chunk_scan, float* partials, Tokens<T> dk, Tokens<T> dv, SeqTable seqs, DkvConfig c) {
  using S = DkvSmem<T, DQK, DV>;
  constexpr int kCk = DQK / SPLIT, kCv = DV / SPLIT;  // dK / dV columns of this CTA
  extern __shared__ __align__(128) unsigned char smem_raw[];  // as the wgmma kernel of this unit declares it
  T* base = reinterpret_cast<T*>(smem_raw);
  const typename S::K ks{base};
  const typename S::V vs{ks.base + S::K::kElements};
  const typename S::Q qs{vs.base + S::V::kElements};
  const typename S::DO dos{qs.base + S::Q::kElements};
  float* lse_s = reinterpret_cast<float*>(dos.base + S::DO::kElements);
  float* delta_s = lse_s + kGather;
  float* scale_s = delta_s + kGather;  // the P factor (p_scale_at)
  int* pos_s = reinterpret_cast<int*>(scale_s + kGather);

  const std::int64_t half = blockIdx.y % SPLIT;
  const selection::DkvTask task = selection::dkv_task(chunk_scan, offsets, seg_begin, seg_end, seqs, c,
                                                      blockIdx.y / SPLIT, kKeys);
  if (task.first >= task.end) return;
  const auto& seq = task.seq;
  const std::int64_t h = task.h, first = task.first, end = task.end, list_begin = task.list_begin,
                     pairs = task.pairs;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  selection::load_rows<T, kKeys, DQK, kThreads>(
      ks, [&](int r) { return first + r < end ? k.row(seq.batch, seq.begin + first + r, h) : nullptr; },
      k.row(seq.batch, seq.begin + first, h));
  selection::load_rows<T, kKeys, DV, kThreads>(
      vs, [&](int r) { return first + r < end ? v.row(seq.batch, seq.begin + first + r, h) : nullptr; },
      v.row(seq.batch, seq.begin + first, h));
  cp_async_commit();

  float dk_acc[kCk / 8][4] = {}, dv_acc[kCv / 8][4] = {};
  const int k_lo = warp * 16 + lane / 4, k_hi = k_lo + 8;  // key rows of this thread in the tile
  const T* q_fallback = q.row(seq.batch, seq.begin, 0);
  const T* do_fallback = d_o.row(seq.batch, seq.begin, 0);
  const std::uint32_t group32 = static_cast<std::uint32_t>(c.group);
  // Query head h * G of the sequence's token 0; head h * G + g is g head strides further.
  const auto x_head = [&](const Tokens<const T>& x) { return x.row(seq.batch, seq.begin, h * c.group); };
  for (std::int64_t p0 = 0; p0 < pairs; p0 += kGather) {
    __syncthreads();  // the previous chunk is done with qs, dos, *_s
    // Pair p0 + r is (token list_begin + (p0 + r) / G, head (p0 + r) % G): 32-bit division (pairs < 2^31).
    auto q_row = [&](int r, const Tokens<const T>& x) -> const T* {
      const std::int64_t pidx = p0 + r;
      if (pidx >= pairs) return nullptr;
      const std::uint32_t token = static_cast<std::uint32_t>(pidx) / group32;
      const std::int64_t pos = tokens[list_begin + token];
      return x_head(x) + pos * x.row_stride + (static_cast<std::uint32_t>(pidx) - token * group32) * x.head_stride;
    };
    selection::load_rows<T, kGather, DQK, kThreads>(qs, [&](int r) { return q_row(r, q); }, q_fallback);
    selection::load_rows<T, kGather, DV, kThreads>(dos, [&](int r) { return q_row(r, d_o); }, do_fallback);
    cp_async_commit();
    if (threadIdx.x < kGather) {
      const int r = threadIdx.x;
      const std::int64_t pidx = p0 + r;
      float lv = INFINITY, dl = 0.f, g = 0.f;
      int pos = -1;
      if (pidx < pairs) {
        const std::uint32_t token = static_cast<std::uint32_t>(pidx) / group32;
        pos = tokens[list_begin + token];
        const std::int64_t hq = h * c.group + (static_cast<std::uint32_t>(pidx) - token * group32);
        const float x = lse.at(seq.batch, seq.begin + pos, hq);
        if (x != -INFINITY) lv = x * kLog2e;
        dl = delta.at(seq.batch, seq.begin + pos, hq);
        g = selection::p_scale_at(p_scale, seq.batch, seq.begin + pos, hq);
      }
      lse_s[r] = lv;
      delta_s[r] = dl;
      scale_s[r] = g;
      pos_s[r] = pos;
    }
    cp_async_wait<0>();
    __syncthreads();

    // S^T and dP^T: 16 keys of this warp x 32 gathered rows.
    float st[kGather / 8][4] = {}, dpt[kGather / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < DQK / 16; ++kk) {
      std::uint32_t a[4];
      selection::load_a(a, ks, warp * 16, kk * 16);
#pragma unroll
      for (int np = 0; np < kGather / 16; ++np) {
        std::uint32_t bq[4];
        selection::load_b_rows(bq, qs, np * 16, kk * 16);
        selection::mma_pair<T>(st[2 * np], st[2 * np + 1], a, bq);
      }
    }
#pragma unroll
    for (int kk = 0; kk < DV / 16; ++kk) {
      std::uint32_t a[4];
      selection::load_a(a, vs, warp * 16, kk * 16);
#pragma unroll
      for (int np = 0; np < kGather / 16; ++np) {
        std::uint32_t bo[4];
        selection::load_b_rows(bo, dos, np * 16, kk * 16);
        selection::mma_pair<T>(dpt[2 * np], dpt[2 * np + 1], a, bo);
      }
    }
    // P^T and dS^T in place.
#pragma unroll
    for (int nt = 0; nt < kGather / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * (lane % 4) + (e & 1);
        const std::int64_t s = first + (e < 2 ? k_lo : k_hi);
        const int pos = pos_s[col];
        const bool visible = s < end && pos >= 0 && s <= pos;
        const float p = visible ? fast_exp2(fmaf(st[nt][e], c.scale_log2, -lse_s[col])) * scale_s[col] : 0.f;
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - delta_s[col]);
      }
    }
    // dV += P^T dO, dK += dS^T Q (k = the 32 gathered rows, two k-steps).
#pragma unroll
    for (int kk = 0; kk < kGather / 16; ++kk) {
      std::uint32_t ap[4], ads[4];
      ap[0] = pack2<T>(st[2 * kk][0], st[2 * kk][1]);
      ap[1] = pack2<T>(st[2 * kk][2], st[2 * kk][3]);
      ap[2] = pack2<T>(st[2 * kk + 1][0], st[2 * kk + 1][1]);
      ap[3] = pack2<T>(st[2 * kk + 1][2], st[2 * kk + 1][3]);
      ads[0] = pack2<T>(dpt[2 * kk][0], dpt[2 * kk][1]);
      ads[1] = pack2<T>(dpt[2 * kk][2], dpt[2 * kk][3]);
      ads[2] = pack2<T>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
      ads[3] = pack2<T>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
      for (int np = 0; np < kCv / 16; ++np) {
        std::uint32_t bo[4];
        selection::load_b_cols(bo, dos, kk * 16, static_cast<int>(half) * kCv + np * 16);
        selection::mma_pair<T>(dv_acc[2 * np], dv_acc[2 * np + 1], ap, bo);
      }
#pragma unroll
      for (int np = 0; np < kCk / 16; ++np) {
        std::uint32_t bq[4];
        selection::load_b_cols(bq, qs, kk * 16, static_cast<int>(half) * kCk + np * 16);
        selection::mma_pair<T>(dk_acc[2 * np], dk_acc[2 * np + 1], ads, bq);
      }
    }
  }
  cp_async_wait<0>();
  selection::store_dkv<T, DQK, DV, kCk, kCv>(dk_acc, dv_acc, task, c, warp * 16, static_cast<int>(half) * kCk,
                                             static_cast<int>(half) * kCv, partials, dk, dv);
}

// dK/dV of the split segments: one CTA per key; the sum of its partial slots in chunk order.
template <class T>
__global__ void dkv_reduce_kernel(const std::uint64_t* chunk_scan, const float* partials, const std::int32_t* offsets,
                                  Tokens<T> dk, Tokens<T> dv, SeqTable seqs, DkvConfig c, int dqk, int dv_dim) {
  const std::int64_t key = blockIdx.x;
  const std::int64_t end_slot = static_cast<std::int64_t>(chunk_scan[key] >> 32);
  const std::int64_t slot0 = key > 0 ? static_cast<std::int64_t>(chunk_scan[key - 1] >> 32) : 0;
  if (end_slot == slot0) return;
  const selection::BlockOf w = selection::block_of(static_cast<std::uint64_t>(key), c.blocks_bound, c.blocks_per_seq,
                                                   offsets, c.batch, c.packed);
  const auto seq = seqs[w.seq];
  const std::int64_t first = w.block * c.block;
  const std::int64_t rows = min(c.block, seq.length - first);
  const std::int64_t stride = c.block * (dqk + dv_dim);
  const std::int64_t dk_pairs = rows * dqk / 2, pairs = dk_pairs + rows * dv_dim / 2;
  for (std::int64_t i = threadIdx.x; i < pairs; i += blockDim.x) {
    const bool is_k = i < dk_pairs;
    const std::int64_t e = is_k ? 2 * i : 2 * (i - dk_pairs);
    const int dim = is_k ? dqk : dv_dim;
    const std::int64_t r = e / dim, col = e % dim;
    const std::int64_t off = is_k ? e : c.block * dqk + e;
    float2 acc = make_float2(0.f, 0.f);
    for (std::int64_t sl = slot0; sl < end_slot; ++sl) {
      const float2 x = *reinterpret_cast<const float2*>(partials + sl * stride + off);
      acc.x += x.x;
      acc.y += x.y;
    }
    const float mul = is_k ? c.scale : 1.f;
    T* dst = (is_k ? dk : dv).row(seq.batch, seq.begin + first + r, w.head) + col;
    dst[0] = from_float<T>(acc.x * mul);
    dst[1] = from_float<T>(acc.y * mul);
  }
}

// ------------------------------------------------------------------------------------------------- host

// The backward's workspace, from shapes only.
struct BwdPlan {
  selection::HostShape shape;
  std::int64_t heads_q, heads_kv, num_idx, block;
  std::int64_t total_rows;     // B*T or N
  std::int64_t blocks_bound;   // selection blocks of all sequences (per KV head), an upper bound
  std::int64_t blocks_per_seq; // batched: ceil(T / block)
  std::int64_t entries;        // total_rows * Hkv * n
  std::int64_t keys;           // Hkv * blocks_bound
  std::int64_t chunk_tokens;   // tokens per dK/dV chunk (dkv_chunk_tokens)
  std::int64_t slots;          // partial slots: an upper bound of the chunks of all split segments
  std::int64_t grid;           // dK/dV CTAs along x: slots + keys
  std::uint32_t sentinel;
  int end_bit;
  std::size_t delta, offsets, keys_in, keys_out, values_in, values_out, seg_begin, seg_end, temp, temp_bytes,
      counts, scan, scan_temp, scan_temp_bytes, partials, total;
  bool dq_kv;                  // KV-block-outer dQ (dq_kv.h) instead of the query-outer one
  std::int64_t dq_chunk_pairs; // its (KV head, token row) pairs per chunk
  selection::SortGroup dq_sort; // its chunks per sort (forward_plan.h)
  std::size_t dq_half, dq_scale;
};

std::size_t smem_optin(int device) {
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();
    return 48 * 1024;
  }
  return static_cast<std::size_t>(bytes);
}

BwdPlan plan_of(const SelectedAttentionBackwardParams& p) {
  BwdPlan plan{};
  plan.shape = selection::host_shape(p.q, p.seqs);
  plan.heads_q = p.q.shape[p.q.rank - 2];
  plan.heads_kv = p.k.shape[p.k.rank - 2];
  plan.num_idx = p.indices.shape[p.indices.rank - 1];
  plan.block = p.block;
  const auto& s = plan.shape;
  plan.total_rows = s.packed ? s.rows : s.batch * s.rows;
  plan.blocks_per_seq = (s.rows + p.block - 1) / p.block;
  plan.blocks_bound = s.packed ? s.rows / p.block + s.batch : s.batch * plan.blocks_per_seq;
  plan.entries = plan.total_rows * plan.heads_kv * plan.num_idx;
  const std::int64_t keys = plan.heads_kv * plan.blocks_bound;
  if (keys >= (std::int64_t{1} << 31) - 1 || plan.entries >= (std::int64_t{1} << 31) - 1) {
    throw std::length_error("sparseattn: selected_attention_backward: tokens x KV heads x n exceeds 2^31 entries");
  }
  plan.sentinel = static_cast<std::uint32_t>(keys);
  plan.end_bit = selection::key_end_bit(plan.sentinel);
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t offset = at;
    at = selection::align_up(at + bytes);
    return offset;
  };
  plan.delta = take(sizeof(float) * plan.total_rows * plan.heads_q);
  plan.offsets = take(sizeof(std::int32_t) * (s.batch + 1));
  plan.keys_in = take(sizeof(std::uint32_t) * plan.entries);
  plan.keys_out = take(sizeof(std::uint32_t) * plan.entries);
  plan.values_in = take(sizeof(std::int32_t) * plan.entries);
  plan.values_out = take(sizeof(std::int32_t) * plan.entries);
  plan.seg_begin = take(sizeof(std::int32_t) * keys);
  plan.seg_end = take(sizeof(std::int32_t) * keys);
  const std::int64_t dqk = p.q.shape[p.q.rank - 1], dv = p.v.shape[p.v.rank - 1];
  const std::int64_t group = plan.heads_kv > 0 ? plan.heads_q / plan.heads_kv : 0;
  {
    const DeviceGuard device(p.q.device_index);
    plan.dq_kv = selection::choose_kv_outer_dq(selection::parse_path_choice(std::getenv(selection::kDqEnv)), group,
                                               dqk, dv, plan.total_rows, plan.num_idx, plan.block,
                                               smem_optin(p.q.device_index));
    plan.temp_bytes = selection::radix_sort_temp_bytes(plan.entries, plan.end_bit);
    if (plan.dq_kv) {
      // The KV-block-outer dQ sorts groups of its chunks in the dK/dV's index buffers (sized for every entry).
      const std::int64_t pairs = plan.total_rows * plan.heads_kv;
      plan.dq_chunk_pairs = selection::dq_kv_chunk_pairs(pairs, group, plan.num_idx, dqk);
      plan.dq_sort = selection::sort_group(ceil_div(pairs, plan.dq_chunk_pairs), plan.dq_chunk_pairs * plan.num_idx,
                                           plan.end_bit);
      plan.temp_bytes =
          std::max(plan.temp_bytes, selection::radix_sort_temp_bytes(plan.entries, plan.dq_sort.end_bit));
    }
  }
  plan.temp = take(plan.temp_bytes);
  plan.keys = keys;
  plan.chunk_tokens = selection::dkv_chunk_tokens(plan.entries, plan.heads_q / std::max<std::int64_t>(1, plan.heads_kv),
                                       plan.num_idx, plan.block, dqk, dv);
  plan.slots = 2 * plan.entries / plan.chunk_tokens;
  plan.grid = plan.slots + keys;
  plan.counts = take(sizeof(std::uint64_t) * keys);
  plan.scan = take(sizeof(std::uint64_t) * keys);
  {
    const DeviceGuard device(p.q.device_index);
    plan.scan_temp_bytes = selection::chunk_scan_temp_bytes(keys);
  }
  plan.scan_temp = take(plan.scan_temp_bytes);
  plan.partials = take(sizeof(float) * plan.slots * plan.block * (dqk + dv));
  if (plan.dq_kv) {
    const std::size_t partials = static_cast<std::size_t>(plan.dq_chunk_pairs * group * plan.num_idx);
    plan.dq_half = take(sizeof(std::uint16_t) * partials * dqk);
    plan.dq_scale = take(sizeof(float) * partials);
  }
  plan.total = at + 256;  // slack: the base is only promised 16-byte aligned
  return plan;
}

}  // namespace

std::size_t selected_attention_backward_workspace_size(const SelectedAttentionBackwardParams& p) {
  return plan_of(p).total;
}

void selected_attention_backward(const SelectedAttentionBackwardParams& p,
                                 const detail::BranchBackwardOptions& options) {
  const TensorView& given_delta = options.delta;
  const DeviceGuard device(p.q.device_index);
  const BwdPlan plan = plan_of(p);
  const selection::HostShape& s = plan.shape;
  const std::int64_t dqk = p.q.shape[p.q.rank - 1], dv = p.v.shape[p.v.rank - 1];
  if (s.batch <= 0 || s.max_len <= 0 || plan.heads_q <= 0) return;
  const auto stream = static_cast<cudaStream_t>(p.stream);
  unsigned char* ws = selection::aligned_workspace(p.workspace);
  // delta = rowsum(dO * O): the caller's (laid out like lse), else computed into the workspace as [rows][Hq].
  float* const delta_ws = reinterpret_cast<float*>(ws + plan.delta);
  const LseView<const float> delta = given_delta.present()
                                         ? lse_of<const float>(given_delta)
                                         : LseView<const float>{delta_ws, s.rows * plan.heads_q, plan.heads_q, 1};
  // The P factor: an NSA branch gate folded into this backward (api/branch_backward.h); null: 1.
  const LseView<const float> p_scale = options.d_o_scale.present() ? lse_of<const float>(options.d_o_scale)
                                                                   : LseView<const float>{nullptr, 0, 0, 0};
  auto* offsets = reinterpret_cast<std::int32_t*>(ws + plan.offsets);
  auto* keys_in = reinterpret_cast<std::uint32_t*>(ws + plan.keys_in);
  auto* keys_out = reinterpret_cast<std::uint32_t*>(ws + plan.keys_out);
  auto* values_in = reinterpret_cast<std::int32_t*>(ws + plan.values_in);
  auto* values_out = reinterpret_cast<std::int32_t*>(ws + plan.values_out);
  auto* seg_begin = reinterpret_cast<std::int32_t*>(ws + plan.seg_begin);
  auto* seg_end = reinterpret_cast<std::int32_t*>(ws + plan.seg_end);
  auto* counts = reinterpret_cast<std::uint64_t*>(ws + plan.counts);
  auto* scan = reinterpret_cast<std::uint64_t*>(ws + plan.scan);
  auto* partials = reinterpret_cast<float*>(ws + plan.partials);
  const std::int64_t group = plan.heads_q / plan.heads_kv;
  const double scale = softmax_scale(p.scale, dqk);
  const float scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const SeqTable table = selection::seq_table(s, p.seqs);
  const auto* cu = static_cast<const std::int32_t*>(p.seqs.cu_seqlens.data);
  const std::int64_t keys = plan.heads_kv * plan.blocks_bound;

  selection::dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // 1. delta = rowsum(dO * O).
    if (plan.total_rows * plan.heads_q > 0 && !given_delta.present()) {
      const std::int64_t items = plan.total_rows * plan.heads_q;
      delta_kernel<T><<<static_cast<unsigned>(ceil_div(items, 8)), 256, 0, stream>>>(
          tokens_of<const T>(p.o), tokens_of<const T>(p.d_o), delta_ws, s.rows, plan.total_rows,
          plan.heads_q, dv);
      check_launch("delta_kernel");
    }
    // 2. Inverse index: block offsets (packed), keys, stable sort, segments.
    if (s.packed) selection::launch_block_offsets(cu, s.batch, plan.block, offsets, stream);
    const selection::KeyConfig kc{plan.num_idx, plan.block, s.rows, s.batch, plan.blocks_per_seq, plan.total_rows,
                                  /*pair0=*/0, plan.total_rows * plan.heads_kv,
                                  /*chunk_pairs=*/plan.total_rows * plan.heads_kv, /*chunk_shift=*/0,
                                  static_cast<std::uint32_t>(plan.blocks_bound), plan.sentinel, s.packed,
                                  /*value_is_entry=*/false};
    selection::launch_make_keys(selection::index_of(p.indices), cu, offsets, kc, keys_in, values_in, stream);
    selection::radix_sort_pairs(ws + plan.temp, plan.temp_bytes, keys_in, keys_out, values_in, values_out,
                                plan.entries, plan.end_bit, stream);
    selection::launch_segments(keys_out, plan.entries, plan.sentinel, seg_begin, seg_end, keys, stream);
    selection::dispatch_dims(dqk, dv, [&](auto dqk_c, auto dv_c) {
      constexpr int DQK = decltype(dqk_c)::value, DV = decltype(dv_c)::value;
      // 3. dQ, query-outer (or KV-block-outer after step 4).
      if (!plan.dq_kv) selection::dq_query_outer(p, delta, p_scale, options.accumulate_dq);
      // 4. dK, dV, KV-block-outer over the inverse index cut into chunks (chunks.cuh).
      {
        constexpr int SPLIT = DQK > 128 ? 2 : 1;
        const std::int64_t subtiles = (plan.block + kKeys - 1) / kKeys;
        const DkvConfig c{plan.heads_kv, group, plan.block, s.rows, plan.blocks_per_seq, s.batch, keys,
                          plan.chunk_tokens, static_cast<std::uint32_t>(plan.blocks_bound), s.packed,
                          static_cast<float>(scale), scale_log2};
        const selection::ChunkConfig cc{keys, plan.chunk_tokens, plan.block, plan.blocks_per_seq, s.batch,
                                        static_cast<std::uint32_t>(plan.blocks_bound), s.packed};
        selection::launch_chunk_counts(seg_begin, seg_end, offsets, table, cc, counts, stream);
        selection::chunk_scan(ws + plan.scan_temp, plan.scan_temp_bytes, counts, scan, keys, stream);
        // The wgmma kernel where it runs (sm_90a; 64/64, 128/128, 192/128), else the mma.sync one; same arguments.
        auto kernel = selected_dkv_kernel<T, DQK, DV, SPLIT>;
        std::size_t smem = DkvSmem<T, DQK, DV>::kBytes;
        std::int64_t split = SPLIT;
        if constexpr (selection::DkvWgmmaTile<DQK, DV>::kSupported) {
          auto wgmma_kernel = selection::selected_dkv_wgmma_kernel<T, DQK, DV>;
          if (wgmma::kernel_runs(wgmma_kernel)) {
            kernel = wgmma_kernel;
            smem = selection::DkvWgmmaTile<DQK, DV>::kSmemBytes;
            split = 1;
          }
        }
        selection::set_smem(kernel, smem);
        const dim3 grid(static_cast<unsigned>(plan.grid), static_cast<unsigned>(subtiles * split));
        kernel<<<grid, kThreads, smem, stream>>>(
            tokens_of<const T>(p.q), tokens_of<const T>(p.k), tokens_of<const T>(p.v),
            lse_of<const float>(p.lse), tokens_of<const T>(p.d_o), delta, p_scale, offsets, seg_begin,
            seg_end, values_out, scan, partials, tokens_of<T>(p.dk), tokens_of<T>(p.dv), table, c);
        check_launch("selected_dkv_kernel");
        if (plan.slots > 0) {
          dkv_reduce_kernel<T><<<static_cast<unsigned>(keys), 256, 0, stream>>>(
              scan, partials, offsets, tokens_of<T>(p.dk), tokens_of<T>(p.dv), table, c, DQK, DV);
          check_launch("dkv_reduce_kernel");
        }
      }
      // 5. dQ, KV-block-outer (dq_kv.h); reuses the inverse index's buffers, which step 4 is done with.
      if (plan.dq_kv) {
        selection::DqKvArgs a{};
        a.heads_q = plan.heads_q;
        a.heads_kv = plan.heads_kv;
        a.group = group;
        a.num_idx = plan.num_idx;
        a.block = plan.block;
        a.rows = s.rows;
        a.batch = s.batch;
        a.blocks_per_seq = plan.blocks_per_seq;
        a.total_rows = plan.total_rows;
        a.chunk_pairs = plan.dq_chunk_pairs;
        a.blocks_bound = static_cast<std::uint32_t>(plan.blocks_bound);
        a.sentinel = plan.sentinel;
        a.end_bit = plan.end_bit;
        a.sort = plan.dq_sort;
        a.packed = s.packed;
        a.scale = static_cast<float>(scale);
        a.scale_log2 = scale_log2;
        a.cu_seqlens = s.packed ? cu : nullptr;
        a.offsets = offsets;
        a.delta = delta;
        a.p_scale = p_scale;
        a.accumulate_dq = options.accumulate_dq;
        a.keys_in = keys_in;
        a.keys_out = keys_out;
        a.values_in = values_in;
        a.values_out = values_out;
        a.temp = ws + plan.temp;
        a.temp_bytes = plan.temp_bytes;
        a.dq_half = ws + plan.dq_half;
        a.dq_scale = reinterpret_cast<float*>(ws + plan.dq_scale);
        selection::dq_kv_outer(p, a);
      }
    });
  });
}

}  // namespace sparseattn::cuda
