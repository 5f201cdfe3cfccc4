// KV-block-outer dQ of the selected-attention backward (dq_kv.cu), for small groups where the query-outer
// dQ (backward.cu) pads the G heads of one token to 16 mma rows and re-reads each token's K/V blocks.
// The planning helpers are host-only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <cuda_runtime.h>

#include "cuda/selection/common.cuh"
#include "sparseattn/selected_attention.h"

namespace sparseattn::cuda::selection {

inline constexpr int kDqKvWarps = 4;
inline constexpr int kDqKvTile = 16;
inline constexpr int kDqKvCtaRows = 256;   // query rows per CTA (entries per CTA = 256 / G)
inline constexpr int kDqKvMaxBlock = 128;
inline constexpr int kDqKvBuffers = 2;
// Partials (fp16 dQ row scaled by its max magnitude + that fp32 scale per (token, query head, slot)) are
// bounded by cutting the tokens into chunks whose partials stay near this many bytes.
inline constexpr std::size_t kDqKvPartialCap = std::size_t{256} << 20;
// Measured (H100, bf16, D = 128, n = 16, block 64, Hkv = 4, indices from select_blocks), time of the selected
// backward with the query-outer dQ / with this one on wgmma (dq_kv_wgmma.cuh), T = 16K and 64K: G = 1
// 3.65-4.02x, G = 4 1.62-1.66x, G = 6 1.24x, G = 8 1.04-1.05x, G = 12 0.84x, G = 16 0.73x (with the mma.sync
// kernel it was G = 6 1.02-1.04x, G = 7 0.94-0.96x: the limit was 6). Short sequences: the forward's limit.
inline constexpr std::int64_t kDqKvMaxGroup = 8;
inline constexpr std::int64_t kDqKvMinTokens = 1024;

inline std::size_t dq_kv_smem_bytes(std::int64_t dim_qk, std::int64_t dim_v, std::int64_t block) {
  const std::size_t key_rows = static_cast<std::size_t>((std::min<std::int64_t>(block, kDqKvMaxBlock) + 15) / 16 * 16);
  const std::size_t lists = 2 * sizeof(std::int32_t) * kDqKvCtaRows;
  const std::size_t slots = std::size_t{kDqKvBuffers} * kDqKvWarps * kDqKvTile;
  const std::size_t rows = slots * (8 + 8 + 8 + 4 + 4 + 4);
  const std::size_t q = slots * (dim_qk + dim_v) * 2;
  const std::size_t kv = key_rows * (dim_qk + dim_v) * 2;
  return lists + rows + q + kv;
}

// Internal switch for tests and measurements: SPARSEATTN_SELECTED_DQ = "query" or "kv" forces a dQ ("kv" only
// where supported), anything else leaves the choice to the heuristic.
inline constexpr const char* kDqEnv = "SPARSEATTN_SELECTED_DQ";

inline bool use_kv_outer_dq(const char* env, std::int64_t group, std::int64_t dim_qk, std::int64_t dim_v,
                            std::int64_t tokens, std::int64_t num_idx, std::int64_t block, std::size_t smem_limit) {
  if (group < 1 || num_idx < 1 || tokens < 1 || block > kDqKvMaxBlock) return false;
  if (dq_kv_smem_bytes(dim_qk, dim_v, block) > smem_limit) return false;
  if (env != nullptr && std::strcmp(env, "query") == 0) return false;
  if (env != nullptr && std::strcmp(env, "kv") == 0) return true;
  return group <= kDqKvMaxGroup && tokens >= kDqKvMinTokens && dim_qk <= 192;  // Dqk 256: its tiles spill
}

inline std::size_t dq_kv_bytes_per_row(std::int64_t heads_q, std::int64_t num_idx, std::int64_t dim_qk) {
  return static_cast<std::size_t>(heads_q * num_idx) * (dim_qk * 2 + 4);
}

inline std::int64_t dq_kv_chunk_rows(std::int64_t total_rows, std::int64_t heads_q, std::int64_t num_idx,
                                     std::int64_t dim_qk) {
  if (total_rows <= 0) return 0;
  const std::size_t per_row = std::max<std::size_t>(1, dq_kv_bytes_per_row(heads_q, num_idx, dim_qk));
  const std::int64_t fit = std::max<std::int64_t>(1, static_cast<std::int64_t>(kDqKvPartialCap / per_row));
  const std::int64_t chunks = (total_rows + fit - 1) / fit;
  return (total_rows + chunks - 1) / chunks;
}

struct DqKvArgs {
  std::int64_t heads_q, heads_kv, group, num_idx, block, rows, batch, blocks_per_seq, total_rows, chunk_rows;
  std::uint32_t blocks_bound, sentinel;
  int end_bit;
  bool packed;
  bool accumulate_dq;  // dq += the gradient
  float scale, scale_log2;
  const std::int32_t* cu_seqlens;  // packed only
  const std::int32_t* offsets;     // packed: block offsets (already built)
  LseView<const float> delta;  // rowsum(dO * O), (batch, row, query head)
  std::uint32_t *keys_in, *keys_out;
  std::int32_t *values_in, *values_out;
  void* temp;
  std::size_t temp_bytes;
  void* dq_half;     // chunk_rows * Hq * n * Dqk halves
  float* dq_scale;   // chunk_rows * Hq * n
};

// Enqueues the KV-block-outer dQ (p: the backward's params) on p.stream.
void dq_kv_outer(const SelectedAttentionBackwardParams& p, const DqKvArgs& a);

}  // namespace sparseattn::cuda::selection
