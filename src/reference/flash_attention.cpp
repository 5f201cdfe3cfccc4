#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "reference/attention_core.h"
#include "reference/dense.h"
#include "reference/reference.h"

namespace sparseattn::reference {

namespace {

// The mask or the bias of one call: batched, 4-D [B|1, Hq|Hkv|1, T|1, S]; packed, the row form
// [Hm|1, Nq|1, Lk] (rank 3) or the key form [Hm|1, Nk] (rank 2), docs/semantics.md section 8.
struct Broadcast4d {
  int rank = 4;
  std::array<std::int64_t, 4> shape{};

  static Broadcast4d of(const TensorView& t) {
    Broadcast4d b;
    b.rank = t.rank;
    for (int d = 0; d < t.rank; ++d) b.shape[d] = t.shape[d];
    return b;
  }
  std::int64_t heads() const { return rank == 4 ? shape[1] : shape[0]; }
  // The head of this tensor that query head h of `q_heads` (group size `group`) reads.
  std::int64_t head(std::int64_t h, std::int64_t q_heads, std::int64_t group) const {
    if (heads() == q_heads) return h;
    return heads() == 1 ? 0 : h / group;
  }
  // Row-major offset of the entry of key 0 of (batch/sequence b, query head h, query row t of the sequence),
  // so that key s of the sequence is at offset + s. q_row and k_row are the sequence's first packed query and
  // key rows (packed forms only).
  std::int64_t row_offset(std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t q_heads, std::int64_t group,
                          std::int64_t q_row = 0, std::int64_t k_row = 0) const {
    const std::int64_t hh = head(h, q_heads, group);
    if (rank == 2) return hh * shape[1] + k_row;
    if (rank == 3) return (hh * shape[1] + (shape[1] == 1 ? 0 : q_row + t)) * shape[2];
    const std::int64_t bb = shape[0] == 1 ? 0 : b;
    const std::int64_t tt = shape[2] == 1 ? 0 : t;
    return ((bb * shape[1] + hh) * shape[2] + tt) * shape[3];
  }
};

// A block-sparse mask as a table of tile states over [Bt, Ht, nQ, nK] (Bt, Ht: B|1, Hb|1 as given):
// 0 absent, 1 exists (the element mask is read), 2 full (exists, the element mask is not read). A bool
// block_mask gives 0 and 1, a uint8 one its own states, the lists 1 (kv_indices) and 2 (full_kv_indices).
struct TileTable {
  enum : std::uint8_t { absent = 0, partial = 1, full = 2 };
  std::array<std::int64_t, 4> shape{};
  std::int64_t block_q = 1, block_k = 1;
  std::vector<std::uint8_t> state;  // empty: no block-sparse mask

  bool present() const { return !state.empty(); }

  static TileTable of(const FlashBlockMask& blocks) {
    TileTable table;
    if (!blocks.present()) return table;
    table.block_q = blocks.block_q;
    table.block_k = blocks.block_k;
    if (blocks.block_mask.present()) {
      const TensorView& m = blocks.block_mask;
      table.shape = {m.shape[0], m.shape[1], m.shape[2], m.shape[3]};
      if (m.dtype == DType::uint8) {  // the states as given (validated to be 0, 1 or 2)
        const Dense states = load(m);
        table.state.reserve(states.values.size());
        for (double x : states.values) table.state.push_back(static_cast<std::uint8_t>(x));
      } else {
        table.state = load_bool(m);  // 1 where the tile exists
      }
      return table;
    }
    // Lists: the table is as wide as the largest index (validation bounds them by every sequence's tile count).
    const TensorView& counts = blocks.kv_num_blocks.present() ? blocks.kv_num_blocks : blocks.full_kv_num_blocks;
    std::int64_t width = 1;
    std::vector<std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>>> lists;
    for (const auto& [n, idx] : {std::pair{&blocks.kv_num_blocks, &blocks.kv_indices},
                                 std::pair{&blocks.full_kv_num_blocks, &blocks.full_kv_indices}}) {
      if (!n->present()) {
        lists.emplace_back();
        continue;
      }
      lists.emplace_back(load_int32(*n), load_int32(*idx));
      const std::int64_t max_k = idx->shape[3];
      const auto& [c, ids] = lists.back();
      for (std::size_t row = 0; row < c.size(); ++row) {
        for (std::int64_t j = 0; j < c[row]; ++j) width = std::max<std::int64_t>(width, ids[row * max_k + j] + 1);
      }
    }
    table.shape = {counts.shape[0], counts.shape[1], counts.shape[2], width};
    table.state.assign(static_cast<std::size_t>(counts.numel() * width), absent);
    const TensorView* indices[2] = {&blocks.kv_indices, &blocks.full_kv_indices};
    for (int form = 0; form < 2; ++form) {
      const auto& [c, ids] = lists[form];
      if (c.empty()) continue;
      const std::int64_t max_k = indices[form]->shape[3];
      for (std::size_t row = 0; row < c.size(); ++row) {
        for (std::int64_t j = 0; j < c[row]; ++j) {
          table.state[row * width + ids[row * max_k + j]] = form == 0 ? partial : full;
        }
      }
    }
    return table;
  }

