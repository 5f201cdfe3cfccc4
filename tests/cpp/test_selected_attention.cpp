#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "attention_testing.h"
#include "sparseattn/selected_attention.h"

namespace sparseattn::test {
namespace {

struct Sizes {
  std::int64_t batch = 1, len = 4, q_heads = 1, kv_heads = 1, dim = 1, dim_v = 1, count = 2;
  int block = 2;
};

// Owning float64 tensors of one batched selected-attention call.
struct Selected {
  Sizes n;
  HostF64 q, k, v, o, lse, d_o, dq, dk, dv;
  Host<std::int32_t> indices;
  std::optional<double> scale;

  explicit Selected(const Sizes& sizes)
      : n(sizes),
        q({n.batch, n.len, n.q_heads, n.dim}),
        k({n.batch, n.len, n.kv_heads, n.dim}),
        v({n.batch, n.len, n.kv_heads, n.dim_v}),
        o({n.batch, n.len, n.q_heads, n.dim_v}),
        lse({n.batch, n.q_heads, n.len}),
        d_o({n.batch, n.len, n.q_heads, n.dim_v}),
        dq({n.batch, n.len, n.q_heads, n.dim}),
        dk({n.batch, n.len, n.kv_heads, n.dim}),
        dv({n.batch, n.len, n.kv_heads, n.dim_v}),
        indices({n.batch, n.len, n.kv_heads, n.count}, -1) {}

