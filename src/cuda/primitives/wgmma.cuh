// Hopper warpgroup MMA (wgmma.mma_async, sm_90a) primitives: the 128-byte swizzled shared-memory layout, its
// descriptors and tile loads, the fences around asynchronous MMAs, and m64nNk16 MMAs (N = 32, 64, 128; 192 as two)
// with bf16/fp16 inputs and fp32 accumulators. The device code is compiled only for sm_90a
// (SPARSEATTN_WGMMA_ENABLED); the host launches a wgmma kernel only after kernel_runs() says the running device
// executes that code.
//
// Layout (PTX ISA, "Asynchronous Warpgroup Level Matrix Shared Memory Layout", 128-byte swizzle): a tile of
// R rows x C 16-bit columns (C a multiple of 64) is stored as C/64 panels of R rows x 128 bytes; in row r the
// 16-byte chunk c sits at chunk position c ^ (r % 8) (swizzled_offset). Eight rows of a panel form a 1024-byte
// swizzle atom (tiles start 1024-byte aligned). Any 8 chunks of one row, or one chunk column of 8 rows, hit
// all 32 banks: the tensor cores and the cp.async writers read and write without conflicts (the layout without
// swizzle, 8x8 core matrices, has bank conflicts that cost wgmma its advantage over mma.sync).
//  - K-major operand (rows = M or N, columns = K, e.g. Q and K for Q K^T): start at the operand's first row
//    and its K offset inside the panel (a k16 step inside a panel moves the start by 32 bytes; the hardware
//    applies the swizzle to the final address), stride byte offset 1024 (next 8 rows);
//  - MN-major operand (rows = K, columns = N, e.g. V for P V; wgmma's transpose flag): leading byte offset =
//    the panel stride R * 128 (next 64 columns of N), stride byte offset 1024 (next 8 rows of K).
// Accumulators: thread t of warp w in the warpgroup holds rows 16w + t/4 and 16w + t/4 + 8; per 8 columns n,
// d[4n + i] is column 8n + 2(t%4) + i%2 of the row i/2 picks: the mma.sync m16n8 C fragment repeated along N.
// An A operand from registers uses the mma.sync m16n8k16 A fragment of the warp's 16 rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mma.cuh"
#include "cuda/primitives/pipeline.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPARSEATTN_WGMMA_ENABLED 1
#else
#define SPARSEATTN_WGMMA_ENABLED 0
#endif

