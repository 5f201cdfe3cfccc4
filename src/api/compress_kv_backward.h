// compress_kv_backward that adds other gradients of k and v into its outputs. Internal: nsa_attention_backward
// sums its branches' dK/dV this way, in one pass over dk and dv on CUDA (the pooling's own gradient is never
// stored, and no separate sum reads it back).
#pragma once

#include <array>

#include "sparseattn/compress_kv.h"

namespace sparseattn::detail {

inline constexpr int kMaxCompressTerms = 2;  // nsa_attention adds the selected and sliding-window branches'

struct CompressBackwardTerms {
  // Like dk and dv (shape, dtype, device); entry i of dk and of dv are both present or both absent.
  std::array<TensorView, kMaxCompressTerms> dk, dv;
};

// dk = the sum of terms.dk + the gradient through the pooling of dk_cmp; dv alike. Packed rows past
// cu_seqlens[B] are left untouched, as compress_kv_backward leaves them.
void compress_kv_backward_adding(const CompressKvBackwardParams& params, const CompressBackwardTerms& terms);

}  // namespace sparseattn::detail
