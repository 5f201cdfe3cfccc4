// Swizzled shared-memory tiles (SmemTile) for the kernels on mma.sync and wgmma, their cp.async row loads and
// ldmatrix operand loads.
#pragma once

#include <cstdint>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mma.cuh"

namespace sparseattn::cuda {

// A tile of R rows of D elements in shared memory, unpadded, with the 16-byte chunks of row r XOR-swizzled by
// r % 8 within each 128-byte group of the row. The 8 row addresses of an ldmatrix then fall in 8 different
// bank groups, and a cp.async pass that writes whole rows fills whole 128-byte lines. Rows are not padded
// (pitch D, not D + 8): with a padded pitch the two 16-byte halves of a global 32-byte sector land in different
// shared-memory wavefronts, and L2 serves the sector more than once.
template <class T, int R, int D>
struct SmemTile {
  static_assert(D % 64 == 0, "swizzled tiles: rows of whole 128-byte groups");
  static constexpr int kPitch = D;
  static constexpr int kElements = R * D;
  T* base;
  // Element offset of (r, c); c's chunk c / 8 keeps its 128-byte group.
  __device__ __forceinline__ static int offset(int r, int c) { return r * D + (((c >> 3) ^ (r & 7)) << 3) + (c & 7); }
  __device__ __forceinline__ T* at(int r, int c) const { return base + offset(r, c); }
};

// Copies R rows of D elements with cp.async: row_pointer(r) returns the global row or null (zero fill).
// The passes over the tile's 16-byte pieces are unrolled at compile time, so a thread's rows and columns are
// constants plus its index; keep row_pointer cheap (a precomputed base plus r times a stride), since it runs
// once per piece. `thread`: the copying thread's index among the Threads (threadIdx.x when the first Threads of
// the CTA copy).
template <class T, int R, int D, int Threads, class RowPointer>
__device__ __forceinline__ void load_rows(const SmemTile<T, R, D>& tile, RowPointer&& row_pointer, const T* fallback,
                                          int thread) {
  constexpr int kChunks = D / 8;  // 16-byte pieces per row
  constexpr int kPieces = R * kChunks, kPasses = (kPieces + Threads - 1) / Threads;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int i = thread + pass * Threads;
    if (kPieces % Threads != 0 && i >= kPieces) break;
    const int r = i / kChunks, c = i % kChunks;
    const T* src = row_pointer(r);
    cp_async_16(tile.at(r, c * 8), (src != nullptr ? src : fallback) + c * 8, src != nullptr ? 16 : 0);
  }
}

template <class T, int R, int D, int Threads, class RowPointer>
__device__ __forceinline__ void load_rows(const SmemTile<T, R, D>& tile, RowPointer&& row_pointer, const T* fallback) {
  load_rows<T, R, D, Threads>(tile, row_pointer, fallback, static_cast<int>(threadIdx.x));
}

// Copies rows [0, R) of a source whose row r is src + r * row_stride, zero-filling rows >= valid (fallback:
// any readable address, for the zero-filled pieces). Each thread walks its rows by one pointer increment per
// pass, the cheapest form for the per-tile K/V loads (load_rows computes a row pointer per piece); used where
// a pass covers whole rows (Threads a multiple of D / 8), load_rows otherwise. Passes 8 rows apart share the
// swizzle, so a thread keeps one shared-memory offset per pass of the first 8 rows.
template <class T, int R, int D, int Threads>
__device__ __forceinline__ void load_strided_rows(const SmemTile<T, R, D>& tile, const T* src, std::int64_t row_stride,
                                                  int valid, const T* fallback) {
  constexpr int kChunks = D / 8;
  if constexpr (Threads % kChunks != 0) {
    load_rows<T, R, D, Threads>(
        tile, [&](int r) -> const T* { return r < valid ? src + r * row_stride : nullptr; }, fallback);
  } else {
    constexpr int kRowsPerPass = Threads / kChunks, kPasses = (R + kRowsPerPass - 1) / kRowsPerPass;
    static_assert(kRowsPerPass % 8 == 0 || 8 % kRowsPerPass == 0, "passes repeat the swizzle every 8 rows");
    constexpr int kPeriod = kRowsPerPass >= 8 ? 1 : 8 / kRowsPerPass;  // passes per 8 rows
    const int r0 = static_cast<int>(threadIdx.x) / kChunks, c = static_cast<int>(threadIdx.x) % kChunks;
    int to[kPeriod];
#pragma unroll
    for (int i = 0; i < kPeriod; ++i) to[i] = SmemTile<T, R, D>::offset(r0 + i * kRowsPerPass, c * 8);
    auto destination = [&](int pass) {
      return tile.base + to[pass % kPeriod] + (pass / kPeriod) * (kPeriod * kRowsPerPass * D);
    };
    const T* from = src + r0 * row_stride + c * 8;
    const std::int64_t pass_stride = kRowsPerPass * row_stride;
    if (valid >= R) {  // a whole tile: no predicates
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        if (R % kRowsPerPass != 0 && r0 + pass * kRowsPerPass >= R) break;
        cp_async_16_whole(destination(pass), from);
        from += pass_stride;
      }
      return;
    }
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int r = r0 + pass * kRowsPerPass;
      if (R % kRowsPerPass != 0 && r >= R) break;
      const bool ok = r < valid;
      cp_async_16(destination(pass), ok ? from : fallback, ok ? 16 : 0);
      from += pass_stride;
    }
  }
}

// A (16 x 16, row-major) fragment of rows [r0, r0+16) and columns [c0, c0+16) of a tile.
template <class T, int R, int D>
__device__ __forceinline__ void load_a(std::uint32_t (&a)[4], const SmemTile<T, R, D>& tile, int r0, int c0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, tile.at(r0 + lane % 16, c0 + (lane / 16) * 8));
}

// B fragments of two n-tiles (rows [n0, n0+16) of the tile as the n dimension, columns [k0, k0+16) as k):
// the tile stores B column-major (B = tile^T). b[0..1] is n-tile n0, b[2..3] n-tile n0+8.
template <class T, int R, int D>
__device__ __forceinline__ void load_b_rows(std::uint32_t (&b)[4], const SmemTile<T, R, D>& tile, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(b, tile.at(n0 + lane % 8 + (lane / 16) * 8, k0 + ((lane / 8) % 2) * 8));
}

// B fragments of two n-tiles where the tile stores B row-major (rows [k0, k0+16) are k, columns
// [n0, n0+16) are n).
template <class T, int R, int D>
__device__ __forceinline__ void load_b_cols(std::uint32_t (&b)[4], const SmemTile<T, R, D>& tile, int k0, int n0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4_trans(b, tile.at(k0 + lane % 8 + ((lane / 8) % 2) * 8, n0 + (lane / 16) * 8));
}

template <class T>
__device__ __forceinline__ void mma_pair(float (&d0)[4], float (&d1)[4], const std::uint32_t (&a)[4],
                                         const std::uint32_t (&b)[4]) {
  const std::uint32_t b0[2] = {b[0], b[1]};
  const std::uint32_t b1[2] = {b[2], b[3]};
  mma_16816<T>(d0, a, b0);
  mma_16816<T>(d1, a, b1);
}

}  // namespace sparseattn::cuda
