// flash_attention's gated attention (alpha, delta), gate threshold and sparse-softmax threshold on the CPU
// reference: hand-computed cases (docs/semantics.md section 8), finite-difference gradients, validation.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>

#include "attention_testing.h"
#include "flash_case.h"
#include "sparseattn/flash_attention.h"
#include "sparseattn/version.h"

namespace sparseattn::test {
namespace {

double logsigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }

// flash_case.h's call with alpha and delta, d_o of ones, and the naive gated attention.
struct Gated : FlashCase {
  explicit Gated(const FlashSizes& sizes) : FlashCase(sizes) {
    add_gates();
    d_o = HostF64({n.batch, n.q_len, n.q_heads, n.dim_v}, 1.0);
  }

  void randomize(std::mt19937_64& rng) {
    for (HostF64* t : {&q, &k, &v, &d_o, &delta}) fill_random(*t, rng);
    fill_random(alpha, rng, 2.0);
  }
  double g(double x) const { return gates.gate == GateMode::product ? x : logsigmoid(x); }
  // Naive gated attention; keep(b, h, t, s) adds key rules (causal, skipped tiles) on top.
  NaiveAttention naive(const std::function<bool(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>& keep) {
    const double sc = scale ? *scale : 1.0 / std::sqrt(double(n.dim));
    const std::int64_t group = n.q_heads / n.kv_heads;
    return naive_attention(q, k, v, sc, keep, [&](auto b, auto h, auto t, auto s) {
      const double a = alpha.data[(b * n.q_len + t) * n.q_heads + h];
      const double d = delta.data[(b * n.k_len + s) * n.kv_heads + h / group];
      return sc * g(a * d);
    });
  }
};

TEST(FlashGated, HandComputedOneQueryTwoKeys) {
  // docs/semantics.md: q = 1, k = (1, -1), v = (1, 3), alpha = 2, delta = (0.5, -1), scale = 1, d_o = 1.
  for (GateMode mode : {GateMode::logsigmoid, GateMode::product}) {
    Gated f({.k_len = 2});
    f.q.data = {1};
    f.k.data = {1, -1};
    f.v.data = {1, 3};
    f.alpha.data = {2};
    f.delta.data = {0.5, -1};
    f.scale = 1.0;
    f.gates.gate = mode;
    f.forward();
    f.backward();
    const bool ls = mode == GateMode::logsigmoid;
    const double g0 = ls ? logsigmoid(1.0) : 1.0, g1 = ls ? logsigmoid(-2.0) : -2.0;
    const double s0 = 1 + g0, s1 = -1 + g1;
    const double lse = std::log(std::exp(s0) + std::exp(s1));
    const double p0 = std::exp(s0 - lse), p1 = std::exp(s1 - lse);
    const double o = p0 * 1 + p1 * 3;
    EXPECT_NEAR(f.o.data[0], o, 1e-12);
    EXPECT_NEAR(f.lse.data[0], lse, 1e-12);
    // ds = p (v - o); dg/dx = sigmoid(-x) or 1.
    const double ds0 = p0 * (1 - o), ds1 = p1 * (3 - o);
    const double gp0 = ls ? 1 / (1 + std::exp(1.0)) : 1.0, gp1 = ls ? 1 / (1 + std::exp(-2.0)) : 1.0;
    EXPECT_NEAR(f.dalpha.data[0], ds0 * gp0 * 0.5 + ds1 * gp1 * -1, 1e-12);
    EXPECT_NEAR(f.ddelta.data[0], ds0 * gp0 * 2, 1e-12);
    EXPECT_NEAR(f.ddelta.data[1], ds1 * gp1 * 2, 1e-12);
    // The section's rounded numbers.
    EXPECT_NEAR(f.o.data[0], ls ? 1.0432 : 1.0134, 5e-5);
    EXPECT_NEAR(f.lse.data[0], ls ? 0.7086 : 2.0067, 5e-5);
    EXPECT_NEAR(f.dalpha.data[0], ls ? -0.0429 : -0.0199, 5e-5);
  }
}

// The section's sparse-softmax example: logits (2, 0, 0.5, 1), v = (1, 2, 3, 4), block_k = 2.
Gated threshold_example(double tau) {
  Gated f({.k_len = 4});
  f.q.data = {1};
  f.k.data = {2, 0, 0.5, 1};
  f.v.data = {1, 2, 3, 4};
  f.scale = 1.0;
  f.gates.gate = GateMode::product;  // with alpha = 0 the gate adds nothing
  f.gates.softmax_threshold = tau;
  f.gates.threshold_block_k = 2;
  return f;
}

TEST(FlashGated, SoftmaxThresholdSkipsATile) {
  Gated f = threshold_example(0.5);  // bar 2 + log 0.5 = 1.307 > 1: key tile 1 skipped
  f.forward();
  const double lse = std::log(std::exp(2.0) + 1.0);
  EXPECT_NEAR(f.lse.data[0], lse, 1e-12);
  EXPECT_NEAR(f.o.data[0], (std::exp(2.0) * 1 + 2) / std::exp(lse), 1e-12);
  EXPECT_NEAR(f.o.data[0], 1.1192, 5e-5);
  // Gradient of what was computed: the skipped keys 2 and 3 get none.
  f.backward();
  EXPECT_EQ(f.dk.data[2], 0.0);
  EXPECT_EQ(f.dk.data[3], 0.0);
  EXPECT_EQ(f.dv.data[2], 0.0);
  EXPECT_NE(f.dv.data[1], 0.0);
}

TEST(FlashGated, SoftmaxThresholdKeepsATile) {
  Gated f = threshold_example(0.1);  // bar 2 + log 0.1 = -0.303 < 1: nothing skipped
  f.forward();
  double sum = 0, weighted = 0;
  for (int s = 0; s < 4; ++s) sum += std::exp(f.k.data[s]), weighted += std::exp(f.k.data[s]) * f.v.data[s];
  EXPECT_NEAR(f.lse.data[0], std::log(sum), 1e-12);
  EXPECT_NEAR(f.o.data[0], weighted / sum, 1e-12);
  EXPECT_NEAR(f.o.data[0], 1.9762, 5e-5);
  // With one key per tile and tau = 0.5, key 1 (0 < 2 - 0.69) and key 2 (0.5 < 1.307) are skipped, key 3 too.
  Gated g = threshold_example(0.5);
  g.gates.threshold_block_k = 1;
  g.forward();
  EXPECT_NEAR(g.o.data[0], 1.0, 1e-12);
  EXPECT_NEAR(g.lse.data[0], 2.0, 1e-12);
}

TEST(FlashGated, GateThresholdSkipsOnlyTheLowTile) {
  // alpha = 1, delta = (2, 1, -3, -2), block_k = 2: bounds logsigmoid(2) = -0.127 and logsigmoid(-2) = -2.127.
  for (double threshold : {-1.0, -3.0}) {
    Gated f({.k_len = 4, .dim = 2, .dim_v = 2});
    std::mt19937_64 rng(7);
    f.randomize(rng);
    f.alpha.data = {1};
    f.delta.data = {2, 1, -3, -2};
    f.gates.gate_threshold = threshold;
    f.gates.threshold_block_k = 2;
    f.forward();
    const bool skip = threshold == -1.0;
    const NaiveAttention want = f.naive([&](auto, auto, auto, auto s) { return !skip || s < 2; });
    expect_near(f.o.data, want.o, 1e-12, "o");
    expect_near(f.lse.data, want.lse, 1e-12, "lse");
  }
}

TEST(FlashGated, EveryKeySkippedGivesZeroAndMinusInf) {
  Gated f({.batch = 2, .q_len = 3, .k_len = 5, .q_heads = 2, .kv_heads = 1, .dim = 2, .dim_v = 2});
  std::mt19937_64 rng(8);
  f.randomize(rng);
  f.gates.gate_threshold = 0.0;  // logsigmoid < 0 everywhere: every tile skipped
  f.forward();
  for (double x : f.o.data) EXPECT_EQ(x, 0.0);
  for (double x : f.lse.data) EXPECT_EQ(x, -kInf);
  f.backward();
  for (double x : f.dalpha.data) EXPECT_EQ(x, 0.0);
  for (double x : f.ddelta.data) EXPECT_EQ(x, 0.0);
  for (double x : f.dq.data) EXPECT_EQ(x, 0.0);
}

TEST(FlashGated, GatesMatchNaiveWithGroupsAndCausal) {
  std::mt19937_64 rng(9);
  for (auto [q_heads, kv_heads] : {std::pair{2, 2}, std::pair{4, 2}, std::pair{4, 1}}) {
    for (GateMode mode : {GateMode::logsigmoid, GateMode::product}) {
      Gated f({.batch = 2, .q_len = 3, .k_len = 6, .q_heads = q_heads, .kv_heads = kv_heads, .dim = 3, .dim_v = 2});
      f.randomize(rng);
      f.causal = true;
      f.gates.gate = mode;
      f.forward();
      const NaiveAttention want = f.naive([&](auto, auto, auto t, auto s) { return s <= t + 3; });
      expect_near(f.o.data, want.o, 1e-12, "o");
      expect_near(f.lse.data, want.lse, 1e-12, "lse");
    }
  }
}

// dq, dk, dv, dalpha, ddelta against central differences of loss = sum(o * d_o).
void check_gradients(Gated& f) {
  f.forward();
  f.backward();
  auto loss = [&] {
    f.forward();
    return dot(f.o.data, f.d_o.data);
  };
  EXPECT_LT(max_abs_diff(f.dq.data, numeric_gradient(f.q, loss)), 1e-7);
  EXPECT_LT(max_abs_diff(f.dk.data, numeric_gradient(f.k, loss)), 1e-7);
  EXPECT_LT(max_abs_diff(f.dv.data, numeric_gradient(f.v, loss)), 1e-7);
  EXPECT_LT(max_abs_diff(f.dalpha.data, numeric_gradient(f.alpha, loss)), 1e-7);
  EXPECT_LT(max_abs_diff(f.ddelta.data, numeric_gradient(f.delta, loss)), 1e-7);
}

TEST(FlashGated, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(10);
  for (GateMode mode : {GateMode::logsigmoid, GateMode::product}) {
    Gated f({.batch = 2, .q_len = 3, .k_len = 5, .q_heads = 4, .kv_heads = 2, .dim = 3, .dim_v = 2});
    f.randomize(rng);
    f.causal = true;
    f.scale = 0.8;
    f.gates.gate = mode;
    SCOPED_TRACE(mode == GateMode::product ? "product" : "logsigmoid");
    check_gradients(f);
  }
  {  // With both thresholds on small tiles (the choice of tiles is piecewise constant: no gradient).
    Gated f({.batch = 1, .q_len = 4, .k_len = 6, .q_heads = 2, .kv_heads = 1, .dim = 2, .dim_v = 2});
    f.randomize(rng);
    f.gates.gate_threshold = -2.5;
    f.gates.softmax_threshold = 0.3;
    f.gates.threshold_block_q = 2;
    f.gates.threshold_block_k = 2;
    check_gradients(f);
  }
}

TEST(FlashGated, InvalidArgumentsNameTheArgument) {
  Gated f({.batch = 1, .q_len = 2, .k_len = 3, .q_heads = 2, .kv_heads = 1, .dim = 2, .dim_v = 2});
  HostF64 alpha_bad({1, 2, 1}), delta_bad({1, 3, 2});
  struct Case {
    const char* what;
    std::function<void(FlashAttentionParams&)> edit;
    ErrorKind kind;
    const char* arg;
  };
  const std::vector<Case> cases = {
      {"alpha alone", [](auto& p) { p.gates.delta = TensorView{}; }, ErrorKind::config, "delta"},
      {"delta alone", [](auto& p) { p.gates.alpha = TensorView{}; }, ErrorKind::config, "alpha"},
      {"alpha shape", [&](auto& p) { p.gates.alpha = alpha_bad.view(); }, ErrorKind::shape, "alpha"},
      {"delta shape", [&](auto& p) { p.gates.delta = delta_bad.view(); }, ErrorKind::shape, "delta"},
      {"alpha dtype", [](auto& p) { p.gates.alpha.dtype = DType::float16; }, ErrorKind::dtype, "alpha"},
      {"tau 0", [](auto& p) { p.gates.softmax_threshold = 0.0; }, ErrorKind::config, "softmax_threshold"},
      {"tau 1.5", [](auto& p) { p.gates.softmax_threshold = 1.5; }, ErrorKind::config, "softmax_threshold"},
      {"block_q 0", [](auto& p) { p.gates.threshold_block_q = 0; }, ErrorKind::config, "threshold_block_q"},
      {"block_k -1", [](auto& p) { p.gates.threshold_block_k = -1; }, ErrorKind::config, "threshold_block_k"},
      {"threshold tiles on the cpu", [](auto& p) { p.gates.softmax_threshold = 0.5, p.threshold_tiles = p.lse; },
       ErrorKind::config, "threshold_tiles"},
      {"gate threshold without gates", [](auto& p) { p.gates.alpha = p.gates.delta = TensorView{}, p.gates.gate_threshold = -1.0; },
       ErrorKind::config, "gate_threshold"},
      {"gate threshold nan", [](auto& p) { p.gates.gate_threshold = std::nan(""); }, ErrorKind::config, "gate_threshold"},
  };
  for (const Case& c : cases) {
    FlashAttentionParams p = f.forward_params();
    c.edit(p);
    SCOPED_TRACE(c.what);
    expect_error([&] { flash_attention(p); }, c.kind, c.arg);
  }
  HostF64 dalpha_bad({1, 2, 1});
  FlashAttentionBackwardParams b = f.backward_params();
  b.dalpha = dalpha_bad.view();
  expect_error([&] { flash_attention_backward(b); }, ErrorKind::shape, "dalpha");
  b = f.backward_params();
  b.gates.alpha = b.gates.delta = TensorView{};
  expect_error([&] { flash_attention_backward(b); }, ErrorKind::config, "dalpha");
}

TEST(FlashGated, CudaTensorsTakeGatesAndTheForwardSoftmaxThreshold) {
  if (!built_with_cuda()) GTEST_SKIP() << "CUDA backend not built";
  Gated f({.batch = 1, .q_len = 2, .k_len = 3, .q_heads = 2, .kv_heads = 1, .dim = 2, .dim_v = 2});
  FlashAttentionParams p = f.forward_params();
  p.q = on_cuda(p.q), p.k = on_cuda(p.k), p.v = on_cuda(p.v), p.o = on_cuda(p.o), p.lse = on_cuda(p.lse);
  p.gates.alpha = on_cuda(p.gates.alpha), p.gates.delta = on_cuda(p.gates.delta);
  p.q.dtype = p.k.dtype = p.v.dtype = p.o.dtype = DType::float32;  // never launched: validation fails first
  p.gates.alpha.dtype = p.gates.delta.dtype = DType::float32;
  p.lse.dtype = DType::float32;
  // The gate passes the CUDA checks; the float32 q is what the kernels refuse.
  expect_error([&] { flash_attention(p); }, ErrorKind::unsupported, "q");
  p.gates.gate_threshold = -1.0;
  expect_error([&] { flash_attention(p); }, ErrorKind::unsupported, "gate_threshold");
  p.gates.gate_threshold.reset();
  p.gates.alpha = p.gates.delta = TensorView{};
  // The forward takes softmax_threshold on CUDA (in the kernel's tiles); the float32 q is what the kernels refuse.
  p.gates.softmax_threshold = 0.5;
  expect_error([&] { flash_attention(p); }, ErrorKind::unsupported, "q");
  // Tiles of float32 (no CUDA kernels) are none.
  EXPECT_EQ(flash_attention_threshold_tiles(p).block_q, 0);
  p.gates.softmax_threshold.reset();
  p.threshold_tiles = p.lse;
  expect_error([&] { flash_attention(p); }, ErrorKind::config, "threshold_tiles");
}

}  // namespace
}  // namespace sparseattn::test