namespace sparseattn::cuda::wgmma {

// Host: whether a wgmma kernel runs. SPARSEATTN_ATTENTION_MMA=sync forces the mma.sync kernels of attention,
// selected attention and select_blocks (the tests use it to cover them on Hopper); otherwise yes when the
// running device executes the kernel's sm_90a code (not on A100, nor on Hopper from a build without the 90a
// target, where the kernel body is empty).
template <class Kernel>
bool kernel_runs(Kernel kernel) {
  const char* choice = std::getenv("SPARSEATTN_ATTENTION_MMA");
  if (choice != nullptr && std::string_view(choice) == "sync") return false;
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attributes.binaryVersion == 90 && attributes.ptxVersion == 90;
}

// Swizzle atoms are 1024 bytes; tiles start at multiples of this.
inline constexpr int kTileAlignment = 1024;

// Element offset of (row, col) in an R-row swizzled tile.
template <int kRows>
__host__ __device__ constexpr int swizzled_offset(int row, int col) {
  return (col >> 6) * kRows * 64 + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

__device__ __forceinline__ std::uint64_t descriptor(const void* smem, std::uint32_t leading_bytes,
                                                    std::uint32_t stride_bytes) {
  const std::uint32_t address = shared_address(smem);
  return static_cast<std::uint64_t>((address & 0x3FFFF) >> 4) |
         (static_cast<std::uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<std::uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32) |
         (std::uint64_t{1} << 62);  // 128-byte swizzle, base offset 0 (atoms 1024-byte aligned)
}

// Byte offset, inside an R-row tile of 16-bit elements, where the operand starting at (row0, col0) begins.
template <int kRows>
__host__ __device__ constexpr std::uint32_t operand_offset(int row0, int col0) {
  return 2 * ((col0 >> 6) * kRows * 64 + row0 * 64 + (col0 & 63));
}

// Operand at rows [row0, ...) and K columns [col0, col0 + 16) of an R-row tile (row0 % 8 == 0, col0 % 16 == 0).
template <int kRows, class T>
__device__ __forceinline__ std::uint64_t k_major_descriptor(const T* tile, int row0, int col0) {
  return descriptor(reinterpret_cast<const char*>(tile) + operand_offset<kRows>(row0, col0), 16, 1024);
}

// Operand at K rows [row0, row0 + 16) and N columns [col0, ...) of an R-row tile (col0 % 64 == 0).
template <int kRows, class T>
__device__ __forceinline__ std::uint64_t mn_major_descriptor(const T* tile, int row0, int col0) {
  return descriptor(reinterpret_cast<const char*>(tile) + operand_offset<kRows>(row0, col0), kRows * 128, 1024);
}

// A descriptor moved `bytes` (a multiple of 16) further into shared memory: the start address is its low field
// (address / 16, 14 bits) and shared addresses stay below 2^18, so the sum never carries out of it. With the
// offsets known at compile time, a k-loop of MMAs costs one integer add per operand instead of a descriptor.
// The add is on the low 32 bits alone: the high half (stride, swizzle) stays a compile-time constant that the
// compiler keeps in a uniform register, where a 64-bit add would cost an add with carry and a move of both
// halves into uniform registers per MMA.
__device__ __forceinline__ std::uint64_t advance(std::uint64_t desc, std::uint32_t bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | (static_cast<std::uint32_t>(desc) + (bytes >> 4));
}

// Copies rows [row0, row0 + valid) of head h into a kRows x kDim swizzled tile (the layout above), zero-filling the
// rest. Eight consecutive threads move the 8 chunks of 16 bytes of one 128-byte row piece: one coalesced
// global read, and a conflict-free shared-memory write. Where the threads cover whole rows a multiple of 8
// apart (64 and 128 columns), a thread keeps one chunk column, so its swizzle is the same in every row it
// copies: one address computation, then one pointer increment per pass, and no predicates when the tile is
// whole (the common case; these loads are issued by the threads that run the softmax, so their instructions
// count). Wider rows that the threads do not cover so (192 columns) are copied as 64-column panels, each the
// same way; otherwise each chunk is placed on its own. kUnroll: passes unrolled (a producer warpgroup with few
// registers unrolls less: each unrolled pass holds a 64-bit address).
template <int kRows, int kDim, int kThreadCount, int kUnroll = kRows, class T, class G>  // G: T or const T
__device__ __forceinline__ void load_swizzled_tile(T* smem, const Tokens<G>& g, std::int64_t b, std::int64_t row0,
                                                   std::int64_t valid, std::int64_t h) {
  static_assert(kDim % 64 == 0, "swizzled tiles: whole 128-byte panels");
  constexpr int kChunks = kDim / 8, kRowStep = kThreadCount / kChunks;
  if constexpr (kThreadCount % kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0) {
    const int c = threadIdx.x % kChunks, r0 = threadIdx.x / kChunks;
    const int rows = valid < kRows ? static_cast<int>(valid) : kRows;
    const G* src = g.row(b, row0, h) + r0 * g.row_stride + c * 8;
    const std::int64_t pass_stride = kRowStep * g.row_stride;
    T* dst = smem + swizzled_offset<kRows>(r0, c * 8);
    if (rows == kRows) {
#pragma unroll(kUnroll)
      for (int i = 0; i < kRows / kRowStep; ++i, src += pass_stride) cp_async_16(dst + i * kRowStep * 64, src, 16);
    } else {
#pragma unroll(kUnroll)
      for (int i = 0; i < kRows / kRowStep; ++i, src += pass_stride) {
        const bool ok = r0 + i * kRowStep < rows;
        cp_async_16(dst + i * kRowStep * 64, ok ? src : g.data, ok ? 16 : 0);
      }
    }
  } else if constexpr (kDim > 64 && kThreadCount % 64 == 0 && kRows % (kThreadCount / 8) == 0) {
#pragma unroll 1
    for (int panel = 0; panel < kDim / 64; ++panel) {
      Tokens<G> columns = g;
      columns.data += panel * 64;
      load_swizzled_tile<kRows, 64, kThreadCount, kUnroll>(smem + panel * kRows * 64, columns, b, row0, valid, h);
    }
  } else {
    for (int i = threadIdx.x; i < kRows * kChunks; i += kThreadCount) {
      const int r = i / kChunks, c = i % kChunks;
      const bool ok = r < valid;
      cp_async_16(smem + swizzled_offset<kRows>(r, c * 8), ok ? g.row(b, row0 + r, h) + c * 8 : g.data,
                  ok ? 16 : 0);
    }
  }
}

// Copies kRows rows of kDim elements, row r from row_pointer(r) (null: a zero row; fallback: any readable
// address), into a kRows x kDim swizzled tile: the gathered-row counterpart of load_swizzled_tile. As there,
// where the threads cover whole rows a multiple of 8 apart a thread keeps one chunk column and one swizzle, so a
// chunk costs a row-pointer read and the copy (the KV-block-outer kernels gather a tile per 64 query rows, and the
// per-chunk index arithmetic of the generic loop is a large share of their instructions); rows of 192 columns go
// the same way in 64-column panels, a thread copying its chunk of each panel of the row it reads the pointer of.
template <int kRows, int kDim, int kThreadCount, class T, class RowPointer>
__device__ __forceinline__ void gather_swizzled_rows(T* smem, RowPointer&& row_pointer, const T* fallback) {
  constexpr bool kWholeRows = kThreadCount % (kDim / 8) == 0 && (kThreadCount / (kDim / 8)) % 8 == 0;
  constexpr int kSpan = kWholeRows ? kDim : 64;  // columns a thread's chunk column repeats over: one per panel
  constexpr int kChunks = kSpan / 8, kRowStep = kThreadCount / kChunks;
  if constexpr (kDim % kSpan == 0 && kThreadCount % kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0) {
    const int c = threadIdx.x % kChunks, r0 = threadIdx.x / kChunks;
    T* dst = smem + swizzled_offset<kRows>(r0, c * 8);
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i) {
      const T* src = row_pointer(r0 + i * kRowStep);
      const T* from = (src != nullptr ? src : fallback) + c * 8;
#pragma unroll
      for (int col0 = 0; col0 < kDim; col0 += kSpan) {
        cp_async_16(dst + i * kRowStep * 64 + (col0 / 64) * kRows * 64, from + col0, src != nullptr ? 16 : 0);
      }
    }
  } else {
    constexpr int kRowChunks = kDim / 8;
    for (int i = threadIdx.x; i < kRows * kRowChunks; i += kThreadCount) {
      const int r = i / kRowChunks, c = i % kRowChunks;
      const T* src = row_pointer(r);
      cp_async_16(smem + swizzled_offset<kRows>(r, c * 8), (src != nullptr ? src : fallback) + c * 8,
                  src != nullptr ? 16 : 0);
    }
  }
}

// This thread's warpgroup (threadIdx.x / 128) through a shuffle, so that the compiler knows it is warp-uniform
// and keeps the descriptors computed from it in uniform registers (otherwise every wgmma moves its descriptor
// into one: an R2UR per operand). Used by select_blocks and the attention forward and dQ; the attention dK/dV
// kernel keeps warp / 4, where ptxas allocates its registers better without the shuffle.
__device__ __forceinline__ int warpgroup_index() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
}

