// flash_decode: decode-shaped attention (1 to 16 new queries per sequence) against a KV cache, dense or paged,
// with the keys split over CTAs (split-KV) and the splits merged in a fixed order. Forward only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "sparseattn/tensor.h"

namespace sparseattn {

// Sequence b has L_b = cache_seqlens[b] valid keys in its cache (the new tokens already appended) and Tq queries;
// query t is aligned to key position a = L_b - Tq + t (bottom-right, as flash_attention): causal keeps keys <= a,
// the window keeps keys in [a - window_left, a + window_right] (a negative bound is unbounded), and keys >= L_b
// never take part. A query that keeps no key returns o = 0 and lse = -inf. The result is flash_attention's on the
// gathered keys 0 .. L_b - 1 of each sequence (docs/semantics.md section 8, "Decode-shaped calls").
//
// The cache is either dense, k_cache [B, S, Hkv, Dqk] and v_cache [B, S, Hkv, Dv] (key s of sequence b is row
// [b, s]), or paged, k_cache [num_pages, page_size, Hkv, Dqk] and v_cache [num_pages, page_size, Hkv, Dv] with
// block_table int32 [B, max_pages]: key s of sequence b is row s % page_size of page block_table[b][s /
// page_size]. The capacity of a sequence is S (dense) or max_pages * page_size (paged).
//
// Trusted device data: on CUDA, cache_seqlens and block_table are read on the device only (no host sync, so a
// call can be captured in a CUDA graph and replayed with new lengths and tables). Their contents are trusted:
// the kernels clamp each length to [0, capacity] and each page index to [0, num_pages), so no memory outside the
// cache is read whatever they hold, and they read only the block_table entries of the pages that hold keys
// 0 .. L_b - 1. On the CPU both are checked (ErrorKind::value): lengths in [0, capacity], the used entries of
// block_table in [0, num_pages).
//
// CUDA kernels: float16 and bfloat16, the head-dim pairs of sparseattn/head_dims.h, page_size a multiple of 16
// (a 16-key chunk of a tile never straddles two pages), a capacity of at most 2^30 keys; any Tq <= 16 and any
// group size Hq / Hkv (the group's query heads and the Tq queries form the rows of one tile, which reads K and V
// once).
// The keys [0, capacity) are cut into P consecutive splits of equal length (a multiple of 64 keys); each split
// writes a float32 partial o and lse into the workspace, and the last CTA of each group of 8 splits to finish
// merges them in split order (then, with more than 8 splits, the last group's merger merges the groups in order:
// docs/semantics.md section 8), so the result is bit-identical run to run. The workspace also holds the merges'
// arrival counters, which the call zeroes on its stream before the kernel. P (num_splits, or a heuristic from the SM count, the shapes and the
// capacity) depends on shapes, dtypes and the device only, never on cache_seqlens or block_table; with P = 1 the
// kernel writes o directly and needs no workspace.
struct FlashDecodeParams {
  TensorView q;             // [B, Tq, Hq, Dqk], 1 <= Tq <= 16
  TensorView k_cache;       // dense [B, S, Hkv, Dqk] or paged [num_pages, page_size, Hkv, Dqk]
  TensorView v_cache;       // dense [B, S, Hkv, Dv] or paged [num_pages, page_size, Hkv, Dv]
  TensorView block_table;   // optional (paged cache): int32 [B, max_pages]
  TensorView cache_seqlens; // int32 [B] on q's device; optional with a dense cache (absent: every length is S)
  TensorView o;             // out: [B, Tq, Hq, Dv], dtype of q
  TensorView lse;           // out: [B, Hq, Tq]; float32 (float64 for float64 inputs)
  bool causal = true;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  std::optional<double> scale;  // default 1/sqrt(Dqk)
  std::int64_t num_splits = 0;  // split-KV count on CUDA (at most 256 used), 0 = heuristic; ignored on CPU
  void* workspace = nullptr;    // on q's device, 16-byte aligned, flash_decode_workspace_size bytes
  std::size_t workspace_bytes = 0;
  Stream stream = nullptr;
};

// Bytes of device scratch the call needs (the splits' float32 partials; 0 on the CPU and with one split). Depends
// on shapes, dtypes, num_splits and the device only (views with null data are accepted).
std::size_t flash_decode_workspace_size(const FlashDecodeParams& params);

// The number of KV splits the call uses (1 on the CPU); shapes, dtypes, num_splits and the device only.
std::int64_t flash_decode_num_splits(const FlashDecodeParams& params);

void flash_decode(const FlashDecodeParams& params);

}  // namespace sparseattn
