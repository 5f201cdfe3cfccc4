// nsa_decode's launches for __half.
#include "cuda/nsa_decode/launch.cuh"

namespace sparseattn::cuda::nsa_dec {
template void launch_nsa_decode<__half>(const NsaDecodeArgs<__half>&, const Plan&, cudaStream_t);
}  // namespace sparseattn::cuda::nsa_dec