  // The states of the key tiles of query row t for (sequence/batch b, query head h): a row of nK entries.
  const std::uint8_t* row(std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t q_heads,
                          std::int64_t group) const {
    const std::int64_t bb = shape[0] == 1 ? 0 : b;
    const std::int64_t hb = shape[1] == q_heads ? h : (shape[1] == 1 ? 0 : h / group);
    return state.data() + ((bb * shape[1] + hb) * shape[2] + t / block_q) * shape[3];
  }
  // The state of key s in a row: keys past the table (a sequence's tiles past nK) are absent.
  std::uint8_t at(const std::uint8_t* row, std::int64_t s) const {
    const std::int64_t tile = s / block_k;
    return tile < shape[3] ? row[tile] : static_cast<std::uint8_t>(absent);
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
  // Gated attention: alpha [Bq, Nq, Hq] and delta [Bk, Nk, Hkv] (a batch dim of 1 when packed); empty if absent.
  Dense alpha, delta;
  GateMode gate_mode = GateMode::logsigmoid;
  // Thresholds: kept[seq * Hq + h][query tile * key tiles + key tile] is 0 for a skipped pair; empty if none.
  std::int64_t block_q = 1, block_k = 1;
  std::vector<std::vector<std::uint8_t>> kept;
  // Block-sparse mask (empty if none) and per-head windows ([Hq] each; empty if not given).
  TileTable tiles_mask;
  std::vector<std::int32_t> head_left, head_right;

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
    const FlashGateOptions& gates = params.gates;
    gate_mode = gates.gate;
    if (gates.alpha.present()) {
      alpha = with_batch_dim(load(gates.alpha), layout_q.packed);
      delta = with_batch_dim(load(gates.delta), layout_k.packed);
    }
    tiles_mask = TileTable::of(params.blocks);
    if (params.head_windows.left.present()) head_left = load_int32(params.head_windows.left);
    if (params.head_windows.right.present()) head_right = load_int32(params.head_windows.right);
    const bool thresholds = gates.gate_threshold.has_value() || gates.softmax_threshold.has_value();
    if (params.mask.present() || params.bias.present() || gated() || thresholds || tiles_mask.present() ||
        !head_left.empty() || !head_right.empty()) {
      problem.add_scores = [this](std::int64_t seq, std::int64_t t, std::int64_t head,
                                  const std::vector<std::int64_t>& keys, double* scores) {
        add_terms(seq, t, head, keys, scores);
        skip_tiles(seq, t, head, keys, scores);
      };
    }
    if (thresholds) choose_tiles(params.causal, gates);
  }
  FlashProblem(const FlashProblem&) = delete;

  std::int64_t group() const { return q.dim(2) / k.dim(2); }
  bool gated() const { return !alpha.values.empty() || !delta.values.empty(); }
  // ceil(length / block), without the overflow of length + block - 1 for huge blocks.
  static std::int64_t tiles(std::int64_t length, std::int64_t block) { return length > 0 ? (length - 1) / block + 1 : 0; }
  std::int64_t key_tiles(std::int64_t seq) const { return tiles(problem.k_spans[seq].length, block_k); }

