// The inverse index of selected attention: for each KV head and selection block, the (token, slot) entries
// whose index row lists that block (and can see it: the block starts at or before the token). Built by a
// deterministic stable radix sort (cub) of (key, value) pairs in caller-provided scratch. The KV-block-outer
// forward (forward_kv_block_outer.cu) and dQ (dq_kv_block_outer.cu) build it chunk by chunk
// (for_each_sorted_chunk); the backward (backward.cu) builds it whole, with its segments, for the dK/dV
// (dkdv.cu).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/selected_attention/common.cuh"
#include "cuda/selected_attention/forward_plan.h"

namespace sparseattn::cuda::selection {

// Keys number the selection blocks globally: key = h * blocks_bound + block_base(sequence) + b, where
// block_base is seq * blocks_per_seq (batched) or offsets[seq] (packed, from launch_block_offsets).
// Entries that list no visible block get the sentinel key (Hkv * blocks_bound) and sort last.
// A build covers a range of (KV head h, token row) pairs in head-major order, pair = h * total_rows + row (row
// of B*T, or of N packed): a chunk of them then touches the K/V blocks of one or two heads only. The build's
// pairs are cut into chunks of chunk_pairs; a chunk's index c within the build goes into the key as c <<
// chunk_shift (the sort group of forward_plan.h), so that chunk c's entries sort to [c * chunk_pairs * n, ...).
struct KeyConfig {
  std::int64_t num_idx, block, rows, batch, blocks_per_seq;  // rows: T or N; blocks_per_seq: batched
  std::int64_t total_rows;          // B*T or N
  std::int64_t pair0, pair_count;   // the pairs [pair0, pair0 + pair_count) this build covers
  std::int64_t chunk_pairs;         // pairs per chunk (pair_count: the build is one chunk)
  int chunk_shift;                  // the chunk index's lowest key bit (the bits of plain keys)
  std::uint32_t blocks_bound, sentinel;
  bool packed;
  bool value_is_entry;  // value = entry index within its chunk (forward, dQ) instead of the token position t
  // Query chunks (common.cuh): a block is visible from key position t + S - T. Packed: the keys' cu_seqlens (null:
  // the queries' own, offset 0), which the block offsets then count; batched: S - T.
  const std::int32_t* cu_seqlens_k = nullptr;
  std::int64_t batched_offset = 0;
};

// Number of key bits the radix sort must look at to order keys in [0, sentinel].
int key_end_bit(std::uint32_t sentinel);

// offsets[s] = sum_{s' < s} ceil(len_s' / block) from cu_seqlens (packed layout; the keys' for a query chunk); one
// CTA, deterministic.
void launch_block_offsets(const std::int32_t* cu_seqlens, std::int64_t batch, std::int64_t block,
                          std::int32_t* offsets, cudaStream_t stream);
// keys/values of the pair_count * num_idx entries of the pairs; entry (pair, j) sits at (pair - pair0) * num_idx + j.
// Keys: the (KV head, block) key (or the sentinel) | chunk << chunk_shift.
void launch_make_keys(const IndexView& indices, const std::int32_t* cu_seqlens, const std::int32_t* offsets,
                      const KeyConfig& c, std::uint32_t* keys, std::int32_t* values, cudaStream_t stream);
// cub radix sort scratch for `count` pairs (host-side query, no device work).
std::size_t radix_sort_temp_bytes(std::int64_t count, int end_bit);
// Stable sort by key; throws on a cub error.
void radix_sort_pairs(void* temp, std::size_t temp_bytes, const std::uint32_t* keys_in, std::uint32_t* keys_out,
                      const std::int32_t* values_in, std::int32_t* values_out, std::int64_t count, int end_bit,
                      cudaStream_t stream);
// seg_begin/seg_end[key] from the sorted keys (both zeroed first, here: an empty list is [0, 0)).
void launch_segments(const std::uint32_t* sorted_keys, std::int64_t count, std::uint32_t sentinel,
                     std::int32_t* seg_begin, std::int32_t* seg_end, std::int64_t keys, cudaStream_t stream);

// Index buffers of one sort group: keys and values in and out of the sort, and its scratch.
struct IndexBuffers {
  std::uint32_t *keys_in, *keys_out;
  std::int32_t *values_in, *values_out;
  void* temp;
  std::size_t temp_bytes;
};

// Walks the pairs [0, total_pairs) a sort group at a time (forward_plan.h): one make_keys and one stable sort per
// group, then each_chunk(pair0, pairs, keys, values) for each of the group's chunks (keys.chunk_pairs pairs each)
// with that chunk's sorted entries. keys gives everything but pair0 and pair_count.
template <class EachChunk>
void for_each_sorted_chunk(const IndexView& indices, const std::int32_t* cu_seqlens, const std::int32_t* offsets,
                           KeyConfig keys, std::int64_t total_pairs, const SortGroup& sort, const IndexBuffers& b,
                           cudaStream_t stream, EachChunk&& each_chunk) {
  const std::int64_t group_pairs = keys.chunk_pairs * sort.chunks;
  for (std::int64_t group0 = 0; group0 < total_pairs; group0 += group_pairs) {
    keys.pair0 = group0;
    keys.pair_count = std::min(group_pairs, total_pairs - group0);
    launch_make_keys(indices, cu_seqlens, offsets, keys, b.keys_in, b.values_in, stream);
    radix_sort_pairs(b.temp, b.temp_bytes, b.keys_in, b.keys_out, b.values_in, b.values_out,
                     keys.pair_count * keys.num_idx, sort.end_bit, stream);
    for (std::int64_t pair0 = group0; pair0 < group0 + keys.pair_count; pair0 += keys.chunk_pairs) {
      const std::int64_t first = (pair0 - group0) * keys.num_idx;
      each_chunk(pair0, std::min(keys.chunk_pairs, group0 + keys.pair_count - pair0), b.keys_out + first,
                 b.values_out + first);
    }
  }
}

}  // namespace sparseattn::cuda::selection
