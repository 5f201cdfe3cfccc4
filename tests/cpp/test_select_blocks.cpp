#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "sparseattn/error.h"
#include "sparseattn/select_blocks.h"
#include "test_util.h"

namespace sparseattn::test {
namespace {

constexpr double kZeroLogit = -1000;  // exp(-1000) is exactly 0 in float64: a probability of 0

// One batch of select_blocks inputs (batched layout) with owning buffers.
struct Selection {
  std::int64_t tokens, heads_q, heads_kv, dim;
  SelectBlocksParams params;
  HostF64 q, k_cmp, lse;
  Host<std::int32_t> indices;

  Selection(std::int64_t t, std::int64_t hq, std::int64_t hkv, std::int64_t d, int cmp_block, int cmp_stride,
            int sel_block, int num_selected, int num_init, int num_local, std::int64_t batch = 1)
      : tokens(t), heads_q(hq), heads_kv(hkv), dim(d) {
    params.cmp_block = cmp_block;
    params.cmp_stride = cmp_stride;
    params.sel_block = sel_block;
    params.num_selected = num_selected;
    params.num_init = num_init;
    params.num_local = num_local;
    q = HostF64({batch, t, hq, d});
    k_cmp = HostF64({batch, num_compressed_blocks(t, cmp_block, cmp_stride), hkv, d});
    lse = HostF64({batch, hq, t});
    indices = Host<std::int32_t>({batch, t, hkv, num_selected}, -7);
  }
  void run() {
    params.q = q.view();
    params.k_cmp = k_cmp.view();
    params.lse_cmp = lse.view();
    params.indices = indices.view();
    select_blocks(params);
  }
  std::vector<std::int32_t> at(std::int64_t t, std::int64_t h, std::int64_t b = 0) const {
    const std::int64_t n = params.num_selected;
    const auto first = indices.data.begin() + ((b * tokens + t) * heads_kv + h) * n;
    return {first, first + n};
  }
};

// NSA's (l, d, l') = (32, 16, 64) with one query head per KV head and Dqk = 1: q = 1 and lse = 0 make
// P[t, j] = exp(k_cmp[j]), so the test sets P directly through k_cmp = log P.
Selection paper_blocks(std::int64_t heads, int num_selected, int num_init, int num_local) {
  Selection s(320, heads, heads, 1, 32, 16, 64, num_selected, num_init, num_local);
  s.params.scale = 1.0;
  std::fill(s.q.data.begin(), s.q.data.end(), 1.0);
  std::fill(s.k_cmp.data.begin(), s.k_cmp.data.end(), kZeroLogit);
  return s;
}

void set_probability(Selection& s, std::int64_t j, std::int64_t h, double p) {
  s.k_cmp.data[j * s.heads_kv + h] = std::log(p);
}

TEST(SelectBlocks, OverlapWeightsAreOneTwoTwoTwoOne) {
  // Selection block 2 covers tokens [128, 192); compressed block j covers [16j, 16j + 32), so j = 7..11
  // overlap it by 16, 32, 32, 32, 16 tokens: weights 1, 2, 2, 2, 1. Heads 2i and 2i + 1 put P = 1 on
  // j = 6 + i alone, and a competitor on j = 18 (weight 2 in block 4): P = 0.6 (S4 = 1.2) for head 2i,
  // P = 0.3 (S4 = 0.6) for head 2i + 1. The one selected block (nothing forced) shows the weight of
  // j = 6 + i in its blocks: 2 beats both competitors, 1 only the second, 0 neither.
  Selection s = paper_blocks(14, 1, 0, 0);
  for (std::int64_t i = 0; i < 7; ++i) {
    for (std::int64_t h : {2 * i, 2 * i + 1}) set_probability(s, 6 + i, h, 1.0);
    set_probability(s, 18, 2 * i, 0.6);
    set_probability(s, 18, 2 * i + 1, 0.3);
  }
  s.run();
  // j = 6 lies in block 1 (weight 2); j = 7 and j = 11 straddle two blocks (weight 1 each, the tie goes to
  // the lower block); j = 8, 9, 10 lie in block 2; j = 12 in block 3.
  const std::int32_t against_strong[7] = {1, 4, 2, 2, 2, 4, 3};
  const std::int32_t against_weak[7] = {1, 1, 2, 2, 2, 2, 3};
  for (std::int64_t i = 0; i < 7; ++i) {
    EXPECT_EQ(s.at(319, 2 * i), std::vector<std::int32_t>{against_strong[i]}) << "j = " << 6 + i;
    EXPECT_EQ(s.at(319, 2 * i + 1), std::vector<std::int32_t>{against_weak[i]}) << "j = " << 6 + i;
  }
}

TEST(SelectBlocks, HandComputedScores) {
  // Forced block 0 (num_init = 1) plus two free slots. P per head (all other P = 0) and the scores
  // S[b] = sum_j overlap(j, b) / 16 * P[j] of blocks 1..4:
  //   head 0: P6 = 1.3, P8 = 1, P11 = 1, P12 = 1.5 -> S = 2.6, 2 + 1 = 3, 1 + 3 = 4, 0 -> blocks 2, 3
  //   head 1: P6 = 1.3, P8 = 1, P11 = 1, P12 = 0.75 -> S = 2.6, 3, 1 + 1.5 = 2.5, 0 -> blocks 1, 2
  //   head 2: P7 = 1, P12 = 1 -> S = 1, 1, 2, 0: block 3, then an exact tie won by the lower block 1
  Selection s = paper_blocks(3, 3, 1, 0);
  for (std::int64_t h = 0; h < 2; ++h) {
    set_probability(s, 6, h, 1.3);
    set_probability(s, 8, h, 1.0);
    set_probability(s, 11, h, 1.0);
  }
  set_probability(s, 12, 0, 1.5);
  set_probability(s, 12, 1, 0.75);
  set_probability(s, 7, 2, 1.0);
  set_probability(s, 12, 2, 1.0);
  s.run();
  EXPECT_EQ(s.at(319, 0), (std::vector<std::int32_t>{0, 2, 3}));
  EXPECT_EQ(s.at(319, 1), (std::vector<std::int32_t>{0, 1, 2}));
  EXPECT_EQ(s.at(319, 2), (std::vector<std::int32_t>{0, 1, 3}));
  // Query 240 sees j <= 13 (16j + 31 <= 240) and blocks 0..3: head 2 has S1 = S2 = 1 and S3 = 2.
  EXPECT_EQ(s.at(240, 2), (std::vector<std::int32_t>{0, 1, 3}));
  // Query 150 sees j <= 7 and blocks 0..2: head 2 has S1 = S2 = 1 (j = 7), all three are taken.
  EXPECT_EQ(s.at(150, 2), (std::vector<std::int32_t>{0, 1, 2}));
  // Query 5: a single candidate block.
  EXPECT_EQ(s.at(5, 0), (std::vector<std::int32_t>{0, -1, -1}));
}

TEST(SelectBlocks, GroupSumsProbabilitiesAndSkipsEmptyRows) {
  // Two query heads share one KV head; Dqk = 2 lets each query head read its own k_cmp coordinate.
  // Query head 0 puts P = 1 on j = 8 (S2 = 2); query head 1 puts exp(log 1.5 - lse) on j = 12 (block 3).
  Selection s(320, 2, 1, 2, 32, 16, 64, 1, 0, 0);
  s.params.scale = 1.0;
  std::fill(s.k_cmp.data.begin(), s.k_cmp.data.end(), kZeroLogit);
  for (std::int64_t t = 0; t < 320; ++t) {
    s.q.data[(t * 2 + 0) * 2 + 0] = 1.0;
    s.q.data[(t * 2 + 1) * 2 + 1] = 1.0;
  }
  s.k_cmp.data[8 * 2 + 0] = 0.0;
  s.k_cmp.data[12 * 2 + 1] = std::log(1.5);
  const double inf = std::numeric_limits<double>::infinity();
  auto set_lse = [&](std::int64_t t, double head0, double head1) {
    s.lse.data[0 * 320 + t] = head0;
    s.lse.data[1 * 320 + t] = head1;
  };
  set_lse(317, 0, 0);          // S3 = 3 > S2 = 2
  set_lse(318, 0, std::log(2.0));  // S3 = 2 * 0.75 = 1.5 < S2 = 2
  set_lse(319, -inf, std::log(2.0));  // head 0 saw no block: P = 0 from it, S3 = 1.5 > S2 = 0
  s.run();
  EXPECT_EQ(s.at(317, 0), std::vector<std::int32_t>{3});
  EXPECT_EQ(s.at(318, 0), std::vector<std::int32_t>{2});
  EXPECT_EQ(s.at(319, 0), std::vector<std::int32_t>{3});
}

TEST(SelectBlocks, ForcedBlocks) {
  // num_init = 1, num_local = 2, n = 4; all probability on j = 8 (block 2).
  Selection s = paper_blocks(1, 4, 1, 2);
  set_probability(s, 8, 0, 1.0);
  s.run();
  EXPECT_EQ(s.at(0, 0), (std::vector<std::int32_t>{0, -1, -1, -1}));
  EXPECT_EQ(s.at(64, 0), (std::vector<std::int32_t>{0, 1, -1, -1}));
  EXPECT_EQ(s.at(130, 0), (std::vector<std::int32_t>{0, 1, 2, -1}));
  EXPECT_EQ(s.at(200, 0), (std::vector<std::int32_t>{0, 1, 2, 3}));   // forced 0, 2, 3; block 1 fills the slot
  EXPECT_EQ(s.at(319, 0), (std::vector<std::int32_t>{0, 2, 3, 4}));   // forced 0, 3, 4; block 2 scores highest
}

// S[t, b] from the definition token by token: every token x of block b adds P[j] / stride for each
// compressed block j visible from t that covers x. Independent of the reference's overlap arithmetic.
std::vector<double> oracle_scores(const Selection& s, std::int64_t batch, std::int64_t t, std::int64_t h) {
  const SelectBlocksParams& p = s.params;
  const std::int64_t group = s.heads_q / s.heads_kv;
  const std::int64_t blocks = num_compressed_blocks(s.tokens, p.cmp_block, p.cmp_stride);
  const double scale = p.scale.value_or(1.0 / std::sqrt(static_cast<double>(s.dim)));
  std::vector<double> probability(blocks, 0.0);
  for (std::int64_t j = 0; j < blocks; ++j) {
    if (j * p.cmp_stride + p.cmp_block - 1 > t) continue;
    for (std::int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
      const double lse = s.lse.data[(batch * s.heads_q + hq) * s.tokens + t];
      if (std::isinf(lse)) continue;
      double logit = 0;
      for (std::int64_t d = 0; d < s.dim; ++d) {
        logit += s.q.data[((batch * s.tokens + t) * s.heads_q + hq) * s.dim + d] *
                 s.k_cmp.data[((batch * blocks + j) * s.heads_kv + h) * s.dim + d];
      }
      probability[j] += std::exp(scale * logit - lse);
    }
  }
  std::vector<double> scores(t / p.sel_block + 1, 0.0);
  for (std::int64_t x = 0; x < static_cast<std::int64_t>(scores.size()) * p.sel_block; ++x) {
    for (std::int64_t j = 0; j < blocks; ++j) {
      if (j * p.cmp_stride <= x && x < j * p.cmp_stride + p.cmp_block) {
        scores[x / p.sel_block] += probability[j] / p.cmp_stride;
      }
    }
  }
  return scores;
}

// Every invariant of the selection for every query and KV head, against oracle_scores.
void expect_valid_selection(const Selection& s, std::int64_t batch) {
  const SelectBlocksParams& p = s.params;
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    for (std::int64_t h = 0; h < s.heads_kv; ++h) {
      SCOPED_TRACE("batch " + std::to_string(batch) + " token " + std::to_string(t) + " head " + std::to_string(h));
      const std::vector<std::int32_t> row = s.at(t, h, batch);
      const std::int64_t candidates = t / p.sel_block + 1;
      const std::int64_t count = std::min<std::int64_t>(p.num_selected, candidates);
      for (std::int64_t i = 0; i < p.num_selected; ++i) {
        if (i >= count) {
          ASSERT_EQ(row[i], -1);  // -1 only at the tail
          continue;
        }
        ASSERT_GE(row[i], 0);
        ASSERT_LT(row[i], candidates);
        if (i > 0) {
          ASSERT_LT(row[i - 1], row[i]);  // strictly ascending
        }
      }
      std::vector<char> selected(candidates, 0), forced(candidates, 0);
      for (std::int64_t i = 0; i < count; ++i) selected[row[i]] = 1;
      for (std::int64_t b = 0; b < candidates; ++b) {
        forced[b] = b < p.num_init || b > t / p.sel_block - p.num_local;
        if (forced[b]) {
          ASSERT_TRUE(selected[b]) << "forced block " << b;
        }
      }
      // A freely chosen block outscores every unselected candidate, or ties with it at a lower index.
      const std::vector<double> scores = oracle_scores(s, batch, t, h);
      for (std::int64_t b = 0; b < candidates; ++b) {
        if (!selected[b] || forced[b]) continue;
        for (std::int64_t c = 0; c < candidates; ++c) {
          if (selected[c]) continue;
          const double tolerance = 1e-12 * std::max(1.0, std::abs(scores[c]));
          const bool tie = std::abs(scores[b] - scores[c]) <= tolerance;
          EXPECT_TRUE(scores[b] > scores[c] + tolerance || (tie && b < c))
              << "block " << b << " (S " << scores[b] << ") chosen over " << c << " (S " << scores[c] << ")";
        }
      }
    }
  }
}

struct RandomConfig {
  std::int64_t heads_q, heads_kv;
  int cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local;
};

TEST(SelectBlocks, InvariantsOverRandomInputs) {
  const RandomConfig configs[] = {
      {6, 2, 16, 8, 32, 4, 1, 1},  // G = 3
      {3, 3, 8, 4, 16, 3, 0, 0},   // nothing forced
      {5, 1, 8, 8, 24, 5, 2, 2},   // G = 5, stride = block, sel_block not a power of two
      {2, 1, 8, 4, 8, 2, 0, 2},    // cmp_block = sel_block, all slots forced
  };
  std::mt19937_64 rng(11);
  for (const RandomConfig& c : configs) {
    Selection s(150, c.heads_q, c.heads_kv, 4, c.cmp_block, c.cmp_stride, c.sel_block, c.num_selected, c.num_init,
                c.num_local, /*batch=*/2);
    fill_random(s.q, rng);
    fill_random(s.k_cmp, rng);
    fill_random(s.lse, rng, 0.5);
    s.lse.data[7] = -std::numeric_limits<double>::infinity();
    s.run();
    for (std::int64_t b = 0; b < 2; ++b) expect_valid_selection(s, b);
  }
}

TEST(SelectBlocks, TiesGoToTheLowerBlock) {
  // q = 0: every visible compressed block has the same P, so all fully visible interior selection blocks
  // tie exactly; the free slots must go to the lowest of them.
  Selection s(200, 2, 1, 4, 16, 8, 32, 4, 1, 1);
  s.run();
  expect_valid_selection(s, 0);
  // Query 199: block 0 has a smaller score (its first 8 tokens are covered once); blocks 1..5 tie.
  EXPECT_EQ(s.at(199, 0), (std::vector<std::int32_t>{0, 1, 2, 6}));
}

TEST(SelectBlocks, PackedMatchesBatchedPerSequence) {
  std::mt19937_64 rng(13);
  const std::vector<std::int64_t> lengths = {1, 37, 70};
  const std::int64_t heads_q = 4, heads_kv = 2, dim = 3, rows = 110;
  const int block = 8, stride = 4, sel = 16;
  Host<std::int32_t> cu({4}), cu_cmp({4});
  cu.data = {0, 1, 38, 108};
  cu_cmp.data = {0, 0, 8, 24};
  HostF64 q({rows, heads_q, dim}), k_cmp({26, heads_kv, dim}), lse({heads_q, rows});
  fill_random(q, rng);
  fill_random(k_cmp, rng);
  fill_random(lse, rng);
  Host<std::int32_t> indices({rows, heads_kv, 3}, -7);
  SelectBlocksParams params;
  params.q = q.view();
  params.k_cmp = k_cmp.view();
  params.lse_cmp = lse.view();
  params.indices = indices.view();
  params.seqs.cu_seqlens = cu.view();
  params.cu_seqlens_cmp = cu_cmp.view();
  params.cmp_block = block;
  params.cmp_stride = stride;
  params.sel_block = sel;
  params.num_selected = 3;
  params.num_init = 1;
  params.num_local = 1;
  select_blocks(params);
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    Selection s(lengths[b], heads_q, heads_kv, dim, block, stride, sel, 3, 1, 1);
    std::copy_n(q.data.begin() + cu.data[b] * heads_q * dim, s.q.numel(), s.q.data.begin());
    std::copy_n(k_cmp.data.begin() + cu_cmp.data[b] * heads_kv * dim, s.k_cmp.numel(), s.k_cmp.data.begin());
    for (std::int64_t h = 0; h < heads_q; ++h) {
      std::copy_n(lse.data.begin() + h * rows + cu.data[b], lengths[b], s.lse.data.begin() + h * lengths[b]);
    }
    s.run();
    const auto first = indices.data.begin() + cu.data[b] * heads_kv * 3;
    EXPECT_EQ(s.indices.data, std::vector<std::int32_t>(first, first + s.indices.numel())) << "sequence " << b;
  }
  for (std::int64_t e = 108 * heads_kv * 3; e < indices.numel(); ++e) EXPECT_EQ(indices.data[e], -7);
}

