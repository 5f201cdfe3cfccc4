#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "nsa_case.h"
#include "sparseattn/compress_kv.h"
#include "sparseattn/select_blocks.h"

namespace sparseattn::test {
namespace {

// loss = <o, w> for a random w. For every differentiable input, the analytic gradient must match central
// differences on about `samples` elements spread over the tensor, and along one random direction through
// all of it.
void expect_gradients(NsaCase& c, std::int64_t samples = 24) {
  std::mt19937_64 rng(99);
  HostF64 w = c.new_output();
  fill_random(w, rng);
  const NsaGrads g = c.backward(w);
  const auto loss = [&] { return dot(c.forward().data, w.data); };
  const double eps = 1e-6;
  for (const auto& [name, x, grad] : c.differentiable(g)) {
    const std::vector<double> saved = x->data;
    const auto numeric = [&](const std::vector<double>& direction) {
      for (std::size_t i = 0; i < saved.size(); ++i) x->data[i] = saved[i] + eps * direction[i];
      const double plus = loss();
      for (std::size_t i = 0; i < saved.size(); ++i) x->data[i] = saved[i] - eps * direction[i];
      const double minus = loss();
      x->data = saved;
      return (plus - minus) / (2 * eps);
    };
    const std::int64_t step = std::max<std::int64_t>(1, x->numel() / samples);
    for (std::int64_t i = (x->numel() - 1) % step; i < x->numel(); i += step) {
      std::vector<double> unit(saved.size(), 0.0);
      unit[i] = 1;
      const double expected = numeric(unit);
      EXPECT_NEAR(grad->data[i], expected, 1e-6 * std::max(1.0, std::abs(expected))) << name << "[" << i << "]";
    }
    HostF64 direction = *x;
    fill_random(direction, rng);
    const double expected = numeric(direction.data);
    EXPECT_NEAR(dot(grad->data, direction.data), expected, 1e-6 * std::max(1.0, std::abs(expected)))
        << name << " along a random direction";
  }
}

// Softmax attention of one query row over the listed (key, value) rows: writes the output row and returns
// the log-sum-exp (-inf and a zero row when there is no key).
double attend(const double* q, const std::vector<std::pair<const double*, const double*>>& keys, std::int64_t dim,
              std::int64_t dim_v, double scale, double* out) {
  std::fill(out, out + dim_v, 0.0);
  if (keys.empty()) return -std::numeric_limits<double>::infinity();
  std::vector<double> logits;
  for (const auto& [k, v] : keys) {
    double s = 0;
    for (std::int64_t d = 0; d < dim; ++d) s += q[d] * k[d];
    logits.push_back(scale * s);
  }
  const double top = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (double s : logits) sum += std::exp(s - top);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const double p = std::exp(logits[i] - top) / sum;
    for (std::int64_t d = 0; d < dim_v; ++d) out[d] += p * keys[i].second[d];
  }
  return top + std::log(sum);
}

double* row(HostF64& t, std::int64_t b, std::int64_t r, std::int64_t h) {
  return t.data.data() + ((b * t.shape[1] + r) * t.shape[2] + h) * t.shape[3];
}

// NSA straight from the semantics brief with plain loops (batched layout). The selection is the one
// select_blocks (tested on its own) makes from this function's compressed log-sum-exp (or the user's
// block_indices); `selection`, if given, receives it.
HostF64 naive_forward(NsaCase& c, Host<std::int32_t>* selection = nullptr) {
  const NsaConfig& cfg = c.config;
  const std::int64_t batch = c.batch, tokens = c.rows, hq = c.heads_q, hkv = c.heads_kv, group = hq / hkv;
  const std::int64_t dim = c.dim, dim_v = c.dim_v, blocks = c.cmp_rows;
  const double scale = cfg.scale.value_or(1.0 / std::sqrt(static_cast<double>(dim)));
  HostF64 k_cmp = c.k_cmp, v_cmp = c.v_cmp;
  if (!c.use_cmp) {
    for (auto [pooled, x] : {std::pair{&k_cmp, &c.k}, std::pair{&v_cmp, &c.v}}) {
      for (std::int64_t b = 0; b < batch; ++b)
        for (std::int64_t j = 0; j < blocks; ++j)
          for (std::int64_t h = 0; h < hkv; ++h)
            for (std::int64_t d = 0; d < pooled->shape[3]; ++d) {
              double sum = 0;
              for (std::int64_t t = j * cfg.cmp_stride; t < j * cfg.cmp_stride + cfg.cmp_block; ++t) {
                sum += row(*x, b, t, h)[d];
              }
              row(*pooled, b, j, h)[d] = sum / cfg.cmp_block;
            }
    }
  }
  std::array<HostF64, kNumBranches> outs;
  for (HostF64& o : outs) o = c.new_output();
  HostF64 lse_cmp = host<double>({batch, hq, tokens});
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t h = 0; h < hq; ++h) {
        std::vector<std::pair<const double*, const double*>> keys;
        for (std::int64_t j = 0; j < blocks && j * cfg.cmp_stride + cfg.cmp_block - 1 <= t; ++j) {
          keys.emplace_back(row(k_cmp, b, j, h / group), row(v_cmp, b, j, h / group));
        }
        lse_cmp.data[(b * hq + h) * tokens + t] =
            attend(row(c.q, b, t, h), keys, dim, dim_v, scale, row(outs[0], b, t, h));
      }
  Host<std::int32_t> indices = c.block_indices;
  if (c.use_gate[1] && !c.use_indices) {
    SelectBlocksParams select;
    select.q = c.q.view();
    select.k_cmp = k_cmp.view();
    select.lse_cmp = lse_cmp.view();
    select.indices = indices.view();
    select.cmp_block = cfg.cmp_block;
    select.cmp_stride = cfg.cmp_stride;
    select.sel_block = cfg.sel_block;
    select.num_selected = cfg.num_selected;
    select.num_init = cfg.num_init;
    select.num_local = cfg.num_local;
    select.scale = cfg.scale;
    select_blocks(select);
  }
  if (selection != nullptr) *selection = indices;
  const std::int64_t n = indices.shape[3];
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t h = 0; h < hq; ++h) {
        std::vector<std::pair<const double*, const double*>> selected, window;
        for (std::int64_t i = 0; i < n; ++i) {
          const std::int32_t block = indices.data[((b * tokens + t) * hkv + h / group) * n + i];
          for (std::int64_t s = block * cfg.sel_block; block >= 0 && s < (block + 1) * cfg.sel_block && s <= t; ++s) {
            selected.emplace_back(row(c.k, b, s, h / group), row(c.v, b, s, h / group));
          }
        }
        for (std::int64_t s = std::max<std::int64_t>(0, t - cfg.window + 1); s <= t; ++s) {
          window.emplace_back(row(c.k, b, s, h / group), row(c.v, b, s, h / group));
        }
        attend(row(c.q, b, t, h), selected, dim, dim_v, scale, row(outs[1], b, t, h));
        attend(row(c.q, b, t, h), window, dim, dim_v, scale, row(outs[2], b, t, h));
      }
  HostF64 o = c.new_output();
  for (int i = 0; i < kNumBranches; ++i) {
    if (!c.use_gate[i]) continue;
    for (std::int64_t e = 0; e < o.numel(); ++e) o.data[e] += c.gates[i].data[e / dim_v] * outs[i].data[e];
  }
  return o;
}

