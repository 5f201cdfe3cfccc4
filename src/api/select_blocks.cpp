#include "sparseattn/select_blocks.h"

#include "api/block_checks.h"
#include "api/check.h"
#include "reference/reference.h"

namespace sparseattn {

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
  const std::int64_t rows =
      detail::compressed_rows(check, layout, params.k_cmp, "k_cmp", params.cmp_block, params.cmp_stride);
  const std::int64_t heads_kv = params.k_cmp.shape[params.k_cmp.rank - 2];
  check.require(heads_kv > 0 && heads_q % heads_kv == 0, ErrorKind::shape, "k_cmp",
                "its " + std::to_string(heads_kv) + " heads must divide the " + std::to_string(heads_q) +
                    " query heads of 'q'");
  check.shape(params.k_cmp, "k_cmp", detail::compressed_shape(layout, rows, heads_kv, dim));
  check.compressed_layout(layout, params.seqs, params.cu_seqlens_cmp, rows, params.cmp_block, params.cmp_stride);

  check.tensor(params.lse_cmp, "lse_cmp", detail::lse_dtype(params.q.dtype), params.q, "q");
  check.shape(params.lse_cmp, "lse_cmp", layout.lse(heads_q));
  check.tensor(params.indices, "indices", DType::int32, params.q, "q");
  check.shape(params.indices, "indices", layout.tokens(heads_kv, params.num_selected));

  switch (detail::backend(check, params.q, "q", /*has_cuda_kernels=*/false)) {
    case detail::Backend::cpu: reference::select_blocks(params); break;
    case detail::Backend::cuda: break;
  }
}

}  // namespace sparseattn