void expect_error(Selection& s, ErrorKind kind, const std::string& argument) {
  const std::vector<std::int32_t> before = s.indices.data;
  try {
    select_blocks(s.params);
    ADD_FAILURE() << "expected an error naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_EQ(e.op(), "select_blocks");
  }
  EXPECT_EQ(s.indices.data, before) << "indices written despite the error";
}

TEST(SelectBlocks, ConfigValidationNamesTheField) {
  struct Bad {
    void (*apply)(SelectBlocksParams&);
    const char* argument;
  };
  const Bad cases[] = {
      {[](SelectBlocksParams& p) { p.cmp_block = 0; }, "cmp_block"},
      {[](SelectBlocksParams& p) { p.cmp_stride = -4; }, "cmp_stride"},
      {[](SelectBlocksParams& p) { p.cmp_stride = 3; }, "cmp_stride"},                    // does not divide 8
      {[](SelectBlocksParams& p) { p.cmp_block = 12; p.cmp_stride = 6; }, "cmp_stride"},  // does not divide 16
      {[](SelectBlocksParams& p) { p.sel_block = 0; }, "sel_block"},
      {[](SelectBlocksParams& p) { p.cmp_block = 32; }, "sel_block"},  // cmp_block > sel_block
      {[](SelectBlocksParams& p) { p.num_selected = 0; }, "num_selected"},
      {[](SelectBlocksParams& p) { p.num_init = -1; }, "num_init"},
      {[](SelectBlocksParams& p) { p.num_local = -1; }, "num_local"},
      {[](SelectBlocksParams& p) { p.num_init = 2; p.num_local = 2; }, "num_selected"},  // 4 > 3 forced
      {[](SelectBlocksParams& p) { p.scale = -1.0; }, "scale"},
  };
  for (const Bad& bad : cases) {
    Selection s(40, 2, 1, 4, 8, 4, 16, 3, 1, 1);
    s.run();
    bad.apply(s.params);
    expect_error(s, ErrorKind::config, bad.argument);
  }
}

