// Host-only planning of the selected-attention forward on CUDA: which of the three forwards runs, the shared
// memory the KV-block-outer and group kernels need, and how the KV-block-outer workspace is cut into chunks and
// sort groups. Plain C++ (no CUDA headers) so that tests/cpp checks it on machines without a GPU.
//
// The forwards (entry point: forward.cu):
//  - query-outer (forward_query_outer.cu): one CTA per (token, KV head, 16 query heads of the group); the G
//    heads of one token are the 16 rows of an mma tile, padded with zero rows, so G = 1 does 16x the useful
//    math and every token re-reads all K/V rows of its n selected blocks; its group form
//    (forward_query_group.cu) runs 8 consecutive tokens per CTA, which load each K/V tile of the union of their
//    blocks once (use_group_forward below);
//  - KV-block-outer (forward_kv_block_outer.cu, the FSA design): the (token, slot) pairs are sorted by (KV
//    head, selected block); a CTA loads one block's K and V once and packs the query rows (token x group head)
//    of many tokens into full tiles (16 rows per warp on mma.sync, 64 per warpgroup on wgmma), writing a
//    partial (o, lse) per (token, query head, slot) that a merge kernel combines.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace sparseattn::cuda::selection {

// ----------------------------------------------------------------------------- KV-block-outer kernel shape

inline constexpr int kKvWarps = 4;         // warps per CTA
inline constexpr int kKvTileRows = 16;     // gathered query rows per warp tile (mma M)
inline constexpr int kKvCtaRows = 256;     // target query rows per CTA (entries per CTA = kKvCtaRows / G)
inline constexpr int kKvMaxBlock = 128;    // the whole selection block's K and V sit in shared memory
inline constexpr int kKvQBuffers = 2;      // per-warp Q tiles (the next tile loads while one is computed)
// Partial outputs are bounded by cutting the (KV head, token row) pairs into chunks whose scratch stays below
// this many bytes (one chunk holds at least one pair, so huge groups may exceed it).
inline constexpr std::size_t kKvWorkspaceCap = std::size_t{256} << 20;

// (token, slot) entries one CTA takes from the sorted list: about kKvCtaRows query rows.
inline std::int64_t kv_entries_per_cta(std::int64_t group) {
  return std::max<std::int64_t>(1, kKvCtaRows / std::max<std::int64_t>(1, group));
}

inline std::int64_t round_up16(std::int64_t x) { return (x + 15) / 16 * 16; }

// Dynamic shared memory of the KV-block-outer kernel for 16-bit inputs: sorted keys and values of its
// entries, per-warp row descriptors, per-warp Q tiles and the block's K and V (swizzled tiles, swizzled_tile.cuh).
inline std::size_t kv_forward_smem_bytes(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t block) {
  const std::size_t key_rows = static_cast<std::size_t>(round_up16(std::min<std::int64_t>(block, kKvMaxBlock)));
  const std::size_t lists = 2 * sizeof(std::int32_t) * kKvCtaRows;
  const std::size_t rows = std::size_t{kKvQBuffers} * kKvWarps * kKvTileRows * (8 + 8 + 4);
  const std::size_t q = std::size_t{kKvQBuffers} * kKvWarps * kKvTileRows * dim_qk * 2;
  const std::size_t kv = key_rows * (dim_qk + dim_v) * 2;
  return lists + rows + q + kv;
}

// Whether the KV-block-outer kernel can run these shapes: the block fits its shared memory tiles
// (block <= kKvMaxBlock) and the device grants that much shared memory per CTA (smem_limit: the opt-in
// maximum, cudaDevAttrMaxSharedMemoryPerBlockOptin; 227 KB on H100, 163 KB on A100).
inline bool kv_forward_supported(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t block, std::size_t smem_limit) {
  return block > 0 && block <= kKvMaxBlock && kv_forward_smem_bytes(dim_qk, dim_v, block) <= smem_limit;
}

// ------------------------------------------------------------------------------------------- the heuristic

