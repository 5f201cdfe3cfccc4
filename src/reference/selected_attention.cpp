#include <algorithm>

#include "reference/attention_core.h"
#include "reference/dense.h"
#include "reference/query_chunk.h"
#include "reference/reference.h"

namespace sparseattn::reference {

namespace {

// Query t of KV head h sees the tokens at positions <= a of the blocks listed in indices[t, h, :], with
// a = t + S - T its key position (a = t without a query chunk).
struct SelectedProblem {
  detail::TokenLayout layout;
  Dense q, k, v;
  std::vector<std::int32_t> indices;  // row-major [B, T, Hkv, n] or [N, Hkv, n]
  std::int64_t kv_heads, count;
  AttentionProblem problem;
  std::vector<std::int64_t> offsets;  // S_b - T_b

  template <class Params>
  explicit SelectedProblem(const Params& params)
      : layout(token_layout(params.q, params.seqs.cu_seqlens)),
        q(load_tokens(params.q, layout.packed)),
        k(load_tokens(params.k, layout.packed)),
        v(load_tokens(params.v, layout.packed)),
        indices(load_int32(params.indices)),
        kv_heads(k.dim(2)),
        count(params.indices.shape[params.indices.rank - 1]),
        problem{q, k, v, spans(layout, params.seqs.cu_seqlens),
                key_spans(layout, params.seqs, params.seqs_k, params.k.shape[params.k.rank - 3]),
                softmax_scale(params.scale, q.dim(3)), {}, {}},
        offsets(chunk_offsets(problem.q_spans, problem.k_spans)) {
    problem.visible_keys = [this, block = std::int64_t{params.block}](std::int64_t seq, std::int64_t t,
                                                                       std::int64_t kv_head,
                                                                       std::vector<std::int64_t>& keys) {
      const Span& span = problem.q_spans[seq];
      const std::int32_t* row =
          indices.data() + ((span.batch * layout.rows + span.begin + t) * kv_heads + kv_head) * count;
      keys.clear();
      const std::int64_t a = t + offsets[seq];
      for (std::int64_t j = 0; j < count && row[j] >= 0; ++j) {
        const std::int64_t end = std::min((row[j] + 1) * block, a + 1);
        for (std::int64_t s = row[j] * block; s < end; ++s) keys.push_back(s);
      }
    };
  }
  SelectedProblem(const SelectedProblem&) = delete;
};

}  // namespace

void selected_attention(const SelectedAttentionParams& params) {
  const SelectedProblem slc(params);
  attention_forward_into(slc.problem, slc.layout.packed, params.o, params.lse);
}

void selected_attention_backward(const SelectedAttentionBackwardParams& params) {
  const SelectedProblem slc(params);
  const bool packed = slc.layout.packed;
  attention_backward_into(slc.problem, load_backward_inputs(params.o, params.lse, params.d_o, packed), packed,
                          params.dq, params.dk, params.dv);
}

}  // namespace sparseattn::reference
