#include "sparseattn/compressed_attention.h"

#include <cstdint>
#include <string>
#include <vector>

#include "api/block_checks.h"
#include "api/branch_backward.h"
#include "api/check.h"
#include "api/cuda_limits.h"
#include "reference/reference.h"
#ifdef SPARSEATTN_WITH_CUDA
#include "cuda/attention/ops.h"
#endif

namespace sparseattn {

namespace {

struct CompressedShapes {
  detail::TokenLayout layout;
  detail::ChunkKeys keys;  // S_b >= T_b keys per sequence, whose compressed blocks k_cmp holds
  std::int64_t q_heads = 0, kv_heads = 0, dim_qk = 0, dim_v = 0;
  std::int64_t block = 0, stride = 0;
  std::int64_t cmp_rows = 0;  // Tc (batched) or Nc (packed)

  std::vector<std::int64_t> cmp_tokens(std::int64_t dim) const {
    if (layout.packed) return {cmp_rows, kv_heads, dim};
    return {layout.batch, cmp_rows, kv_heads, dim};
  }
};

// Checks what the forward and the backward share (for the backward, o and lse are inputs).
template <class Params>
CompressedShapes check_common(const detail::Check& check, const Params& params) {
  const TensorView& q = params.q;
  check.present(q, "q");
  check.floating(q, "q");
  const DType dtype = q.dtype;
  check.tensor(q, "q", dtype, q, "q");
  CompressedShapes shapes;
  shapes.layout = check.layout(q, "q", params.seqs, "cu_seqlens");
  check.positive(params.block, "block");
  check.positive(params.stride, "stride");
  check.require(params.block % params.stride == 0, ErrorKind::config, "stride",
                "must divide block, got block " + std::to_string(params.block) + " and stride " +
                    std::to_string(params.stride));
  shapes.block = params.block;
  shapes.stride = params.stride;
  shapes.q_heads = q.shape[q.rank - 2];
  shapes.dim_qk = q.shape[q.rank - 1];
  check.require(shapes.dim_qk > 0, ErrorKind::shape, "q", "needs a positive head dim, got " + q.shape_string());

  const TensorView& k_cmp = params.k_cmp;
  check.tensor(k_cmp, "k_cmp", dtype, q, "q");
  const int cmp_rank = shapes.layout.packed ? 3 : 4;
  check.require(k_cmp.rank == cmp_rank, ErrorKind::shape, "k_cmp",
                std::string("expected ") +
                    (shapes.layout.packed ? "3 dimensions [Nc, Hkv, Dqk]" : "4 dimensions [B, Tc, Hkv, Dqk]") +
                    ", got " + k_cmp.shape_string());
  shapes.kv_heads = k_cmp.shape[cmp_rank - 2];
  check.require(shapes.kv_heads > 0, ErrorKind::shape, "k_cmp", "needs at least one head, got " + k_cmp.shape_string());
  check.require(shapes.q_heads % shapes.kv_heads == 0, ErrorKind::shape, "k_cmp",
                "has " + std::to_string(shapes.kv_heads) + " heads, which must divide the " +
                    std::to_string(shapes.q_heads) + " query heads of q (group size Hq / Hkv)");
  shapes.keys = detail::chunk_key_count(check, shapes.layout, params.seqs, params.seqs_k, params.seqlen_k);
  shapes.cmp_rows = shapes.layout.packed
                        ? k_cmp.shape[0]
                        : num_compressed_blocks(shapes.keys.layout.rows, shapes.block, shapes.stride);
  check.compressed_layout(shapes.keys.layout, shapes.keys.seqs, params.cu_seqlens_cmp, shapes.cmp_rows, shapes.block,
                          shapes.stride);
  if (!shapes.layout.packed) {
    check.require(k_cmp.shape[1] == shapes.cmp_rows, ErrorKind::shape, "k_cmp",
                  "has " + std::to_string(k_cmp.shape[1]) + " compressed blocks, but sequences of " +
                      std::to_string(shapes.keys.layout.rows) + " keys have num_compressed_blocks(S, block " +
                      std::to_string(shapes.block) + ", stride " + std::to_string(shapes.stride) +
                      ") = " + std::to_string(shapes.cmp_rows));
  }
  check.shape(k_cmp, "k_cmp", shapes.cmp_tokens(shapes.dim_qk));
  check.tensor(params.v_cmp, "v_cmp", dtype, q, "q");
  shapes.dim_v = params.v_cmp.shape[params.v_cmp.rank - 1];
  check.shape(params.v_cmp, "v_cmp", shapes.cmp_tokens(shapes.dim_v));
  check.tensor(params.o, "o", dtype, q, "q");
  check.shape(params.o, "o", shapes.layout.tokens(shapes.q_heads, shapes.dim_v));
  check.tensor(params.lse, "lse", detail::lse_dtype(dtype), q, "q");
  check.shape(params.lse, "lse", shapes.layout.lse(shapes.q_heads));
  detail::resolve_scale(check, params.scale, shapes.dim_qk);
  return shapes;
}

template <class Params>
void check_cuda_compressed(const detail::Check& check, const Params& params, const CompressedShapes& shapes) {
  detail::check_cuda_half(check, params.q);
  detail::check_cuda_head_dims(check, shapes.dim_qk, shapes.dim_v);
  detail::check_cuda_rows(check, params.q, "q");
  detail::check_cuda_rows(check, params.k_cmp, "k_cmp");
  detail::check_cuda_rows(check, params.v_cmp, "v_cmp");
  detail::check_cuda_rows(check, params.o, "o");
  detail::check_cuda_length(check, params.q, params.seqs, "q");
}

}  // namespace

void compressed_attention(const CompressedAttentionParams& params) {
  const detail::Check check("compressed_attention");
  const CompressedShapes shapes = check_common(check, params);
  switch (detail::backend(check, params.q, "q", detail::kCudaBuilt)) {
    case detail::Backend::cpu: reference::compressed_attention(params); break;
    case detail::Backend::cuda:
      check_cuda_compressed(check, params, shapes);
#ifdef SPARSEATTN_WITH_CUDA
      cuda::compressed_attention(params);
#endif
      break;
  }
}

std::size_t compressed_attention_backward_workspace_size(const CompressedAttentionBackwardParams& params) {
  // The CPU reference keeps its scratch on the host; CUDA needs delta = rowsum(dO * O) (fp32, one per row) and,
  // when the dK/dV kernel splits the group's heads over CTAs, their fp32 partials.
#ifdef SPARSEATTN_WITH_CUDA
  if (params.q.present() && params.q.device == DeviceType::cuda) {
    return cuda::compressed_attention_backward_workspace_size(params);
  }
#endif
  (void)params;
  return 0;
}

void compressed_attention_backward(const CompressedAttentionBackwardParams& params) {
  detail::compressed_attention_backward(params, {});
}

void detail::compressed_attention_backward(const CompressedAttentionBackwardParams& params,
                                           const BranchBackwardOptions& options) {
  const detail::Check check("compressed_attention_backward");
  const CompressedShapes shapes = check_common(check, params);
  const DType dtype = params.q.dtype;
  check.tensor(params.d_o, "d_o", dtype, params.q, "q");
  check.shape(params.d_o, "d_o", shapes.layout.tokens(shapes.q_heads, shapes.dim_v));
  check.tensor(params.dq, "dq", dtype, params.q, "q");
  check.shape(params.dq, "dq", shapes.layout.tokens(shapes.q_heads, shapes.dim_qk));
  check.tensor(params.dk_cmp, "dk_cmp", dtype, params.q, "q");
  check.shape(params.dk_cmp, "dk_cmp", shapes.cmp_tokens(shapes.dim_qk));
  check.tensor(params.dv_cmp, "dv_cmp", dtype, params.q, "q");
  check.shape(params.dv_cmp, "dv_cmp", shapes.cmp_tokens(shapes.dim_v));
  check.buffer(params.workspace, params.workspace_bytes, compressed_attention_backward_workspace_size(params), "workspace",
               "compressed_attention_backward_workspace_size");
  detail::check_options(check, options, shapes.layout.lse(shapes.q_heads), params.q);
  switch (detail::backend(check, params.q, "q", detail::kCudaBuilt)) {
    case detail::Backend::cpu: reference::compressed_attention_backward(params); break;
    case detail::Backend::cuda:
      check_cuda_compressed(check, params, shapes);
      detail::check_cuda_rows(check, params.d_o, "d_o");
      detail::check_cuda_rows(check, params.dq, "dq");
      detail::check_cuda_rows(check, params.dk_cmp, "dk_cmp");
      detail::check_cuda_rows(check, params.dv_cmp, "dv_cmp");
#ifdef SPARSEATTN_WITH_CUDA
      cuda::compressed_attention_backward(params, options);
#endif
      break;
  }
}

}  // namespace sparseattn
