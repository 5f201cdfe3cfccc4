// CUDA entry points of selected_attention's forward. Three forwards exist (forward_plan.h explains them and
// holds the heuristics): the query-outer one (forward_query_outer.cu), which pads each token's G query heads to a
// 16-row mma tile, its group form (forward_query_group.cu), whose CTAs of consecutive tokens load the K/V tiles
// they share once (query_adaptive.cu chooses between the two on the device), and the KV-block-outer one
// (forward_kv_block_outer.cu, with its sm_90a kernel in forward_kv_block_outer_wgmma.cuh), which packs the query
// rows of many tokens that selected the same block into full tiles and merges per-slot partials. The backward's
// entry point is backward.cu.
#include <cuda_runtime.h>

#include <cstdlib>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/launch.cuh"
#include "cuda/selected_attention/common.cuh"
#include "cuda/selected_attention/forward_plan.h"
#include "cuda/selected_attention/launchers.h"
#include "cuda/selected_attention/ops.h"

namespace sparseattn::cuda {

namespace {

// Which forward runs: the heuristic, or SPARSEATTN_SELECTED_FORWARD (read here, on the host, by the size
// query and the launch alike). Shapes only.
selection::ForwardPath forward_path(const SelectedAttentionParams& p) {
  const HostShape s = host_shape(p.q, p.seqs);
  const std::int64_t heads_q = p.q.shape[p.q.rank - 2], heads_kv = p.k.shape[p.k.rank - 2];
  if (heads_kv <= 0 || heads_q <= 0 || heads_q % heads_kv != 0 || p.block <= 0) {
    return selection::ForwardPath::query_outer;
  }
  const std::int64_t tokens = s.packed ? s.rows : s.batch * s.rows;
  const std::int64_t blocks_bound = s.packed ? s.rows / p.block + s.batch : s.batch * ((s.rows + p.block - 1) / p.block);
  // Past this bound the KV-block-outer forward's keys do not fit; no tokens: nothing runs.
  const std::int64_t kv_tokens = heads_kv * blocks_bound >= (std::int64_t{1} << 31) - 1 ? 0 : tokens;
  const auto choice = selection::parse_path_choice(std::getenv(selection::kForwardEnv));
  const selection::ForwardPath path =
      selection::choose_forward(choice, heads_q / heads_kv, p.q.shape[p.q.rank - 1], p.v.shape[p.v.rank - 1],
                                kv_tokens, s.max_len, p.indices.shape[p.indices.rank - 1], p.block,
                                smem_optin_bytes(p.q.device_index));
  // The KV-block-outer forward takes no query chunk (its inverse index numbers the blocks of the queries' own
  // sequences); the query-outer ones do (common.cuh).
  if (path == selection::ForwardPath::kv_outer && selection::query_chunk(p.q, p.k, p.seqs_k)) {
    return selection::ForwardPath::query_outer;
  }
  return path;
}

}  // namespace

// The query-outer forwards need no scratch but the word of the device's choice between them; the KV-block-outer one
// its chunked inverse index and partials.
std::size_t selected_attention_workspace_size(const SelectedAttentionParams& p) {
  switch (forward_path(p)) {
    case selection::ForwardPath::kv_outer: return selection::kv_forward_plan(p).total;
    case selection::ForwardPath::query_adaptive: return selection::kAdaptiveWorkspaceBytes;
    case selection::ForwardPath::query_group:
    case selection::ForwardPath::query_outer: break;
  }
  return 0;
}

void selected_attention(const SelectedAttentionParams& p) {
  const DeviceGuard device(p.q.device_index);
  switch (forward_path(p)) {
    case selection::ForwardPath::kv_outer: return selection::forward_kv_outer(p, selection::kv_forward_plan(p));
    case selection::ForwardPath::query_group: return selection::forward_query_group(p);
    case selection::ForwardPath::query_adaptive: return selection::forward_query_adaptive(p);
    case selection::ForwardPath::query_outer: return selection::forward_query_outer(p);
  }
}

}  // namespace sparseattn::cuda