// The KV-block-outer forward runs for groups up to kKvMaxGroup. What it saves is the query-outer forward's
// padding (16 mma rows per token whatever G is; the tiles are full from G = 16 on), while the traffic of its
// partials grows with G: it is several times faster at small G and breaks even with the query-outer forward at
// G = 9 on an H100 (bf16, Dqk = Dv = 128, n = 16, block 64, Hkv = 4, indices from select_blocks;
// scripts/measure_selected_forward.py; the ratios are in docs/perf/2026-11-27-measurements-from-source-comments.md).
// Its mma.sync kernel is a little slower than the wgmma one, and the same bound serves sm_80 and
// SPARSEATTN_ATTENTION_MMA=sync. The KV-block-outer dQ has its own bound (kDqKvMaxGroup, backward_plan.h).
inline constexpr std::int64_t kKvMaxGroup = 9;
// Below this many token rows the sort and merge launches cost more than the padding saves.
inline constexpr std::int64_t kKvMinTokens = 1024;

// The pure heuristic: use the KV-block-outer forward for group size `group`, head dims, `tokens` token rows
// (B*T, or N packed), n = `num_idx` slots and selection block `block`, on a device granting `smem_limit`
// bytes of shared memory per CTA.
inline bool use_kv_outer_forward(std::int64_t group, std::int64_t dim_qk, std::int64_t dim_v, std::int64_t tokens,
                                 std::int64_t num_idx, std::int64_t block, std::size_t smem_limit) {
  if (!kv_forward_supported(dim_qk, dim_v, block, smem_limit)) return false;
  if (group < 1 || num_idx < 1) return false;
  return group <= kKvMaxGroup && tokens >= kKvMinTokens;
}

// Where the query-outer forward runs, its group form (forward_query_group.cu: 8 consecutive tokens per CTA load
// each K/V tile of the union of their blocks once) is a candidate for Dqk = Dv = 128 up to sequences of
// kGroupMaxLen tokens (`max_len`: the longest sequence of the batch); there the device chooses between it and the
// one-token kernel from how much the tokens share (ForwardPath::query_adaptive below). Longer sequences are not
// measured, and at 192/128 the larger tiles leave fewer stages and the group form is the slower one. It needs about
// 227 KB of shared memory per CTA (an H100's, not an A100's 163 KB), and index lists of at most 77 entries.
inline constexpr std::int64_t kGroupMaxLen = 131072;
inline constexpr int kGroupTokens = 8;  // consecutive tokens per CTA (forward_query_group.cu)

// Shared memory of a group kernel: `rows_bytes` of per-token rows first (none in the forward; the dQ's, see
// backward_plan.h), then a ring of stages, each one key tile's K and V rows (64 keys, 32 from Dqk = 192 on), as
// many as fit what the rows leave of 224 KB (16 at most), the ring's full and empty barriers, per token a queue of
// (use, keys) entries and its count, and the tokens' index lists (num_idx entries each).
inline constexpr std::size_t group_smem_bytes(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t num_idx,
                                              std::size_t rows_bytes) {
  const std::size_t stage = static_cast<std::size_t>((dim_qk <= 128 ? 64 : 32) * (dim_qk + dim_v) * 2);
  const std::size_t room = 224 * 1024 > rows_bytes ? 224 * 1024 - rows_bytes : 0;
  const std::size_t stages = std::min<std::size_t>(room / stage, 16);
  return rows_bytes + stages * stage + 2 * stages * 8 + kGroupTokens * (2 * stages + 1) * 4 +
         kGroupTokens * static_cast<std::size_t>(num_idx) * 4;
}

// The group forward's: no rows.
inline constexpr std::size_t group_forward_smem_bytes(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t num_idx) {
  return group_smem_bytes(dim_qk, dim_v, num_idx, 0);
}

inline bool group_forward_supported(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t num_idx,
                                    std::size_t smem_limit) {
  return group_forward_smem_bytes(dim_qk, dim_v, num_idx) <= smem_limit;
}

inline bool use_group_forward(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t max_len, std::int64_t num_idx,
                              std::size_t smem_limit) {
  return dim_qk == 128 && dim_v == 128 && max_len >= 1 && max_len <= kGroupMaxLen &&
         group_forward_supported(dim_qk, dim_v, num_idx, smem_limit);
}

// Internal switches for tests and measurements: an environment variable, read on the host by the CUDA entry
// points (size query and launch alike, so both agree), forces a path: "query" (the one-token query-outer
// kernel), "group" (the group kernel: the forward's, or the dQ's) or "kv" ("kv" only where that
// path is supported); anything else (or unset) leaves the choice to the heuristic. The forward's is
// SPARSEATTN_SELECTED_FORWARD (choose_forward), the backward's dQ has SPARSEATTN_SELECTED_DQ (backward_plan.h).
enum class PathChoice { automatic, query_outer, query_group, kv_outer };
inline constexpr const char* kForwardEnv = "SPARSEATTN_SELECTED_FORWARD";

