// Host-side helpers shared by the selected-attention launchers: dtype and head-dim dispatch, shared-memory
// opt-in, workspace alignment, and the log2 constants of the exp2-domain softmax.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "cuda/common.cuh"
#include "sparseattn/tensor.h"

namespace sparseattn::cuda::selection {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// Calls body(DQK, DV) as integral constants for the instantiated (Dqk, Dv) pairs.
template <class Body>
void dispatch_dims(std::int64_t dqk, std::int64_t dv, Body&& body) {
  if (dqk == 64 && dv == 64) return body(std::integral_constant<int, 64>{}, std::integral_constant<int, 64>{});
  if (dqk == 128 && dv == 128) return body(std::integral_constant<int, 128>{}, std::integral_constant<int, 128>{});
  if (dqk == 192 && dv == 128) return body(std::integral_constant<int, 192>{}, std::integral_constant<int, 128>{});
  if (dqk == 256 && dv == 256) return body(std::integral_constant<int, 256>{}, std::integral_constant<int, 256>{});
  throw std::logic_error("sparseattn: selected_attention head dims not dispatched (the API validates this)");
}

template <class Body>
void dispatch_16bit(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::float16: body(TypeTag<__half>{}); break;
    case DType::bfloat16: body(TypeTag<__nv_bfloat16>{}); break;
    default: throw std::logic_error("sparseattn: selected_attention takes float16 or bfloat16 on CUDA");
  }
}

template <class Kernel>
void set_smem(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

inline std::size_t align_up(std::size_t x) { return (x + 255) / 256 * 256; }

// The workspace base rounded up to 256 bytes (the API promises 16; the plans add 256 bytes of slack).
inline unsigned char* aligned_workspace(void* workspace) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(workspace) + 255) / 256 * 256);
}

}  // namespace sparseattn::cuda::selection