  double gate(double x) const {
    if (gate_mode == GateMode::product) return x;
    return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));  // logsigmoid, stable
  }
  // dg/dx: sigmoid(-x) for logsigmoid, 1 for product.
  double gate_slope(double x) const {
    if (gate_mode == GateMode::product) return 1.0;
    return x >= 0 ? std::exp(-x) / (1 + std::exp(-x)) : 1 / (1 + std::exp(x));
  }
  double alpha_at(std::int64_t seq, std::int64_t t, std::int64_t head) const {
    const Span& qs = problem.q_spans[seq];
    return alpha(qs.batch, qs.begin + t, head);
  }
  double delta_at(std::int64_t seq, std::int64_t s, std::int64_t kv_head) const {
    const Span& ks = problem.k_spans[seq];
    return delta(ks.batch, ks.begin + s, kv_head);
  }

  // Mask, bias, block-sparse mask, per-head windows and the gate term scale * g (everything but the
  // thresholds' tile skipping).
  void add_terms(std::int64_t seq, std::int64_t t, std::int64_t head, const std::vector<std::int64_t>& keys,
                 double* scores) const {
    constexpr double kNegInf = -std::numeric_limits<double>::infinity();
    const std::uint8_t* tile_row = tiles_mask.present() ? tiles_mask.row(seq, head, t, q.dim(2), group()) : nullptr;
    if (!mask.empty() || !bias.values.empty()) add_mask_and_bias(seq, t, head, keys, tile_row, scores);
    if (tile_row) {
      for (std::size_t i = 0; i < keys.size(); ++i) {
        if (tiles_mask.at(tile_row, keys[i]) == TileTable::absent) scores[i] = kNegInf;
      }
    }
    if (!head_left.empty() || !head_right.empty()) {
      const std::int64_t aligned = t + problem.k_spans[seq].length - problem.q_spans[seq].length;
      const std::int64_t left = head_left.empty() ? -1 : head_left[head];
      const std::int64_t right = head_right.empty() ? -1 : head_right[head];
      for (std::size_t i = 0; i < keys.size(); ++i) {
        if ((left >= 0 && keys[i] < aligned - left) || (right >= 0 && keys[i] > aligned + right)) scores[i] = kNegInf;
      }
    }
    if (gated()) {
      const double a = alpha_at(seq, t, head);
      const std::int64_t kv_head = head / group();
      for (std::size_t i = 0; i < keys.size(); ++i) scores[i] += problem.scale * gate(a * delta_at(seq, keys[i], kv_head));
    }
  }

