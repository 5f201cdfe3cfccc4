// KV-block-outer dQ of the selected-attention backward (dq_kv_block_outer.cu), for small groups where the
// query-outer dQ (dq_query_outer.cu) pads the G heads of one token to 16 mma rows and re-reads each token's K/V
// blocks.
// Its plan (which dQ runs, shared memory, partial chunks) is host-only: backward_plan.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/selected_attention/backward_plan.h"
#include "cuda/selected_attention/common.cuh"
#include "sparseattn/selected_attention.h"

namespace sparseattn::cuda::selection {

struct DqKvArgs {
  std::int64_t heads_q, heads_kv, group, num_idx, block, rows, batch, blocks_per_seq, total_rows;
  std::int64_t chunk_pairs;  // (KV head, token row) pairs per chunk, head-major (dq_kv_chunk_pairs)
  std::uint32_t blocks_bound, sentinel;
  int end_bit;     // bits of a plain (KV head, block) key
  SortGroup sort;  // chunks per sort and that sort's key bits (forward_plan.h)
  bool packed;
  bool accumulate_dq;  // dq += the gradient
  float scale, scale_log2;
  const std::int32_t* cu_seqlens;  // packed only
  const std::int32_t* offsets;     // packed: block offsets (already built)
  LseView<const float> delta;    // rowsum(dO * O), (batch, row, query head)
  LseView<const float> p_scale;  // the P factor (p_scale_at): scales a row's dQ, so applied to its partials
  std::uint32_t *keys_in, *keys_out;
  std::int32_t *values_in, *values_out;
  void* temp;
  std::size_t temp_bytes;
  void* dq_half;     // chunk_pairs * G * n * Dqk halves
  float* dq_scale;   // chunk_pairs * G * n
};

// Enqueues the KV-block-outer dQ (p: the backward's params) on p.stream.
void dq_kv_outer(const SelectedAttentionBackwardParams& p, const DqKvArgs& a);

}  // namespace sparseattn::cuda::selection
