#include "reference/attention_core.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace sparseattn::reference {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
// Forward work items cover this many query rows of one (sequence, KV head).
constexpr std::int64_t kForwardRows = 16;
// Backward: the query rows of one (sequence, KV head) are split into parts of at least this many rows,
// at most kMaxParts of them; each part owns a dk/dv buffer for the sequence's keys (so the buffers cost at
// most kMaxParts times dk and dv).
constexpr std::int64_t kBackwardRows = 256;
constexpr std::int64_t kMaxParts = 8;

// Eight independent partial sums keep the adder busy (a single sum chain runs at the add latency); the
// compiler packs them into vector registers.
double dot(const double* a, const double* b, std::int64_t n) {
  double sum[8] = {};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) sum[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) sum[0] += a[i] * b[i];
  return ((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]));
}

void axpy(double alpha, const double* x, double* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

struct Dims {
  std::int64_t q_heads, kv_heads, group, dim_qk, dim_v;
};

Dims dims_of(const AttentionProblem& problem) {
  const std::int64_t q_heads = problem.q.dim(2);
  const std::int64_t kv_heads = problem.k.dim(2);
  return {q_heads, kv_heads, kv_heads > 0 ? q_heads / kv_heads : 0, problem.q.dim(3), problem.v.dim(3)};
}

// scores[i] = scale * q.k + extra terms, for keys[i] of query row t, head `head`.
void row_scores(const AttentionProblem& problem, const Dims& dims, std::int64_t seq, std::int64_t t,
                std::int64_t head, const std::vector<std::int64_t>& keys, std::vector<double>& scores) {
  const Span& qs = problem.q_spans[seq];
  const Span& ks = problem.k_spans[seq];
  const double* q = problem.q.row(qs.batch, qs.begin + t, head);
  const std::int64_t kv_head = head / dims.group;
  scores.resize(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    scores[i] = problem.scale * dot(q, problem.k.row(ks.batch, ks.begin + keys[i], kv_head), dims.dim_qk);
  }
  if (problem.add_scores) problem.add_scores(seq, t, head, keys, scores.data());
}

// Rows [begin, end) of one sequence, seen through one KV head.
struct RowRange {
  std::int64_t seq, kv_head, begin, end;
};

void forward_rows(const AttentionProblem& problem, const Dims& dims, const RowRange& range, AttentionOutputs& out) {
  const Span& qs = problem.q_spans[range.seq];
  const Span& ks = problem.k_spans[range.seq];
  std::vector<std::int64_t> keys;
  std::vector<double> scores;
  for (std::int64_t t = range.begin; t < range.end; ++t) {
    problem.visible_keys(range.seq, t, range.kv_head, keys);
    for (std::int64_t h = range.kv_head * dims.group; h < (range.kv_head + 1) * dims.group; ++h) {
      row_scores(problem, dims, range.seq, t, h, keys, scores);
      double max = kNegInf;
      for (double s : scores) max = std::max(max, s);
      double& lse = out.lse(qs.batch, h, qs.begin + t);
      if (max == kNegInf) {  // nothing visible: o stays 0
        lse = kNegInf;
        continue;
      }
      double* o = out.o.row(qs.batch, qs.begin + t, h);
      double sum = 0;
      for (std::size_t i = 0; i < keys.size(); ++i) {
        const double weight = std::exp(scores[i] - max);
        sum += weight;
        axpy(weight, problem.v.row(ks.batch, ks.begin + keys[i], range.kv_head), o, dims.dim_v);
      }
      for (std::int64_t c = 0; c < dims.dim_v; ++c) o[c] /= sum;
      lse = max + std::log(sum);
    }
  }
}

// One part of the backward: the query rows of `range`, with its own dk/dv buffers over the sequence's keys.
struct BackwardPart {
  RowRange range;
  std::vector<double> dk;  // [keys of the sequence, Dqk]
  std::vector<double> dv;  // [keys of the sequence, Dv]
};

void backward_rows(const AttentionProblem& problem, const Dims& dims, const Dense& o, const Dense& lse,
                   const Dense& d_o, BackwardPart& part, Dense& dq) {
  const RowRange& range = part.range;
  const Span& qs = problem.q_spans[range.seq];
  const Span& ks = problem.k_spans[range.seq];
  part.dk.assign(static_cast<std::size_t>(ks.length * dims.dim_qk), 0.0);
  part.dv.assign(static_cast<std::size_t>(ks.length * dims.dim_v), 0.0);
  std::vector<std::int64_t> keys;
  std::vector<double> scores;
  for (std::int64_t t = range.begin; t < range.end; ++t) {
    problem.visible_keys(range.seq, t, range.kv_head, keys);
    if (keys.empty()) continue;
    for (std::int64_t h = range.kv_head * dims.group; h < (range.kv_head + 1) * dims.group; ++h) {
      const std::int64_t row = qs.begin + t;
      const double row_lse = lse(qs.batch, h, row);
      if (row_lse == kNegInf) continue;
      row_scores(problem, dims, range.seq, t, h, keys, scores);
      const double* q = problem.q.row(qs.batch, row, h);
      const double* grad_o = d_o.row(qs.batch, row, h);
      const double delta = dot(grad_o, o.row(qs.batch, row, h), dims.dim_v);
      double* grad_q = dq.row(qs.batch, row, h);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        const double p = std::exp(scores[i] - row_lse);
        if (p == 0) continue;  // hidden (-inf) or negligible: no contribution anywhere
        const double* k = problem.k.row(ks.batch, ks.begin + keys[i], range.kv_head);
        const double* v = problem.v.row(ks.batch, ks.begin + keys[i], range.kv_head);
        const double ds = p * (dot(grad_o, v, dims.dim_v) - delta);
        axpy(problem.scale * ds, k, grad_q, dims.dim_qk);
        axpy(problem.scale * ds, q, part.dk.data() + keys[i] * dims.dim_qk, dims.dim_qk);
        axpy(p, grad_o, part.dv.data() + keys[i] * dims.dim_v, dims.dim_v);
      }
    }
  }
}

}  // namespace