inline PathChoice parse_path_choice(const char* value) {
  if (value == nullptr) return PathChoice::automatic;
  if (std::strcmp(value, "query") == 0) return PathChoice::query_outer;
  if (std::strcmp(value, "group") == 0) return PathChoice::query_group;
  if (std::strcmp(value, "kv") == 0) return PathChoice::kv_outer;
  return PathChoice::automatic;
}

// Whether a KV-block-outer path runs under `choice`: never when a query-outer one is forced, wherever it is
// `supported` when forced, else where the heuristic `prefers` it. Shared by the forward and the dQ.
inline bool kv_outer_by_choice(PathChoice choice, bool supported, bool prefers) {
  switch (choice) {
    case PathChoice::query_outer:
    case PathChoice::query_group: return false;
    case PathChoice::kv_outer: return supported;
    case PathChoice::automatic: break;
  }
  return prefers;
}

// Whether the KV-block-outer forward runs: as `choice` forces it, else as use_kv_outer_forward decides.
inline bool choose_kv_outer(PathChoice choice, std::int64_t group, std::int64_t dim_qk, std::int64_t dim_v,
                            std::int64_t tokens, std::int64_t num_idx, std::int64_t block, std::size_t smem_limit) {
  if (group < 1 || num_idx < 1 || tokens < 1) return false;
  return kv_outer_by_choice(choice, kv_forward_supported(dim_qk, dim_v, block, smem_limit),
                            use_kv_outer_forward(group, dim_qk, dim_v, tokens, num_idx, block, smem_limit));
}

// Which forward runs: the KV-block-outer one as choose_kv_outer decides; otherwise the group form where it is
// forced and supported, the group form or the one-token forward as the device chooses (query_adaptive) where the
// heuristic prefers the group form, else the one-token query-outer forward. `max_len`: the longest sequence; the
// other arguments as for choose_kv_outer.
//
// query_adaptive: which of the two query-outer forms is faster depends on the index lists, not on the shapes. The
// group form loads each block its 8 tokens share once, but its tokens wait on each other's stages; the one-token
// forward loads every entry's tiles and is faster where the tokens share little (random inputs at 64K tokens), the
// group form where they share much (inputs with locality; short sequences, where the blocks are few). A sampling
// kernel (query_adaptive.cu) counts distinct blocks in about 500 groups (group_sharing.h) and writes the choice to
// the workspace; both forms are launched, and the CTAs of the one not chosen return at once. Both give the same bits
// where the lists ascend.
enum class ForwardPath { query_outer, query_group, query_adaptive, kv_outer };
// The workspace of query_adaptive: the choice and the sampling kernel's counts (query_adaptive.cu).
inline constexpr std::size_t kAdaptiveWorkspaceBytes = 512;
inline ForwardPath choose_forward(PathChoice choice, std::int64_t group, std::int64_t dim_qk, std::int64_t dim_v,
                                  std::int64_t tokens, std::int64_t max_len, std::int64_t num_idx, std::int64_t block,
                                  std::size_t smem_limit) {
  if (choose_kv_outer(choice, group, dim_qk, dim_v, tokens, num_idx, block, smem_limit)) return ForwardPath::kv_outer;
  if (choice == PathChoice::query_group) {
    return group_forward_supported(dim_qk, dim_v, num_idx, smem_limit) ? ForwardPath::query_group
                                                                        : ForwardPath::query_outer;
  }
  const bool adaptive =
      choice == PathChoice::automatic && use_group_forward(dim_qk, dim_v, max_len, num_idx, smem_limit);
  return adaptive ? ForwardPath::query_adaptive : ForwardPath::query_outer;
}

// --------------------------------------------------------------------------------------- workspace chunks

// The partials are cut into chunks of (KV head, token row) pairs taken in head-major order (pair = h * total
// rows + row, inverse_index.h), not of token rows across all heads: every chunk then re-reads the K/V blocks of
// one or two heads, where a chunk of token rows would re-read those of every head (and its runs, split over
// more chunks, would fill fewer tile rows).

