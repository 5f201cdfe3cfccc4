// nsa_decode's launches for __nv_bfloat16.
#include "cuda/nsa_decode/launch.cuh"

namespace sparseattn::cuda::nsa_dec {
template void launch_nsa_decode<__nv_bfloat16>(const NsaDecodeArgs<__nv_bfloat16>&, const Plan&, cudaStream_t);
}  // namespace sparseattn::cuda::nsa_dec