  // Hides the keys of the key tiles the thresholds skipped for this row's query tile.
  void skip_tiles(std::int64_t seq, std::int64_t t, std::int64_t head, const std::vector<std::int64_t>& keys,
                  double* scores) const {
    if (kept.empty()) return;
    const std::vector<std::uint8_t>& pairs = kept[seq * q.dim(2) + head];
    const std::uint8_t* row = pairs.data() + (t / block_q) * key_tiles(seq);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (!row[keys[i] / block_k]) scores[i] = -std::numeric_limits<double>::infinity();
    }
  }

  // Decides, per (sequence, query head, query tile), which key tiles the gate threshold and the sparse-softmax
  // threshold skip (docs/semantics.md section 8). Forward and backward run the same decision.
  void choose_tiles(bool causal, const FlashGateOptions& gates) {
    constexpr double kNegInf = -std::numeric_limits<double>::infinity();
    block_q = gates.threshold_block_q;
    block_k = gates.threshold_block_k;
    const std::int64_t q_heads = q.dim(2), sequences = static_cast<std::int64_t>(problem.q_spans.size());
    kept.assign(static_cast<std::size_t>(sequences * q_heads), {});
    parallel_for(sequences * q_heads, [&](std::int64_t item) {
      const std::int64_t seq = item / q_heads, head = item % q_heads, kv_head = head / group();
      const std::int64_t rows = problem.q_spans[seq].length, keys_len = problem.k_spans[seq].length;
      const std::int64_t q_tiles = tiles(rows, block_q), k_tiles = key_tiles(seq);
      std::vector<std::uint8_t>& pairs = kept[item];
      pairs.assign(static_cast<std::size_t>(q_tiles * k_tiles), 1);
      if (gates.gate_threshold) {
        std::vector<double> dmin(k_tiles, std::numeric_limits<double>::infinity()), dmax(k_tiles, kNegInf);
        for (std::int64_t s = 0; s < keys_len; ++s) {
          const double d = delta_at(seq, s, kv_head);
          dmin[s / block_k] = std::min(dmin[s / block_k], d);
          dmax[s / block_k] = std::max(dmax[s / block_k], d);
        }
        for (std::int64_t qt = 0; qt < q_tiles; ++qt) {
          double amin = std::numeric_limits<double>::infinity(), amax = kNegInf;
          for (std::int64_t t = qt * block_q; t < std::min(rows, (qt + 1) * block_q); ++t) {
            amin = std::min(amin, alpha_at(seq, t, head));
            amax = std::max(amax, alpha_at(seq, t, head));
          }
          for (std::int64_t kt = 0; kt < k_tiles; ++kt) {
            const double bound = std::max(std::max(amin * dmin[kt], amin * dmax[kt]),
                                          std::max(amax * dmin[kt], amax * dmax[kt]));
            if (gate(bound) < *gates.gate_threshold) pairs[qt * k_tiles + kt] = 0;
          }
        }
      }
      if (!gates.softmax_threshold || keys_len == 0) return;
      const double tau = *gates.softmax_threshold;
      const std::int64_t dim = q.dim(3);
      const Span& qs = problem.q_spans[seq];
      const Span& ks = problem.k_spans[seq];
      std::vector<std::int64_t> keys;
      std::vector<double> scores;
      for (std::int64_t qt = 0; qt < q_tiles; ++qt) {
        const std::int64_t first = qt * block_q, count = std::min(rows, first + block_q) - first;
        // tile_max[r * k_tiles + kt]: row r's largest logit in key tile kt (-inf if none is visible).
        std::vector<double> tile_max(static_cast<std::size_t>(count * k_tiles), kNegInf), log_tau(count, kNegInf);
        for (std::int64_t r = 0; r < count; ++r) {
          const std::int64_t t = first + r;
          const double row_tau = causal ? tau * static_cast<double>(t + keys_len - rows + 1) / keys_len : tau;
          if (row_tau > 0) log_tau[r] = std::log(row_tau);
          problem.visible_keys(seq, t, kv_head, keys);
          scores.assign(keys.size(), 0.0);
          const double* qrow = q.row(qs.batch, qs.begin + t, head);
          for (std::size_t i = 0; i < keys.size(); ++i) {
            const double* krow = k.row(ks.batch, ks.begin + keys[i], kv_head);
            double sum = 0;
            for (std::int64_t c = 0; c < dim; ++c) sum += qrow[c] * krow[c];
            scores[i] = problem.scale * sum;
          }
          add_terms(seq, t, head, keys, scores.data());
          for (std::size_t i = 0; i < keys.size(); ++i) {
            double& m = tile_max[r * k_tiles + keys[i] / block_k];
            m = std::max(m, scores[i]);
          }
        }
        std::vector<double> running(count, kNegInf);
        for (std::int64_t kt = 0; kt < k_tiles; ++kt) {
          std::uint8_t& keep = pairs[qt * k_tiles + kt];
          if (!keep) continue;  // gate-skipped: counts as fully masked
          bool skip = true;
          for (std::int64_t r = 0; r < count && skip; ++r) {
            const double m = tile_max[r * k_tiles + kt];
            if (m == kNegInf) continue;  // nothing visible in this tile: no condition
            if (!(m < running[r] + log_tau[r])) skip = false;
          }
          if (skip) {
            keep = 0;
            continue;
          }
          for (std::int64_t r = 0; r < count; ++r) running[r] = std::max(running[r], tile_max[r * k_tiles + kt]);
        }
      }
    });
  }

  // Offset of key 0 of (sequence b, query head, query row t) in the mask or bias of shape `shape`: batched,
  // the sequence index is the batch index; packed, the row and key forms index packed rows.
  std::int64_t offset(const Broadcast4d& shape, std::int64_t b, std::int64_t t, std::int64_t head) const {
    return shape.row_offset(b, head, t, q.dim(2), group(), problem.q_spans[b].begin, problem.k_spans[b].begin);
  }

  // Keys of full tiles (tile_row, when given) do not read the mask.
  void add_mask_and_bias(std::int64_t b, std::int64_t t, std::int64_t head, const std::vector<std::int64_t>& keys,
                         const std::uint8_t* tile_row, double* scores) const {
    if (!mask.empty()) {
      const std::uint8_t* keep = mask.data() + offset(mask_shape, b, t, head);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        if (tile_row && tiles_mask.at(tile_row, keys[i]) == TileTable::full) continue;
        if (!keep[keys[i]]) scores[i] = -std::numeric_limits<double>::infinity();
      }
    }
    if (!bias.values.empty()) {
      const double* row = bias.values.data() + offset(bias_shape, b, t, head);
      for (std::size_t i = 0; i < keys.size(); ++i) scores[i] += row[keys[i]];
    }
  }
};

