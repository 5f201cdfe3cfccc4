// Gradients of k and v that compress_kv's backward adds into its outputs (internal): nsa_attention_backward sums
// its branches' dK/dV this way, in one pass over dk and dv on CUDA (the pooling's own gradient is never stored,
// and no separate sum reads it back).
#pragma once

#include <array>

#include "sparseattn/tensor.h"

namespace sparseattn::detail {

inline constexpr int kMaxCompressTerms = 2;  // nsa_attention adds the selected and sliding-window branches'

struct CompressBackwardTerms {
  // Like dk and dv (shape, dtype, device); entry i of dk and of dv are both present or both absent.
  std::array<TensorView, kMaxCompressTerms> dk, dv;
};

}  // namespace sparseattn::detail