AttentionOutputs attention_forward(const AttentionProblem& problem) {
  const Dims dims = dims_of(problem);
  const std::int64_t batch = problem.q.dim(0), rows = problem.q.dim(1);
  AttentionOutputs out{Dense::zeros({batch, rows, dims.q_heads, dims.dim_v}),
                       Dense::zeros({batch, dims.q_heads, rows})};
  std::vector<RowRange> ranges;
  for (std::int64_t seq = 0; seq < static_cast<std::int64_t>(problem.q_spans.size()); ++seq) {
    const std::int64_t length = problem.q_spans[seq].length;
    for (std::int64_t kv = 0; kv < dims.kv_heads; ++kv) {
      for (std::int64_t begin = 0; begin < length; begin += kForwardRows) {
        ranges.push_back({seq, kv, begin, std::min(length, begin + kForwardRows)});
      }
    }
  }
  parallel_for(static_cast<std::int64_t>(ranges.size()),
               [&](std::int64_t i) { forward_rows(problem, dims, ranges[i], out); });
  return out;
}

AttentionGradients attention_backward(const AttentionProblem& problem, const Dense& o, const Dense& lse,
                                      const Dense& d_o) {
  const Dims dims = dims_of(problem);
  AttentionGradients grads{Dense::zeros(problem.q.shape), Dense::zeros(problem.k.shape),
                           Dense::zeros(problem.v.shape)};
  std::vector<BackwardPart> parts;
  std::vector<std::int64_t> group_start;  // parts of one (sequence, KV head) are contiguous
  for (std::int64_t seq = 0; seq < static_cast<std::int64_t>(problem.q_spans.size()); ++seq) {
    const std::int64_t length = problem.q_spans[seq].length;
    if (length == 0 || problem.k_spans[seq].length == 0) continue;
    const std::int64_t count = std::clamp<std::int64_t>((length + kBackwardRows - 1) / kBackwardRows, 1, kMaxParts);
    for (std::int64_t kv = 0; kv < dims.kv_heads; ++kv) {
      group_start.push_back(static_cast<std::int64_t>(parts.size()));
      for (std::int64_t p = 0; p < count; ++p) {
        parts.push_back({{seq, kv, length * p / count, length * (p + 1) / count}, {}, {}});
      }
    }
  }
  group_start.push_back(static_cast<std::int64_t>(parts.size()));
  parallel_for(static_cast<std::int64_t>(parts.size()),
               [&](std::int64_t i) { backward_rows(problem, dims, o, lse, d_o, parts[i], grads.dq); });
  // Sum the parts of each group in part order.
  parallel_for(static_cast<std::int64_t>(group_start.size()) - 1, [&](std::int64_t g) {
    for (std::int64_t i = group_start[g]; i < group_start[g + 1]; ++i) {
      const BackwardPart& part = parts[i];
      const Span& ks = problem.k_spans[part.range.seq];
      for (std::int64_t s = 0; s < ks.length; ++s) {
        axpy(1.0, part.dk.data() + s * dims.dim_qk, grads.dk.row(ks.batch, ks.begin + s, part.range.kv_head),
             dims.dim_qk);
        axpy(1.0, part.dv.data() + s * dims.dim_v, grads.dv.row(ks.batch, ks.begin + s, part.range.kv_head),
             dims.dim_v);
      }
    }
  });
  return grads;
}

