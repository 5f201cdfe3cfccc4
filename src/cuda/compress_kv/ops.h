// CUDA entry points of compress_kv (mean pooling), torch-free. Params are validated by src/api before these run;
// each function only enqueues work on params.stream and never synchronises or allocates.
#pragma once

#include "core/compress_backward_terms.h"
#include "sparseattn/compress_kv.h"

namespace sparseattn::cuda {

void compress_kv(const CompressKvParams& params);
// dk = terms.dk summed + the gradient through the pooling (dv alike), in one pass.
void compress_kv_backward(const CompressKvBackwardParams& params, const detail::CompressBackwardTerms& terms);

}  // namespace sparseattn::cuda
