// The head-dim configurations with kernels, and the explicit instantiations that live in one .cu each
// (inst_<mask>_<Dqk>.cu) to keep compile units small.
#pragma once

#include "cuda/attention/launch.cuh"

#define SPARSEATTN_ATTENTION_CONFIGS(X) X(64, 64) X(128, 128) X(192, 128) X(256, 256)

#define SPARSEATTN_ATTENTION_DECLARE_ONE(T, DQK, DV, MASK)                                                   \
  extern template void run_forward<T, DQK, DV, MASK>(const AttnArgs<T>&, const MASK::Config&, const Launch&); \
  extern template void run_backward<T, DQK, DV, MASK>(const AttnArgs<T>&, const MASK::Config&, const Launch&);

namespace sparseattn::cuda::attention {
#define SPARSEATTN_ATTENTION_DECLARE(DQK, DV)                           \
  SPARSEATTN_ATTENTION_DECLARE_ONE(__half, DQK, DV, FlashMask)          \
  SPARSEATTN_ATTENTION_DECLARE_ONE(__nv_bfloat16, DQK, DV, FlashMask)   \
  SPARSEATTN_ATTENTION_DECLARE_ONE(__half, DQK, DV, CompressedMask)     \
  SPARSEATTN_ATTENTION_DECLARE_ONE(__nv_bfloat16, DQK, DV, CompressedMask)
SPARSEATTN_ATTENTION_CONFIGS(SPARSEATTN_ATTENTION_DECLARE)
#undef SPARSEATTN_ATTENTION_DECLARE
}  // namespace sparseattn::cuda::attention
