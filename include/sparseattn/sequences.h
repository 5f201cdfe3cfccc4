// How tokens are grouped into sequences, and the NSA block arithmetic every operation shares.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

#include "sparseattn/tensor.h"

namespace sparseattn {

// Batched layout: token tensors are [B, T, H, D] and `cu_seqlens` is absent.
// Packed (varlen) layout: token tensors are [N, H, D] (all sequences back to back) and `cu_seqlens` is
// int32 [B+1] with cu_seqlens[0] == 0, non-decreasing, cu_seqlens[B] <= N. Rows past cu_seqlens[B] are
// ignored on input and left untouched on output.
struct Sequences {
  TensorView cu_seqlens;        // int32 [B+1], on the device of the data; absent for the batched layout
  std::int64_t max_seqlen = 0;  // packed only: an upper bound of every length (0: use N); sizes GPU grids
};

// The softmax scale every attention operation uses: the caller's, else 1/sqrt(Dqk).
inline double softmax_scale(const std::optional<double>& scale, std::int64_t dim_qk) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(dim_qk));
}

// Number of compressed blocks of a sequence of `length` tokens: block j covers [j*stride, j*stride+block).
inline std::int64_t num_compressed_blocks(std::int64_t length, std::int64_t block, std::int64_t stride) {
  return length >= block ? (length - block) / stride + 1 : 0;
}

// Number of selection blocks of a sequence: block b covers [b*block, (b+1)*block).
inline std::int64_t num_selection_blocks(std::int64_t length, std::int64_t block) {
  return (length + block - 1) / block;
}

// Rows a packed compressed K/V tensor needs for N packed tokens, whatever the split into sequences:
// sum_b num_compressed_blocks(T_b) <= sum_b floor(T_b / stride) <= N / stride (because block >= stride).
inline std::int64_t compressed_rows_bound(std::int64_t total_tokens, std::int64_t stride) {
  return total_tokens / stride;
}

}  // namespace sparseattn