// A gate tensor's values ([Bd, N, H]) to `out` ([B, N, H] or packed [N, H], where only the spans' rows are
// written, as store_tokens does).
void store_gate(Dense values, const TensorView& out, bool packed, const std::vector<Span>& spans) {
  if (!packed) {
    store(values, out);
    return;
  }
  values.shape.push_back(1);
  TensorView rows = out;
  rows.rank = 3;
  rows.shape[2] = 1;
  rows.stride[2] = 1;
  store_tokens(values, rows, true, spans);
}

// dbias reduced to bias's own shape: each row (b', h', t') of dbias sums, in a fixed order, the score
// gradients of every query row that reads it, so dbias rows can run in parallel and the result is
// deterministic.
void bias_gradient(const FlashProblem& flash, const Dense& o, const Dense& lse, const Dense& d_o,
                   const TensorView& dbias_out) {  // batched layout
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

// dbias of a packed-form bias (row form [Hm|1, Nq|1, Lk] or key form [Hm|1, Nk]): each entry sums the score
// gradients of the (head, packed query row) pairs that read it, heads ascending, then packed rows ascending.
// Entries no sequence reads (columns past a sequence's keys, rows past the last sequence) are left untouched.
void packed_bias_gradient(const FlashProblem& flash, const Dense& o, const Dense& lse, const Dense& d_o,
                          const TensorView& dbias_out) {
  const Broadcast4d& shape = flash.bias_shape;
  Dense dbias = load(dbias_out);
  const std::vector<Span>& q_spans = flash.problem.q_spans;
  const std::vector<Span>& k_spans = flash.problem.k_spans;
  const std::int64_t q_heads = flash.q.dim(2), group = flash.group(), heads = shape.heads();
  const std::int64_t sequences = static_cast<std::int64_t>(q_spans.size());
  // Adds the score gradients of query rows [t_begin, t_end) of sequence seq, for every query head reading bias
  // head hb, to out (key 0 of the sequence at out[0]); heads ascending, rows ascending.
  const auto accumulate = [&](std::int64_t hb, std::int64_t seq, std::int64_t t_begin, std::int64_t t_end,
                              double* out, std::vector<std::int64_t>& keys, std::vector<double>& ds) {
    for (std::int64_t h = 0; h < q_heads; ++h) {
      if (shape.head(h, q_heads, group) != hb) continue;
      for (std::int64_t t = t_begin; t < t_end; ++t) {
        score_gradients(flash.problem, o, lse, d_o, seq, t, h, keys, ds);
        for (std::size_t i = 0; i < keys.size(); ++i) out[keys[i]] += ds[i];
      }
    }
  };
  if (shape.rank == 2) {  // key form: (bias head, sequence) items own the sequence's keys
    parallel_for(heads * sequences, [&](std::int64_t item) {
      const std::int64_t hb = item / sequences, seq = item % sequences;
      double* out = dbias.values.data() + hb * shape.shape[1] + k_spans[seq].begin;
      std::fill(out, out + k_spans[seq].length, 0.0);
      std::vector<std::int64_t> keys;
      std::vector<double> ds;
      accumulate(hb, seq, 0, q_spans[seq].length, out, keys, ds);
    });
  } else if (shape.shape[1] == 1) {  // row form shared by every query row: one item per bias head
    std::int64_t longest = 0;
    for (const Span& ks : k_spans) longest = std::max(longest, ks.length);
    parallel_for(heads, [&](std::int64_t hb) {
      double* out = dbias.values.data() + hb * shape.shape[2];
      std::fill(out, out + longest, 0.0);
      std::vector<std::int64_t> keys;
      std::vector<double> ds;
      for (std::int64_t h = 0; h < q_heads; ++h) {
        if (shape.head(h, q_heads, group) != hb) continue;
        for (std::int64_t seq = 0; seq < sequences; ++seq) {
          for (std::int64_t t = 0; t < q_spans[seq].length; ++t) {
            score_gradients(flash.problem, o, lse, d_o, seq, t, h, keys, ds);
            for (std::size_t i = 0; i < keys.size(); ++i) out[keys[i]] += ds[i];
          }
        }
      }
    });
  } else {  // row form [Hm|1, Nq, Lk]: (bias head, sequence) items own the sequence's rows
    parallel_for(heads * sequences, [&](std::int64_t item) {
      const std::int64_t hb = item / sequences, seq = item % sequences;
      std::vector<std::int64_t> keys;
      std::vector<double> ds;
      for (std::int64_t t = 0; t < q_spans[seq].length; ++t) {
        double* out = dbias.values.data() + (hb * shape.shape[1] + q_spans[seq].begin + t) * shape.shape[2];
        std::fill(out, out + k_spans[seq].length, 0.0);
        accumulate(hb, seq, t, t + 1, out, keys, ds);
      }
    });
  }
  store(dbias, dbias_out);
}

// dalpha and ddelta from the score gradients: work items are (sequence, KV head), each owning the dalpha
// entries of its group's query heads and the ddelta entries of its keys; rows then heads in a fixed order.
void gate_gradients(const FlashProblem& flash, const Dense& o, const Dense& lse, const Dense& d_o,
                    const TensorView& dalpha_out, const TensorView& ddelta_out) {
  Dense dalpha = Dense::zeros(flash.alpha.shape), ddelta = Dense::zeros(flash.delta.shape);
  const std::int64_t kv_heads = flash.k.dim(2), group = flash.group();
  const double scale = flash.problem.scale;
  parallel_for(static_cast<std::int64_t>(flash.problem.q_spans.size()) * kv_heads, [&](std::int64_t item) {
    const std::int64_t seq = item / kv_heads, kv_head = item % kv_heads;
    const Span& qs = flash.problem.q_spans[seq];
    const Span& ks = flash.problem.k_spans[seq];
    std::vector<std::int64_t> keys;
    std::vector<double> ds;
    for (std::int64_t t = 0; t < qs.length; ++t) {
      for (std::int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        score_gradients(flash.problem, o, lse, d_o, seq, t, h, keys, ds);
        const double a = flash.alpha_at(seq, t, h);
        double da = 0;
        for (std::size_t i = 0; i < keys.size(); ++i) {
          if (ds[i] == 0) continue;
          const double d = flash.delta_at(seq, keys[i], kv_head);
          const double dg = ds[i] * scale * flash.gate_slope(a * d);
          da += dg * d;
          ddelta(ks.batch, ks.begin + keys[i], kv_head) += dg * a;
        }
        dalpha(qs.batch, qs.begin + t, h) += da;
      }
    }
  });
  const bool packed_q = flash.layout_q.packed, packed_k = flash.layout_k.packed;
  if (dalpha_out.present()) store_gate(dalpha, dalpha_out, packed_q, flash.problem.q_spans);
  if (ddelta_out.present()) store_gate(ddelta, ddelta_out, packed_k, flash.problem.k_spans);
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
  if (params.dbias.present()) {
    if (packed) {
      packed_bias_gradient(flash, inputs.o, inputs.lse, inputs.d_o, params.dbias);
    } else {
      bias_gradient(flash, inputs.o, inputs.lse, inputs.d_o, params.dbias);
    }
  }
  if (params.dalpha.present() || params.ddelta.present()) {
    gate_gradients(flash, inputs.o, inputs.lse, inputs.d_o, params.dalpha, params.ddelta);
  }
}

}  // namespace sparseattn::reference
