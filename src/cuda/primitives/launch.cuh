// Host-side helpers of the kernel launchers: dtype and head-dim dispatch (the head dims from the one table,
// sparseattn/head_dims.h), the shared-memory opt-in and its limit, and workspace alignment.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "sparseattn/head_dims.h"
#include "cuda/primitives/common.cuh"
#include "sparseattn/tensor.h"

namespace sparseattn::cuda {

// Calls body(DQK, DV) as integral constants for the (Dqk, Dv) pairs of sparseattn/head_dims.h, so that every kernel
// a launcher dispatches to is instantiated for each of them.
template <class Body>
void dispatch_head_dims(std::int64_t dqk, std::int64_t dv, Body&& body) {
#define SPARSEATTN_DISPATCH_HEAD_DIMS(QK, V) \
  if (dqk == QK && dv == V) return body(std::integral_constant<int, QK>{}, std::integral_constant<int, V>{});
  SPARSEATTN_HEAD_DIMS(SPARSEATTN_DISPATCH_HEAD_DIMS)
#undef SPARSEATTN_DISPATCH_HEAD_DIMS
  throw std::logic_error("sparseattn: head dims not dispatched to CUDA (the API validates them)");
}

// Calls body(DQK) as an integral constant for a Dqk of the head-dim pairs (select_blocks reads q and k only).
template <class Body>
void dispatch_head_dim_qk(std::int64_t dqk, Body&& body) {
#define SPARSEATTN_DISPATCH_HEAD_DIM_QK(QK, V) \
  if (dqk == QK) return body(std::integral_constant<int, QK>{});
  SPARSEATTN_HEAD_DIMS(SPARSEATTN_DISPATCH_HEAD_DIM_QK)
#undef SPARSEATTN_DISPATCH_HEAD_DIM_QK
  throw std::logic_error("sparseattn: head dim not dispatched to CUDA (the API validates it)");
}

// Calls body(TypeTag<T>{}) with the CUDA element type of a float16 or bfloat16 dtype.
template <class Body>
void dispatch_16bit(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::float16: body(TypeTag<__half>{}); break;
    case DType::bfloat16: body(TypeTag<__nv_bfloat16>{}); break;
    default: throw std::logic_error("sparseattn: the attention kernels take float16 or bfloat16 (the API validates this)");
  }
}

// Whether launch_dependent uses programmatic dependent launch on `device`: compute capability 9.0 or later, unless
// the environment sets SPARSEATTN_DEPENDENT_LAUNCH=0 (every launch is then an ordinary one).
inline bool dependent_launch_supported(int device) {
  const char* choice = std::getenv("SPARSEATTN_DEPENDENT_LAUNCH");
  if (choice != nullptr && choice[0] == '0') return false;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major >= 9;
}

// Launches `kernel` on `stream` so that it may start while the stream's previous kernel finishes (programmatic
// dependent launch, where `dependent` is true and the device supports it): the kernel must call
// wait_for_previous_grid() (common.cuh) before it touches memory. Otherwise an ordinary launch.
template <class... Params, class... Args>
void launch_dependent(bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = dependent ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Lets `kernel` take `bytes` of dynamic shared memory: above 48 KB a kernel needs the opt-in.
template <class Kernel>
void set_dynamic_smem(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

// The most dynamic shared memory a CTA of `device` can opt in to (227 KB on an H100, 163 KB on an A100); 0 when
// the query fails, which the plans read as "no kernel that needs the opt-in".
inline std::size_t smem_optin_bytes(int device) {
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();  // clear it
    return 0;
  }
  return static_cast<std::size_t>(bytes);
}

// Workspace slices start at 256-byte offsets.
inline std::size_t align_up(std::size_t x) { return (x + 255) / 256 * 256; }

// The workspace base rounded up to 256 bytes (the API promises 16; the plans add 256 bytes of slack).
inline unsigned char* aligned_workspace(void* workspace) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(workspace) + 255) / 256 * 256);
}

}  // namespace sparseattn::cuda
