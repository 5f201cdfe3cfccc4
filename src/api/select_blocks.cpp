#include "sparseattn/select_blocks.h"

#include <algorithm>
#include <string>

#include "api/block_checks.h"
#include "api/check.h"
#include "api/cuda_limits.h"
#include "reference/reference.h"
#ifdef SPARSEATTN_WITH_CUDA
#include "cuda/selection/ops.h"
#endif

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

  const detail::Backend backend = detail::backend(check, params.q, "q", detail::kCudaBuilt);
#ifdef SPARSEATTN_WITH_CUDA
  if (backend == detail::Backend::cuda) {
    detail::check_cuda_half(check, params.q);
    check.require(dim == 64 || dim == 128 || dim == 192 || dim == 256, ErrorKind::unsupported, "q",
                  "head dim " + std::to_string(dim) + " has no CUDA kernel (64, 128, 192 or 256)");
    const std::int64_t max_length =
        layout.packed && params.seqs.max_seqlen > 0 ? std::min(params.seqs.max_seqlen, layout.rows) : layout.rows;
    check.require(cuda::select_blocks_fits(max_length, params.sel_block, heads_q / heads_kv, dim, params.num_selected,
                                           params.q.device_index),
                  ErrorKind::unsupported, "q",
                  "sequences of up to " + std::to_string(max_length) + " tokens need more shared memory per block "
                  "than this GPU has (one row of pooled scores, the group's queries)");
  }
#endif
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