  // Random data and, per row, a random ascending subset of all blocks (future ones included), -1 padded.
  void randomize(std::mt19937_64& rng) {
    for (HostF64* t : {&q, &k, &v, &d_o}) fill_random(*t, rng);
    const std::int64_t blocks = num_selection_blocks(n.len, n.block);
    for (std::int64_t row = 0; row < n.batch * n.len * n.kv_heads; ++row) {
      std::vector<std::int32_t> chosen;
      for (std::int32_t b = 0; b < blocks; ++b) {
        if (static_cast<std::int64_t>(chosen.size()) < n.count && rng() % 2) chosen.push_back(b);
      }
      std::copy(chosen.begin(), chosen.end(), indices.data.begin() + row * n.count);
    }
  }
  SelectedAttentionParams forward_params() {
    SelectedAttentionParams p;
    p.q = q.view(), p.k = k.view(), p.v = v.view(), p.indices = indices.view(), p.o = o.view(), p.lse = lse.view();
    p.block = n.block, p.scale = scale;
    return p;
  }
  SelectedAttentionBackwardParams backward_params() {
    SelectedAttentionBackwardParams p;
    p.q = q.view(), p.k = k.view(), p.v = v.view(), p.indices = indices.view(), p.o = o.view(), p.lse = lse.view();
    p.d_o = d_o.view(), p.dq = dq.view(), p.dk = dk.view(), p.dv = dv.view();
    p.block = n.block, p.scale = scale;
    return p;
  }
  void forward() { selected_attention(forward_params()); }
  void backward() { selected_attention_backward(backward_params()); }
  NaiveAttention naive() const {
    return naive_attention(q, k, v, scale ? *scale : 1.0 / std::sqrt(double(n.dim)), [&](auto b, auto h, auto t, auto s) {
      const std::int64_t kv = h / (n.q_heads / n.kv_heads);
      const auto first = indices.data.begin() + ((b * n.len + t) * n.kv_heads + kv) * n.count;
      return s <= t && std::find(first, first + n.count, s / n.block) != first + n.count;
    });
  }
};

TEST(SelectedAttention, HandComputed) {
  // block 2, T = 4; scores k = [0, log 3, 2, 0] (q = 1, scale 1), values [1, 5, 7, 9].
  Selected s({});
  s.q.data = {1, 1, 1, 1};
  s.k.data = {0, std::log(3.0), 2, 0};
  s.v.data = {1, 5, 7, 9};
  s.indices.data = {1, -1, /*t=1*/ 0, 1, /*t=2*/ 1, -1, /*t=3*/ 0, 1};
  s.scale = 1.0;
  s.forward();
  EXPECT_EQ(s.o.data[0], 0.0);  // block 1 starts after t = 0: nothing visible
  EXPECT_EQ(s.lse.data[0], -kInf);
  EXPECT_NEAR(s.o.data[1], 4.0, 1e-12);  // tokens 0, 1: weights 1/4, 3/4
  EXPECT_NEAR(s.lse.data[1], std::log(4.0), 1e-12);
  EXPECT_NEAR(s.o.data[2], 7.0, 1e-12);  // token 2 only
  EXPECT_NEAR(s.lse.data[2], 2.0, 1e-12);
  const double e2 = std::exp(2.0);  // tokens 0..3: weights 1, 3, e^2, 1
  EXPECT_NEAR(s.o.data[3], (1 + 15 + 7 * e2 + 9) / (5 + e2), 1e-12);
  EXPECT_NEAR(s.lse.data[3], std::log(5 + e2), 1e-12);
}

TEST(SelectedAttention, MatchesNaiveForGroupSizesOneAndThree) {
  std::mt19937_64 rng(21);
  for (auto [q_heads, kv_heads] : {std::pair{2, 2}, std::pair{3, 1}, std::pair{6, 2}}) {
    Selected s({.batch = 2, .len = 11, .q_heads = q_heads, .kv_heads = kv_heads, .dim = 3, .dim_v = 2, .count = 3, .block = 3});
    s.randomize(rng);
    s.forward();
    const NaiveAttention want = s.naive();
    expect_near(s.o.data, want.o, 1e-12, "o");
    expect_near(s.lse.data, want.lse, 1e-12, "lse");
  }
}

TEST(SelectedAttention, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(22);
  for (auto [q_heads, kv_heads] : {std::pair{2, 2}, std::pair{3, 1}}) {
    Selected s({.batch = 2, .len = 7, .q_heads = q_heads, .kv_heads = kv_heads, .dim = 3, .dim_v = 2, .count = 2, .block = 2});
    s.randomize(rng);
    s.forward();
    s.backward();
    auto loss = [&] {
      s.forward();
      return dot(s.o.data, s.d_o.data);
    };
    EXPECT_LT(max_abs_diff(s.dq.data, numeric_gradient(s.q, loss)), 1e-7);
    EXPECT_LT(max_abs_diff(s.dk.data, numeric_gradient(s.k, loss)), 1e-7);
    EXPECT_LT(max_abs_diff(s.dv.data, numeric_gradient(s.v, loss)), 1e-7);
  }
}

TEST(SelectedAttention, RowsIgnoreLaterTokensOfSelectedBlocks) {
  std::mt19937_64 rng(23);
  Selected s({.batch = 1, .len = 8, .q_heads = 3, .kv_heads = 1, .dim = 2, .dim_v = 2, .count = 3, .block = 3});
  s.randomize(rng);
  for (std::int64_t t = 0; t < 8; ++t) {
    for (std::int32_t b = 0; b < 3; ++b) s.indices.data[t * 3 + b] = b;  // every block, future ones too
  }
  s.forward();
  const HostF64 o = s.o, lse = s.lse;
  for (std::int64_t t = 0; t < 7; ++t) {
    Selected g = s;
    for (std::int64_t x = (t + 1) * 2; x < 16; ++x) {
      g.k.data[x] += 10;
      g.v.data[x] -= 10;
    }
    g.forward();
    for (std::int64_t r = 0; r <= t; ++r) {
      for (std::int64_t i = r * 6; i < (r + 1) * 6; ++i) EXPECT_EQ(g.o.data[i], o.data[i]) << "row " << r;
      for (std::int64_t h = 0; h < 3; ++h) EXPECT_EQ(g.lse.data[h * 8 + r], lse.data[h * 8 + r]);
    }
  }
}

TEST(SelectedAttention, EmptyRowsGiveZeroAndNoGradient) {
  std::mt19937_64 rng(24);
  Selected s({.batch = 1, .len = 6, .q_heads = 2, .kv_heads = 1, .dim = 2, .dim_v = 2, .count = 2, .block = 2});
  s.randomize(rng);
  for (std::int64_t t = 0; t < 6; ++t) s.indices.data[t * 2] = 0, s.indices.data[t * 2 + 1] = -1;
  s.indices.data[6] = -1;  // row t = 3 selects nothing
  s.indices.data[2] = 2;   // row t = 1 selects only block 2, which starts after it
  s.forward();
  s.backward();
  const HostF64 dk = s.dk, dv = s.dv;
  for (std::int64_t t : {1, 3}) {
    for (std::int64_t h = 0; h < 2; ++h) {
      EXPECT_EQ(s.lse.data[h * 6 + t], -kInf);
      for (std::int64_t i = 0; i < 2; ++i) {
        const std::int64_t at = (t * 2 + h) * 2 + i;
        EXPECT_EQ(s.o.data[at], 0.0);
        EXPECT_EQ(s.dq.data[at], 0.0);
        s.d_o.data[at] -= 2;  // reaches nothing
      }
    }
  }
  s.backward();
  EXPECT_EQ(s.dk.data, dk.data);
  EXPECT_EQ(s.dv.data, dv.data);
}

TEST(SelectedAttention, PackedEqualsBatchedPerSequence) {
  std::mt19937_64 rng(25);
  const std::int64_t q_heads = 3, kv_heads = 1, dim = 3, dim_v = 2, count = 2, poison = -77;
  const int block = 2;
  const std::int64_t lens[] = {5, 1};
  // 6 packed tokens in use and one unused row whose indices are garbage (never read nor checked).
  HostF64 q({7, q_heads, dim}), k({7, kv_heads, dim}), v({7, kv_heads, dim_v}), d_o({7, q_heads, dim_v});
  for (HostF64* t : {&q, &k, &v, &d_o}) fill_random(*t, rng);
  HostF64 o({7, q_heads, dim_v}, poison), lse({q_heads, 7}, poison), dq({7, q_heads, dim}, poison),
      dk({7, kv_heads, dim}, poison), dv({7, kv_heads, dim_v}, poison);
  Host<std::int32_t> indices({7, kv_heads, count}), cu({3});
  indices.data = {0, -1, 0, -1, 0, 1, 1, -1, 0, 2, /*second sequence*/ 0, -1, /*unused*/ 99, -5};
  cu.data = {0, 5, 6};
  SelectedAttentionParams p;
  p.q = q.view(), p.k = k.view(), p.v = v.view(), p.indices = indices.view(), p.o = o.view(), p.lse = lse.view();
  p.seqs.cu_seqlens = cu.view(), p.block = block;
  selected_attention(p);
  SelectedAttentionBackwardParams b;
  b.q = p.q, b.k = p.k, b.v = p.v, b.indices = p.indices, b.o = p.o, b.lse = p.lse, b.d_o = d_o.view();
  b.dq = dq.view(), b.dk = dk.view(), b.dv = dv.view(), b.seqs = p.seqs, b.block = block;
  selected_attention_backward(b);

  auto rows = [](const auto& t, std::int64_t first, std::int64_t n) {
    const std::int64_t row = t.numel() / t.shape[0];
    return std::vector(t.data.begin() + first * row, t.data.begin() + (first + n) * row);
  };
  for (int seq = 0; seq < 2; ++seq) {
    Selected s({.batch = 1, .len = lens[seq], .q_heads = q_heads, .kv_heads = kv_heads, .dim = dim, .dim_v = dim_v,
                .count = count, .block = block});
    const std::int64_t first = cu.data[seq];
    s.q.data = rows(q, first, s.n.len);
    s.k.data = rows(k, first, s.n.len);
    s.v.data = rows(v, first, s.n.len);
    s.d_o.data = rows(d_o, first, s.n.len);
    s.indices.data = rows(indices, first, s.n.len);
    s.forward();
    s.backward();
    expect_near(rows(o, first, s.n.len), s.o.data, 1e-12, "o");
    for (std::int64_t h = 0; h < q_heads; ++h) {
      for (std::int64_t t = 0; t < s.n.len; ++t) EXPECT_EQ(lse.data[h * 7 + first + t], s.lse.data[h * s.n.len + t]);
    }
    expect_near(rows(dq, first, s.n.len), s.dq.data, 1e-12, "dq");
    expect_near(rows(dk, first, s.n.len), s.dk.data, 1e-12, "dk");
    expect_near(rows(dv, first, s.n.len), s.dv.data, 1e-12, "dv");
  }
  for (double x : {o.data.back(), dq.data.back(), dk.data.back(), dv.data.back()}) EXPECT_EQ(x, poison);
  for (std::int64_t h = 0; h < q_heads; ++h) EXPECT_EQ(lse.data[h * 7 + 6], poison);
}

TEST(SelectedAttention, Float32AndBfloat16Inputs) {
  std::mt19937_64 rng(26);
  Selected s({.batch = 1, .len = 9, .q_heads = 2, .kv_heads = 1, .dim = 8, .dim_v = 4, .count = 2, .block = 4});
  s.randomize(rng);
  s.forward();
  s.backward();
  {
    Host<float> q = to_float32(s.q), k = to_float32(s.k), v = to_float32(s.v), d_o = to_float32(s.d_o);
    Host<float> o({1, 9, 2, 4}), lse({1, 2, 9}), dq({1, 9, 2, 8}), dk({1, 9, 1, 8}), dv({1, 9, 1, 4});
    SelectedAttentionParams p;
    p.q = q.view(), p.k = k.view(), p.v = v.view(), p.indices = s.indices.view(), p.o = o.view(), p.lse = lse.view();
    p.block = 4;
    selected_attention(p);
    expect_near(to_float64(o.data), s.o.data, 1e-5, "o");
    expect_near(to_float64(lse.data), s.lse.data, 1e-5, "lse");
    SelectedAttentionBackwardParams b;
    b.q = p.q, b.k = p.k, b.v = p.v, b.indices = p.indices, b.o = p.o, b.lse = p.lse, b.d_o = d_o.view();
    b.dq = dq.view(), b.dk = dk.view(), b.dv = dv.view(), b.block = 4;
    selected_attention_backward(b);
    expect_near(to_float64(dq.data), s.dq.data, 1e-4, "dq");
    expect_near(to_float64(dk.data), s.dk.data, 1e-4, "dk");
    expect_near(to_float64(dv.data), s.dv.data, 1e-4, "dv");
  }
  {
    Selected r = s;
    r.q = rounded_to_bfloat16(s.q), r.k = rounded_to_bfloat16(s.k), r.v = rounded_to_bfloat16(s.v);
    r.forward();
    Host<std::uint16_t> q = to_bfloat16(s.q), k = to_bfloat16(s.k), v = to_bfloat16(s.v), o({1, 9, 2, 4});
    Host<float> lse({1, 2, 9});
    SelectedAttentionParams p;
    p.q = bfloat16_view(q), p.k = bfloat16_view(k), p.v = bfloat16_view(v), p.o = bfloat16_view(o);
    p.indices = s.indices.view(), p.lse = lse.view(), p.block = 4;
    selected_attention(p);
    const std::vector<double> got = from_bfloat16(o.data);
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], r.o.data[i], std::abs(r.o.data[i]) / 256 + 1e-12);
    expect_near(to_float64(lse.data), r.lse.data, 1e-5, "lse");
  }
}

