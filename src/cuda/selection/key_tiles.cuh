// The key tiles of one token's selected blocks, walked by a warp: shared by the query-outer selected forward
// (forward_query.cu) and the query-outer dQ (backward.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sparseattn::cuda::selection {

// The key tiles of one token's selected blocks, in slot order: [s0, end) of at most kKeys keys, all <= t. The
// warp walks them together (every lane calls next()); the slots' block indices sit in registers, lane i holding
// slot chunk_base + i, so finding the next tile costs a shuffle, not a global load on the path to the next tile's
// K load.
template <int kKeys>
struct KeyTiles {
  const std::int32_t* idx;
  std::int64_t num_idx, block, t;
  std::int64_t slot = -1, s0 = 0, end = 0;  // the current tile; slot == num_idx: no more
  std::int64_t chunk_base = 0;
  std::int32_t lane_block = -1;

  __device__ __forceinline__ KeyTiles(const std::int32_t* idx_, std::int64_t num_idx_, std::int64_t block_,
                                      std::int64_t t_)
      : idx(idx_), num_idx(num_idx_), block(block_), t(t_) {
    const int lane = threadIdx.x % 32;
    if (lane < num_idx) lane_block = idx[lane];
  }

  // Moves to the next tile (the rest of the current block, else the next visible block).
  __device__ __forceinline__ bool next() {
    if (slot >= 0 && s0 + kKeys < end) {
      s0 += kKeys;
      return true;
    }
    while (++slot < num_idx) {
      if (slot - chunk_base == 32) {
        chunk_base += 32;
        const std::int64_t mine = chunk_base + threadIdx.x % 32;
        lane_block = mine < num_idx ? idx[mine] : -1;
      }
      const std::int64_t b = __shfl_sync(0xffffffffu, lane_block, static_cast<int>(slot - chunk_base));
      if (b < 0) break;
      const std::int64_t first = b * block;
      if (first > t) continue;  // starts after t (or out of range): contributes nothing
      s0 = first;
      end = min(first + block, t + 1);
      return true;
    }
    slot = num_idx;
    return false;
  }
  __device__ __forceinline__ int keys() const { return static_cast<int>(min(end - s0, std::int64_t{kKeys})); }
};

}  // namespace sparseattn::cuda::selection
