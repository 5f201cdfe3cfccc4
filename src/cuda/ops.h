// Entry points of the CUDA backend (torch-free). Params are validated by src/api before these run; each
// function only enqueues work on params.stream and never synchronises or allocates.
#pragma once

#include "api/accumulate.h"
#include "api/compress_kv_backward.h"
#include "sparseattn/combine.h"
#include "sparseattn/compress_kv.h"

namespace sparseattn::cuda {

void compress_kv(const CompressKvParams& params);
// dk = terms.dk summed + the gradient through the pooling (dv alike), in one pass.
void compress_kv_backward(const CompressKvBackwardParams& params, const detail::CompressBackwardTerms& terms);
void combine(const CombineParams& params);
// deltas and scales (optional per branch): float32 like lse; see detail::combine_backward (api/branch_backward.h).
void combine_backward(const CombineBackwardParams& params, const std::array<TensorView, kNumBranches>& deltas,
                      const std::array<TensorView, kNumBranches>& scales);
void accumulate(const detail::AccumulateParams& params);

}  // namespace sparseattn::cuda
