// CUDA entry point of accumulate (internal elementwise sum), torch-free. Params are validated by src/api before it
// runs; it only enqueues work on params.stream and never synchronises or allocates.
#pragma once

#include "core/accumulate_params.h"

namespace sparseattn::cuda {

void accumulate(const detail::AccumulateParams& params);

}  // namespace sparseattn::cuda
