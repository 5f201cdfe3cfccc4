#include <gtest/gtest.h>

#include <cmath>

#include "attention_testing.h"
#include "sparseattn/compressed_attention.h"

namespace sparseattn::test {
namespace {

struct Sizes {
  std::int64_t batch = 1, len = 4, q_heads = 1, kv_heads = 1, dim = 1, dim_v = 1;
  int block = 2, stride = 1;
};

// Owning float64 tensors of one batched compressed-attention call.
struct Compressed {
  Sizes n;
  std::int64_t blocks;  // Tc
  HostF64 q, k_cmp, v_cmp, o, lse, d_o, dq, dk_cmp, dv_cmp;
  std::optional<double> scale;

  explicit Compressed(const Sizes& sizes)
      : n(sizes),
        blocks(num_compressed_blocks(n.len, n.block, n.stride)),
        q({n.batch, n.len, n.q_heads, n.dim}),
        k_cmp({n.batch, blocks, n.kv_heads, n.dim}),
        v_cmp({n.batch, blocks, n.kv_heads, n.dim_v}),
        o({n.batch, n.len, n.q_heads, n.dim_v}),
        lse({n.batch, n.q_heads, n.len}),
        d_o({n.batch, n.len, n.q_heads, n.dim_v}),
        dq({n.batch, n.len, n.q_heads, n.dim}),
        dk_cmp({n.batch, blocks, n.kv_heads, n.dim}),
        dv_cmp({n.batch, blocks, n.kv_heads, n.dim_v}) {}