TEST(NsaAttention, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(1);
  NsaCase c = NsaCase::batched(1, 70, 3, 1, rng);
  expect_gradients(c);
}

TEST(NsaAttention, GradientsWithGroupSizeTwo) {
  std::mt19937_64 rng(2);
  NsaCase c = NsaCase::batched(2, 41, 4, 2, rng);
  expect_gradients(c);
}

// The seven ways to choose which branches run.
std::vector<std::array<bool, kNumBranches>> branch_subsets() {
  std::vector<std::array<bool, kNumBranches>> subsets;
  for (int mask = 1; mask < 8; ++mask) subsets.push_back({(mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0});
  return subsets;
}

void expect_near(const std::vector<double>& actual, const std::vector<double>& expected, double tolerance) {
  ASSERT_EQ(actual.size(), expected.size());
  EXPECT_LT(max_abs_diff(actual, expected), tolerance);
}

TEST(NsaAttention, MatchesNaiveForwardForEveryBranchSubset) {
  std::mt19937_64 rng(3);
  for (NsaCase c : {NsaCase::batched(1, 70, 3, 1, rng), NsaCase::batched(2, 45, 4, 2, rng)}) {
    for (const auto& subset : branch_subsets()) {
      c.use_gate = subset;
      SCOPED_TRACE("gates " + std::to_string(subset[0]) + std::to_string(subset[1]) + std::to_string(subset[2]));
      expect_near(c.forward().data, naive_forward(c).data, 1e-12);
    }
  }
}

TEST(NsaAttention, SequencesShorterThanACompressedBlock) {
  // 5 tokens, compressed blocks of 8: the compressed branch sees nothing (o_cmp = 0), block 0 is selected.
  std::mt19937_64 rng(4);
  NsaCase c = NsaCase::batched(2, 5, 3, 1, rng);
  expect_near(c.forward().data, naive_forward(c).data, 1e-12);
  expect_gradients(c);
}

TEST(NsaAttention, GradientsForSingleBranchesAndPairs) {
  std::mt19937_64 rng(5);
  NsaCase c = NsaCase::batched(1, 40, 2, 1, rng);
  for (const auto& subset : branch_subsets()) {
    if (subset[0] && subset[1] && subset[2]) continue;  // covered by GradientsMatchFiniteDifferences
    c.use_gate = subset;
    SCOPED_TRACE("gates " + std::to_string(subset[0]) + std::to_string(subset[1]) + std::to_string(subset[2]));
    expect_gradients(c, /*samples=*/8);
  }
}

TEST(NsaAttention, UserCompressedKv) {
  std::mt19937_64 rng(6);
  NsaCase c = NsaCase::batched(1, 60, 3, 1, rng);
  c.use_cmp = true;
  expect_near(c.forward().data, naive_forward(c).data, 1e-12);
  expect_gradients(c);

  // Mean-pooled K/V passed by the user give the pipeline's own result.
  CompressKvParams pool;
  pool.k = c.k.view();
  pool.v = c.v.view();
  pool.k_cmp = c.k_cmp.view();
  pool.v_cmp = c.v_cmp.view();
  pool.block = c.config.cmp_block;
  pool.stride = c.config.cmp_stride;
  compress_kv(pool);
  const HostF64 with_user_cmp = c.forward();
  c.use_cmp = false;
  EXPECT_EQ(c.forward().data, with_user_cmp.data);
}

TEST(NsaAttention, UserCompressedKvGetsZeroGradientWithoutTheCompressedBranch) {
  // Selection still reads k_cmp, but selection is not differentiated: dk_cmp = dv_cmp = 0.
  std::mt19937_64 rng(7);
  NsaCase c = NsaCase::batched(1, 50, 3, 1, rng);
  c.use_cmp = true;
  c.use_gate = {false, true, true};
  HostF64 d_o = c.new_output();
  fill_random(d_o, rng);
  const NsaGrads g = c.backward(d_o, /*fill=*/-99);
  EXPECT_EQ(g.dk_cmp.data, std::vector<double>(g.dk_cmp.data.size(), 0.0));
  EXPECT_EQ(g.dv_cmp.data, std::vector<double>(g.dv_cmp.data.size(), 0.0));
  expect_gradients(c);
}

// Valid random indices: per row, forced block 0 plus a random subset of the other candidate blocks.
void fill_random_indices(NsaCase& c, std::mt19937_64& rng) {
  const std::int64_t n = c.block_indices.shape.back();
  std::fill(c.block_indices.data.begin(), c.block_indices.data.end(), -1);
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t t = 0; t < c.rows; ++t)
      for (std::int64_t h = 0; h < c.heads_kv; ++h) {
        std::int32_t* out = c.block_indices.data.data() + ((b * c.rows + t) * c.heads_kv + h) * n;
        std::int64_t slot = 0;
        for (std::int64_t block = 0; block <= t / c.config.sel_block && slot < n; ++block) {
          if (block == 0 || rng() % 2 == 0) out[slot++] = static_cast<std::int32_t>(block);
        }
      }
}