TEST(SelectedAttention, ValidationNamesTheArgumentAndWritesNothing) {
  const double poison = -55;
  // T = 5 with block 2: 3 selection blocks; two slots per row.
  Selected s({.batch = 2, .len = 5, .q_heads = 3, .kv_heads = 1, .dim = 2, .dim_v = 2, .count = 2, .block = 2});
  s.o.data.assign(s.o.data.size(), poison);
  s.lse.data.assign(s.lse.data.size(), poison);
  HostF64 k_short({2, 4, 1, 2}), k_two_heads({2, 5, 2, 2}), indices_float({2, 5, 1, 2});
  Host<std::int32_t> no_slots({2, 5, 1, 0}), two_heads({2, 5, 2, 2}, -1);
  // Row (sequence 1, token 2, KV head 0) starts at element (1 * 5 + 2) * 2 = 14.
  auto with_row = [&](std::int32_t first, std::int32_t second) {
    Host<std::int32_t> indices({2, 5, 1, 2}, -1);
    indices.data[14] = first, indices.data[15] = second;
    return indices;
  };
  Host<std::int32_t> descending = with_row(1, 0), repeated = with_row(1, 1), gap = with_row(-1, 0),
                     negative = with_row(-2, -1), too_far = with_row(0, 3), fine = with_row(0, 2);

  using Edit = std::function<void(SelectedAttentionParams&)>;
  struct Case { const char* what; Edit edit; ErrorKind kind; const char* arg; };
  const std::vector<Case> cases = {
      {"descending", [&](auto& p) { p.indices = descending.view(); }, ErrorKind::value, "indices"},
      {"repeated", [&](auto& p) { p.indices = repeated.view(); }, ErrorKind::value, "indices"},
      {"-1 before an index", [&](auto& p) { p.indices = gap.view(); }, ErrorKind::value, "indices"},
      {"-2", [&](auto& p) { p.indices = negative.view(); }, ErrorKind::value, "indices"},
      {"index past the last block", [&](auto& p) { p.indices = too_far.view(); }, ErrorKind::value, "indices"},
      {"indices float", [&](auto& p) { p.indices = indices_float.view(); }, ErrorKind::dtype, "indices"},
      {"no slots", [&](auto& p) { p.indices = no_slots.view(); }, ErrorKind::shape, "indices"},
      {"indices heads", [&](auto& p) { p.indices = two_heads.view(); }, ErrorKind::shape, "indices"},
      {"indices on cuda", [](auto& p) { p.indices = on_cuda(p.indices); }, ErrorKind::device, "indices"},
      {"k length", [&](auto& p) { p.k = k_short.view(); }, ErrorKind::shape, "k"},
      {"Hq % Hkv", [&](auto& p) { p.k = k_two_heads.view(); }, ErrorKind::shape, "k"},
      {"v dtype", [](auto& p) { p.v.dtype = DType::float16; }, ErrorKind::dtype, "v"},
      {"block 0", [](auto& p) { p.block = 0; }, ErrorKind::config, "block"},
      {"o inner stride", [](auto& p) { p.o.stride[3] = 2; }, ErrorKind::layout, "o"},
      {"cuda anchor", [](auto& p) { p.q = on_cuda(p.q), p.k = on_cuda(p.k), p.v = on_cuda(p.v), p.indices = on_cuda(p.indices), p.o = on_cuda(p.o), p.lse = on_cuda(p.lse); },
       ErrorKind::unsupported, "q"},
  };
  for (const Case& c : cases) {
    SelectedAttentionParams p = s.forward_params();
    c.edit(p);
    SCOPED_TRACE(c.what);
    const std::string message = expect_error([&] { selected_attention(p); }, c.kind, c.arg);
    if (c.kind == ErrorKind::value) {
      EXPECT_NE(message.find("sequence 1, token 2, KV head 0"), std::string::npos) << message;
    }
  }
  for (double x : s.o.data) EXPECT_EQ(x, poison);
  for (double x : s.lse.data) EXPECT_EQ(x, poison);
  SelectedAttentionParams p = s.forward_params();
  p.indices = fine.view();
  selected_attention(p);  // the same row with valid entries passes

  // Packed: block 2 of the 3-token first sequence does not exist, although 3 tokens + 4 tokens would have it.
  HostF64 q({7, 3, 2}), k({7, 1, 2}), v({7, 1, 2}), o({7, 3, 2}, poison), lse({3, 7}, poison);
  Host<std::int32_t> indices({7, 1, 2}, -1), cu({3});
  cu.data = {0, 3, 7};
  indices.data[2 * 2] = 2;
  SelectedAttentionParams packed;
  packed.q = q.view(), packed.k = k.view(), packed.v = v.view(), packed.indices = indices.view();
  packed.o = o.view(), packed.lse = lse.view(), packed.seqs.cu_seqlens = cu.view(), packed.block = 2;
  const std::string message = expect_error([&] { selected_attention(packed); }, ErrorKind::value, "indices");
  EXPECT_NE(message.find("sequence 0, token 2"), std::string::npos) << message;
  for (double x : o.data) EXPECT_EQ(x, poison);
  for (double x : lse.data) EXPECT_EQ(x, poison);

  // Backward outputs stay untouched as well.
  for (HostF64* t : {&s.dq, &s.dk, &s.dv}) t->data.assign(t->data.size(), poison);
  SelectedAttentionBackwardParams b = s.backward_params();
  b.indices = too_far.view();
  expect_error([&] { selected_attention_backward(b); }, ErrorKind::value, "indices");
  b = s.backward_params();
  b.dv.shape[3] = 3;
  expect_error([&] { selected_attention_backward(b); }, ErrorKind::shape, "dv");
  for (const HostF64* t : {&s.dq, &s.dk, &s.dv}) {
    for (double x : t->data) EXPECT_EQ(x, poison);
  }
}

}  // namespace
}  // namespace sparseattn::test