// Before the first wgmma that reads registers (accumulators, A fragments) written by ordinary code.
__device__ __forceinline__ void fence() {
#if SPARSEATTN_WGMMA_ENABLED
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void commit() {
#if SPARSEATTN_WGMMA_ENABLED
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void wait() {
#if SPARSEATTN_WGMMA_ENABLED
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Registers of an MMA that may still be in flight (accumulators, A fragments): after wait(), keeps the compiler
// from moving ordinary reads or writes of them above the wait (the asm of the MMA shows them as written at issue).
template <int N>
__device__ __forceinline__ void fence_operand(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operand(std::uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
  }
}
// Shared memory written by the generic proxy (stores, cp.async) and read next by wgmma: in each writing
// thread, after its writes landed and before the barrier.
__device__ __forceinline__ void fence_shared_for_async() {
#if SPARSEATTN_WGMMA_ENABLED
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// The asm of one m64nNk16 MMA; TYPE is "bf16" or "f16" (generated operand lists).
#define SPARSEATTN_WGMMA_SS_32(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, %19;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB))

#define SPARSEATTN_WGMMA_SS_64(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %35;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB))

#define SPARSEATTN_WGMMA_RS_64(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB))

#define SPARSEATTN_WGMMA_SS_128(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, %67;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB))

#define SPARSEATTN_WGMMA_RS_128(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB))


// d (64 x N, fp32) (+)= A (64 x 16 from shared memory) * B (16 x N from shared memory); accumulate = 0
// overwrites d. kTransB: B is MN-major.
template <class T, int N, int kTransB>
__device__ __forceinline__ void mma_ss(float (&d)[N / 2], std::uint64_t desc_a, std::uint64_t desc_b,
                                       int accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "wgmma: N is 32, 64 or 128 here");
#if SPARSEATTN_WGMMA_ENABLED
  if constexpr (N == 32) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) SPARSEATTN_WGMMA_SS_32("bf16");
    else SPARSEATTN_WGMMA_SS_32("f16");
  } else if constexpr (N == 64) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) SPARSEATTN_WGMMA_SS_64("bf16");
    else SPARSEATTN_WGMMA_SS_64("f16");
  } else {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) SPARSEATTN_WGMMA_SS_128("bf16");
    else SPARSEATTN_WGMMA_SS_128("f16");
  }
