#include "sparseattn/select_blocks.h"

#include <string>

#include "api/block_checks.h"
#include "api/check.h"
#include "api/cuda_limits.h"
#include "reference/reference.h"
#ifdef SPARSEATTN_WITH_CUDA
#include "sparseattn/head_dims.h"
#include "cuda/select_blocks/ops.h"
#endif

namespace sparseattn {

std::size_t select_blocks_workspace_size(const SelectBlocksParams& params) {
  // From shapes only (views may have no data); the CPU reference keeps its scratch on the host.
#ifdef SPARSEATTN_WITH_CUDA
  const TensorView& q = params.q;
  if (q.device == DeviceType::cuda && (q.rank == 3 || q.rank == 4) && params.k_cmp.rank == q.rank &&
      params.indices.rank == q.rank && params.sel_block > 0 && (q.rank == 4 || params.seqs.cu_seqlens.rank == 1)) {
    return cuda::select_blocks_workspace_size(params);
  }
#endif
  (void)params;
  return 0;
}

void select_blocks(const SelectBlocksParams& params) {
  const detail::Check check("select_blocks");
  detail::check_selection_config(check, {params.cmp_block, params.cmp_stride, params.sel_block,
                                         params.num_selected, params.num_init, params.num_local});
  const detail::TokenLayout layout = check.layout(params.q, "q", params.seqs, "cu_seqlens");
  check.floating(params.q, "q");
  check.inner_contiguous(params.q, "q");
  const std::int64_t heads_q = params.q.shape[params.q.rank - 2];
  const std::int64_t dim = params.q.shape[params.q.rank - 1];
  detail::resolve_scale(check, params.scale, dim);

  check.tensor(params.k_cmp, "k_cmp", params.q.dtype, params.q, "q");
  check.require(params.k_cmp.rank == params.q.rank, ErrorKind::shape, "k_cmp",
                "expected " + std::to_string(params.q.rank) + " dimensions like 'q', got " +
                    params.k_cmp.shape_string());
  const detail::ChunkKeys keys =
      detail::chunk_key_count(check, layout, params.seqs, params.seqs_k, params.seqlen_k);
  const std::int64_t rows =
      detail::compressed_rows(check, keys.layout, params.k_cmp, "k_cmp", params.cmp_block, params.cmp_stride);
  const std::int64_t heads_kv = params.k_cmp.shape[params.k_cmp.rank - 2];
  check.require(heads_kv > 0 && heads_q % heads_kv == 0, ErrorKind::shape, "k_cmp",
                "its " + std::to_string(heads_kv) + " heads must divide the " + std::to_string(heads_q) +
                    " query heads of 'q'");
  check.shape(params.k_cmp, "k_cmp", detail::compressed_shape(layout, rows, heads_kv, dim));
  check.compressed_layout(keys.layout, keys.seqs, params.cu_seqlens_cmp, rows, params.cmp_block, params.cmp_stride);

  check.tensor(params.lse_cmp, "lse_cmp", detail::lse_dtype(params.q.dtype), params.q, "q");
  check.shape(params.lse_cmp, "lse_cmp", layout.lse(heads_q));
  check.tensor(params.indices, "indices", DType::int32, params.q, "q");
  check.shape(params.indices, "indices", layout.tokens(heads_kv, params.num_selected));

  const detail::Backend backend = detail::backend(check, params.q, "q", detail::kCudaBuilt);
#ifdef SPARSEATTN_WITH_CUDA
  if (backend == detail::Backend::cuda) {
    detail::check_cuda_half(check, params.q);
    check.require(cuda_head_dim_qk_supported(dim), ErrorKind::unsupported, "q",
                  "head dim " + std::to_string(dim) + " has no CUDA kernel; the (Dqk, Dv) pairs with kernels are " +
                      cuda_head_dims_list());
    detail::check_cuda_rows(check, params.q, "q");
    detail::check_cuda_rows(check, params.k_cmp, "k_cmp");
    check.require(heads_q / heads_kv <= cuda::kSelectMaxGroup, ErrorKind::unsupported, "k_cmp",
                  "the CUDA kernel takes up to " + std::to_string(cuda::kSelectMaxGroup) +
                      " query heads per KV head, got " + std::to_string(heads_q / heads_kv));
    check.require(cuda::select_blocks_config_supported(params.cmp_block, params.cmp_stride, params.sel_block),
                  ErrorKind::unsupported, "cmp_stride",
                  "the CUDA kernel needs sel_block / cmp_stride + cmp_block / cmp_stride - 1 <= " +
                      std::to_string(cuda::kSelectColumns) + " (one tile of compressed blocks per selection block), got " +
                      std::to_string(params.sel_block / params.cmp_stride + params.cmp_block / params.cmp_stride - 1));
  }
#endif
  check.buffer(params.workspace, params.workspace_bytes, select_blocks_workspace_size(params), "workspace",
               "select_blocks_workspace_size");
  switch (backend) {
    case detail::Backend::cpu: reference::select_blocks(params); break;
#ifdef SPARSEATTN_WITH_CUDA
    case detail::Backend::cuda: cuda::select_blocks(params); break;
#else
    case detail::Backend::cuda: break;
#endif
  }
}

}  // namespace sparseattn
