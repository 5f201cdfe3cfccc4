// The launch of the split-KV decode kernel for one dtype and cache form (its instantiation units are
// dense_fp16.cu, dense_bf16.cu, paged_fp16.cu and paged_bf16.cu, so that the four compile in parallel).
#pragma once

#include <cuda_runtime.h>

#include "cuda/decode/kernel.cuh"
#include "cuda/decode/plan.h"

namespace sparseattn::cuda::decode {

// Launches flash_decode_kernel for the head dims (dqk, dv) and the plan's warp layout: one CTA per (row block,
// split, sequence, KV head).
template <class T, bool kPaged>
void launch_decode_kernel(const DecodeArgs<T>& args, const DecodePlan& plan, int dqk, int dv, cudaStream_t stream);

}  // namespace sparseattn::cuda::decode
