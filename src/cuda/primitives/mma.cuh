// Tensor-core and async-copy primitives shared by the attention kernels (PTX wrappers; sm_80 and later).
// Fragment layouts are those of mma.sync m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"):
//   A (16x16, row-major): 4 x b32 registers, each two 16-bit elements;
//   B (16x8, column-major): 2 x b32 registers;  C/D (16x8, fp32): 4 floats, thread (lane) holds
//   rows lane/4 and lane/4 + 8, columns 2*(lane%4) and 2*(lane%4) + 1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace sparseattn::cuda {

// D = A * B + C with fp32 accumulation; T is __half or __nv_bfloat16.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// D = A * B + C for m16n8k8 (fp32 accumulation; T is __half or __nv_bfloat16): A (16x8, row-major) in 2 x b32
// registers, a[0] rows lane/4 and a[1] rows lane/4 + 8, columns 2*(lane%4) and 2*(lane%4) + 1 (the layout of one
// m16n8 C fragment packed to 16 bits: d[0..1] and d[2..3]); B (8x8, column-major) in one b32 register, k rows
// 2*(lane%4) and 2*(lane%4) + 1 of column lane/4. bf16 needs sm_80.
template <class T>
__device__ __forceinline__ void mma_1688(float (&d)[4], const std::uint32_t (&a)[2], std::uint32_t b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b));
  }
}

__device__ __forceinline__ std::uint32_t shared_address(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

// Four 8x8 b16 matrices from shared memory; lane i supplies the row address of row i%8 of matrix i/8.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row_address)));
}

// The same, transposed (loads a row-major tile as the column-major B operand).
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row_address)));
}

__device__ __forceinline__ void ldmatrix_x2(std::uint32_t (&r)[2], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_address(row_address)));
}

__device__ __forceinline__ void ldmatrix_x2_trans(std::uint32_t (&r)[2], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_address(row_address)));
}

// 16-byte global -> shared copy that bypasses L1; `bytes` < 16 zero-fills the rest (0 = pure zero fill,
// used for rows past the end of a sequence).
__device__ __forceinline__ void cp_async_16(void* shared_destination, const void* global_source, int bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared_destination)),
               "l"(global_source), "r"(bytes));
}
// The same for a copy known to be whole: the plain form, without the source-size operand.
__device__ __forceinline__ void cp_async_16_whole(void* shared_destination, const void* global_source) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared_destination)),
               "l"(global_source));
}
// 4 bytes (bytes = 0: zero-filled), through L1 (cp.async.cg takes 16-byte copies only).
__device__ __forceinline__ void cp_async_4(void* shared_destination, const void* global_source, int bytes = 4) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(shared_destination)),
               "l"(global_source), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending)); }

// Two floats -> one b32 register of two 16-bit elements (the A operand of the P.V product).
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&v);
  }
}

// lo += first and hi += second 16-bit element of `pair` (the inverse of pack2, added): for stores that accumulate.
template <class T>
__device__ __forceinline__ void add_unpacked(std::uint32_t pair, float& lo, float& hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pair));
    lo += v.x, hi += v.y;
  } else {
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&pair));
    lo += v.x, hi += v.y;
  }
}

}  // namespace sparseattn::cuda
