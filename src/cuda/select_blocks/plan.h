// Host-only planning of select_blocks on CUDA (select_blocks.cu): the kernel's configuration from shapes and
// NSA parameters, and its workspace, whose size is capped whatever the sequence length (no T x T buffer).
// Plain C++ (no CUDA headers) so that tests/cpp checks it on machines without a GPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/select_blocks/ops.h"

namespace sparseattn::cuda::selection {

inline constexpr int kSelectWarps = 8;
inline constexpr int kSelectRows = 16 * kSelectWarps;  // MMA rows per tile: (token, group head) pairs
static_assert(kSelectRows == kSelectMaxGroup, "a tile holds at least one token of the largest group");
// The pooled-score slots of all CTAs (one slot: a tile's tokens x the selection blocks of the longest
// sequence, fp32) stay within this many bytes: fewer CTAs where the sequences are long.
inline constexpr std::size_t kSelectWorkspaceCap = std::size_t{256} << 20;

// The kernel's parameters. Positions within a sequence (and block numbers) fit int32 (cu_seqlens is int32);
// the per-element and pooling arithmetic uses int32 without divisions, which matters at small groups (128
// tokens per tile).
struct SelectConfig {
  std::int64_t heads_kv, group, tokens_per_tile;
  int rows_per_token;   // Gp: the group rounded up to a power of two
  int tokens_per_warp;  // max(1, 16 / Gp)
  int warps_per_token;  // max(1, Gp / 16)
  std::int64_t cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local;
  int cols_per_block;  // sel_block / cmp_stride
  int border;          // cmp_block / cmp_stride - 1: compressed blocks reaching into the previous selection block
  int stencil;         // cols_per_block + border: compressed blocks overlapping one selection block
  // Gp = 16 (one token per warp), an even cols_per_block and a stencil of 2, 5 or 9: the kernel pools each column
  // tile straight from the lanes' group sums (pool_from_lanes), without the shared-memory sums.
  bool pool_in_lanes;
  // Weight of compressed block j = b * cols_per_block - border + s in selection block b: its overlap / stride.
  // In the kernel parameters, so that the unrolled pooling takes them as constant operands, not registers.
  float taps[kSelectColumns];
  int blocks_per_tile;        // selection blocks pooled per column tile
  std::int64_t slot_blocks;   // row length of a slot: selection blocks of the longest key sequence, rounded up to 4
  std::int64_t position_tiles;  // token tiles of the longest sequence
  std::int64_t batch;
  float scale_log2;  // set by the launch (softmax scale * log2 e)
  bool k_by_tma;     // set by the launch: K tiles loaded with TMA (sm_90a wgmma kernel)
  bool q_by_tma;     // set by the launch: the Q tile too (G = 16), the next tile's copied during the top-n
};

struct SelectPlan {
  SelectConfig config{};
  int ctas = 0;  // 0: nothing to do (or a shape the kernel does not take)
  std::size_t slot_bytes = 0;
  std::size_t workspace_bytes() const { return static_cast<std::size_t>(ctas) * slot_bytes; }
};

// The plan for `batch` sequences of at most `max_len` queries (from p.q and p.seqs) and `max_keys` keys (a query
// chunk's: docs/semantics.md section 11; 0: max_len), the heads of p.q and p.k_cmp and the compression and
// selection parameters of `p`, on a device of `multiprocessors` SMs.
inline SelectPlan plan_select_blocks(const SelectBlocksParams& p, std::int64_t batch, std::int64_t max_len,
                                     int multiprocessors, std::int64_t max_keys = 0) {
  const auto ceil_div = [](std::int64_t a, std::int64_t b) { return (a + b - 1) / b; };
  const std::int64_t heads_q = p.q.shape[p.q.rank - 2], heads_kv = p.k_cmp.shape[p.k_cmp.rank - 2];
  SelectPlan plan;
  if (batch <= 0 || max_len <= 0 || heads_kv <= 0 || heads_q % heads_kv != 0 || heads_q / heads_kv > kSelectRows ||
      p.cmp_stride <= 0 || p.sel_block <= 0 || !select_blocks_config_supported(p.cmp_block, p.cmp_stride, p.sel_block)) {
    return plan;
  }
  SelectConfig& c = plan.config;
  c.heads_kv = heads_kv;
  c.group = heads_q / heads_kv;
  c.rows_per_token = 1;
  while (c.rows_per_token < c.group) c.rows_per_token *= 2;
  c.tokens_per_warp = std::max(1, 16 / c.rows_per_token);
  c.warps_per_token = std::max(1, c.rows_per_token / 16);
  c.tokens_per_tile = kSelectRows / c.rows_per_token;
  c.cmp_block = p.cmp_block;
  c.cmp_stride = p.cmp_stride;
  c.sel_block = p.sel_block;
  c.num_selected = p.num_selected;
  c.num_init = p.num_init;
  c.num_local = p.num_local;
  c.cols_per_block = static_cast<int>(p.sel_block / p.cmp_stride);
  c.border = static_cast<int>(p.cmp_block / p.cmp_stride - 1);
  c.stencil = c.cols_per_block + c.border;
  c.pool_in_lanes = c.rows_per_token == 16 && c.cols_per_block % 2 == 0 &&
                    (c.stencil == 2 || c.stencil == 5 || c.stencil == 9);
  for (int s = 0; s < c.stencil; ++s) {
    const std::int64_t start = (s - c.border) * p.cmp_stride;
    const std::int64_t overlap = std::min<std::int64_t>(start + p.cmp_block, p.sel_block) - std::max<std::int64_t>(start, 0);
    c.taps[s] = static_cast<float>(overlap) / static_cast<float>(p.cmp_stride);
  }
  c.blocks_per_tile = static_cast<int>((kSelectColumns - c.border) / c.cols_per_block);
  c.slot_blocks = ceil_div(ceil_div(std::max(max_len, max_keys), p.sel_block), 4) * 4;
  c.position_tiles = ceil_div(max_len, c.tokens_per_tile);
  c.batch = batch;
  plan.slot_bytes = static_cast<std::size_t>(c.tokens_per_tile * c.slot_blocks) * sizeof(float);
  const std::int64_t tiles = c.position_tiles * c.batch * c.heads_kv;
  const std::int64_t by_cap = std::max<std::int64_t>(1, static_cast<std::int64_t>(kSelectWorkspaceCap / plan.slot_bytes));
  plan.ctas = static_cast<int>(std::min({tiles, std::int64_t{2} * std::max(multiprocessors, 1), by_cap}));
  return plan;
}

}  // namespace sparseattn::cuda::selection
