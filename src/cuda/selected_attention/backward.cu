// selected_attention's backward on CUDA: plans the workspace from shapes, then enqueues, in order,
//  1. delta = rowsum(dO * O) (primitives/delta.cuh), unless the caller gives it;
//  2. the inverse index (inverse_index.h): for each sequence, KV head and selection block, the ascending tokens
//     whose index row lists it, built by a stable radix sort, and its segments;
//  3. dQ, query-outer (dq_query_outer.cu: one warp per token, for large groups; or its group form,
//     dq_query_group.cu: 8 consecutive tokens per CTA sharing K/V tiles; or the two chosen between on the device,
//     query_adaptive.cu), or
//  4. dK/dV, KV-block-outer over the inverse index cut into chunks (dkdv.cu, dkdv_wgmma.cuh);
//  5. dQ, KV-block-outer (dq_kv_block_outer.cu: gathered query rows per selected block, for groups up to 8),
//     which reuses the inverse index's buffers once step 4 is done with them.
// Which dQ path runs is a host choice from shapes (backward_plan.h); between the query-outer dQ's two forms the
// device may choose from the index lists. No float atomics anywhere: every sum over CTAs is written to a workspace
// slot and added up in a fixed order, so the backward is deterministic.
// A query chunk (common.cuh: keys outnumbering queries) numbers the blocks of the keys' sequences; the inverse index
// and the dK/dV take it, and its dQ is the query-outer one.
//
// Workspace (shapes only): delta, the inverse index (4 x 4 bytes per (token, KV head, slot) entry + the radix
// sort's scratch), the chunk table (16 bytes per (KV head, block)), the dK/dV partials (at most kDkvPartialCap =
// 256 MB, see dkv_chunk_tokens) and, on the KV-block-outer dQ path, its partials (at most about kDqKvPartialCap =
// 256 MB: (KV head, token) pairs go in chunks, dq_kv_chunk_pairs; a chunk holds at least one pair) in the same bytes
// as the dK/dV's, which step 5 no longer needs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <stdexcept>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/delta.cuh"
#include "cuda/selected_attention/dkdv_chunks.cuh"
#include "cuda/selected_attention/common.cuh"
#include "cuda/selected_attention/dq_kv_block_outer.h"
#include "cuda/selected_attention/inverse_index.h"
#include "cuda/selected_attention/launchers.h"
#include "cuda/primitives/launch.cuh"
#include "cuda/selected_attention/ops.h"

