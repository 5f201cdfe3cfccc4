#include "reference/attention_core.h"
#include "reference/dense.h"
#include "reference/reference.h"
#include "reference/sequence_rows.h"

namespace sparseattn::reference {

namespace {

Dense zeros_like(const TensorView& t, bool packed) {
  return with_batch_dim(Dense::zeros(std::vector<std::int64_t>(t.shape.begin(), t.shape.begin() + t.rank)), packed);
}

// The spans of the compressed sequences: batched [B, Tc, ...] or packed by cu_seqlens_cmp.
std::vector<Span> compressed_spans(const detail::TokenLayout& tokens, const TensorView& cmp,
                                   const TensorView& cu_seqlens_cmp) {
  detail::TokenLayout layout = tokens;
  layout.rows = cmp.shape[tokens.packed ? 0 : 1];
  return spans(layout, cu_seqlens_cmp);
}

// Runs body(token_span, cmp_span, head) once per sequence and head: each call owns disjoint rows.
template <class Body>
void for_each_sequence_head(const std::vector<Span>& token_spans, const std::vector<Span>& cmp_spans,
                            std::int64_t heads, Body&& body) {
  parallel_for(static_cast<std::int64_t>(token_spans.size()) * heads, [&](std::int64_t i) {
    body(token_spans[i / heads], cmp_spans[i / heads], i % heads);
  });
}

}  // namespace

void compress_kv(const CompressKvParams& params) {
  const detail::TokenLayout layout = token_layout(params.k, params.seqs.cu_seqlens);
  const std::vector<Span> token_spans = spans(layout, params.seqs.cu_seqlens);
  const std::vector<Span> cmp_spans = compressed_spans(layout, params.k_cmp, params.cu_seqlens_cmp);
  const std::int64_t heads = params.k.shape[params.k.rank - 2];
  for (const auto& [input, output] : {std::pair{params.k, params.k_cmp}, std::pair{params.v, params.v_cmp}}) {
    const Dense x = load_tokens(input, layout.packed);
    Dense x_cmp = zeros_like(output, layout.packed);  // packed rows past cu_seqlens_cmp[B] stay 0
    const std::int64_t dim = x.dim(3);
    for_each_sequence_head(token_spans, cmp_spans, heads, [&](const Span& seq, const Span& cmp, std::int64_t h) {
      for (std::int64_t j = 0; j < cmp.length; ++j) {
        double* mean = x_cmp.row(cmp.batch, cmp.begin + j, h);
        for (std::int64_t t = j * params.stride; t < j * params.stride + params.block; ++t) {
          const double* token = x.row(seq.batch, seq.begin + t, h);
          for (std::int64_t d = 0; d < dim; ++d) mean[d] += token[d];
        }
        for (std::int64_t d = 0; d < dim; ++d) mean[d] /= params.block;
      }
    });
    store(x_cmp, output);
  }
}

void compress_kv_backward(const CompressKvBackwardParams& params) {
  const detail::TokenLayout layout = token_layout(params.dk, params.seqs.cu_seqlens);
  const std::vector<Span> token_spans = spans(layout, params.seqs.cu_seqlens);
  const std::vector<Span> cmp_spans = compressed_spans(layout, params.dk_cmp, params.cu_seqlens_cmp);
  const std::int64_t heads = params.dk.shape[params.dk.rank - 2];
  for (const auto& [input, output] : {std::pair{params.dk_cmp, params.dk}, std::pair{params.dv_cmp, params.dv}}) {
    const Dense dx_cmp = load_tokens(input, layout.packed);
    const TensorView covered = covered_rows(output, params.seqs.cu_seqlens);
    Dense dx = zeros_like(covered, layout.packed);  // tokens covered by no block keep 0
    const std::int64_t dim = dx.dim(3);
    for_each_sequence_head(token_spans, cmp_spans, heads, [&](const Span& seq, const Span& cmp, std::int64_t h) {
      for (std::int64_t j = 0; j < cmp.length; ++j) {
        const double* grad = dx_cmp.row(cmp.batch, cmp.begin + j, h);
        for (std::int64_t t = j * params.stride; t < j * params.stride + params.block; ++t) {
          double* token = dx.row(seq.batch, seq.begin + t, h);
          for (std::int64_t d = 0; d < dim; ++d) token[d] += grad[d] / params.block;
        }
      }
    });
    store(dx, covered);
  }
}

}  // namespace sparseattn::reference
