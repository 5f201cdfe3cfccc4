// compress_kv_backward that adds other gradients of k and v into its outputs (core/compress_backward_terms.h).
// Internal: nsa_attention_backward sums its branches' dK/dV this way.
#pragma once

#include "core/compress_backward_terms.h"
#include "sparseattn/compress_kv.h"

namespace sparseattn::detail {

// dk = the sum of terms.dk + the gradient through the pooling of dk_cmp; dv alike. Packed rows past
// cu_seqlens[B] are left untouched, as compress_kv_backward leaves them.
void compress_kv_backward_adding(const CompressKvBackwardParams& params, const CompressBackwardTerms& terms);

}  // namespace sparseattn::detail
