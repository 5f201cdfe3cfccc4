// Helpers shared by the selection kernels: where each sequence lives, and log-sum-exp views.
#pragma once

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/softmax.cuh"
#include "sparseattn/sequences.h"
#include "sparseattn/tensor.h"

namespace sparseattn::cuda::selection {

// Sequence b: batched sequences are batch rows of fixed length; packed ones are read from cu_seqlens on
// the device (no host sync).
struct SeqTable {
  const std::int32_t* cu_seqlens;  // null for batched
  std::int64_t batched_length;     // T for batched
  std::int64_t count;              // B

  struct Seq {
    std::int64_t batch, begin, length;
  };
  __device__ __forceinline__ Seq operator[](std::int64_t b) const {
    if (cu_seqlens == nullptr) return {b, 0, batched_length};
    return {0, cu_seqlens[b], std::int64_t{cu_seqlens[b + 1]} - cu_seqlens[b]};
  }
};

// The last s in [0, count) with bounds[s] <= x, for ascending bounds with bounds[0] <= x: the sequence of packed
// row x when bounds is cu_seqlens, of global block x when bounds are the per-sequence block offsets.
__device__ __forceinline__ std::int64_t last_at_most(const std::int32_t* bounds, std::int64_t count, std::int64_t x) {
  std::int64_t lo = 0, hi = count;
  while (hi - lo > 1) {
    const std::int64_t mid = (lo + hi) / 2;
    if (bounds[mid] <= x) lo = mid; else hi = mid;
  }
  return lo;
}

// Host-side shape facts of a token tensor [B, T, H, D] / packed [N, H, D].
struct HostShape {
  bool packed;
  std::int64_t batch;    // B (packed: cu_seqlens.shape[0] - 1)
  std::int64_t rows;     // T (packed: N)
  std::int64_t max_len;  // upper bound of every sequence length
};

inline HostShape host_shape(const TensorView& tokens, const Sequences& seqs) {
  const bool packed = tokens.rank == 3;
  const std::int64_t rows = tokens.shape[packed ? 0 : 1];
  HostShape s{packed, packed ? seqs.cu_seqlens.shape[0] - 1 : tokens.shape[0], rows, rows};
  if (packed && seqs.max_seqlen > 0 && seqs.max_seqlen < rows) s.max_len = seqs.max_seqlen;
  return s;
}

inline SeqTable seq_table(const HostShape& s, const Sequences& seqs) {
  return {s.packed ? static_cast<const std::int32_t*>(seqs.cu_seqlens.data) : nullptr, s.rows, s.batch};
}

// The P factor of row (b, row, h) in a backward: the gate of an NSA branch folded into it (api/branch_backward.h:
// P becomes g P); 1 without one (data null).
__device__ __forceinline__ float p_scale_at(const LseView<const float>& p_scale, std::int64_t b, std::int64_t row,
                                            std::int64_t h) {
  return p_scale.data == nullptr ? 1.f : p_scale.at(b, row, h);
}

// Indices [B, T, Hkv, n] (packed [N, Hkv, n]); the innermost stride is 1.
struct IndexView {
  const std::int32_t* data;
  std::int64_t batch_stride, row_stride, head_stride;
  __device__ __forceinline__ const std::int32_t* row(std::int64_t b, std::int64_t t, std::int64_t h) const {
    return data + b * batch_stride + t * row_stride + h * head_stride;
  }
};

inline IndexView index_of(const TensorView& view) {
  const bool packed = view.rank == 3;
  return {static_cast<const std::int32_t*>(view.data), packed ? 0 : view.stride[0], view.stride[packed ? 0 : 1],
          view.stride[packed ? 1 : 2]};
}

}  // namespace sparseattn::cuda::selection