TEST(NsaAttention, UserBlockIndices) {
  std::mt19937_64 rng(8);
  NsaCase c = NsaCase::batched(2, 50, 4, 2, rng);
  const HostF64 selected_by_nsa = c.forward();
  // The indices the pipeline chooses itself, passed in, give the same result.
  naive_forward(c, &c.block_indices);
  c.use_indices = true;
  expect_near(c.forward().data, selected_by_nsa.data, 1e-12);
  // Arbitrary valid indices: the output follows them and gradients flow as usual.
  fill_random_indices(c, rng);
  const HostF64 o = c.forward();
  expect_near(o.data, naive_forward(c).data, 1e-12);
  EXPECT_GT(max_abs_diff(o.data, selected_by_nsa.data), 1e-3);
  expect_gradients(c);
}

TEST(NsaAttention, PackedMatchesBatchedPerSequence) {
  std::mt19937_64 rng(9);
  const std::vector<std::int64_t> lengths = {1, 37, 70};
  NsaCase packed = NsaCase::varlen(lengths, /*padding=*/3, 4, 2, rng);
  const HostF64 o = [&] {
    HostF64 out = packed.new_output(-99);
    std::vector<std::byte> workspace;
    nsa_attention(packed.params(out, workspace));
    return out;
  }();
  HostF64 d_o = packed.new_output();
  fill_random(d_o, rng);
  const NsaGrads g = packed.backward(d_o, /*fill=*/-99);

  // Copies rows [begin, begin + count) of a packed [N, ...] tensor (or columns of a [H, N] one).
  const auto rows_of = [](const HostF64& t, std::int64_t begin, std::int64_t count) {
    const std::int64_t row = t.numel() / t.shape[0];
    return std::vector<double>(t.data.begin() + begin * row, t.data.begin() + (begin + count) * row);
  };
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    const std::int64_t begin = packed.cu.data[b], length = lengths[b];
    NsaCase single = NsaCase::batched(1, length, 4, 2, rng);
    for (auto [from, to] : {std::pair{&packed.q, &single.q}, std::pair{&packed.k, &single.k},
                            std::pair{&packed.v, &single.v}, std::pair{&packed.gates[0], &single.gates[0]},
                            std::pair{&packed.gates[1], &single.gates[1]},
                            std::pair{&packed.gates[2], &single.gates[2]}}) {
      to->data = rows_of(*from, begin, length);
    }
    expect_near(single.forward().data, rows_of(o, begin, length), 1e-13);
    HostF64 d_o_single = single.new_output();
    d_o_single.data = rows_of(d_o, begin, length);
    const NsaGrads gs = single.backward(d_o_single);
    expect_near(gs.dq.data, rows_of(g.dq, begin, length), 1e-13);
    expect_near(gs.dk.data, rows_of(g.dk, begin, length), 1e-13);
    expect_near(gs.dv.data, rows_of(g.dv, begin, length), 1e-13);
    for (int i = 0; i < kNumBranches; ++i) expect_near(gs.d_gates[i].data, rows_of(g.d_gates[i], begin, length), 1e-13);
  }
  // Rows past cu_seqlens[B] are left untouched.
  const std::int64_t used = packed.cu.data.back(), padding = packed.rows - used;
  for (const HostF64* t : {&o, &g.dq, &g.dk, &g.dv, &g.d_gates[0], &g.d_gates[1], &g.d_gates[2]}) {
    EXPECT_EQ(rows_of(*t, used, padding), std::vector<double>(rows_of(*t, used, padding).size(), -99.0));
  }
}

