#pragma once

namespace sparseattn {

inline constexpr const char* kVersion = "0.1.0";

// True when this build contains CUDA kernels (nvcc was found at configure time).
bool built_with_cuda();

}  // namespace sparseattn
