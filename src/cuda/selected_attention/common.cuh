// Views shared by the selected-attention kernels: the block indices, and the P factor of a folded gate.
#pragma once

#include <cstdint>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/sequences.cuh"
#include "cuda/primitives/softmax.cuh"
#include "sparseattn/tensor.h"

namespace sparseattn::cuda::selection {

// The P factor of row (b, row, h) in a backward: the gate of an NSA branch folded into it
// (core/branch_backward_options.h: P becomes g P); 1 without one (data null).
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

// Query chunks (docs/semantics.md section 11): sequence b's T_b queries are the last of its S_b >= T_b keys, and its
// query t sits at key position t + S_b - T_b. The query and key sequences of a call: batched, q's T rows and k's S
// rows; packed, cu_seqlens and the keys' cu_seqlens_k (absent: cu_seqlens).
inline SeqPairTable query_key_table(const TensorView& q, const TensorView& k, const Sequences& seqs,
                                    const Sequences& seqs_k) {
  if (q.rank == 4) return {{nullptr, q.shape[1], q.shape[0]}, {nullptr, k.shape[1], q.shape[0]}};
  const std::int64_t batch = seqs.cu_seqlens.shape[0] - 1;
  const auto* cu = static_cast<const std::int32_t*>(seqs.cu_seqlens.data);
  const auto* cu_k = seqs_k.cu_seqlens.present() ? static_cast<const std::int32_t*>(seqs_k.cu_seqlens.data) : cu;
  return {{cu, 0, batch}, {cu_k, 0, batch}};
}

// The keys' host shape (rows: S or Nk; max_len: the longest key sequence's bound).
inline HostShape key_host_shape(const TensorView& k, const Sequences& seqs, const Sequences& seqs_k) {
  return host_shape(k, seqs_k.cu_seqlens.present() ? seqs_k : seqs);
}

// Whether keys may outnumber queries: the paths that take no query chunk are not chosen for one.
inline bool query_chunk(const TensorView& q, const TensorView& k, const Sequences& seqs_k) {
  return q.rank == 3 ? seqs_k.cu_seqlens.present() : k.rank == 4 && k.shape[1] != q.shape[1];
}

inline IndexView index_of(const TensorView& view) {
  const bool packed = view.rank == 3;
  return {static_cast<const std::int32_t*>(view.data), packed ? 0 : view.stride[0], view.stride[packed ? 0 : 1],
          view.stride[packed ? 1 : 2]};
}

}  // namespace sparseattn::cuda::selection