namespace sparseattn::cuda {

namespace {

using selection::DkvConfig;
// ------------------------------------------------------------------------------------------------- host

// The backward's workspace, from shapes only.
struct BwdPlan {
  HostShape shape;             // of the queries
  HostShape key_shape;         // of the keys (common.cuh)
  bool chunk;                  // keys may outnumber queries
  std::int64_t heads_q, heads_kv, num_idx, block;
  std::int64_t total_rows;     // B*T or N
  std::int64_t blocks_bound;   // selection blocks of all sequences (per KV head), an upper bound
  std::int64_t blocks_per_seq; // batched: ceil(S / block)
  std::int64_t entries;        // total_rows * Hkv * n
  std::int64_t keys;           // Hkv * blocks_bound
  std::int64_t chunk_tokens;   // tokens per dK/dV chunk (dkv_chunk_tokens)
  std::int64_t slots;          // partial slots: an upper bound of the chunks of all split segments
  std::int64_t grid;           // dK/dV CTAs along x: slots + keys
  std::uint32_t sentinel;
  int end_bit;
  std::size_t delta, offsets, keys_in, keys_out, values_in, values_out, seg_begin, seg_end, temp, temp_bytes,
      counts, scan, scan_temp, scan_temp_bytes, partials, total;
  bool dq_kv;                  // KV-block-outer dQ (dq_kv_block_outer.h) instead of the query-outer one
  selection::DqForm dq_form;   // the query-outer dQ's: one-token, group (dq_query_group.cu) or chosen on the device
  std::size_t dq_choice;       // the device's choice (query_adaptive.cu), where dq_form is adaptive
  std::int64_t dq_chunk_pairs; // its (KV head, token row) pairs per chunk
  selection::SortGroup dq_sort; // its chunks per sort (forward_plan.h)
  std::size_t dq_half, dq_scale;
};

BwdPlan plan_of(const SelectedAttentionBackwardParams& p) {
  BwdPlan plan{};
  plan.shape = host_shape(p.q, p.seqs);
  plan.key_shape = selection::key_host_shape(p.k, p.seqs, p.seqs_k);
  plan.chunk = selection::query_chunk(p.q, p.k, p.seqs_k);
  plan.heads_q = p.q.shape[p.q.rank - 2];
  plan.heads_kv = p.k.shape[p.k.rank - 2];
  plan.num_idx = p.indices.shape[p.indices.rank - 1];
  plan.block = p.block;
  const auto& s = plan.shape;
  const std::int64_t key_rows = plan.key_shape.rows;
  plan.total_rows = s.packed ? s.rows : s.batch * s.rows;
  plan.blocks_per_seq = (key_rows + p.block - 1) / p.block;
  plan.blocks_bound = s.packed ? key_rows / p.block + s.batch : s.batch * plan.blocks_per_seq;
  plan.entries = plan.total_rows * plan.heads_kv * plan.num_idx;
  const std::int64_t keys = plan.heads_kv * plan.blocks_bound;
  if (keys >= (std::int64_t{1} << 31) - 1 || plan.entries >= (std::int64_t{1} << 31) - 1) {
    throw std::length_error("sparseattn: selected_attention_backward: tokens x KV heads x n exceeds 2^31 entries");
  }
  plan.sentinel = static_cast<std::uint32_t>(keys);
  plan.end_bit = selection::key_end_bit(plan.sentinel);
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t offset = at;
    at = align_up(at + bytes);
    return offset;
  };
  plan.delta = take(sizeof(float) * plan.total_rows * plan.heads_q);
  plan.offsets = take(sizeof(std::int32_t) * (s.batch + 1));
  plan.keys_in = take(sizeof(std::uint32_t) * plan.entries);
  plan.keys_out = take(sizeof(std::uint32_t) * plan.entries);
  plan.values_in = take(sizeof(std::int32_t) * plan.entries);
  plan.values_out = take(sizeof(std::int32_t) * plan.entries);
  plan.seg_begin = take(sizeof(std::int32_t) * keys);
  plan.seg_end = take(sizeof(std::int32_t) * keys);
  const std::int64_t dqk = p.q.shape[p.q.rank - 1], dv = p.v.shape[p.v.rank - 1];
  const std::int64_t group = plan.heads_kv > 0 ? plan.heads_q / plan.heads_kv : 0;
  {
    const DeviceGuard device(p.q.device_index);
    const auto choice = selection::parse_path_choice(std::getenv(selection::kDqEnv));
    const std::size_t smem_limit = smem_optin_bytes(p.q.device_index);
    plan.dq_kv = !plan.chunk && selection::choose_kv_outer_dq(choice, group, dqk, dv, plan.total_rows, plan.num_idx,
                                                              plan.block, smem_limit);
    plan.dq_form = selection::choose_dq_form(choice, dqk, dv, s.max_len, plan.num_idx, smem_limit);
    plan.temp_bytes = selection::radix_sort_temp_bytes(plan.entries, plan.end_bit);
    if (plan.dq_kv) {
      // The KV-block-outer dQ sorts groups of its chunks in the dK/dV's index buffers (sized for every entry).
      const std::int64_t pairs = plan.total_rows * plan.heads_kv;
      plan.dq_chunk_pairs = selection::dq_kv_chunk_pairs(pairs, group, plan.num_idx, dqk);
      plan.dq_sort = selection::sort_group(ceil_div(pairs, plan.dq_chunk_pairs), plan.dq_chunk_pairs * plan.num_idx,
                                           plan.end_bit);
      plan.temp_bytes =
          std::max(plan.temp_bytes, selection::radix_sort_temp_bytes(plan.entries, plan.dq_sort.end_bit));
    }
  }
  plan.temp = take(plan.temp_bytes);
  if (!plan.dq_kv && plan.dq_form == selection::DqForm::adaptive) {
    plan.dq_choice = take(selection::kAdaptiveWorkspaceBytes);
  }
  plan.keys = keys;
  plan.chunk_tokens = selection::dkv_chunk_tokens(plan.entries, plan.heads_q / std::max<std::int64_t>(1, plan.heads_kv),
                                       plan.num_idx, plan.block, dqk, dv);
  plan.slots = 2 * plan.entries / plan.chunk_tokens;
  plan.grid = plan.slots + keys;
  plan.counts = take(sizeof(std::uint64_t) * keys);
  plan.scan = take(sizeof(std::uint64_t) * keys);
  {
    const DeviceGuard device(p.q.device_index);
    plan.scan_temp_bytes = selection::chunk_scan_temp_bytes(keys);
  }
  plan.scan_temp = take(plan.scan_temp_bytes);
  // The KV-block-outer dQ's partials share their bytes with the dK/dV's: step 5 runs after the dK/dV's last reader
  // of them (dkv_reduce_kernel) on the same stream.
  const std::size_t partials_begin = at;
  plan.partials = take(sizeof(float) * plan.slots * plan.block * (dqk + dv));
  if (plan.dq_kv) {
    const std::size_t dkv_end = at;
    at = partials_begin;
    const std::size_t partials = static_cast<std::size_t>(plan.dq_chunk_pairs * group * plan.num_idx);
    plan.dq_half = take(sizeof(std::uint16_t) * partials * dqk);
    plan.dq_scale = take(sizeof(float) * partials);
    at = std::max(at, dkv_end);
  }
  plan.total = at + 256;  // slack: the base is only promised 16-byte aligned
  return plan;
}

}  // namespace

