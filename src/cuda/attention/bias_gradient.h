// flash_attention's bias gradient on CUDA: where the dK/dV kernels write their fp32 contributions (a slice of the
// backward's workspace, BiasGradientSink) and the reduction that sums them into dbias in a fixed order
// (deterministic, no atomics).
//  - A bias shared by every query row (batched [B|1, H|1, 1, S], packed key form [Hm|1, Nk] or row form
//    [Hm|1, 1, Lk]): per (query head, key), the sum over the head's queries, which one dK/dV CTA owns: [Hq][B][S]
//    (packed [Hq][1][Nk]). The reduction adds the query heads (and the batch rows or sequences) that read an entry.
//  - A bias with query rows (batched [B|1, H|1, T, S], packed row form [Hm|1, Nq, Lk]): per (batch row, workspace
//    head, query row, key), where the workspace heads are the query heads for a bias of Hq heads, else the KV
//    heads, whose group's query heads the one thread that holds an element adds up in every step (the dK/dV
//    kernel then runs without head splits). The reduction adds the workspace heads and batch rows that read an
//    entry.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/attention/bias_reduce.cuh"
#include "cuda/attention/score_terms.cuh"
#include "sparseattn/flash_attention.h"

namespace sparseattn::cuda {

struct BiasGradientPlan {
  bool present = false;
  bool key_sums = false;
  std::int64_t workspace_heads = 0;
  std::int64_t head_stride = 0, batch_stride = 0, row_stride = 0;  // of the fp32 workspace, in elements
  int head_div = 1;  // rows: query head h adds into workspace head h / head_div
  std::size_t bytes = 0;
  // The dK/dV kernel must not split a group's heads over CTAs (rows summed over the group by one thread).
  bool single_head_split = false;

  attention::BiasGradientSink sink(float* data) const {
    return {present ? data : nullptr, key_sums, head_stride, batch_stride, row_stride, head_div};
  }
};

// The plan of a backward call (absent without dbias); depends on shapes only.
inline BiasGradientPlan bias_gradient_plan(const FlashAttentionBackwardParams& p) {
  using i64 = std::int64_t;
  BiasGradientPlan plan;
  const TensorView &bias = p.bias, &q = p.q, &k = p.k;
  if (!p.dbias.present() || !bias.present() || !q.present() || !k.present() || q.rank != k.rank) return plan;
  const bool packed = q.rank == 3;
  const i64 q_heads = q.shape[q.rank - 2], kv_heads = k.shape[k.rank - 2];
  if (kv_heads <= 0 || q_heads % kv_heads != 0) return plan;
  const i64 group = q_heads / kv_heads;
  const i64 bias_heads = bias.rank == 4 ? bias.shape[1] : bias.shape[0];
  plan.present = true;
  plan.key_sums = bias.rank == 2 || (bias.rank == 3 && bias.shape[1] == 1) || (bias.rank == 4 && bias.shape[2] == 1);
  if (plan.key_sums) {
    const i64 batch = packed ? 1 : q.shape[0], key_rows = packed ? k.shape[0] : k.shape[1];
    plan.workspace_heads = q_heads;
    plan.batch_stride = key_rows;
    plan.head_stride = batch * key_rows;
    plan.bytes = static_cast<std::size_t>(q_heads * batch * key_rows) * sizeof(float);
    return plan;
  }
  const bool per_query_head = bias_heads == q_heads;
  plan.workspace_heads = per_query_head ? q_heads : kv_heads;
  plan.head_div = static_cast<int>(per_query_head ? 1 : group);
  plan.single_head_split = !per_query_head && group > 1;
  if (packed) {
    const i64 rows = q.shape[0], columns = bias.shape[2];
    plan.row_stride = columns;
    plan.head_stride = rows * columns;
    plan.batch_stride = 0;
    plan.bytes = static_cast<std::size_t>(plan.workspace_heads * rows * columns) * sizeof(float);
  } else {
    const i64 batch = q.shape[0], rows = q.shape[1], keys = k.shape[1];
    plan.row_stride = keys;
    plan.head_stride = rows * keys;
    plan.batch_stride = plan.workspace_heads * rows * keys;
    plan.bytes = static_cast<std::size_t>(batch * plan.batch_stride) * sizeof(float);
  }
  return plan;
}

// dbias = the workspace's contributions summed in a fixed order (batch rows or sequences, then workspace heads
// ascending); enqueued on `stream` after the dK/dV kernels. Packed entries that no sequence reads stay untouched.
void reduce_bias_gradient(const FlashAttentionBackwardParams& params, const BiasGradientPlan& plan,
                          const float* workspace, cudaStream_t stream);

}  // namespace sparseattn::cuda
