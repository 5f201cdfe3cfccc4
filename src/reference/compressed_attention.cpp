#include <algorithm>
#include <cmath>

#include "reference/attention_core.h"
#include "reference/dense.h"
#include "reference/reference.h"

namespace sparseattn::reference {

namespace {

// Queries and compressed keys in float64; query t of a sequence sees compressed blocks 0 .. j_max where
// j_max * stride + block - 1 <= t.
struct CompressedProblem {
  detail::TokenLayout layout, layout_cmp;
  Dense q, k_cmp, v_cmp;
  AttentionProblem problem;

  template <class Params>
  explicit CompressedProblem(const Params& params)
      : layout(token_layout(params.q, params.seqs.cu_seqlens)),
        layout_cmp(token_layout(params.k_cmp, params.cu_seqlens_cmp)),
        q(load_tokens(params.q, layout.packed)),
        k_cmp(load_tokens(params.k_cmp, layout.packed)),
        v_cmp(load_tokens(params.v_cmp, layout.packed)),
        problem{q, k_cmp, v_cmp, spans(layout, params.seqs.cu_seqlens), spans(layout_cmp, params.cu_seqlens_cmp),
                params.scale ? *params.scale : 1.0 / std::sqrt(static_cast<double>(q.dim(3))), {}, {}} {
    problem.visible_keys = [this, block = std::int64_t{params.block}, stride = std::int64_t{params.stride}](
                               std::int64_t seq, std::int64_t t, std::int64_t, std::vector<std::int64_t>& keys) {
      keys.clear();
      if (t < block - 1) return;
      const std::int64_t count = std::min((t - block + 1) / stride + 1, problem.k_spans[seq].length);
      for (std::int64_t j = 0; j < count; ++j) keys.push_back(j);
    };
  }
  CompressedProblem(const CompressedProblem&) = delete;
};

}  // namespace

void compressed_attention(const CompressedAttentionParams& params) {
  const CompressedProblem cmp(params);
  const AttentionOutputs out = attention_forward(cmp.problem);
  store_tokens(out.o, params.o, cmp.layout.packed, cmp.problem.q_spans);
  store_lse(out.lse, params.lse, cmp.layout.packed, cmp.problem.q_spans);
}

void compressed_attention_backward(const CompressedAttentionBackwardParams& params) {
  const CompressedProblem cmp(params);
  const bool packed = cmp.layout.packed;
  const AttentionGradients grads = attention_backward(cmp.problem, load_tokens(params.o, packed),
                                                      load_tokens(params.lse, packed), load_tokens(params.d_o, packed));
  store_tokens(grads.dq, params.dq, packed, cmp.problem.q_spans);
  store_tokens(grads.dk, params.dk_cmp, packed, cmp.problem.k_spans);
  store_tokens(grads.dv, params.dv_cmp, packed, cmp.problem.k_spans);
}

}  // namespace sparseattn::reference
