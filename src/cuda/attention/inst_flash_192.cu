// Explicit instantiation: FlashMask, Dqk = 192, Dv = 128, fp16 and bf16.
#include "cuda/attention/launch.cuh"

namespace sparseattn::cuda::attention {
template void run_forward<__half, 192, 128, FlashMask>(const AttnArgs<__half>&, const FlashMask::Config&, const Launch&);
template void run_backward<__half, 192, 128, FlashMask>(const AttnArgs<__half>&, const FlashMask::Config&, const Launch&);
template void run_forward<__nv_bfloat16, 192, 128, FlashMask>(const AttnArgs<__nv_bfloat16>&, const FlashMask::Config&, const Launch&);
template void run_backward<__nv_bfloat16, 192, 128, FlashMask>(const AttnArgs<__nv_bfloat16>&, const FlashMask::Config&, const Launch&);
}  // namespace sparseattn::cuda::attention