#endif
}

// d (64 x N) (+)= A (64 x 16, this warp's 16 rows as an mma.sync A fragment) * B (16 x N, shared memory).
template <class T, int N, int kTransB>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const std::uint32_t (&a)[4], std::uint64_t desc_b,
                                       int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma: N is 64 or 128 here");
#if SPARSEATTN_WGMMA_ENABLED
  if constexpr (N == 64) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) SPARSEATTN_WGMMA_RS_64("bf16");
    else SPARSEATTN_WGMMA_RS_64("f16");
  } else {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) SPARSEATTN_WGMMA_RS_128("bf16");
    else SPARSEATTN_WGMMA_RS_128("f16");
  }
#endif
}

// d (64 x N) (+)= A (registers, as mma_rs) * B (16 x N, MN-major, in a tile of kRowsB rows) for N = 64, 128 or
// 192: N = 192 is an N = 128 MMA and an N = 64 one of the same A, the second's B two 64-column panels further and
// its accumulators the last 32 of d (the accumulator layout repeats along N).
template <class T, int N, int kRowsB>
__device__ __forceinline__ void mma_rs_mn(float (&d)[N / 2], const std::uint32_t (&a)[4], std::uint64_t desc_b,
                                          int accumulate) {
  static_assert(N == 64 || N == 128 || N == 192, "wgmma: N is 64, 128 or 192 here");
  if constexpr (N <= 128) {
    mma_rs<T, N, 1>(d, a, desc_b, accumulate);
  } else {
    mma_rs<T, 128, 1>(reinterpret_cast<float(&)[64]>(d[0]), a, desc_b, accumulate);
    mma_rs<T, N - 128, 1>(reinterpret_cast<float(&)[(N - 128) / 2]>(d[64]), a,
                          advance(desc_b, operand_offset<kRowsB>(0, 128)), accumulate);
  }
}

