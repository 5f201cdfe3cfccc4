// The parameters of accumulate, the internal elementwise sum of same-shaped tensors that composed operations use
// to add up contributions (nsa_attention_backward sums the gradients of its branches). The API (src/api/
// accumulate.h) validates them; the backends implement the sum.
#pragma once

#include <vector>

#include "sparseattn/tensor.h"

namespace sparseattn::detail {

// Terms one call takes on CUDA (nsa_attention sums at most three).
inline constexpr int kMaxAccumulateTerms = 4;

struct AccumulateParams {
  TensorView out;                 // out: any rank, float; out = the sum of `terms` (0 when there are none)
  std::vector<TensorView> terms;  // like out (shape, dtype, device); a term may be `out` itself (every
                                  // element is read before it is written)
  TensorView cu_seqlens;          // optional int32 [B+1]: `out` is packed and its rows past cu_seqlens[B]
                                  // are left untouched
  Stream stream = nullptr;
};

}  // namespace sparseattn::detail