TEST(NsaAttention, PackedGradientsWithUserCompressedKv) {
  std::mt19937_64 rng(10);
  NsaCase c = NsaCase::varlen({9, 30}, /*padding=*/2, 2, 1, rng);
  c.use_cmp = true;
  expect_gradients(c);
}

TEST(NsaAttention, Causality) {
  // Changing anything at tokens after t changes no output at or before t.
  std::mt19937_64 rng(11);
  NsaCase c = NsaCase::batched(1, 70, 3, 1, rng);
  const HostF64 before = c.forward();
  const std::int64_t t = 40;
  for (HostF64* x : {&c.q, &c.k, &c.v, &c.gates[0], &c.gates[1], &c.gates[2]}) {
    const std::int64_t row = x->numel() / x->shape[1];
    std::normal_distribution<double> normal(0.0, 3.0);
    for (std::int64_t e = (t + 1) * row; e < x->numel(); ++e) x->data[e] = normal(rng);
  }
  const HostF64 after = c.forward();
  const std::int64_t row = c.heads_q * c.dim_v;
  for (std::int64_t e = 0; e < (t + 1) * row; ++e) ASSERT_DOUBLE_EQ(after.data[e], before.data[e]) << "element " << e;
  EXPECT_GT(max_abs_diff(after.data, before.data), 1e-3);
}

TEST(NsaAttention, Float32MatchesFloat64) {
  std::mt19937_64 rng(12);
  NsaCase c = NsaCase::batched(1, 40, 2, 1, rng);
  const HostF64 expected = c.forward();
  HostF64 o64 = c.new_output();
  std::vector<std::byte> unused;
  NsaParams p = c.params(o64, unused);
  std::vector<Host<float>> copies;
  copies.reserve(8);
  const auto to_float = [&](TensorView& view, const HostF64& from) {
    Host<float>& copy = copies.emplace_back();
    copy.shape = from.shape;
    copy.data.assign(from.data.begin(), from.data.end());
    view = copy.view();
  };
  to_float(p.q, c.q);
  to_float(p.k, c.k);
  to_float(p.v, c.v);
  for (int i = 0; i < kNumBranches; ++i) to_float(p.gates[i], c.gates[i]);
  to_float(p.o, o64);
  std::vector<std::byte> workspace(nsa_workspace_size(p));
  p.workspace = workspace.data();
  p.workspace_bytes = workspace.size();
  nsa_attention(p);
  const std::vector<double> o(copies.back().data.begin(), copies.back().data.end());
  expect_near(o, expected.data, 1e-5);
}

}  // namespace
}  // namespace sparseattn::test
