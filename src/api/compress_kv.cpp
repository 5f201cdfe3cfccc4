#include "sparseattn/compress_kv.h"

#include <string>

#include "api/accumulate.h"
#include "api/block_checks.h"
#include "api/compress_kv_backward.h"
#include "api/check.h"
#include "reference/reference.h"
#ifdef SPARSEATTN_WITH_CUDA
#include "cuda/compress_kv/ops.h"
#endif

namespace sparseattn {

namespace {

// Checks the config, the token tensors (k and v, or their gradients) and the compressed pair; the first
// token tensor fixes the layout, dtype and device of all four.
void check_pair(const detail::Check& check, const TensorView& k, const std::string& k_arg, const TensorView& v,
                const std::string& v_arg, const TensorView& k_cmp, const std::string& k_cmp_arg,
                const TensorView& v_cmp, const std::string& v_cmp_arg, const Sequences& seqs,
                const TensorView& cu_seqlens_cmp, int block, int stride) {
  detail::check_compression(check, block, "block", stride, "stride");
  const detail::TokenLayout layout = check.layout(k, k_arg, seqs, "cu_seqlens");
  check.floating(k, k_arg);
  check.inner_contiguous(k, k_arg);
  const std::int64_t heads = k.shape[k.rank - 2];
  const std::int64_t dim_k = k.shape[k.rank - 1];
  check.tensor(v, v_arg, k.dtype, k, k_arg);
  const std::int64_t dim_v = v.shape[v.rank - 1];
  check.shape(v, v_arg, layout.tokens(heads, dim_v));

  check.tensor(k_cmp, k_cmp_arg, k.dtype, k, k_arg);
  const std::int64_t rows = detail::compressed_rows(check, layout, k_cmp, k_cmp_arg, block, stride);
  check.shape(k_cmp, k_cmp_arg, detail::compressed_shape(layout, rows, heads, dim_k));
  check.tensor(v_cmp, v_cmp_arg, k.dtype, k, k_arg);
  check.shape(v_cmp, v_cmp_arg, detail::compressed_shape(layout, rows, heads, dim_v));
  check.compressed_layout(layout, seqs, cu_seqlens_cmp, rows, block, stride);
}

}  // namespace

void compress_kv(const CompressKvParams& params) {
  const detail::Check check("compress_kv");
  check_pair(check, params.k, "k", params.v, "v", params.k_cmp, "k_cmp", params.v_cmp, "v_cmp", params.seqs,
             params.cu_seqlens_cmp, params.block, params.stride);
  switch (detail::backend(check, params.k, "k", detail::kCudaBuilt)) {
    case detail::Backend::cpu: reference::compress_kv(params); break;
#ifdef SPARSEATTN_WITH_CUDA
    case detail::Backend::cuda: cuda::compress_kv(params); break;
#else
    case detail::Backend::cuda: break;
#endif
  }
}

namespace {

void backward(const detail::Check& check, const CompressKvBackwardParams& params,
              const detail::CompressBackwardTerms& terms) {
  check_pair(check, params.dk, "dk", params.dv, "dv", params.dk_cmp, "dk_cmp", params.dv_cmp, "dv_cmp", params.seqs,
             params.cu_seqlens_cmp, params.block, params.stride);
  // Each term like the output it adds to (dtype and device of dk, shape of dk or dv, contiguous last dim).
  const auto like = [&](const TensorView& term, const std::string& arg, const TensorView& out) {
    check.tensor(term, arg, params.dk.dtype, params.dk, "dk");
    check.shape(term, arg, detail::shape_of(out));
    check.inner_contiguous(term, arg);
  };
  for (int i = 0; i < detail::kMaxCompressTerms; ++i) {
    const std::string k_arg = "terms.dk[" + std::to_string(i) + "]", v_arg = "terms.dv[" + std::to_string(i) + "]";
    check.require(terms.dk[i].present() == terms.dv[i].present(), ErrorKind::value, v_arg,
                  "present exactly where " + k_arg + " is");
    if (!terms.dk[i].present()) continue;
    like(terms.dk[i], k_arg, params.dk);
    like(terms.dv[i], v_arg, params.dv);
  }
  switch (detail::backend(check, params.dk, "dk", detail::kCudaBuilt)) {
    case detail::Backend::cpu: {
      reference::compress_kv_backward(params);
      // out += the present terms (packed rows past cu_seqlens[B] untouched, as the reference leaves them).
      const auto add = [&](const TensorView& out, const auto& added) {
        detail::AccumulateParams sum{.out = out, .terms = {out}, .cu_seqlens = params.seqs.cu_seqlens,
                                     .stream = params.stream};
        for (const TensorView& term : added) {
          if (term.present()) sum.terms.push_back(term);
        }
        if (sum.terms.size() > 1) detail::accumulate(sum);
      };
      add(params.dk, terms.dk);
      add(params.dv, terms.dv);
      break;
    }
#ifdef SPARSEATTN_WITH_CUDA
    case detail::Backend::cuda: cuda::compress_kv_backward(params, terms); break;
#else
    case detail::Backend::cuda: break;
#endif
  }
}

}  // namespace

void compress_kv_backward(const CompressKvBackwardParams& params) {
  backward(detail::Check("compress_kv_backward"), params, {});
}

namespace detail {

void compress_kv_backward_adding(const CompressKvBackwardParams& params, const CompressBackwardTerms& terms) {
  backward(Check("compress_kv_backward"), params, terms);
}

}  // namespace detail

}  // namespace sparseattn
