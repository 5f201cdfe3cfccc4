// The launches of nsa_decode's kernels for one element type, instantiated in nsa_decode_bf16.cu and
// nsa_decode_fp16.cu (one compile unit per type keeps the head-dim instantiations apart).
#pragma once

#include <cuda_runtime.h>

#include "cuda/nsa_decode/kernels.cuh"
#include "cuda/nsa_decode/plan.h"

namespace sparseattn::cuda::nsa_dec {

template <class T>
void launch_nsa_decode(const NsaDecodeArgs<T>& args, const Plan& plan, cudaStream_t stream);

}  // namespace sparseattn::cuda::nsa_dec
