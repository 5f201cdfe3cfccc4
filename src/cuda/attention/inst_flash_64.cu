// Explicit instantiation: FlashMask, Dqk = 64, Dv = 64, fp16 and bf16.
#include "cuda/attention/launch.cuh"

namespace sparseattn::cuda::attention {
template void run_forward<__half, 64, 64, FlashMask>(const AttnArgs<__half>&, const FlashMask::Config&, const Launch&);
template void run_backward<__half, 64, 64, FlashMask>(const AttnArgs<__half>&, const FlashMask::Config&, const Launch&);
template void run_forward<__nv_bfloat16, 64, 64, FlashMask>(const AttnArgs<__nv_bfloat16>&, const FlashMask::Config&, const Launch&);
template void run_backward<__nv_bfloat16, 64, 64, FlashMask>(const AttnArgs<__nv_bfloat16>&, const FlashMask::Config&, const Launch&);
}  // namespace sparseattn::cuda::attention