  void randomize(std::mt19937_64& rng) {
    for (HostF64* t : {&q, &k_cmp, &v_cmp, &d_o}) fill_random(*t, rng);
  }
  CompressedAttentionParams forward_params() {
    CompressedAttentionParams p;
    p.q = q.view(), p.k_cmp = k_cmp.view(), p.v_cmp = v_cmp.view(), p.o = o.view(), p.lse = lse.view();
    p.block = n.block, p.stride = n.stride, p.scale = scale;
    return p;
  }
  CompressedAttentionBackwardParams backward_params() {
    CompressedAttentionBackwardParams p;
    p.q = q.view(), p.k_cmp = k_cmp.view(), p.v_cmp = v_cmp.view(), p.o = o.view(), p.lse = lse.view();
    p.d_o = d_o.view(), p.dq = dq.view(), p.dk_cmp = dk_cmp.view(), p.dv_cmp = dv_cmp.view();
    p.block = n.block, p.stride = n.stride, p.scale = scale;
    return p;
  }
  void forward() { compressed_attention(forward_params()); }
  void backward() { compressed_attention_backward(backward_params()); }
  NaiveAttention naive() const {
    return naive_attention(q, k_cmp, v_cmp, scale ? *scale : 1.0 / std::sqrt(double(n.dim)),
                           [&](auto, auto, auto t, auto j) { return j * n.stride + n.block - 1 <= t; });
  }
};

TEST(CompressedAttention, HandComputed) {
  // block 2, stride 1, T = 4: Tc = 3 and query t sees blocks j <= t - 1. Scores 0, log 3, 0.
  Compressed c({});
  c.q.data = {1, 1, 1, 1};
  c.k_cmp.data = {0, std::log(3.0), 0};
  c.v_cmp.data = {1, 5, 7};
  c.scale = 1.0;
  c.forward();
  EXPECT_EQ(c.o.data[0], 0.0);  // t = 0 sees no block
  EXPECT_EQ(c.lse.data[0], -kInf);
  EXPECT_NEAR(c.o.data[1], 1.0, 1e-12);  // only block 0
  EXPECT_NEAR(c.lse.data[1], 0.0, 1e-12);
  EXPECT_NEAR(c.o.data[2], 4.0, 1e-12);  // weights 1/4, 3/4
  EXPECT_NEAR(c.lse.data[2], std::log(4.0), 1e-12);
  EXPECT_NEAR(c.o.data[3], 23.0 / 5.0, 1e-12);  // weights 1/5, 3/5, 1/5
  EXPECT_NEAR(c.lse.data[3], std::log(5.0), 1e-12);
}

TEST(CompressedAttention, MatchesNaiveForGroupSizesOneAndThree) {
  std::mt19937_64 rng(11);
  for (auto [q_heads, kv_heads] : {std::pair{2, 2}, std::pair{3, 1}, std::pair{6, 2}}) {
    Compressed c({.batch = 2, .len = 11, .q_heads = q_heads, .kv_heads = kv_heads, .dim = 3, .dim_v = 2, .block = 4, .stride = 2});
    ASSERT_EQ(c.blocks, 4);
    c.randomize(rng);
    c.forward();
    const NaiveAttention want = c.naive();
    expect_near(c.o.data, want.o, 1e-12, "o");
    expect_near(c.lse.data, want.lse, 1e-12, "lse");
  }
}

TEST(CompressedAttention, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(12);
  for (auto [q_heads, kv_heads] : {std::pair{2, 2}, std::pair{3, 1}}) {
    Compressed c({.batch = 2, .len = 9, .q_heads = q_heads, .kv_heads = kv_heads, .dim = 3, .dim_v = 2, .block = 4, .stride = 2});
    c.randomize(rng);
    c.forward();
    c.backward();
    auto loss = [&] {
      c.forward();
      return dot(c.o.data, c.d_o.data);
    };
    EXPECT_LT(max_abs_diff(c.dq.data, numeric_gradient(c.q, loss)), 1e-7);
    EXPECT_LT(max_abs_diff(c.dk_cmp.data, numeric_gradient(c.k_cmp, loss)), 1e-7);
    EXPECT_LT(max_abs_diff(c.dv_cmp.data, numeric_gradient(c.v_cmp, loss)), 1e-7);
  }
}

TEST(CompressedAttention, EarlyRowsAreEmptyAndGetNoGradient) {
  std::mt19937_64 rng(13);
  Compressed c({.batch = 1, .len = 8, .q_heads = 2, .kv_heads = 1, .dim = 2, .dim_v = 2, .block = 4, .stride = 2});
  c.randomize(rng);
  c.forward();
  c.backward();
  const HostF64 dk = c.dk_cmp, dv = c.dv_cmp;
  for (std::int64_t t = 0; t < 8; ++t) {
    for (std::int64_t h = 0; h < 2; ++h) {
      const bool empty = t < 3;  // block - 1
      EXPECT_EQ(std::isinf(c.lse.data[h * 8 + t]), empty) << "t=" << t;
      for (std::int64_t i = 0; i < 2; ++i) {
        const std::int64_t at = (t * 2 + h) * 2 + i;
        if (!empty) continue;
        EXPECT_EQ(c.o.data[at], 0.0);
        EXPECT_EQ(c.dq.data[at], 0.0);
        c.d_o.data[at] += 3;  // reaches nothing
      }
    }
  }
  c.backward();
  EXPECT_EQ(c.dk_cmp.data, dk.data);
  EXPECT_EQ(c.dv_cmp.data, dv.data);
}

TEST(CompressedAttention, RowsIgnoreBlocksThatEndLater) {
  std::mt19937_64 rng(14);
  Compressed c({.batch = 1, .len = 12, .q_heads = 1, .kv_heads = 1, .dim = 2, .dim_v = 2, .block = 4, .stride = 2});
  c.randomize(rng);
  c.forward();
  const HostF64 o = c.o;
  for (std::int64_t j = 0; j < c.blocks; ++j) {
    Compressed d = c;
    d.k_cmp.data[j * 2] += 4;
    d.v_cmp.data[j * 2 + 1] -= 4;
    d.forward();
    for (std::int64_t t = 0; t < 12; ++t) {
      const bool sees = j * 2 + 3 <= t;
      EXPECT_EQ(d.o.data[t * 2] == o.data[t * 2] && d.o.data[t * 2 + 1] == o.data[t * 2 + 1], !sees)
          << "block " << j << " row " << t;
    }
  }
}

TEST(CompressedAttention, PackedEqualsBatchedPerSequence) {
  std::mt19937_64 rng(15);
  const std::int64_t q_heads = 3, kv_heads = 1, dim = 3, dim_v = 2, poison = -77;
  const int block = 4, stride = 2;
  // Sequences of 7 and 1 tokens: 2 and 0 compressed blocks. One unused row after each packed tensor.
  const std::int64_t lens[] = {7, 1};
  HostF64 q({9, q_heads, dim}), k_cmp({3, kv_heads, dim}), v_cmp({3, kv_heads, dim_v}), d_o({9, q_heads, dim_v});
  for (HostF64* t : {&q, &k_cmp, &v_cmp, &d_o}) fill_random(*t, rng);
  HostF64 o({9, q_heads, dim_v}, poison), lse({q_heads, 9}, poison), dq({9, q_heads, dim}, poison),
      dk_cmp({3, kv_heads, dim}, poison), dv_cmp({3, kv_heads, dim_v}, poison);
  Host<std::int32_t> cu({3}), cu_cmp({3});
  cu.data = {0, 7, 8};
  cu_cmp.data = {0, 2, 2};
  CompressedAttentionParams p;
  p.q = q.view(), p.k_cmp = k_cmp.view(), p.v_cmp = v_cmp.view(), p.o = o.view(), p.lse = lse.view();
  p.seqs.cu_seqlens = cu.view(), p.cu_seqlens_cmp = cu_cmp.view(), p.block = block, p.stride = stride;
  compressed_attention(p);
  CompressedAttentionBackwardParams b;
  b.q = p.q, b.k_cmp = p.k_cmp, b.v_cmp = p.v_cmp, b.o = p.o, b.lse = p.lse, b.d_o = d_o.view();
  b.dq = dq.view(), b.dk_cmp = dk_cmp.view(), b.dv_cmp = dv_cmp.view();
  b.seqs = p.seqs, b.cu_seqlens_cmp = p.cu_seqlens_cmp, b.block = block, b.stride = stride;
  compressed_attention_backward(b);

  auto rows = [](const HostF64& t, std::int64_t first, std::int64_t count) {
    const std::int64_t row = t.numel() / t.shape[0];
    return std::vector<double>(t.data.begin() + first * row, t.data.begin() + (first + count) * row);
  };
  for (int seq = 0; seq < 2; ++seq) {
    Compressed c({.batch = 1, .len = lens[seq], .q_heads = q_heads, .kv_heads = kv_heads, .dim = dim, .dim_v = dim_v,
                  .block = block, .stride = stride});
    const std::int64_t q0 = cu.data[seq], c0 = cu_cmp.data[seq];
    c.q.data = rows(q, q0, c.n.len);
    c.k_cmp.data = rows(k_cmp, c0, c.blocks);
    c.v_cmp.data = rows(v_cmp, c0, c.blocks);
    c.d_o.data = rows(d_o, q0, c.n.len);
    c.forward();
    c.backward();
    expect_near(rows(o, q0, c.n.len), c.o.data, 1e-12, "o");
    for (std::int64_t h = 0; h < q_heads; ++h) {
      for (std::int64_t t = 0; t < c.n.len; ++t) EXPECT_EQ(lse.data[h * 9 + q0 + t], c.lse.data[h * c.n.len + t]);
    }
    expect_near(rows(dq, q0, c.n.len), c.dq.data, 1e-12, "dq");
    expect_near(rows(dk_cmp, c0, c.blocks), c.dk_cmp.data, 1e-12, "dk_cmp");
    expect_near(rows(dv_cmp, c0, c.blocks), c.dv_cmp.data, 1e-12, "dv_cmp");
  }
  for (double x : {o.data.back(), dq.data.back(), dk_cmp.data.back(), dv_cmp.data.back()}) EXPECT_EQ(x, poison);
  for (std::int64_t h = 0; h < q_heads; ++h) EXPECT_EQ(lse.data[h * 9 + 8], poison);
}

TEST(CompressedAttention, Float32AndBfloat16Inputs) {
  std::mt19937_64 rng(16);
  Compressed c({.batch = 1, .len = 10, .q_heads = 2, .kv_heads = 1, .dim = 8, .dim_v = 4, .block = 4, .stride = 2});
  c.randomize(rng);
  c.forward();
  c.backward();
  {
    Host<float> q = to_float32(c.q), k = to_float32(c.k_cmp), v = to_float32(c.v_cmp), d_o = to_float32(c.d_o);
    Host<float> o({1, 10, 2, 4}), lse({1, 2, 10}), dq({1, 10, 2, 8}), dk({1, 4, 1, 8}), dv({1, 4, 1, 4});
    CompressedAttentionParams p;
    p.q = q.view(), p.k_cmp = k.view(), p.v_cmp = v.view(), p.o = o.view(), p.lse = lse.view(), p.block = 4, p.stride = 2;
    compressed_attention(p);
    expect_near(to_float64(o.data), c.o.data, 1e-5, "o");
    expect_near(to_float64(lse.data), c.lse.data, 1e-5, "lse");
    CompressedAttentionBackwardParams b;
    b.q = p.q, b.k_cmp = p.k_cmp, b.v_cmp = p.v_cmp, b.o = p.o, b.lse = p.lse, b.d_o = d_o.view();
    b.dq = dq.view(), b.dk_cmp = dk.view(), b.dv_cmp = dv.view(), b.block = 4, b.stride = 2;
    compressed_attention_backward(b);
    expect_near(to_float64(dq.data), c.dq.data, 1e-4, "dq");
    expect_near(to_float64(dk.data), c.dk_cmp.data, 1e-4, "dk_cmp");
    expect_near(to_float64(dv.data), c.dv_cmp.data, 1e-4, "dv_cmp");
  }
  {
    Compressed r = c;
    r.q = rounded_to_bfloat16(c.q), r.k_cmp = rounded_to_bfloat16(c.k_cmp), r.v_cmp = rounded_to_bfloat16(c.v_cmp);
    r.forward();
    Host<std::uint16_t> q = to_bfloat16(c.q), k = to_bfloat16(c.k_cmp), v = to_bfloat16(c.v_cmp), o({1, 10, 2, 4});
    Host<float> lse({1, 2, 10});
    CompressedAttentionParams p;
    p.q = bfloat16_view(q), p.k_cmp = bfloat16_view(k), p.v_cmp = bfloat16_view(v), p.o = bfloat16_view(o);
    p.lse = lse.view(), p.block = 4, p.stride = 2;
    compressed_attention(p);
    const std::vector<double> got = from_bfloat16(o.data);
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], r.o.data[i], std::abs(r.o.data[i]) / 256 + 1e-12);
    expect_near(to_float64(lse.data), r.lse.data, 1e-5, "lse");
  }
}

