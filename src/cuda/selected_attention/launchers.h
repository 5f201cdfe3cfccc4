// Internal launchers of selected attention's kernels (the entry points are in forward.cu and backward.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/selected_attention/common.cuh"
#include "cuda/selected_attention/dkdv_chunks.cuh"
#include "cuda/selected_attention/dkdv_common.cuh"
#include "cuda/selected_attention/forward_plan.h"
#include "sparseattn/selected_attention.h"

namespace sparseattn::cuda::selection {

// Query-outer forwards, no workspace: one token per warp (forward_query_outer.cu), or consecutive tokens per CTA
// sharing their K/V tiles (forward_query_group.cu). chosen_form (device memory; null: run): the word in which
// query_adaptive.cu chose the form, so that the launch of the other form returns at once.
void forward_query_outer(const SelectedAttentionParams& p, const std::int32_t* chosen_form = nullptr);
void forward_query_group(const SelectedAttentionParams& p, const std::int32_t* chosen_form = nullptr);
// Query-outer dQ (dq_query_outer.cu): p.dq = (or += with accumulate_dq) the gradient of p.q, from delta = rowsum(dO
// O) and the P factor (null data: 1) laid out like lse (backward.cu); no workspace.
void dq_query_outer(const SelectedAttentionBackwardParams& p, const LseView<const float>& delta,
                    const LseView<const float>& p_scale, bool accumulate_dq,
                    const std::int32_t* chosen_form = nullptr);
// Its group form (dq_query_group.cu): 8 consecutive tokens per CTA sharing their K/V tiles; the same arguments.
void dq_query_group(const SelectedAttentionBackwardParams& p, const LseView<const float>& delta,
                    const LseView<const float>& p_scale, bool accumulate_dq,
                    const std::int32_t* chosen_form = nullptr);
// Both forms of the forward, or of the dQ, the form chosen on the device from a sample of the index lists
// (query_adaptive.cu); `workspace` (the forward's: p.workspace) holds at least kAdaptiveWorkspaceBytes.
void forward_query_adaptive(const SelectedAttentionParams& p);
void dq_query_adaptive(const SelectedAttentionBackwardParams& p, const LseView<const float>& delta,
                       const LseView<const float>& p_scale, bool accumulate_dq, void* workspace);

// Workspace of the KV-block-outer forward, from shapes only: byte offsets of each slice from the 256-byte
// aligned base (see forward_kv_block_outer.cu for what they hold).
struct KvForwardPlan {
  HostShape shape;
  std::int64_t heads_q = 0, heads_kv = 0, group = 0, num_idx = 0, block = 0, dim_v = 0;
  std::int64_t total_rows = 0;      // B*T or N
  std::int64_t blocks_per_seq = 0;  // batched: ceil(T / block)
  std::int64_t blocks_bound = 0;    // selection blocks of all sequences (per KV head), an upper bound
  std::int64_t total_pairs = 0;     // (KV head, token row) pairs: Hkv * total_rows
  std::int64_t chunk_pairs = 0;     // pairs per chunk (head-major, forward_plan.h)
  std::int64_t chunk_entries = 0;   // chunk_pairs * n
  std::uint32_t sentinel = 0;
  int end_bit = 1;             // bits of a plain (KV head, block) key
  SortGroup sort;              // chunks sorted together and the key bits of that sort (forward_plan.h)
  std::size_t offsets = 0, keys_in = 0, keys_out = 0, values_in = 0, values_out = 0, o_part = 0, scale_part = 0, lse_part = 0,
              temp = 0, temp_bytes = 0, total = 0;
};

KvForwardPlan kv_forward_plan(const SelectedAttentionParams& p);
// Enqueues the KV-block-outer forward on p.stream; p.workspace holds at least plan.total bytes.
void forward_kv_outer(const SelectedAttentionParams& p, const KvForwardPlan& plan);

// The buffers of the KV-block-outer dK/dV (dkdv.cu), carved from backward.cu's workspace: the inverse index's block
// offsets, segments and sorted entries, the chunk table (counts and their scan), and the partial slots.
struct DkdvBuffers {
  const std::int32_t* offsets;
  const std::int32_t* seg_begin;
  const std::int32_t* seg_end;
  const std::int32_t* values_out;
  std::uint64_t* counts;
  std::uint64_t* scan;
  void* scan_temp;
  std::size_t scan_temp_bytes;
  float* partials;
  std::int64_t grid;   // CTAs along x: partial slots + keys
  std::int64_t slots;  // partial slots
};
// Enqueues the chunk table, the dK/dV kernel and, where segments were split, the reduction of their partials.
void dkdv_kv_block_outer(const SelectedAttentionBackwardParams& p, const DkvConfig& c, const ChunkConfig& cc,
                         const DkdvBuffers& buffers, const LseView<const float>& delta,
                         const LseView<const float>& p_scale, const SeqPairTable& table);

}  // namespace sparseattn::cuda::selection
