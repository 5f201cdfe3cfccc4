// CUDA entry points of combine (the gated sum of the NSA branches), torch-free. Params are validated by src/api
// before these run; each function only enqueues work on params.stream and never synchronises or allocates.
#pragma once

#include <array>

#include "sparseattn/combine.h"

namespace sparseattn::cuda {

void combine(const CombineParams& params);
// deltas and scales (optional per branch): float32 like lse; see core/branch_backward_options.h.
void combine_backward(const CombineBackwardParams& params, const std::array<TensorView, kNumBranches>& deltas,
                      const std::array<TensorView, kNumBranches>& scales);

}  // namespace sparseattn::cuda
