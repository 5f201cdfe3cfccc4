#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "reference/attention_core.h"
#include "reference/dense.h"
#include "reference/reference.h"

namespace sparseattn::reference {

namespace {

// The mask and the bias of one call, broadcast as [B|1, Hq|Hkv|1, T|1, S] (batched layout only).
struct Broadcast4d {
  std::array<std::int64_t, 4> shape{};

  static Broadcast4d of(const TensorView& t) { return {{t.shape[0], t.shape[1], t.shape[2], t.shape[3]}}; }
  // The head of this tensor that query head h of `q_heads` (group size `group`) reads.
  std::int64_t head(std::int64_t h, std::int64_t q_heads, std::int64_t group) const {
    if (shape[1] == q_heads) return h;
    return shape[1] == 1 ? 0 : h / group;
  }
  // Row-major offset of the first key of (batch b, query head h, query row t).
  std::int64_t row_offset(std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t q_heads,
                          std::int64_t group) const {
    const std::int64_t bb = shape[0] == 1 ? 0 : b;
    const std::int64_t tt = shape[2] == 1 ? 0 : t;
    return ((bb * shape[1] + head(h, q_heads, group)) * shape[2] + tt) * shape[3];
  }
};

// Everything a flash-attention pass needs in float64, with the causal/window rule and the mask/bias hook.
struct FlashProblem {
  Dense q, k, v;
  detail::TokenLayout layout_q, layout_k;
  std::vector<std::uint8_t> mask;
  Dense bias;
  Broadcast4d mask_shape, bias_shape;
  AttentionProblem problem;

  template <class Params>
  explicit FlashProblem(const Params& params)
      : q(load_tokens(params.q, params.seqs_q.cu_seqlens.present())),
        k(load_tokens(params.k, params.seqs_k.cu_seqlens.present())),
        v(load_tokens(params.v, params.seqs_k.cu_seqlens.present())),
        layout_q(token_layout(params.q, params.seqs_q.cu_seqlens)),
        layout_k(token_layout(params.k, params.seqs_k.cu_seqlens)),
        problem{q, k, v, spans(layout_q, params.seqs_q.cu_seqlens), spans(layout_k, params.seqs_k.cu_seqlens),
                softmax_scale(params.scale, q.dim(3)), {}, {}} {
    problem.visible_keys = [this, causal = params.causal, left = params.window_left, right = params.window_right](
                               std::int64_t seq, std::int64_t t, std::int64_t, std::vector<std::int64_t>& keys) {
      const std::int64_t keys_len = problem.k_spans[seq].length;
      const std::int64_t aligned = t + keys_len - problem.q_spans[seq].length;  // bottom-right alignment
      std::int64_t first = 0, last = keys_len - 1;
      if (causal) last = std::min(last, aligned);
      if (right >= 0) last = std::min(last, aligned + right);
      if (left >= 0) first = std::max(first, aligned - left);
      keys.clear();
      for (std::int64_t s = first; s <= last; ++s) keys.push_back(s);
    };
    if (params.mask.present()) {
      mask = load_bool(params.mask);
      mask_shape = Broadcast4d::of(params.mask);
    }
    if (params.bias.present()) {
      bias = load(params.bias);
      bias_shape = Broadcast4d::of(params.bias);
    }
    if (params.mask.present() || params.bias.present()) {
      problem.add_scores = [this](std::int64_t seq, std::int64_t t, std::int64_t head,
                                  const std::vector<std::int64_t>& keys, double* scores) {
        add_mask_and_bias(seq, t, head, keys, scores);
      };
    }
  }
  FlashProblem(const FlashProblem&) = delete;

  std::int64_t group() const { return q.dim(2) / k.dim(2); }

  // Mask and bias exist in the batched layout only, where the sequence index is the batch index.
  void add_mask_and_bias(std::int64_t b, std::int64_t t, std::int64_t head, const std::vector<std::int64_t>& keys,
                         double* scores) const {
    if (!mask.empty()) {
      const std::uint8_t* keep = mask.data() + mask_shape.row_offset(b, head, t, q.dim(2), group());
      for (std::size_t i = 0; i < keys.size(); ++i) {
        if (!keep[keys[i]]) scores[i] = -std::numeric_limits<double>::infinity();
      }
    }
    if (!bias.values.empty()) {
      const double* row = bias.values.data() + bias_shape.row_offset(b, head, t, q.dim(2), group());
      for (std::size_t i = 0; i < keys.size(); ++i) scores[i] += row[keys[i]];
    }
  }
};

// dbias reduced to bias's own shape: each row (b', h', t') of dbias sums, in a fixed order, the score
// gradients of every query row that reads it, so dbias rows can run in parallel and the result is
// deterministic.
void bias_gradient(const FlashProblem& flash, const Dense& o, const Dense& lse, const Dense& d_o,
                   const TensorView& dbias_out) {
  const std::array<std::int64_t, 4>& shape = flash.bias_shape.shape;
  Dense dbias = Dense::zeros({shape[0], shape[1], shape[2], shape[3]});
  const std::int64_t batch = flash.layout_q.batch, q_heads = flash.q.dim(2), rows = flash.layout_q.rows;
  parallel_for(shape[0] * shape[1] * shape[2], [&](std::int64_t bias_row) {
    const std::int64_t bb = bias_row / (shape[1] * shape[2]), hb = bias_row / shape[2] % shape[1];
    const std::int64_t tb = bias_row % shape[2];
    const std::int64_t t_begin = shape[2] == 1 ? 0 : tb, t_end = shape[2] == 1 ? rows : tb + 1;
    double* out = dbias.values.data() + bias_row * shape[3];
    std::vector<std::int64_t> keys;
    std::vector<double> ds;
    for (std::int64_t b = 0; b < batch; ++b) {
      if (shape[0] != 1 && b != bb) continue;
      for (std::int64_t h = 0; h < q_heads; ++h) {
        if (flash.bias_shape.head(h, q_heads, flash.group()) != hb) continue;
        for (std::int64_t t = t_begin; t < t_end; ++t) {
          score_gradients(flash.problem, o, lse, d_o, b, t, h, keys, ds);
          for (std::size_t i = 0; i < keys.size(); ++i) out[keys[i]] += ds[i];
        }
      }
    }
  });
  store(dbias, dbias_out);
}

}  // namespace

void flash_attention(const FlashAttentionParams& params) {
  const FlashProblem flash(params);
  attention_forward_into(flash.problem, flash.layout_q.packed, params.o, params.lse);
}

void flash_attention_backward(const FlashAttentionBackwardParams& params) {
  const FlashProblem flash(params);
  const bool packed = flash.layout_q.packed;
  const BackwardInputs inputs = load_backward_inputs(params.o, params.lse, params.d_o, packed);
  attention_backward_into(flash.problem, inputs, packed, params.dq, params.dk, params.dv);
  if (params.dbias.present()) bias_gradient(flash, inputs.o, inputs.lse, inputs.d_o, params.dbias);
}

}  // namespace sparseattn::reference
