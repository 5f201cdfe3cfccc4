// Explicit instantiation: CompressedMask, Dqk = 128, Dv = 128, fp16 and bf16.
#include "cuda/attention/launch.cuh"

namespace sparseattn::cuda::attention {
template void run_forward<__half, 128, 128, CompressedMask>(const AttnArgs<__half>&, const CompressedMask::Config&, const Launch&);
template void run_backward<__half, 128, 128, CompressedMask>(const AttnArgs<__half>&, const CompressedMask::Config&, const Launch&);
template void run_forward<__nv_bfloat16, 128, 128, CompressedMask>(const AttnArgs<__nv_bfloat16>&, const CompressedMask::Config&, const Launch&);
template void run_backward<__nv_bfloat16, 128, 128, CompressedMask>(const AttnArgs<__nv_bfloat16>&, const CompressedMask::Config&, const Launch&);
}  // namespace sparseattn::cuda::attention
