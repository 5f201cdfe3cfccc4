// Host-only planning of the selected-attention backward on CUDA: which dQ runs, the shared memory and the
// partial chunks of the KV-block-outer dQ, and the token chunks of the dK/dV. Plain C++ (no CUDA headers) so
// that tests/cpp checks it on machines without a GPU.
//
// The dQ paths (entry point: backward.cu):
//  - query-outer (dq_query_outer.cu): one CTA per (token, KV head, 16 query heads of the group), like the
//    query-outer forward; its group form (dq_query_group.cu) runs 8 consecutive tokens per CTA, which load each
//    K/V tile of the union of their blocks once (use_group_dq below);
//  - KV-block-outer (dq_kv_block_outer.cu, on sm_90a dq_kv_block_outer_wgmma.cuh; the FSA forward's design):
//    per selected block, gathered query rows of many tokens, a compact partial dQ per (token, query head,
//    slot), merged in slot order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/selected_attention/forward_plan.h"

namespace sparseattn::cuda::selection {

// --------------------------------------------------------------------------------- KV-block-outer dQ shape

inline constexpr int kDqKvWarps = 4;
inline constexpr int kDqKvTile = 16;
// Query rows per CTA (entries per CTA = kDqKvCtaRows / G). Each CTA loads the K and V of every run it touches,
// so a run of many entries is loaded once per CTA it spans: twice the forward's 256 rows loads long runs fewer
// times and is the fastest of 256, 512 and 1024 on an H100.
inline constexpr int kDqKvCtaRows = 512;
inline constexpr int kDqKvMaxBlock = 128;
inline constexpr int kDqKvBuffers = 2;
// Partials (fp16 dQ row scaled by its max magnitude + that fp32 scale per (token, query head, slot)) are
// bounded by cutting the (KV head, token row) pairs into chunks whose partials stay near this many bytes.
inline constexpr std::size_t kDqKvPartialCap = std::size_t{256} << 20;

// Dynamic shared memory of the mma.sync kernel for 16-bit inputs: sorted keys and values of its entries, per
// row slot its q, dO and partial pointers and statistics, the per-warp Q and dO tiles, the block's K and V.
inline std::size_t dq_kv_smem_bytes(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t block) {
  const std::size_t key_rows = static_cast<std::size_t>(round_up16(std::min<std::int64_t>(block, kDqKvMaxBlock)));
  const std::size_t lists = 2 * sizeof(std::int32_t) * kDqKvCtaRows;
  const std::size_t slots = std::size_t{kDqKvBuffers} * kDqKvWarps * kDqKvTile;
  const std::size_t rows = slots * (8 + 8 + 8 + 4 + 4 + 4 + 4);
  const std::size_t q = slots * (dim_qk + dim_v) * 2;
  const std::size_t kv = key_rows * (dim_qk + dim_v) * 2;
  return lists + rows + q + kv;
}

// Whether the KV-block-outer dQ can run these shapes on a device granting `smem_limit` bytes of shared memory
// per CTA (cudaDevAttrMaxSharedMemoryPerBlockOptin).
inline bool dq_kv_supported(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t block, std::size_t smem_limit) {
  return block > 0 && block <= kDqKvMaxBlock && dq_kv_smem_bytes(dim_qk, dim_v, block) <= smem_limit;
}

// ------------------------------------------------------------------------------------------- the heuristic

// The KV-block-outer dQ runs for groups up to kDqKvMaxGroup: as in the forward, it saves the query-outer dQ's
// padding of G heads to 16 mma rows, and its partials' traffic grows with G. With the wgmma kernel the whole
// selected backward is several times faster at G = 1, still ahead at G = 8 and about even at G = 9 on an H100
// (bf16, D = 128, n = 16, block 64, Hkv = 4, indices from select_blocks; scripts/measure_selected_dq.py; the
// ratios are in docs/perf/2026-11-27-measurements-from-source-comments.md). Short sequences: the forward's
// limit.
inline constexpr std::int64_t kDqKvMaxGroup = 8;
inline constexpr std::int64_t kDqKvMinTokens = 1024;
inline constexpr std::int64_t kDqKvMaxDimQk = 192;  // Dqk = 256: its tiles spill

// The pure heuristic: use the KV-block-outer dQ for group size `group`, head dims, `tokens` token rows (B*T,
// or N packed), n = `num_idx` slots and selection block `block`, on a device granting `smem_limit` bytes.
inline bool use_kv_outer_dq(std::int64_t group, std::int64_t dim_qk, std::int64_t dim_v, std::int64_t tokens,
                            std::int64_t num_idx, std::int64_t block, std::size_t smem_limit) {
  if (!dq_kv_supported(dim_qk, dim_v, block, smem_limit)) return false;
  if (group < 1 || num_idx < 1) return false;
  return group <= kDqKvMaxGroup && tokens >= kDqKvMinTokens && dim_qk <= kDqKvMaxDimQk;
}

// Internal switch for tests and measurements, read on the host like the forward's (forward_plan.h):
// SPARSEATTN_SELECTED_DQ = "query", "group" or "kv" forces a dQ ("group" only where group_dq_supported, "kv" only
// where dq_kv_supported), anything else (or unset) leaves the choice to use_kv_outer_dq and use_group_dq.
inline constexpr const char* kDqEnv = "SPARSEATTN_SELECTED_DQ";

inline bool choose_kv_outer_dq(PathChoice choice, std::int64_t group, std::int64_t dim_qk, std::int64_t dim_v,
                               std::int64_t tokens, std::int64_t num_idx, std::int64_t block, std::size_t smem_limit) {
  if (group < 1 || num_idx < 1 || tokens < 1) return false;
  return kv_outer_by_choice(choice, dq_kv_supported(dim_qk, dim_v, block, smem_limit),
                            use_kv_outer_dq(group, dim_qk, dim_v, tokens, num_idx, block, smem_limit));
}

// ------------------------------------------------------------------------------------------ the group dQ

// The query-outer dQ's group form (dq_query_group.cu: 8 consecutive tokens per CTA share each K/V tile of the
// union of their blocks, as the group forward does) keeps per token its 16 dO rows in shared memory, and its Q
// rows too where Dqk + Dv > 256 (as the one-token dQ does there): with both in registers beside dQ, S and dP the
// consumer needs about 250 registers and gets 232 beside the producer. The stages take what is left of 224 KB.
inline constexpr std::size_t group_dq_rows_bytes(std::int64_t dim_qk, std::int64_t dim_v) {
  return static_cast<std::size_t>(kGroupTokens * 16 * (dim_v + (dim_qk + dim_v > 256 ? dim_qk : 0)) * 2);
}

inline constexpr std::size_t group_dq_smem_bytes(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t num_idx) {
  return group_smem_bytes(dim_qk, dim_v, num_idx, group_dq_rows_bytes(dim_qk, dim_v));
}

inline bool group_dq_supported(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t num_idx, std::size_t smem_limit) {
  return group_dq_smem_bytes(dim_qk, dim_v, num_idx) <= smem_limit;
}

// Where the query-outer dQ runs, its group form is a candidate for Dqk = Dv = 128 up to sequences of kGroupMaxLen
// tokens (`max_len`: the longest of the batch; the forward's bound), on a device with the shared memory. There the
// device chooses between it and the one-token dQ from how much 8 consecutive tokens share, as for the forward
// (forward_plan.h, ForwardPath::query_adaptive; the same sampling and bound): where they share little, the group
// form's ring, which holds a stage until its last reader is done, leaves the consumers waiting
// (docs/perf/2026-11-28-group-dq.md, 2026-11-28-adaptive-group-forward.md).
inline bool use_group_dq(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t max_len, std::int64_t num_idx,
                         std::size_t smem_limit) {
  return dim_qk == 128 && dim_v == 128 && max_len >= 1 && max_len <= kGroupMaxLen &&
         group_dq_supported(dim_qk, dim_v, num_idx, smem_limit);
}

// Which query-outer dQ runs (where it runs: not choose_kv_outer_dq): the group form where "group" forces it and it
// is supported, the form chosen on the device under "automatic" where use_group_dq allows the group form, else
// (and always under "query") the one-token dQ.
enum class DqForm { one_token, group, adaptive };
inline DqForm choose_dq_form(PathChoice choice, std::int64_t dim_qk, std::int64_t dim_v, std::int64_t max_len,
                             std::int64_t num_idx, std::size_t smem_limit) {
  if (num_idx < 1 || max_len < 1) return DqForm::one_token;
  switch (choice) {
    case PathChoice::query_group:
      return group_dq_supported(dim_qk, dim_v, num_idx, smem_limit) ? DqForm::group : DqForm::one_token;
    case PathChoice::automatic:
      return use_group_dq(dim_qk, dim_v, max_len, num_idx, smem_limit) ? DqForm::adaptive : DqForm::one_token;
    case PathChoice::query_outer:
    case PathChoice::kv_outer: break;
  }
  return DqForm::one_token;
}

// ------------------------------------------------------------------------------------ KV-block-outer chunks

// Partial bytes per (KV head, token row) pair of a chunk: an fp16 dQ row and its fp32 scale per (group head,
// slot). Chunks are runs of pairs in head-major order, as in the forward (forward_plan.h).
inline std::size_t dq_kv_bytes_per_pair(std::int64_t group, std::int64_t num_idx, std::int64_t dim_qk) {
  return static_cast<std::size_t>(group * num_idx) * (dim_qk * 2 + 4);
}

// Pairs per chunk of total_pairs = Hkv * (B*T or N): as many as fit kDqKvPartialCap, evened out.
inline std::int64_t dq_kv_chunk_pairs(std::int64_t total_pairs, std::int64_t group, std::int64_t num_idx,
                                      std::int64_t dim_qk) {
  return chunk_length(total_pairs, dq_kv_bytes_per_pair(group, num_idx, dim_qk), kDqKvPartialCap);
}

// ------------------------------------------------------------------------------------------ dK/dV chunks

// The dK/dV chunk length in tokens (a multiple of 32, so that chunks hold whole 32-row gathers for any G):
//  - at least kDkvMinChunkRows query rows and half the mean segment length (n * block tokens: a block is
//    selected by about n * block tokens on average), so that the long segments (block 0, the early blocks
//    that many tokens choose) are split into pieces of about the usual work, while the partial traffic stays
//    small. At short T a few hundred segments share the SMs and the long chunks set the tail, so half the mean
//    beats the mean and twice the mean; at long T the cap below decides;
//  - large enough that the partial slots fit kDkvPartialCap: a segment of L > C tokens makes ceil(L / C) <
//    2 L / C partials, and the segments hold at most `entries` tokens in all, so there are fewer than
//    2 * entries / C slots of block * (Dqk + Dv) * 4 bytes each. E.g. T = 64K, n = 16, block 64, D = 128:
//    C = 2048 tokens at Hkv = 4 and 16384 at Hkv = 32 (a 64K-token block 0 becomes 32 or 4 chunks).
inline constexpr std::int64_t kDkvMinChunkRows = 256;
inline constexpr std::size_t kDkvPartialCap = std::size_t{256} << 20;

inline std::int64_t dkv_chunk_tokens(std::int64_t entries, std::int64_t group, std::int64_t num_idx,
                                     std::int64_t block, std::int64_t dim_qk, std::int64_t dim_v) {
  const auto ceil_div = [](std::int64_t a, std::int64_t b) { return (a + b - 1) / b; };
  const std::int64_t slot_bytes = block * (dim_qk + dim_v) * 4;
  const std::int64_t max_slots = std::max<std::int64_t>(1, static_cast<std::int64_t>(kDkvPartialCap) / slot_bytes);
  std::int64_t c = std::max<std::int64_t>(ceil_div(kDkvMinChunkRows, std::max<std::int64_t>(1, group)),
                                          num_idx * block / 2);
  c = std::max(c, ceil_div(2 * entries, max_slots));
  return std::max<std::int64_t>(32, ceil_div(c, 32) * 32);
}

}  // namespace sparseattn::cuda::selection