void score_gradients(const AttentionProblem& problem, const Dense& o, const Dense& lse, const Dense& d_o,
                     std::int64_t seq, std::int64_t t, std::int64_t head, std::vector<std::int64_t>& keys,
                     std::vector<double>& ds) {
  const Dims dims = dims_of(problem);
  const Span& qs = problem.q_spans[seq];
  const Span& ks = problem.k_spans[seq];
  const std::int64_t kv_head = head / dims.group;
  problem.visible_keys(seq, t, kv_head, keys);
  const std::int64_t row = qs.begin + t;
  const double row_lse = lse(qs.batch, head, row);
  if (row_lse == kNegInf) {
    ds.assign(keys.size(), 0.0);
    return;
  }
  row_scores(problem, dims, seq, t, head, keys, ds);
  const double* grad_o = d_o.row(qs.batch, row, head);
  const double delta = dot(grad_o, o.row(qs.batch, row, head), dims.dim_v);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const double p = std::exp(ds[i] - row_lse);
    const double* v = problem.v.row(ks.batch, ks.begin + keys[i], kv_head);
    ds[i] = p == 0 ? 0.0 : p * (dot(grad_o, v, dims.dim_v) - delta);
  }
}

detail::TokenLayout token_layout(const TensorView& tokens, const TensorView& cu_seqlens) {
  detail::TokenLayout layout;
  layout.packed = cu_seqlens.present();
  layout.batch = layout.packed ? cu_seqlens.shape[0] - 1 : tokens.shape[0];
  layout.rows = tokens.shape[layout.packed ? 0 : 1];
  return layout;
}

Dense load_tokens(const TensorView& tokens, bool packed) { return with_batch_dim(load(tokens), packed); }

void store_tokens(const Dense& values, const TensorView& out, bool packed, const std::vector<Span>& spans) {
  if (!packed) {
    store(values, out);
    return;
  }
  const std::int64_t heads = values.dim(2), dim = values.dim(3);
  for (const Span& span : spans) {
    if (span.length == 0) continue;
    TensorView rows = out;
    rows.data = static_cast<char*>(out.data) + span.begin * out.stride[0] * element_size(out.dtype);
    rows.shape[0] = span.length;
    Dense slice = Dense::zeros({span.length, heads, dim});
    const auto first = values.values.begin() + span.begin * heads * dim;
    std::copy(first, first + span.length * heads * dim, slice.values.begin());
    store(slice, rows);
  }
}

void store_lse(const Dense& values, const TensorView& out, bool packed, const std::vector<Span>& spans) {
  if (!packed) {
    store(values, out);
    return;
  }
  const std::int64_t heads = values.dim(1);
  for (const Span& span : spans) {
    if (span.length == 0) continue;
    TensorView columns = out;
    columns.data = static_cast<char*>(out.data) + span.begin * out.stride[1] * element_size(out.dtype);
    columns.shape[1] = span.length;
    Dense slice = Dense::zeros({heads, span.length});
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t j = 0; j < span.length; ++j) slice(h, j) = values(0, h, span.begin + j);
    }
    store(slice, columns);
  }
}

BackwardInputs load_backward_inputs(const TensorView& o, const TensorView& lse, const TensorView& d_o, bool packed) {
  return {load_tokens(o, packed), load_tokens(lse, packed), load_tokens(d_o, packed)};
}

void attention_forward_into(const AttentionProblem& problem, bool packed, const TensorView& o, const TensorView& lse) {
  const AttentionOutputs out = attention_forward(problem);
  store_tokens(out.o, o, packed, problem.q_spans);
  store_lse(out.lse, lse, packed, problem.q_spans);
}

void attention_backward_into(const AttentionProblem& problem, const BackwardInputs& inputs, bool packed,
                             const TensorView& dq, const TensorView& dk, const TensorView& dv) {
  const AttentionGradients grads = attention_backward(problem, inputs.o, inputs.lse, inputs.d_o);
  store_tokens(grads.dq, dq, packed, problem.q_spans);
  store_tokens(grads.dk, dk, packed, problem.k_spans);
  store_tokens(grads.dv, dv, packed, problem.k_spans);
}

}  // namespace sparseattn::reference
