#include "sparseattn/combine.h"

#include <string>

#include "api/branch_backward.h"
#include "api/check.h"
#include "reference/reference.h"
#ifdef SPARSEATTN_WITH_CUDA
#include "cuda/combine/ops.h"
#endif

namespace sparseattn {

namespace {

const char* const kBranch[kNumBranches] = {"cmp", "slc", "swa"};

// Checks the branch outputs and gates against `anchor` (an output-shaped tensor) and returns the layout.
detail::TokenLayout check_branches(const detail::Check& check, const std::array<TensorView, kNumBranches>& outputs,
                                   const std::array<TensorView, kNumBranches>& gates, const TensorView& anchor,
                                   const std::string& anchor_arg) {
  check.present(anchor, anchor_arg);
  check.floating(anchor, anchor_arg);
  check.inner_contiguous(anchor, anchor_arg);
  check.require(anchor.rank == 3 || anchor.rank == 4, ErrorKind::shape, anchor_arg,
                "expected [B, T, Hq, Dv] or packed [N, Hq, Dv], got " + anchor.shape_string());
  detail::TokenLayout layout;
  layout.packed = anchor.rank == 3;
  layout.batch = layout.packed ? 1 : anchor.shape[0];
  layout.rows = anchor.shape[anchor.rank - 3];
  const std::int64_t heads = anchor.shape[anchor.rank - 2];
  const std::int64_t dim = anchor.shape[anchor.rank - 1];
  int branches = 0;
  for (int i = 0; i < kNumBranches; ++i) {
    const std::string gate = std::string("g_") + kBranch[i];
    const std::string out = std::string("o_") + kBranch[i];
    if (!gates[i].present()) continue;
    ++branches;
    check.tensor(gates[i], gate, anchor.dtype, anchor, anchor_arg);
    check.shape(gates[i], gate, layout.per_head(heads));
    check.tensor(outputs[i], out, anchor.dtype, anchor, anchor_arg);
    check.shape(outputs[i], out, layout.tokens(heads, dim));
  }
  check.require(branches > 0, ErrorKind::config, "gates", "at least one branch gate must be given");
  return layout;
}

}  // namespace

void combine(const CombineParams& params) {
  const detail::Check check("combine");
  check_branches(check, params.outputs, params.gates, params.o, "o");
  switch (detail::backend(check, params.o, "o", detail::kCudaBuilt)) {
    case detail::Backend::cpu: reference::combine(params); break;
#ifdef SPARSEATTN_WITH_CUDA
    case detail::Backend::cuda: cuda::combine(params); break;
#else
    case detail::Backend::cuda: break;
#endif
  }
}

void combine_backward(const CombineBackwardParams& params) { detail::combine_backward(params, {}, {}); }

namespace detail {

void check_delta(const Check& check, const TensorView& delta, const std::string& arg,
                 const std::vector<std::int64_t>& lse_shape, const TensorView& anchor, const std::string& anchor_arg) {
  if (!delta.present()) return;
  check.require(anchor.device == DeviceType::cuda, ErrorKind::unsupported, arg, "is taken on CUDA only");
  check.tensor(delta, arg, DType::float32, anchor, anchor_arg);
  check.shape(delta, arg, lse_shape);
  check.inner_contiguous(delta, arg);
}

void check_options(const Check& check, const BranchBackwardOptions& options, const std::vector<std::int64_t>& lse_shape,
                   const TensorView& q) {
  check.require(!options.accumulate_dq || q.device == DeviceType::cuda, ErrorKind::unsupported, "dq",
                "accumulates on CUDA only");
  check_delta(check, options.delta, "delta", lse_shape, q, "q");
  check_delta(check, options.d_o_scale, "d_o_scale", lse_shape, q, "q");
}

void combine_backward(const CombineBackwardParams& params, const std::array<TensorView, kNumBranches>& deltas,
                      const std::array<TensorView, kNumBranches>& scales) {
  const detail::Check check("combine_backward");
  const detail::TokenLayout layout = check_branches(check, params.outputs, params.gates, params.d_o, "d_o");
  const std::int64_t heads = params.d_o.shape[params.d_o.rank - 2];
  const std::int64_t dim = params.d_o.shape[params.d_o.rank - 1];
  for (int i = 0; i < kNumBranches; ++i) {
    const std::string d_out = std::string("d_o_") + kBranch[i];
    const std::string d_gate = std::string("d_g_") + kBranch[i];
    if (!params.gates[i].present()) {
      check.absent(params.d_outputs[i], d_out, "for a branch without a gate");
      check.absent(params.d_gates[i], d_gate, "for a branch without a gate");
      continue;
    }
    if (scales[i].present()) {
      check.absent(params.d_outputs[i], d_out, "for a branch whose gate is folded into its backward");
      check_delta(check, scales[i], std::string("scale_") + kBranch[i], layout.lse(heads), params.d_o, "d_o");
    } else {
      check.tensor(params.d_outputs[i], d_out, params.d_o.dtype, params.d_o, "d_o");
      check.shape(params.d_outputs[i], d_out, layout.tokens(heads, dim));
    }
    if (params.d_gates[i].present()) {
      check.tensor(params.d_gates[i], d_gate, params.d_o.dtype, params.d_o, "d_o");
      check.shape(params.d_gates[i], d_gate, layout.per_head(heads));
    }
    check_delta(check, deltas[i], std::string("delta_") + kBranch[i], layout.lse(heads), params.d_o, "d_o");
  }
  switch (detail::backend(check, params.d_o, "d_o", detail::kCudaBuilt)) {
    case detail::Backend::cpu: reference::combine_backward(params); break;
#ifdef SPARSEATTN_WITH_CUDA
    case detail::Backend::cuda: cuda::combine_backward(params, deltas, scales); break;
#else
    case detail::Backend::cuda: break;
#endif
  }
}

}  // namespace detail

}  // namespace sparseattn
