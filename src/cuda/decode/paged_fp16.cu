// flash_decode's kernels for a paged cache in fp16, every head-dim pair and warp layout.
#include "cuda/decode/launch.cuh"

namespace sparseattn::cuda::decode {

template void launch_decode_kernel<__half, true>(const DecodeArgs<__half>&, const DecodePlan&,
                                                 int, int, cudaStream_t);

}  // namespace sparseattn::cuda::decode