TEST(CompressedAttention, ValidationNamesTheArgumentAndWritesNothing) {
  const double poison = -55;
  Compressed c({.batch = 2, .len = 9, .q_heads = 3, .kv_heads = 1, .dim = 2, .dim_v = 2, .block = 4, .stride = 2});
  ASSERT_EQ(c.blocks, 3);
  c.o.data.assign(c.o.data.size(), poison);
  c.lse.data.assign(c.lse.data.size(), poison);
  HostF64 k_too_long({2, 4, 1, 2}), k_two_heads({2, 3, 2, 2}), v_short({2, 2, 1, 2}), q_wide({2, 9, 3, 4});
  Host<std::int32_t> cu({3});
  cu.data = {0, 4, 9};

  using Edit = std::function<void(CompressedAttentionParams&)>;
  struct Case { const char* what; Edit edit; ErrorKind kind; const char* arg; };
  const std::vector<Case> cases = {
      {"Tc != num_compressed_blocks", [&](auto& p) { p.k_cmp = k_too_long.view(); }, ErrorKind::shape, "k_cmp"},
      {"Hq % Hkv", [&](auto& p) { p.k_cmp = k_two_heads.view(); }, ErrorKind::shape, "k_cmp"},
      {"v_cmp rows", [&](auto& p) { p.v_cmp = v_short.view(); }, ErrorKind::shape, "v_cmp"},
      {"v_cmp dtype", [](auto& p) { p.v_cmp.dtype = DType::float32; }, ErrorKind::dtype, "v_cmp"},
      {"lse dtype", [](auto& p) { p.lse.dtype = DType::float32; }, ErrorKind::dtype, "lse"},
      {"stride does not divide block", [](auto& p) { p.stride = 3; }, ErrorKind::config, "stride"},
      {"block 0", [](auto& p) { p.block = 0; }, ErrorKind::config, "block"},
      {"cu_seqlens_cmp when batched", [&](auto& p) { p.cu_seqlens_cmp = cu.view(); }, ErrorKind::config, "cu_seqlens_cmp"},
      {"k_cmp on cuda", [](auto& p) { p.k_cmp = on_cuda(p.k_cmp); }, ErrorKind::device, "k_cmp"},
      {"q inner stride", [&](auto& p) { p.q = inner_stride_two(q_wide); }, ErrorKind::layout, "q"},
      {"cuda anchor", [](auto& p) { p.q = on_cuda(p.q), p.k_cmp = on_cuda(p.k_cmp), p.v_cmp = on_cuda(p.v_cmp), p.o = on_cuda(p.o), p.lse = on_cuda(p.lse); },
       ErrorKind::unsupported, "q"},
  };
  for (const Case& e : cases) {
    CompressedAttentionParams p = c.forward_params();
    e.edit(p);
    SCOPED_TRACE(e.what);
    expect_error([&] { compressed_attention(p); }, e.kind, e.arg);
  }
  for (double x : c.o.data) EXPECT_EQ(x, poison);
  for (double x : c.lse.data) EXPECT_EQ(x, poison);

  // Packed: 4 + 5 tokens have 1 + 1 compressed blocks.
  HostF64 q({9, 3, 2}), k_cmp({2, 1, 2}), v_cmp({2, 1, 2}), o({9, 3, 2}, poison), lse({3, 9}, poison);
  Host<std::int32_t> cu_cmp_ok({3}), cu_cmp_bad({3}), cu_cmp_long({4});
  cu_cmp_ok.data = {0, 1, 2};
  cu_cmp_bad.data = {0, 2, 2};
  cu_cmp_long.data = {0, 1, 2, 2};
  const std::vector<Case> packed_cases = {
      {"cu_seqlens_cmp missing", [](auto& p) { p.cu_seqlens_cmp = TensorView{}; }, ErrorKind::shape, "cu_seqlens_cmp"},
      {"cu_seqlens_cmp wrong counts", [&](auto& p) { p.cu_seqlens_cmp = cu_cmp_bad.view(); }, ErrorKind::value, "cu_seqlens_cmp"},
      {"cu_seqlens_cmp batch", [&](auto& p) { p.cu_seqlens_cmp = cu_cmp_long.view(); }, ErrorKind::shape, "cu_seqlens_cmp"},
      {"cu_seqlens_cmp dtype", [&](auto& p) { p.cu_seqlens_cmp = k_cmp.view(); }, ErrorKind::dtype, "cu_seqlens_cmp"},
  };
  for (const Case& e : packed_cases) {
    CompressedAttentionParams p;
    p.q = q.view(), p.k_cmp = k_cmp.view(), p.v_cmp = v_cmp.view(), p.o = o.view(), p.lse = lse.view();
    p.seqs.cu_seqlens = cu.view(), p.cu_seqlens_cmp = cu_cmp_ok.view(), p.block = 4, p.stride = 2;
    compressed_attention(p);  // valid as given
    o.data.assign(o.data.size(), poison);
    lse.data.assign(lse.data.size(), poison);
    e.edit(p);
    SCOPED_TRACE(e.what);
    expect_error([&] { compressed_attention(p); }, e.kind, e.arg);
    for (double x : o.data) EXPECT_EQ(x, poison);
    for (double x : lse.data) EXPECT_EQ(x, poison);
  }

  // Backward outputs.
  for (HostF64* t : {&c.dq, &c.dk_cmp, &c.dv_cmp}) t->data.assign(t->data.size(), poison);
  HostF64 dk_bad({2, 2, 1, 2});
  const std::vector<std::pair<std::function<void(CompressedAttentionBackwardParams&)>, const char*>> backward_cases = {
      {[&](auto& p) { p.dk_cmp = dk_bad.view(); }, "dk_cmp"},
      {[](auto& p) { p.d_o.shape[3] = 1; }, "d_o"},
      {[](auto& p) { p.dq.shape[2] = 1; }, "dq"},
  };
  for (const auto& [edit, arg] : backward_cases) {
    CompressedAttentionBackwardParams p = c.backward_params();
    edit(p);
    expect_error([&] { compressed_attention_backward(p); }, ErrorKind::shape, arg);
  }
  for (const HostF64* t : {&c.dq, &c.dk_cmp, &c.dv_cmp}) {
    for (double x : t->data) EXPECT_EQ(x, poison);
  }
}

}  // namespace
}  // namespace sparseattn::test