TEST(SelectBlocks, TensorValidationNamesTheArgument) {
  Selection s(40, 4, 2, 4, 8, 4, 16, 3, 1, 1);
  s.run();
  const SelectBlocksParams good = s.params;
  s.params.k_cmp.shape[1] = 8;  // 40 tokens make 9 compressed blocks
  expect_error(s, ErrorKind::shape, "k_cmp");
  s.params = good;
  s.params.k_cmp.shape[2] = 3;  // does not divide 4 query heads
  expect_error(s, ErrorKind::shape, "k_cmp");
  s.params = good;
  s.params.k_cmp.dtype = DType::float32;
  expect_error(s, ErrorKind::dtype, "k_cmp");
  s.params = good;
  s.params.lse_cmp.dtype = DType::float32;  // float64 inputs need a float64 log-sum-exp
  expect_error(s, ErrorKind::dtype, "lse_cmp");
  s.params = good;
  s.params.lse_cmp.shape[2] = 39;
  expect_error(s, ErrorKind::shape, "lse_cmp");
  s.params = good;
  s.params.indices.dtype = DType::float64;
  expect_error(s, ErrorKind::dtype, "indices");
  s.params = good;
  s.params.indices.shape[3] = 4;
  expect_error(s, ErrorKind::shape, "indices");
  s.params = good;
  s.params.q.rank = 2;
  expect_error(s, ErrorKind::shape, "q");
  s.params = good;
  s.params.cu_seqlens_cmp = s.indices.view();
  expect_error(s, ErrorKind::config, "cu_seqlens_cmp");  // batched layout
  s.params = good;
  for (TensorView* t : {&s.params.q, &s.params.k_cmp, &s.params.lse_cmp, &s.params.indices}) {
    t->device = DeviceType::cuda;
  }
  s.params.q.dtype = s.params.k_cmp.dtype = s.params.lse_cmp.dtype = DType::float32;
  expect_error(s, ErrorKind::unsupported, "q");
}

}  // namespace
}  // namespace sparseattn::test
