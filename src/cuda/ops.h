// Entry points of the CUDA backend (torch-free). Params are validated by src/api before these run; each
// function only enqueues work on params.stream and never synchronises or allocates.
#pragma once

#include "api/accumulate.h"
#include "sparseattn/combine.h"
#include "sparseattn/compress_kv.h"

namespace sparseattn::cuda {

void compress_kv(const CompressKvParams& params);
void compress_kv_backward(const CompressKvBackwardParams& params);
void combine(const CombineParams& params);
void combine_backward(const CombineBackwardParams& params);
void accumulate(const detail::AccumulateParams& params);

}  // namespace sparseattn::cuda