// Scratch bytes per pair of a chunk: the partial of every (group head, slot) (fp16 o row, fp32 scale and lse),
// and the inverse-index entries of every slot (keys and values, in and out of the sort, and about as much
// again for the radix sort's own buffers).
inline std::size_t kv_bytes_per_pair(std::int64_t group, std::int64_t num_idx, std::int64_t dim_v) {
  const std::size_t partial = static_cast<std::size_t>(group * num_idx) * (dim_v * 2 + 8);
  const std::size_t index = static_cast<std::size_t>(num_idx) * 6 * sizeof(std::int32_t);
  return partial + index;
}

// Items per chunk: as many as fit `cap` bytes at `bytes_per_item` (at least 1), then evened out over the
// chunks so that the last chunk is not a sliver. Shared by the KV-block-outer forward and dQ.
inline std::int64_t chunk_length(std::int64_t total_items, std::size_t bytes_per_item, std::size_t cap) {
  if (total_items <= 0) return 0;
  const auto fitting = static_cast<std::int64_t>(cap / std::max<std::size_t>(1, bytes_per_item));
  const std::int64_t fit = std::max<std::int64_t>(1, fitting);
  const std::int64_t chunks = (total_items + fit - 1) / fit;
  return (total_items + chunks - 1) / chunks;
}

// The forward's pairs per chunk (kKvWorkspaceCap) of total_pairs = Hkv * (B*T or N). Depends on shapes only.
inline std::int64_t kv_chunk_pairs(std::int64_t total_pairs, std::int64_t group, std::int64_t num_idx,
                                   std::int64_t dim_v) {
  return chunk_length(total_pairs, kv_bytes_per_pair(group, num_idx, dim_v), kKvWorkspaceCap);
}

// ------------------------------------------------------------------------------------------- sort groups

// The KV-block-outer forward and dQ sort the entries of several chunks at once: each entry's key carries the
// index of its chunk within the sort group above the (KV head, block) key bits, so that one stable sort leaves
// every chunk's entries contiguous, in the order a sort of that chunk alone gives (its sentinels last), and a
// long sequence takes a few sorts and make_keys launches instead of one of each per chunk. The forward's index
// for a group (keys and values, in and out of the sort: 16 bytes per entry; the sort's scratch is about as much
// again) stays within this cap, half the partials': a larger index raises the peak memory of fwd+bwd without
// making it faster. The backward's dQ reuses the dK/dV's index buffers, which hold every entry.
inline constexpr std::size_t kKvIndexCap = std::size_t{128} << 20;
inline constexpr std::size_t kIndexBytesPerEntry = 16;

struct SortGroup {
  std::int64_t chunks = 1;  // chunks per sort
  int end_bit = 1;          // key bits the sort orders: the (KV head, block) key's, then the chunk index's
};

// Chunks per sort for `chunks` chunks of `chunk_entries` entries whose keys take `key_bits` bits: as many as
// `index_cap` bytes of index hold and 32-bit keys can number, at least one.
inline SortGroup sort_group(std::int64_t chunks, std::int64_t chunk_entries, int key_bits,
                            std::size_t index_cap = std::numeric_limits<std::size_t>::max()) {
  const std::size_t entry_bytes =
      kIndexBytesPerEntry * static_cast<std::size_t>(std::max<std::int64_t>(1, chunk_entries));
  const std::size_t fitting = std::min<std::size_t>(index_cap / entry_bytes, std::size_t{1} << 62);
  const auto by_memory = static_cast<std::int64_t>(fitting);
  SortGroup group;
  group.chunks = std::max<std::int64_t>(1, std::min(chunks, by_memory));
  int chunk_bits = 0;
  while ((std::int64_t{1} << chunk_bits) < group.chunks) ++chunk_bits;
  if (key_bits + chunk_bits > 32) {
    chunk_bits = std::max(0, 32 - key_bits);
    group.chunks = std::min(group.chunks, std::int64_t{1} << chunk_bits);
  }
  group.end_bit = key_bits + chunk_bits;
  return group;
}

// The (KV head, block) bits of a key whose plain part takes key_bits bits.
inline std::uint32_t key_mask(int key_bits) {
  return key_bits >= 32 ? ~std::uint32_t{0} : (std::uint32_t{1} << key_bits) - 1;
}

}  // namespace sparseattn::cuda::selection