std::size_t selected_attention_backward_workspace_size(const SelectedAttentionBackwardParams& p) {
  return plan_of(p).total;
}

void selected_attention_backward(const SelectedAttentionBackwardParams& p,
                                 const detail::BranchBackwardOptions& options) {
  const TensorView& given_delta = options.delta;
  const DeviceGuard device(p.q.device_index);
  const BwdPlan plan = plan_of(p);
  const HostShape& s = plan.shape;
  const std::int64_t dqk = p.q.shape[p.q.rank - 1], dv = p.v.shape[p.v.rank - 1];
  // Without keys nothing is written; without queries dK and dV are still written (zero: every segment is empty).
  if (s.batch <= 0 || plan.key_shape.max_len <= 0 || plan.heads_q <= 0) return;
  const auto stream = static_cast<cudaStream_t>(p.stream);
  unsigned char* ws = aligned_workspace(p.workspace);
  // delta = rowsum(dO * O): the caller's (laid out like lse), else computed into the workspace as [rows][Hq].
  float* const delta_ws = reinterpret_cast<float*>(ws + plan.delta);
  const LseView<const float> delta = given_delta.present()
                                         ? lse_of<const float>(given_delta)
                                         : LseView<const float>{delta_ws, s.rows * plan.heads_q, plan.heads_q, 1};
  // The P factor: an NSA branch gate folded into this backward (core/branch_backward_options.h); null: 1.
  const LseView<const float> p_scale = options.d_o_scale.present() ? lse_of<const float>(options.d_o_scale)
                                                                   : LseView<const float>{nullptr, 0, 0, 0};
  auto* offsets = reinterpret_cast<std::int32_t*>(ws + plan.offsets);
  auto* keys_in = reinterpret_cast<std::uint32_t*>(ws + plan.keys_in);
  auto* keys_out = reinterpret_cast<std::uint32_t*>(ws + plan.keys_out);
  auto* values_in = reinterpret_cast<std::int32_t*>(ws + plan.values_in);
  auto* values_out = reinterpret_cast<std::int32_t*>(ws + plan.values_out);
  auto* seg_begin = reinterpret_cast<std::int32_t*>(ws + plan.seg_begin);
  auto* seg_end = reinterpret_cast<std::int32_t*>(ws + plan.seg_end);
  auto* counts = reinterpret_cast<std::uint64_t*>(ws + plan.counts);
  auto* scan = reinterpret_cast<std::uint64_t*>(ws + plan.scan);
  auto* partials = reinterpret_cast<float*>(ws + plan.partials);
  const std::int64_t group = plan.heads_q / plan.heads_kv;
  const double scale = softmax_scale(p.scale, dqk);
  const float scale_log2 = static_cast<float>(scale * kLog2eDouble);
  const SeqPairTable table = selection::query_key_table(p.q, p.k, p.seqs, p.seqs_k);
  const auto* cu = static_cast<const std::int32_t*>(p.seqs.cu_seqlens.data);
  const std::int32_t* cu_k = table.k.cu_seqlens;  // packed: the keys' (cu_seqlens_k, else cu)
  const std::int64_t keys = plan.heads_kv * plan.blocks_bound;

  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // 1. delta = rowsum(dO * O).
    if (!given_delta.present()) {
      launch_delta<T>(tokens_of<const T>(p.o), tokens_of<const T>(p.d_o), {delta_ws, s.rows * plan.heads_q, plan.heads_q, 1},
                      plan.total_rows / std::max<std::int64_t>(s.rows, 1), s.rows, plan.heads_q, static_cast<int>(dv),
                      stream);
    }
    // 2. Inverse index: block offsets (packed), keys, stable sort, segments.
    if (s.packed) selection::launch_block_offsets(cu_k, s.batch, plan.block, offsets, stream);
    const selection::KeyConfig kc{plan.num_idx, plan.block, s.rows, s.batch, plan.blocks_per_seq, plan.total_rows,
                                  /*pair0=*/0, plan.total_rows * plan.heads_kv,
                                  /*chunk_pairs=*/plan.total_rows * plan.heads_kv, /*chunk_shift=*/0,
                                  static_cast<std::uint32_t>(plan.blocks_bound), plan.sentinel, s.packed,
                                  /*value_is_entry=*/false, s.packed && cu_k != cu ? cu_k : nullptr,
                                  s.packed ? 0 : plan.key_shape.rows - s.rows};
    selection::launch_make_keys(selection::index_of(p.indices), cu, offsets, kc, keys_in, values_in, stream);
    selection::radix_sort_pairs(ws + plan.temp, plan.temp_bytes, keys_in, keys_out, values_in, values_out,
                                plan.entries, plan.end_bit, stream);
    selection::launch_segments(keys_out, plan.entries, plan.sentinel, seg_begin, seg_end, keys, stream);
    // 3. dQ, query-outer (or KV-block-outer after step 4).
    if (!plan.dq_kv) {
      switch (plan.dq_form) {
        case selection::DqForm::group: selection::dq_query_group(p, delta, p_scale, options.accumulate_dq); break;
        case selection::DqForm::adaptive:
          selection::dq_query_adaptive(p, delta, p_scale, options.accumulate_dq, ws + plan.dq_choice);
          break;
        case selection::DqForm::one_token: selection::dq_query_outer(p, delta, p_scale, options.accumulate_dq); break;
      }
    }
    // 4. dK, dV, KV-block-outer over the inverse index cut into chunks (dkdv_chunks.cuh).
    {
      const DkvConfig c{plan.heads_kv, group, plan.block, s.rows, plan.blocks_per_seq, s.batch, keys,
                        plan.chunk_tokens, static_cast<std::uint32_t>(plan.blocks_bound), s.packed,
                        static_cast<float>(scale), scale_log2};
      const selection::ChunkConfig cc{keys, plan.chunk_tokens, plan.block, plan.blocks_per_seq, s.batch,
                                      static_cast<std::uint32_t>(plan.blocks_bound), s.packed};
      const selection::DkdvBuffers buffers{offsets, seg_begin, seg_end, values_out, counts, scan,
                                           ws + plan.scan_temp, plan.scan_temp_bytes, partials, plan.grid,
                                           plan.slots};
      selection::dkdv_kv_block_outer(p, c, cc, buffers, delta, p_scale, table);
    }
    // 5. dQ, KV-block-outer (dq_kv_block_outer.h); reuses the inverse index's buffers, which step 4 is done with.
    if (plan.dq_kv) {
      selection::DqKvArgs a{};
      a.heads_q = plan.heads_q;
      a.heads_kv = plan.heads_kv;
      a.group = group;
      a.num_idx = plan.num_idx;
      a.block = plan.block;
      a.rows = s.rows;
      a.batch = s.batch;
      a.blocks_per_seq = plan.blocks_per_seq;
      a.total_rows = plan.total_rows;
      a.chunk_pairs = plan.dq_chunk_pairs;
      a.blocks_bound = static_cast<std::uint32_t>(plan.blocks_bound);
      a.sentinel = plan.sentinel;
      a.end_bit = plan.end_bit;
      a.sort = plan.dq_sort;
      a.packed = s.packed;
      a.scale = static_cast<float>(scale);
      a.scale_log2 = scale_log2;
      a.cu_seqlens = s.packed ? cu : nullptr;
      a.offsets = offsets;
      a.delta = delta;
      a.p_scale = p_scale;
      a.accumulate_dq = options.accumulate_dq;
      a.keys_in = keys_in;
      a.keys_out = keys_out;
      a.values_in = values_in;
      a.values_out = values_out;
      a.temp = ws + plan.temp;
      a.temp_bytes = plan.temp_bytes;
      a.dq_half = ws + plan.dq_half;
      a.dq_scale = reinterpret_cast<float*>(ws + plan.dq_scale);
      selection::dq_kv_outer(p, a);
    }
  });
}

}  // namespace sparseattn::cuda
