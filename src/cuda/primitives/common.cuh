// Device helpers shared by the CUDA kernels: element conversion, strided token views, launch checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "sparseattn/tensor.h"

namespace sparseattn::cuda {

// log2(e) and ln(2): the kernels' softmax runs in the exp2 domain (scores prescaled by scale * log2(e)). Host code
// forms scale * log2(e) in double before rounding it to float.
inline constexpr double kLog2eDouble = 1.4426950408889634;
inline constexpr float kLog2e = static_cast<float>(kLog2eDouble);
inline constexpr float kLn2 = 0.6931471805599453f;

template <class T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float(float x) { return x; }
template <> __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float(float x) { return x; }
template <> __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }

// A token tensor [B, T, H, D] (packed [N, H, D] is seen as B = 1) by pointer and element strides; the
// innermost stride is 1 (validated by the API).
template <class T>
struct Tokens {
  T* data;
  std::int64_t batch_stride, row_stride, head_stride;

  __device__ __forceinline__ T* row(std::int64_t b, std::int64_t t, std::int64_t h) const {
    return data + b * batch_stride + t * row_stride + h * head_stride;
  }
};

template <class T>
Tokens<T> tokens_of(const TensorView& view) {
  const bool packed = view.rank == 3;
  return {static_cast<T*>(view.data), packed ? 0 : view.stride[0], view.stride[packed ? 0 : 1],
          view.stride[packed ? 1 : 2]};
}

// One value per (batch, token, head), any strides: a gate [B, T, H] (packed [N, H]) or, through lse_of, a
// log-sum-exp-like row tensor [B, H, T] (packed [H, N]) such as lse and delta.
template <class T>
struct PerHead {
  T* data;
  std::int64_t batch_stride, row_stride, head_stride;

  __device__ __forceinline__ T& at(std::int64_t b, std::int64_t t, std::int64_t h) const {
    return data[b * batch_stride + t * row_stride + h * head_stride];
  }
};

template <class T>
PerHead<T> per_head_of(const TensorView& view) {
  const bool packed = view.rank == 2;
  return {static_cast<T*>(view.data), packed ? 0 : view.stride[0], view.stride[packed ? 0 : 1],
          view.stride[packed ? 1 : 2]};
}

// The same view over a tensor laid out like lse: [B, H, T] (packed [H, N]).
template <class T>
using LseView = PerHead<T>;

template <class T>
LseView<T> lse_of(const TensorView& view) {
  const bool packed = view.rank == 2;
  return {static_cast<T*>(view.data), packed ? 0 : view.stride[0], view.stride[packed ? 1 : 2],
          view.stride[packed ? 0 : 1]};
}

// Programmatic dependent launch (sm_90 and later; nothing on older GPUs). A kernel that launch_dependent
// (launch.cuh) starts may begin while the kernel before it on the stream still runs: it calls
// wait_for_previous_grid() before it reads or writes anything, which returns once that kernel has finished and its
// writes are visible. The kernel before it calls allow_next_grid() when its CTAs are near their end, so that the
// next kernel's CTAs are scheduled while the last ones finish instead of after the grid has drained.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether this CTA is the last of `expected` CTAs to arrive at `counter` (an int32 the caller zeroed before the
// kernel), after every thread's writes so far: they are made visible device-wide before the count, and the last
// CTA fences before it reads the others' writes (which it reads through L2, e.g. with __ldcg). `flag` is a
// __shared__ int of the CTA. Every thread of the CTA calls it.
__device__ __forceinline__ bool last_to_arrive(std::int32_t* counter, int expected, int& flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) flag = atomicAdd(counter, 1) == expected - 1;
  __syncthreads();
  const bool last = flag != 0;
  if (last) __threadfence();
  return last;
}

// Zeroes `bytes` at `data` on `stream` (a memset node when captured); throws naming `what` if the memset cannot be
// queued.
inline void zero_async(void* data, std::size_t bytes, cudaStream_t stream, const char* what) {
  const cudaError_t status = cudaMemsetAsync(data, 0, bytes, stream);
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("sparseattn: cudaMemsetAsync of ") + what + " failed: " +
                             cudaGetErrorString(status));
  }
}

// Throws if the last launch failed to start (bad configuration). Asynchronous faults surface later, at
// the caller's next synchronisation, as with every CUDA library; no host sync happens here.
inline void check_launch(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("sparseattn: launch of ") + kernel + " failed: " +
                             cudaGetErrorString(status));
  }
}

// The device's SM count (the grid of persistent kernels); 1 if the query fails.
inline int multiprocessors(int device_index) {
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device_index) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  return count > 1 ? count : 1;
}

// Makes the tensors' device current for the duration of a call (kernels launch on the current device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

template <class T>
struct TypeTag {
  using type = T;
};

// Calls body(TypeTag<T>{}) with the CUDA element type T of a 16/32-bit float dtype; the body reads it
// back as `using T = typename decltype(tag)::type;`.
template <class Body>
void dispatch_float(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::float16: body(TypeTag<__half>{}); break;
    case DType::bfloat16: body(TypeTag<__nv_bfloat16>{}); break;
    case DType::float32: body(TypeTag<float>{}); break;
    default: throw std::logic_error("sparseattn: dtype not dispatched to CUDA (the API validates this)");
  }
}

// Whether every row of `t` starts 16-byte aligned and its last dimension splits into whole 16-byte pieces.
inline bool vector_rows(const TensorView& t) {
  const std::int64_t piece = 16 / static_cast<std::int64_t>(element_size(t.dtype));
  if (reinterpret_cast<std::uintptr_t>(t.data) % 16 != 0 || t.shape[t.rank - 1] % piece != 0) return false;
  for (int d = 0; d + 1 < t.rank; ++d) {
    if (t.shape[d] > 1 && t.stride[d] % piece != 0) return false;
  }
  return true;
}

__host__ __device__ inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

}  // namespace sparseattn::cuda
