#include <algorithm>

#include "reference/attention_core.h"
#include "reference/dense.h"
#include "reference/query_chunk.h"
#include "reference/reference.h"

namespace sparseattn::reference {

namespace {

// Queries and compressed keys in float64; query t of a sequence sees compressed blocks 0 .. j_max where
// j_max * stride + block - 1 <= a, with a = t + S - T its key position (a = t without a query chunk).
struct CompressedProblem {
  detail::TokenLayout layout, layout_cmp;
  Dense q, k_cmp, v_cmp;
  std::vector<std::int64_t> offsets;  // S_b - T_b
  AttentionProblem problem;

  template <class Params>
  explicit CompressedProblem(const Params& params)
      : layout(token_layout(params.q, params.seqs.cu_seqlens)),
        layout_cmp(token_layout(params.k_cmp, params.cu_seqlens_cmp)),
        q(load_tokens(params.q, layout.packed)),
        k_cmp(load_tokens(params.k_cmp, layout.packed)),
        v_cmp(load_tokens(params.v_cmp, layout.packed)),
        offsets(chunk_offsets(spans(layout, params.seqs.cu_seqlens),
                              key_spans(layout, params.seqs, params.seqs_k,
                                        params.seqlen_k > 0 ? params.seqlen_k : layout.rows))),
        problem{q, k_cmp, v_cmp, spans(layout, params.seqs.cu_seqlens), spans(layout_cmp, params.cu_seqlens_cmp),
                softmax_scale(params.scale, q.dim(3)), {}, {}} {
    problem.visible_keys = [this, block = std::int64_t{params.block}, stride = std::int64_t{params.stride}](
                               std::int64_t seq, std::int64_t t, std::int64_t, std::vector<std::int64_t>& keys) {
      keys.clear();
      const std::int64_t a = t + offsets[seq];
      if (a < block - 1) return;
      const std::int64_t count = std::min((a - block + 1) / stride + 1, problem.k_spans[seq].length);
      for (std::int64_t j = 0; j < count; ++j) keys.push_back(j);
    };
  }
  CompressedProblem(const CompressedProblem&) = delete;
};

}  // namespace

void compressed_attention(const CompressedAttentionParams& params) {
  const CompressedProblem cmp(params);
  attention_forward_into(cmp.problem, cmp.layout.packed, params.o, params.lse);
}

void compressed_attention_backward(const CompressedAttentionBackwardParams& params) {
  const CompressedProblem cmp(params);
  const bool packed = cmp.layout.packed;
  attention_backward_into(cmp.problem, load_backward_inputs(params.o, params.lse, params.d_o, packed), packed,
                          params.dq, params.dk_cmp, params.dv_cmp);
}

}  // namespace sparseattn::reference