// An accumulator kept as [N/8][4] (the mma.sync C-fragment view) as the flat operand list of mma_ss/mma_rs.
template <int N>
__device__ __forceinline__ float (&flat(float (&acc)[N / 8][4]))[N / 2] {
  return reinterpret_cast<float(&)[N / 2]>(acc);
}

// A 64 x N fp32 accumulator (e.g. probabilities) as the A operands of the next product: k-slice kk covers
// columns [16kk, 16kk + 16), the accumulator's column groups 2kk and 2kk + 1.
template <class T, int N>
__device__ __forceinline__ void to_a_fragments(const float (&acc)[N / 8][4], std::uint32_t (&a)[N / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    a[kk][0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
    a[kk][1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
    a[kk][2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[kk][3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
  }
}

// The update of a dK/dV step over kRows query rows: dV += P^T dO and dK += dS^T Q with P^T and dS^T as register
// A fragments and dO, Q as MN-major tiles (descriptors at their row 0), committed as one MMA group.
template <class T, int kRows, int Dqk, int Dv>
__device__ __forceinline__ void issue_dkv_update(float (&dk)[Dqk / 8][4], float (&dv)[Dv / 8][4],
                                                 const std::uint32_t (&p)[kRows / 16][4],
                                                 const std::uint32_t (&ds)[kRows / 16][4], std::uint64_t q_mn,
                                                 std::uint64_t do_mn) {
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) {
    mma_rs_mn<T, Dv, kRows>(flat<Dv>(dv), p[kk], advance(do_mn, operand_offset<kRows>(16 * kk, 0)), 1);
  }
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) {
    mma_rs_mn<T, Dqk, kRows>(flat<Dqk>(dk), ds[kk], advance(q_mn, operand_offset<kRows>(16 * kk, 0)), 1);
  }
  commit();
}

// The software pipeline of a loop whose step computes scores (an MMA group), an elementwise part on them, and an
// accumulator update (a second MMA group) from that part's result: step i (of steps + 1) issues the scores of
// step i and the update of step i - 1 (whose elementwise part ran one step earlier), then runs step i's
// elementwise part while that update is in flight, then lands it. Used by the forward and dQ key-tile loops and
// the dK/dV query loops. The first and last steps are peeled so that every MMA is issued on a path without
// branches, which ptxas needs to keep them asynchronous.
//  begin(i): the step's barrier and loads; issue_scores(i), issue_update(i): the MMAs (update: of step i - 1);
//  elementwise(i): on step i's landed scores; land(i): wait for every MMA, then what needs the accumulator;
//  turns: taken before a step's MMAs are issued and passed after (pipeline::Turns: two warpgroups alternate).
template <class Begin, class IssueScores, class IssueUpdate, class Elementwise, class Land,
          class Turns = pipeline::NoTurns>
__device__ __forceinline__ void overlapped_steps(int steps, Begin&& begin, IssueScores&& issue_scores,
                                                 IssueUpdate&& issue_update, Elementwise&& elementwise, Land&& land,
                                                 const Turns& turns = Turns{}) {
  begin(0);
  turns.take();
  issue_scores(0);
  turns.pass();
  wait<0>();
  elementwise(0);
  land(0);
  for (int step = 1; step < steps; ++step) {
    begin(step);
    turns.take();
    issue_scores(step);
    issue_update(step);
    turns.pass();
    wait<1>();
    elementwise(step);
    land(step);
  }
  begin(steps);
  turns.take();
  issue_update(steps);
  turns.pass();
  land(steps);
}

#undef SPARSEATTN_WGMMA_SS_32
#undef SPARSEATTN_WGMMA_SS_64
#undef SPARSEATTN_WGMMA_RS_64
#undef SPARSEATTN_WGMMA_SS_128
#undef SPARSEATTN_WGMMA_RS_128

}  // namespace sparseattn::cuda::wgmma
