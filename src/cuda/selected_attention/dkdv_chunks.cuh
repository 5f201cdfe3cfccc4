// Chunk table of the dK/dV backward (dkdv.cu): the inverse index's segments (one per KV head and
// selection block: the tokens that selected it, inverse_index.h) are cut into chunks of at most
// `chunk_tokens` tokens so that no CTA walks a huge segment alone (block 0, forced by NSA, is selected by
// every token). Built on the device, no host sync:
//  1. chunk_counts_kernel: per key (KV head, global block) the value (partial_chunks << 32) | single, where a
//     segment longer than chunk_tokens has partial_chunks = ceil(L / chunk_tokens) (each chunk writes an fp32
//     partial dK/dV into its own workspace slot) and any other existing block has single = 1 (one CTA writes
//     dK/dV directly, zeros for an empty segment); keys of no block (packed padding) get 0;
//  2. an inclusive cub scan of those 64-bit values (the two 32-bit fields never carry into each other);
//  3. CTA x of the dK/dV kernel: x < P (all partial chunks) is partial slot x, chunk x - start of the first key
//     whose scanned partial count exceeds x (binary search); else the (x - P)-th single key; beyond: idle.
//     Split segments come first in the grid, so the long work starts in the first wave;
//  4. dkv_reduce_kernel: per split key, the sum of its partials in chunk order (deterministic), scaled and
//     rounded once.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/selected_attention/common.cuh"

namespace sparseattn::cuda::selection {

struct BlockOf {
  std::int64_t head, seq, block;
};

// The KV head, sequence and block (within its sequence) of key = h * blocks_bound + global block.
__device__ __forceinline__ BlockOf block_of(std::uint64_t key, std::uint32_t blocks_bound, std::int64_t blocks_per_seq,
                                            const std::int32_t* offsets, std::int64_t batch, bool packed) {
  const std::int64_t h = static_cast<std::int64_t>(key / blocks_bound);
  const std::int64_t gblock = static_cast<std::int64_t>(key % blocks_bound);
  if (!packed) return {h, gblock / blocks_per_seq, gblock % blocks_per_seq};
  const std::int64_t seq = last_at_most(offsets, batch, gblock);  // offsets[0] = 0
  return {h, seq, gblock - offsets[seq]};
}

struct ChunkTask {
  std::int64_t key;    // -1: no work
  std::int64_t chunk;  // chunk of the key's segment
  std::int64_t slot;   // partial slot, -1: write dK/dV directly
};

__device__ __forceinline__ ChunkTask locate_chunk(const std::uint64_t* scan, std::int64_t keys, std::int64_t x) {
  constexpr std::uint64_t kLow = 0xffffffffull;
  if (keys <= 0) return {-1, 0, -1};
  const std::uint64_t total = scan[keys - 1];
  const std::int64_t partial_total = static_cast<std::int64_t>(total >> 32);
  const bool split = x < partial_total;
  const std::int64_t y = split ? x : x - partial_total;
  if (!split && y >= static_cast<std::int64_t>(total & kLow)) return {-1, 0, -1};
  std::int64_t lo = 0, hi = keys - 1;  // first key whose scanned count exceeds y
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) / 2;
    const std::uint64_t v = scan[mid];
    const std::int64_t count = static_cast<std::int64_t>(split ? v >> 32 : v & kLow);
    if (count > y) hi = mid; else lo = mid + 1;
  }
  if (!split) return {lo, 0, -1};
  const std::int64_t before = lo > 0 ? static_cast<std::int64_t>(scan[lo - 1] >> 32) : 0;
  return {lo, x - before, x};
}

struct ChunkConfig {
  std::int64_t keys, chunk_tokens, block, blocks_per_seq, batch;
  std::uint32_t blocks_bound;
  bool packed;
};

// counts[key] as in step 1.
void launch_chunk_counts(const std::int32_t* seg_begin, const std::int32_t* seg_end, const std::int32_t* offsets,
                         const SeqTable& seqs, const ChunkConfig& c, std::uint64_t* counts, cudaStream_t stream);
// cub scan scratch for `keys` values (host-side query).
std::size_t chunk_scan_temp_bytes(std::int64_t keys);
void chunk_scan(void* temp, std::size_t temp_bytes, const std::uint64_t* counts, std::uint64_t* scan,
                std::int64_t keys, cudaStream_t stream);

}  // namespace sparseattn::cuda::selection
