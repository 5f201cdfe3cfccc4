#include <gtest/gtest.h>

#include <cmath>
#include <optional>

#include "attention_testing.h"
#include "flash_case.h"
#include "sparseattn/flash_attention.h"

namespace sparseattn::test {
namespace {

// flash_case.h's call with the naive attention and the window rule of these tests.
struct Flash : FlashCase {
  using FlashCase::FlashCase;

  void randomize(std::mt19937_64& rng) {
    for (HostF64* t : {&q, &k, &v, &d_o}) fill_random(*t, rng);
  }
  NaiveAttention naive(const std::function<bool(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>& keep,
                       const std::function<double(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>& add = nullptr) {
    return naive_attention(q, k, v, scale ? *scale : 1.0 / std::sqrt(double(n.dim)), keep, add);
  }
  // The causal/window rule of the header with bottom-right alignment.
  bool in_window(std::int64_t t, std::int64_t s) const {
    const std::int64_t a = t + n.k_len - n.q_len;
    return (!causal || s <= a) && (right < 0 || s <= a + right) && (left < 0 || s >= a - left);
  }
};

TEST(FlashAttention, HandComputedTwoKeys) {
  // scores 1*0 = 0 and 1*log 3: softmax [1/4, 3/4]; o = 1/4 * 1 + 3/4 * 5 = 4; lse = log(1 + 3).
  Flash f({.k_len = 2});
  f.q.data = {1};
  f.k.data = {0, std::log(3.0)};
  f.v.data = {1, 5};
  f.scale = 1.0;
  f.forward();
  EXPECT_NEAR(f.o.data[0], 4.0, 1e-12);
  EXPECT_NEAR(f.lse.data[0], std::log(4.0), 1e-12);
  // Causal with T = 1 < S = 2 aligns the query to the last key: both keys stay visible.
  f.causal = true;
  f.forward();
  EXPECT_NEAR(f.o.data[0], 4.0, 1e-12);
  // A window of 0 keys to the left keeps only the aligned key 1: o = v[1], lse = its score.
  f.left = 0;
  f.forward();
  EXPECT_NEAR(f.o.data[0], 5.0, 1e-12);
  EXPECT_NEAR(f.lse.data[0], std::log(3.0), 1e-12);
}

TEST(FlashAttention, CausalAndWindowMatchNaive) {
  std::mt19937_64 rng(1);
  struct Rule { std::int64_t q_len, k_len; bool causal; std::int64_t left, right; };
  for (const Rule& rule : {Rule{5, 5, true, -1, -1}, Rule{3, 5, true, -1, -1}, Rule{5, 3, true, -1, -1},
                           Rule{5, 5, true, 1, -1}, Rule{4, 6, false, 1, 1}, Rule{6, 4, false, -1, 0},
                           Rule{5, 5, false, 0, 2}}) {
    Flash f({.batch = 2, .q_len = rule.q_len, .k_len = rule.k_len, .q_heads = 2, .kv_heads = 1, .dim = 3, .dim_v = 2});
    f.randomize(rng);
    f.causal = rule.causal, f.left = rule.left, f.right = rule.right;
    f.forward();
    const NaiveAttention want = f.naive([&](auto, auto, auto t, auto s) { return f.in_window(t, s); });
    const std::string what = "T=" + std::to_string(rule.q_len) + " S=" + std::to_string(rule.k_len);
    expect_near(f.o.data, want.o, 1e-12, "o " + what);
    expect_near(f.lse.data, want.lse, 1e-12, "lse " + what);
  }
}

TEST(FlashAttention, MaskAndBiasBroadcastMatchNaive) {
  std::mt19937_64 rng(2);
  const FlashSizes sizes{.batch = 2, .q_len = 4, .k_len = 5, .q_heads = 6, .kv_heads = 2, .dim = 3, .dim_v = 2};
  struct Shapes { std::int64_t mask_b, mask_h, mask_t, bias_b, bias_h, bias_t; };
  for (const Shapes& shapes : {Shapes{2, 6, 4, 1, 2, 1}, Shapes{1, 1, 1, 2, 1, 4}, Shapes{1, 2, 4, 2, 6, 1}}) {
    Flash f(sizes);
    f.randomize(rng);
    f.causal = true;
    f.mask = Host<std::uint8_t>({shapes.mask_b, shapes.mask_h, shapes.mask_t, sizes.k_len});
    for (auto& keep : f.mask.data) keep = rng() % 3 != 0;
    f.bias = HostF64({shapes.bias_b, shapes.bias_h, shapes.bias_t, sizes.k_len});
    fill_random(f.bias, rng);
    // The broadcast index of a [B|1, Hq|Hkv|1, T|1, S] tensor.
    auto at = [&](const std::vector<std::int64_t>& shape, std::int64_t b, std::int64_t h, std::int64_t t,
                  std::int64_t s) {
      const std::int64_t head = shape[1] == sizes.q_heads ? h : shape[1] == 1 ? 0 : h / (sizes.q_heads / sizes.kv_heads);
      return ((std::min(b, shape[0] - 1) * shape[1] + head) * shape[2] + std::min(t, shape[2] - 1)) * shape[3] + s;
    };
    f.forward();
    const NaiveAttention want = f.naive(
        [&](auto b, auto h, auto t, auto s) { return f.in_window(t, s) && f.mask.data[at(f.mask.shape, b, h, t, s)]; },
        [&](auto b, auto h, auto t, auto s) { return f.bias.data[at(f.bias.shape, b, h, t, s)]; });
    expect_near(f.o.data, want.o, 1e-12, "o");
    expect_near(f.lse.data, want.lse, 1e-12, "lse");
  }
}

TEST(FlashAttention, GroupSizesOneAndThreeMatchNaive) {
  std::mt19937_64 rng(3);
  for (auto [q_heads, kv_heads] : {std::pair{2, 2}, std::pair{3, 1}, std::pair{6, 2}}) {
    Flash f({.batch = 1, .q_len = 5, .k_len = 5, .q_heads = q_heads, .kv_heads = kv_heads, .dim = 4, .dim_v = 3});
    f.randomize(rng);
    f.causal = true;
    f.forward();
    const NaiveAttention want = f.naive([&](auto, auto, auto t, auto s) { return s <= t; });
    expect_near(f.o.data, want.o, 1e-12, "o");
    expect_near(f.lse.data, want.lse, 1e-12, "lse");
  }
}

// dq, dk, dv (and dbias for a broadcast bias) against central differences of loss = sum(o * d_o).
void check_gradients(Flash& f) {
  f.forward();
  f.backward();
  auto loss = [&] {
    f.forward();
    return dot(f.o.data, f.d_o.data);
  };
  EXPECT_LT(max_abs_diff(f.dq.data, numeric_gradient(f.q, loss)), 1e-7);
  EXPECT_LT(max_abs_diff(f.dk.data, numeric_gradient(f.k, loss)), 1e-7);
  EXPECT_LT(max_abs_diff(f.dv.data, numeric_gradient(f.v, loss)), 1e-7);
  if (!f.dbias.data.empty()) {
    EXPECT_LT(max_abs_diff(f.dbias.data, numeric_gradient(f.bias, loss)), 1e-7);
  }
}

TEST(FlashAttention, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(4);
  {  // GQA 3, causal with S > T, a mask and a bias [1, Hkv, 1, S].
    Flash f({.batch = 2, .q_len = 3, .k_len = 5, .q_heads = 3, .kv_heads = 1, .dim = 3, .dim_v = 2});
    f.randomize(rng);
    f.causal = true;
    f.mask = Host<std::uint8_t>({2, 1, 3, 5}, 1);
    f.mask.data[3] = f.mask.data[6] = 0;  // (b0, t0, s3) is past the causal edge anyway; (b0, t1, s1) is not
    f.bias = HostF64({1, 1, 1, 5});
    fill_random(f.bias, rng);
    f.dbias = HostF64({1, 1, 1, 5});
    check_gradients(f);
  }
  {  // Group size 1, a two-sided window, a bias with every dimension its own.
    Flash f({.batch = 1, .q_len = 4, .k_len = 4, .q_heads = 2, .kv_heads = 2, .dim = 2, .dim_v = 3});
    f.randomize(rng);
    f.left = 1, f.right = 1;
    f.scale = 0.7;
    f.bias = HostF64({1, 2, 4, 4});
    fill_random(f.bias, rng);
    f.dbias = HostF64({1, 2, 4, 4});
    check_gradients(f);
  }
}

TEST(FlashAttention, CausalRowsIgnoreLaterKeys) {
  std::mt19937_64 rng(5);
  Flash f({.batch = 1, .q_len = 6, .k_len = 6, .q_heads = 3, .kv_heads = 1, .dim = 4, .dim_v = 4});
  f.randomize(rng);
  f.causal = true;
  f.forward();
  const HostF64 o = f.o, lse = f.lse;
  for (std::int64_t t = 0; t < 5; ++t) {
    Flash g = f;
    for (std::int64_t s = t + 1; s < 6; ++s) {
      for (std::int64_t c = 0; c < 4; ++c) {
        g.k.data[s * 4 + c] += 10;
        g.v.data[s * 4 + c] -= 10;
      }
    }
    g.forward();
    for (std::int64_t r = 0; r <= t; ++r) {
      for (std::int64_t i = r * 12; i < (r + 1) * 12; ++i) EXPECT_EQ(g.o.data[i], o.data[i]) << "row " << r;
      for (std::int64_t h = 0; h < 3; ++h) EXPECT_EQ(g.lse.data[h * 6 + r], lse.data[h * 6 + r]);
    }
  }
}

TEST(FlashAttention, EmptyRowsGiveZeroAndNoGradient) {
  std::mt19937_64 rng(6);
  // T = 3 > S = 2 causal: row 0 aligns to key -1 and sees nothing; the mask also hides all of row 2.
  Flash f({.batch = 1, .q_len = 3, .k_len = 2, .q_heads = 1, .kv_heads = 1, .dim = 2, .dim_v = 2});
  f.randomize(rng);
  f.causal = true;
  f.mask = Host<std::uint8_t>({1, 1, 3, 2}, 1);
  f.mask.data[4] = f.mask.data[5] = 0;
  f.bias = HostF64({1, 1, 3, 2});
  fill_random(f.bias, rng);
  f.dbias = HostF64({1, 1, 3, 2}, 99);
  f.forward();
  for (std::int64_t row : {0, 2}) {
    EXPECT_EQ(f.o.data[row * 2], 0.0);
    EXPECT_EQ(f.o.data[row * 2 + 1], 0.0);
    EXPECT_EQ(f.lse.data[row], -kInf);
  }
  EXPECT_TRUE(std::isfinite(f.lse.data[1]));
  f.backward();
  const HostF64 dk = f.dk, dv = f.dv;
  for (std::int64_t row : {0, 2}) {
    EXPECT_EQ(f.dq.data[row * 2], 0.0);
    EXPECT_EQ(f.dq.data[row * 2 + 1], 0.0);
    EXPECT_EQ(f.dbias.data[row * 2], 0.0);
    EXPECT_EQ(f.dbias.data[row * 2 + 1], 0.0);
    f.d_o.data[row * 2] += 5;  // the empty rows' output gradients reach nothing
  }
  f.backward();
  EXPECT_EQ(f.dk.data, dk.data);
  EXPECT_EQ(f.dv.data, dv.data);
}

TEST(FlashAttention, PackedEqualsBatchedPerSequence) {
  std::mt19937_64 rng(7);
  const std::int64_t q_heads = 3, kv_heads = 1, dim = 3, dim_v = 2, poison = -77;
  const std::int64_t q_lens[] = {3, 1}, k_lens[] = {4, 1};
  // Packed rows: 4 queries and 5 keys in use, plus one unused row each that must stay untouched.
  HostF64 q({5, q_heads, dim}), k({6, kv_heads, dim}), v({6, kv_heads, dim_v}), d_o({5, q_heads, dim_v});
  for (HostF64* t : {&q, &k, &v, &d_o}) fill_random(*t, rng);
  HostF64 o({5, q_heads, dim_v}, poison), lse({q_heads, 5}, poison), dq({5, q_heads, dim}, poison),
      dk({6, kv_heads, dim}, poison), dv({6, kv_heads, dim_v}, poison);
  Host<std::int32_t> cu_q({3}), cu_k({3});
  cu_q.data = {0, 3, 4};
  cu_k.data = {0, 4, 5};
  FlashAttentionParams p;
  p.q = q.view(), p.k = k.view(), p.v = v.view(), p.o = o.view(), p.lse = lse.view();
  p.seqs_q.cu_seqlens = cu_q.view();
  p.seqs_k.cu_seqlens = cu_k.view();
  p.causal = true;
  flash_attention(p);
  FlashAttentionBackwardParams b;
  b.q = p.q, b.k = p.k, b.v = p.v, b.o = p.o, b.lse = p.lse, b.d_o = d_o.view();
  b.dq = dq.view(), b.dk = dk.view(), b.dv = dv.view();
  b.seqs_q = p.seqs_q, b.seqs_k = p.seqs_k, b.causal = true;
  flash_attention_backward(b);

  for (int seq = 0; seq < 2; ++seq) {
    Flash f({.batch = 1, .q_len = q_lens[seq], .k_len = k_lens[seq], .q_heads = q_heads, .kv_heads = kv_heads,
             .dim = dim, .dim_v = dim_v});
    f.causal = true;
    const std::int64_t q0 = cu_q.data[seq], k0 = cu_k.data[seq];
    auto rows = [](const HostF64& t, std::int64_t first, std::int64_t count) {
      const std::int64_t row = t.numel() / t.shape[0];
      return std::vector<double>(t.data.begin() + first * row, t.data.begin() + (first + count) * row);
    };
    f.q.data = rows(q, q0, f.n.q_len);
    f.k.data = rows(k, k0, f.n.k_len);
    f.v.data = rows(v, k0, f.n.k_len);
    f.d_o.data = rows(d_o, q0, f.n.q_len);
    f.forward();
    f.backward();
    expect_near(rows(o, q0, f.n.q_len), f.o.data, 1e-12, "o");
    for (std::int64_t h = 0; h < q_heads; ++h) {
      for (std::int64_t t = 0; t < f.n.q_len; ++t) EXPECT_NEAR(lse.data[h * 5 + q0 + t], f.lse.data[h * f.n.q_len + t], 1e-12);
    }
    expect_near(rows(dq, q0, f.n.q_len), f.dq.data, 1e-12, "dq");
    expect_near(rows(dk, k0, f.n.k_len), f.dk.data, 1e-12, "dk");
    expect_near(rows(dv, k0, f.n.k_len), f.dv.data, 1e-12, "dv");
  }
  // Rows past cu_seqlens[B] are untouched.
  for (double x : {o.data.back(), dq.data.back(), dk.data.back(), dv.data.back()}) EXPECT_EQ(x, poison);
  for (std::int64_t h = 0; h < q_heads; ++h) EXPECT_EQ(lse.data[h * 5 + 4], poison);
}

TEST(FlashAttention, Float32AndBfloat16Inputs) {
  std::mt19937_64 rng(8);
  Flash f({.batch = 1, .q_len = 6, .k_len = 6, .q_heads = 2, .kv_heads = 1, .dim = 8, .dim_v = 4});
  f.randomize(rng);
  f.causal = true;
  f.forward();
  f.backward();
  {  // float32: rounding of the inputs and outputs only.
    Host<float> q = to_float32(f.q), k = to_float32(f.k), v = to_float32(f.v), d_o = to_float32(f.d_o);
    Host<float> o({1, 6, 2, 4}), lse({1, 2, 6}), dq({1, 6, 2, 8}), dk({1, 6, 1, 8}), dv({1, 6, 1, 4});
    FlashAttentionParams p;
    p.q = q.view(), p.k = k.view(), p.v = v.view(), p.o = o.view(), p.lse = lse.view(), p.causal = true;
    flash_attention(p);
    expect_near(to_float64(o.data), f.o.data, 1e-5, "o");
    expect_near(to_float64(lse.data), f.lse.data, 1e-5, "lse");
    FlashAttentionBackwardParams b;
    b.q = p.q, b.k = p.k, b.v = p.v, b.o = p.o, b.lse = p.lse, b.d_o = d_o.view(), b.causal = true;
    b.dq = dq.view(), b.dk = dk.view(), b.dv = dv.view();
    flash_attention_backward(b);
    expect_near(to_float64(dq.data), f.dq.data, 1e-4, "dq");
    expect_near(to_float64(dk.data), f.dk.data, 1e-4, "dk");
    expect_near(to_float64(dv.data), f.dv.data, 1e-4, "dv");
  }
  {  // bfloat16: the float64 result on the rounded inputs, rounded once (relative 2^-8), lse in float32.
    Flash r = f;
    r.q = rounded_to_bfloat16(f.q), r.k = rounded_to_bfloat16(f.k), r.v = rounded_to_bfloat16(f.v);
    r.forward();
    Host<std::uint16_t> q = to_bfloat16(f.q), k = to_bfloat16(f.k), v = to_bfloat16(f.v), o({1, 6, 2, 4});
    Host<float> lse({1, 2, 6});
    FlashAttentionParams p;
    p.q = bfloat16_view(q), p.k = bfloat16_view(k), p.v = bfloat16_view(v), p.o = bfloat16_view(o);
    p.lse = lse.view(), p.causal = true;
    flash_attention(p);
    const std::vector<double> got = from_bfloat16(o.data);
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], r.o.data[i], std::abs(r.o.data[i]) / 256 + 1e-12);
    expect_near(to_float64(lse.data), r.lse.data, 1e-5, "lse");
  }
}

TEST(FlashAttention, ValidationNamesTheArgumentAndWritesNothing) {
  const double poison = -55;
  Flash f({.batch = 2, .q_len = 3, .k_len = 4, .q_heads = 3, .kv_heads = 1, .dim = 2, .dim_v = 2});
  f.o.data.assign(f.o.data.size(), poison);
  f.lse.data.assign(f.lse.data.size(), poison);
  HostF64 k_two_heads({2, 4, 2, 2}), q_wide({2, 3, 3, 4}), short_v({2, 3, 1, 2}), bad_o({2, 3, 3, 3});
  HostF64 bias_bad({2, 2, 3, 4}), lse_packed({3, 6});
  Host<std::uint8_t> mask({1, 1, 3, 4}, 1), mask_bad({2, 1, 2, 4}, 1);
  Host<std::int32_t> cu_ok({3}), cu_bad({3}), cu_long({4}), cu_over({3});
  cu_ok.data = {0, 3, 6};
  cu_bad.data = {0, 4, 2};
  cu_long.data = {0, 1, 2, 3};
  cu_over.data = {0, 2, 9};

  using Edit = std::function<void(FlashAttentionParams&)>;
  struct Case { const char* what; Edit edit; ErrorKind kind; const char* arg; };
  const std::vector<Case> cases = {
      {"q int32", [](auto& p) { p.q.dtype = DType::int32; }, ErrorKind::dtype, "q"},
      {"k float32", [](auto& p) { p.k.dtype = DType::float32; }, ErrorKind::dtype, "k"},
      {"lse float32 for float64 inputs", [](auto& p) { p.lse.dtype = DType::float32; }, ErrorKind::dtype, "lse"},
      {"mask float", [&](auto& p) { p.mask = mask.view(), p.mask.dtype = DType::float64; }, ErrorKind::dtype, "mask"},
      {"Hq % Hkv", [&](auto& p) { p.k = k_two_heads.view(); }, ErrorKind::shape, "k"},
      {"Dqk of k", [&](auto& p) { p.q = q_wide.view(); }, ErrorKind::shape, "k"},
      {"v length", [&](auto& p) { p.v = short_v.view(); }, ErrorKind::shape, "v"},
      {"o shape", [&](auto& p) { p.o = bad_o.view(); }, ErrorKind::shape, "o"},
      {"lse shape", [&](auto& p) { p.lse = lse_packed.view(); }, ErrorKind::shape, "lse"},
      {"mask shape", [&](auto& p) { p.mask = mask_bad.view(); }, ErrorKind::shape, "mask"},
      {"bias heads", [&](auto& p) { p.bias = bias_bad.view(); }, ErrorKind::shape, "bias"},
      {"k on cuda", [](auto& p) { p.k = on_cuda(p.k); }, ErrorKind::device, "k"},
      {"mask on cuda", [&](auto& p) { p.mask = on_cuda(mask.view()); }, ErrorKind::device, "mask"},
      {"q inner stride", [&](auto& p) { p.q = inner_stride_two(q_wide); }, ErrorKind::layout, "q"},
      {"scale", [](auto& p) { p.scale = -1.0; }, ErrorKind::config, "scale"},
      {"cu_seqlens_q alone", [&](auto& p) { p.seqs_q.cu_seqlens = cu_ok.view(); }, ErrorKind::config, "cu_seqlens_k"},
      {"cuda anchor", [](auto& p) { p.q = on_cuda(p.q), p.k = on_cuda(p.k), p.v = on_cuda(p.v), p.o = on_cuda(p.o), p.lse = on_cuda(p.lse); },
       ErrorKind::unsupported, "q"},
  };
  for (const Case& c : cases) {
    FlashAttentionParams p = f.forward_params();
    c.edit(p);
    SCOPED_TRACE(c.what);
    const std::string message = expect_error([&] { flash_attention(p); }, c.kind, c.arg);
    if (std::string(c.what) == "Hq % Hkv") {
      EXPECT_NE(message.find("group size"), std::string::npos) << message;
    }
  }
  for (double x : f.o.data) EXPECT_EQ(x, poison);
  for (double x : f.lse.data) EXPECT_EQ(x, poison);

  // Packed layout: cu_seqlens contents, batch counts, and no batched (4-D) mask.
  HostF64 q({6, 3, 2}), k({6, 1, 2}), v({6, 1, 2}), o({6, 3, 2}, poison), lse({3, 6}, poison);
  const std::vector<Case> packed_cases = {
      {"cu_seqlens_q decreasing", [&](auto& p) { p.seqs_q.cu_seqlens = cu_bad.view(); }, ErrorKind::value, "cu_seqlens_q"},
      {"cu_seqlens_k past the rows", [&](auto& p) { p.seqs_k.cu_seqlens = cu_over.view(); }, ErrorKind::value, "cu_seqlens_k"},
      {"batch counts differ", [&](auto& p) { p.seqs_k.cu_seqlens = cu_long.view(); }, ErrorKind::shape, "cu_seqlens_k"},
      {"batched mask when packed", [&](auto& p) { p.mask = mask.view(); }, ErrorKind::shape, "mask"},
      {"batched q when packed", [&](auto& p) { p.q = f.q.view(); }, ErrorKind::shape, "q"},
  };
  for (const Case& c : packed_cases) {
    FlashAttentionParams p;
    p.q = q.view(), p.k = k.view(), p.v = v.view(), p.o = o.view(), p.lse = lse.view();
    p.seqs_q.cu_seqlens = cu_ok.view();
    p.seqs_k.cu_seqlens = cu_ok.view();
    flash_attention(p);  // valid as given
    o.data.assign(o.data.size(), poison);
    lse.data.assign(lse.data.size(), poison);
    c.edit(p);
    SCOPED_TRACE(c.what);
    expect_error([&] { flash_attention(p); }, c.kind, c.arg);
    for (double x : o.data) EXPECT_EQ(x, poison);
    for (double x : lse.data) EXPECT_EQ(x, poison);
  }
}

TEST(FlashAttention, BackwardValidationWritesNothing) {
  const double poison = -55;
  Flash f({.batch = 1, .q_len = 3, .k_len = 3, .q_heads = 2, .kv_heads = 1, .dim = 2, .dim_v = 2});
  f.bias = HostF64({1, 1, 1, 3});
  f.forward();
  for (HostF64* t : {&f.dq, &f.dk, &f.dv}) t->data.assign(t->data.size(), poison);
  HostF64 dbias_bad({1, 1, 3, 3}, poison), dq_bad({1, 3, 2, 3}, poison), dbias({1, 1, 1, 3}, poison);
  using Edit = std::function<void(FlashAttentionBackwardParams&)>;
  struct Case { const char* what; Edit edit; ErrorKind kind; const char* arg; };
  const std::vector<Case> cases = {
      {"dq shape", [&](auto& p) { p.dq = dq_bad.view(); }, ErrorKind::shape, "dq"},
      {"d_o dtype", [](auto& p) { p.d_o.dtype = DType::float32; }, ErrorKind::dtype, "d_o"},
      {"dv on cuda", [](auto& p) { p.dv = on_cuda(p.dv); }, ErrorKind::device, "dv"},
      {"dbias shape", [&](auto& p) { p.dbias = dbias_bad.view(); }, ErrorKind::shape, "dbias"},
      {"dbias without bias", [&](auto& p) { p.bias = TensorView{}, p.dbias = dbias.view(); }, ErrorKind::config, "dbias"},
      {"lse shape", [&](auto& p) { p.lse.shape[2] = 2; }, ErrorKind::shape, "lse"},
  };
  for (const Case& c : cases) {
    FlashAttentionBackwardParams p = f.backward_params();
    p.dbias = dbias.view();
    c.edit(p);
    SCOPED_TRACE(c.what);
    expect_error([&] { flash_attention_backward(p); }, c.kind, c.arg);
  }
  for (const HostF64* t : {&f.dq, &f.dk, &f.dv, &dbias_bad, &dq_bad, &dbias}) {
    for (double x : t->data) EXPECT_EQ(x, poison);
  }
}

}  // namespace
}  // namespace sparseattn::test
