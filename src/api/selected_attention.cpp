#include "sparseattn/selected_attention.h"

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "api/block_checks.h"
#include "api/branch_backward.h"
#include "api/check.h"
#include "api/cuda_limits.h"
#include "reference/reference.h"
#ifdef SPARSEATTN_WITH_CUDA
#include "cuda/selected_attention/ops.h"
#endif

namespace sparseattn {

namespace {

struct SelectedShapes {
  detail::TokenLayout layout;
  detail::ChunkKeys keys;  // of k and v: S_b >= T_b keys per sequence
  std::int64_t q_heads = 0, kv_heads = 0, dim_qk = 0, dim_v = 0;
};

// Checks what the forward and the backward share (for the backward, o and lse are inputs).
template <class Params>
SelectedShapes check_common(const detail::Check& check, const Params& params) {
  const TensorView& q = params.q;
  check.present(q, "q");
  check.floating(q, "q");
  const DType dtype = q.dtype;
  check.tensor(q, "q", dtype, q, "q");
  SelectedShapes shapes;
  shapes.layout = check.layout(q, "q", params.seqs, "cu_seqlens");
  check.positive(params.block, "block");
  shapes.q_heads = q.shape[q.rank - 2];
  shapes.dim_qk = q.shape[q.rank - 1];
  check.require(shapes.dim_qk > 0, ErrorKind::shape, "q", "needs a positive head dim, got " + q.shape_string());

  const TensorView& k = params.k;
  check.tensor(k, "k", dtype, q, "q");
  check.require(k.rank == q.rank, ErrorKind::shape, "k",
                "expected " + std::to_string(q.rank) + " dimensions like q, got " + k.shape_string());
  shapes.keys = detail::chunk_keys(check, shapes.layout, params.seqs, params.seqs_k, k, "k", /*read_contents=*/true);
  shapes.kv_heads = k.shape[k.rank - 2];
  check.require(shapes.kv_heads > 0, ErrorKind::shape, "k", "needs at least one head, got " + k.shape_string());
  check.require(shapes.q_heads % shapes.kv_heads == 0, ErrorKind::shape, "k",
                "has " + std::to_string(shapes.kv_heads) + " heads, which must divide the " +
                    std::to_string(shapes.q_heads) + " query heads of q (group size Hq / Hkv)");
  check.shape(k, "k", shapes.keys.layout.tokens(shapes.kv_heads, shapes.dim_qk));
  check.tensor(params.v, "v", dtype, q, "q");
  shapes.dim_v = params.v.shape[params.v.rank - 1];
  check.shape(params.v, "v", shapes.keys.layout.tokens(shapes.kv_heads, shapes.dim_v));

  const TensorView& indices = params.indices;
  check.tensor(indices, "indices", DType::int32, q, "q");
  const std::int64_t count = indices.shape[indices.rank - 1];
  check.require(count >= 1, ErrorKind::shape, "indices",
                "needs at least one slot per row (n >= 1), got " + indices.shape_string());
  check.shape(indices, "indices", shapes.layout.tokens(shapes.kv_heads, count));
  check.tensor(params.o, "o", dtype, q, "q");
  check.shape(params.o, "o", shapes.layout.tokens(shapes.q_heads, shapes.dim_v));
  check.tensor(params.lse, "lse", detail::lse_dtype(dtype), q, "q");
  check.shape(params.lse, "lse", shapes.layout.lse(shapes.q_heads));
  detail::resolve_scale(check, params.scale, shapes.dim_qk);
  if (indices.device == DeviceType::cpu) {
    check.index_contents(indices, "indices", shapes.layout, params.seqs, shapes.keys.layout, shapes.keys.seqs,
                         params.block);
  }
  return shapes;
}

// What the CUDA kernels need beyond the shared checks (no device reads): dtype, head dims, 16-byte rows.
void check_cuda(const detail::Check& check, const SelectedShapes& shapes, const TensorView& q,
                const std::initializer_list<std::pair<const TensorView*, const char*>>& rows, std::int64_t count) {
#ifdef SPARSEATTN_WITH_CUDA
  detail::check_cuda_half(check, q);
  detail::check_cuda_head_dims(check, shapes.dim_qk, shapes.dim_v);
  for (const auto& [tensor, name] : rows) detail::check_cuda_rows(check, *tensor, name);
  const std::int64_t total_rows = shapes.layout.packed ? shapes.layout.rows : shapes.layout.batch * shapes.layout.rows;
  check.require(total_rows * shapes.kv_heads * count < (std::int64_t{1} << 31) - 1, ErrorKind::unsupported, "indices",
                "tokens x KV heads x n must stay below 2^31 for the CUDA backward's inverse index");
#else
  (void)check, (void)shapes, (void)q, (void)rows, (void)count;
#endif
}

// The size queries work from shapes only (views may have no data); on the CPU the reference keeps its
// scratch on the host.
template <class Params>
bool cuda_sizable(const Params& params) {
  const TensorView& q = params.q;
  return q.device == DeviceType::cuda && (q.rank == 3 || q.rank == 4) && params.k.rank == q.rank &&
         params.v.rank == q.rank && params.indices.rank == q.rank && params.block > 0 &&
         (q.rank == 4 || params.seqs.cu_seqlens.rank == 1);
}

}  // namespace

std::size_t selected_attention_workspace_size(const SelectedAttentionParams& params) {
#ifdef SPARSEATTN_WITH_CUDA
  if (cuda_sizable(params)) return cuda::selected_attention_workspace_size(params);
#endif
  (void)params;
  return 0;
}

void selected_attention(const SelectedAttentionParams& params) {
  const detail::Check check("selected_attention");
  const SelectedShapes shapes = check_common(check, params);
  const detail::Backend backend = detail::backend(check, params.q, "q", detail::kCudaBuilt);
  if (backend == detail::Backend::cuda) {
    check_cuda(check, shapes, params.q, {{&params.q, "q"}, {&params.k, "k"}, {&params.v, "v"}},
               params.indices.shape[params.indices.rank - 1]);
  }
  check.buffer(params.workspace, params.workspace_bytes, selected_attention_workspace_size(params), "workspace",
               "selected_attention_workspace_size");
  switch (backend) {
    case detail::Backend::cpu: reference::selected_attention(params); break;
#ifdef SPARSEATTN_WITH_CUDA
    case detail::Backend::cuda: cuda::selected_attention(params); break;
#else
    case detail::Backend::cuda: break;
#endif
  }
}

std::size_t selected_attention_backward_workspace_size(const SelectedAttentionBackwardParams& params) {
#ifdef SPARSEATTN_WITH_CUDA
  if (cuda_sizable(params)) return cuda::selected_attention_backward_workspace_size(params);
#endif
  (void)params;
  return 0;
}

void selected_attention_backward(const SelectedAttentionBackwardParams& params) {
  detail::selected_attention_backward(params, {});
}

void detail::selected_attention_backward(const SelectedAttentionBackwardParams& params,
                                         const BranchBackwardOptions& options) {
  const detail::Check check("selected_attention_backward");
  const SelectedShapes shapes = check_common(check, params);
  const DType dtype = params.q.dtype;
  check.tensor(params.d_o, "d_o", dtype, params.q, "q");
  check.shape(params.d_o, "d_o", shapes.layout.tokens(shapes.q_heads, shapes.dim_v));
  check.tensor(params.dq, "dq", dtype, params.q, "q");
  check.shape(params.dq, "dq", shapes.layout.tokens(shapes.q_heads, shapes.dim_qk));
  check.tensor(params.dk, "dk", dtype, params.q, "q");
  check.shape(params.dk, "dk", shapes.keys.layout.tokens(shapes.kv_heads, shapes.dim_qk));
  check.tensor(params.dv, "dv", dtype, params.q, "q");
  check.shape(params.dv, "dv", shapes.keys.layout.tokens(shapes.kv_heads, shapes.dim_v));
  const detail::Backend backend = detail::backend(check, params.q, "q", detail::kCudaBuilt);
  if (backend == detail::Backend::cuda) {
    check_cuda(check, shapes, params.q,
               {{&params.q, "q"}, {&params.k, "k"}, {&params.v, "v"}, {&params.o, "o"}, {&params.d_o, "d_o"}},
               params.indices.shape[params.indices.rank - 1]);
  }
  check.buffer(params.workspace, params.workspace_bytes, selected_attention_backward_workspace_size(params), "workspace",
               "selected_attention_backward_workspace_size");
  detail::check_options(check, options, shapes.layout.lse(shapes.q_heads), params.q);
  switch (backend) {
    case detail::Backend::cpu: reference::selected_attention_backward(params); break;
#ifdef SPARSEATTN_WITH_CUDA
    case detail::Backend::cuda: cuda::selected_attention_backward(params, options); break;
#else
    case detail::Backend::cuda: break;
#endif
  }
}

}  // namespace sparseattn
