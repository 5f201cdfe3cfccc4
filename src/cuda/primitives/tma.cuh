// Tensor Memory Accelerator (TMA) loads on sm_90: the host encodes a tensor map (CUtensorMap, through the driver's
// cuTensorMapEncodeTiled, found at run time via the CUDA runtime, so nothing links against libcuda), the kernel takes
// it as a `const __grid_constant__ CUtensorMap` parameter, and one thread copies a whole box of the tensor into
// shared memory with one cp.async.bulk.tensor instruction, whose bytes complete an mbarrier's transaction count
// (PTX ISA, "Tensor copy instructions" and "mbarrier expect-tx").
//
// The tensor maps here describe a token tensor (common.cuh's Tokens: [B, T, H, D], packed [N, H, D] as B = 1) as
// dimensions {D, H, T, B}, innermost first, with boxes of {64 elements, 1 head, rows, 1}: one 128-byte panel of 64
// columns of `rows` consecutive tokens of one head, written with the 128-byte swizzle: row r of the box at byte
// 128 r of the destination, its 16-byte chunk c at chunk position c ^ (r % 8) (the swizzle XORs address bits
// [4, 7) with bits [7, 10), so a 1024-byte aligned destination sees the row's index). That is one panel of
// wgmma.cuh's swizzled tiles (swizzled_offset): a tile of C columns is C / 64 such boxes, R * 128 bytes apart.
// Rows outside the tensor read as zero.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only; the driver function is looked up at run time)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mma.cuh"

namespace sparseattn::cuda {

namespace tma {

// ---------------------------------------------------------------------------------------------------- host side

// cuTensorMapEncodeTiled's signature (CUDA 12.0 on), declared here so that no driver library is needed at link time.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, looked up once through the runtime; null where the driver lacks it.
inline EncodeTiled encode_tiled() {
  static const EncodeTiled function = [] {
    void* pointer = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t status =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pointer, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t status = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &pointer, cudaEnableDefault, &found);
#endif
    if (status != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // clear it
      return EncodeTiled{nullptr};
    }
    return reinterpret_cast<EncodeTiled>(pointer);
  }();
  return function;
}

// Whether TMA loads may run on `device`: compute capability 9.0 or later and the driver's encoder found.
inline bool device_supports(int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major >= 9 && encode_tiled() != nullptr;
}

// The run-time switch of a kernel's TMA loads: the environment variable `name` (read at every call, as the path
// switches are), on where it is "1", off where it is "0", `default_on` where it is unset or anything else.
inline bool switch_on(const char* name, bool default_on) {
  const char* choice = std::getenv(name);
  if (choice == nullptr) return default_on;
  if (choice[0] == '1' && choice[1] == '\0') return true;
  if (choice[0] == '0' && choice[1] == '\0') return false;
  return default_on;
}

// The tensor map of token tensor `view` ([B, T, H, D] or packed [N, H, D], 16-bit elements) with boxes of 64
// columns x `rows` tokens x `heads` consecutive heads, rows and heads <= 256 (128-byte swizzle, zero fill outside
// the tensor, L2 promotion by 256 bytes; the attention forward's boxes are 128 rows of one head). A box of several
// heads lands token-major: box row token * heads + head.
// False where TMA cannot describe it: D not a multiple of 64, a base not 16-byte aligned, a stride not a multiple
// of 16 bytes or past 2^40 bytes, a dimension of 2^31 or more (32-bit coordinates), the innermost stride not 1, or
// the encoder refuses. A dimension of size 1 takes a stride of its own choosing (its only coordinate is 0).
inline bool token_map(CUtensorMap* map, const TensorView& view, int rows, int heads_per_box = 1) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr || element_size(view.dtype) != 2) return false;
  const bool packed = view.rank == 3;
  const std::int64_t batch = packed ? 1 : view.shape[0];
  const std::int64_t tokens = view.shape[view.rank - 3], heads = view.shape[view.rank - 2],
                     dim = view.shape[view.rank - 1];
  if (dim % 64 != 0 || view.stride[view.rank - 1] != 1 || rows < 1 || rows > 256) return false;
  if (heads_per_box < 1 || heads_per_box > 256) return false;
  if (reinterpret_cast<std::uintptr_t>(view.data) % 16 != 0) return false;
  if (batch <= 0 || tokens <= 0 || heads <= 0) return false;
  const std::int64_t kElement = 2;
  // Strides in bytes of the head, token and batch dimensions; size-1 dimensions get the extent of those inside.
  std::int64_t head_stride = view.stride[view.rank - 2] * kElement;
  if (heads == 1) head_stride = dim * kElement;
  std::int64_t token_stride = view.stride[view.rank - 3] * kElement;
  if (tokens == 1) token_stride = heads * head_stride;
  std::int64_t batch_stride = packed ? 0 : view.stride[0] * kElement;
  if (batch == 1) batch_stride = tokens * token_stride;
  const cuuint64_t limit = cuuint64_t{1} << 40;
  for (const std::int64_t s : {head_stride, token_stride, batch_stride}) {
    if (s <= 0 || s % 16 != 0 || static_cast<cuuint64_t>(s) >= limit) return false;
  }
  // Coordinates are 32-bit signed: every dimension stays below 2^31.
  for (const std::int64_t d : {dim, heads, tokens, batch}) {
    if (d >= (std::int64_t{1} << 31)) return false;
  }
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(tokens), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(head_stride), static_cast<cuuint64_t>(token_stride),
                                 static_cast<cuuint64_t>(batch_stride)};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(heads_per_box), static_cast<cuuint32_t>(rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type =
      view.dtype == DType::bfloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, type, 4, view.data, dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// -------------------------------------------------------------------------------------------------- device side

// One arrival on `barrier` that also expects `bytes` more of transactions in the current phase: the phase completes
// once the arrivals are in and the copies that name this barrier have written `bytes`.
__device__ __forceinline__ void arrive_expect_bytes(std::uint64_t* barrier, std::uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
#endif
}

// Starts fetching the tensor map into the cache (before its first use).
__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
#endif
}

// Copies the box of `map` at coordinates {c0, c1, c2, c3} (innermost first) to `destination` in shared memory
// (1024-byte aligned for the 128-byte swizzle); its bytes complete on `barrier`. One thread issues it.
__device__ __forceinline__ void load_box(void* destination, const CUtensorMap* map, std::uint64_t* barrier, int c0,
                                         int c1, int c2, int c3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(shared_address(destination)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(shared_address(barrier))
      : "memory");
#endif
}

// A swizzled tile of kRows rows x kDim columns of T (kDim / 64 boxes of `map`, panel p at tile + p * kRows * 64: the
// layout of wgmma.cuh's swizzled tiles) from the box coordinates {64 p, c1, c2, c3}, after one arrival on `barrier`
// that expects the tile's bytes, which complete its phase. One thread issues it.
template <int kRows, int kDim, class T>
__device__ __forceinline__ void load_tile(T* tile, const CUtensorMap* map, std::uint64_t* barrier, int c1, int c2,
                                          int c3) {
  arrive_expect_bytes(barrier, static_cast<std::uint32_t>(kRows * kDim * sizeof(T)));
#pragma unroll
  for (int panel = 0; panel < kDim / 64; ++panel) {
    load_box(tile + panel * kRows * 64, map, barrier, 64 * panel, c1, c2, c3);
  }
}

}  // namespace tma

}  // namespace sparseattn::cuda
