// flash_decode's kernels for a dense cache in bf16, every head-dim pair and warp layout.
#include "cuda/decode/launch.cuh"

namespace sparseattn::cuda::decode {

template void launch_decode_kernel<__nv_bfloat16, false>(const DecodeArgs<__nv_bfloat16>&, const DecodePlan&,
                                                         int, int, cudaStream_t);

}  // namespace sparseattn::cuda::decode
