// flash_attention's packed (varlen) mask and bias on the CPU reference: the row form [Hm|1, Nq|1, Lk] and the
// key form [Hm|1, Nk] (docs/semantics.md section 8, "Mask and bias, batched and packed"): the spec's worked
// example checked by hand, dbias in the bias's own shape, validation.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "sparseattn/flash_attention.h"
#include "sparseattn/version.h"

namespace sparseattn::test {
namespace {

constexpr double kPoison = -77;

// The worked example: Hq = 2, Hkv = 1, D = 2, Dv = 1, cu_seqlens_q = [0, 2, 3], cu_seqlens_k = [0, 3, 5],
// scale 1/sqrt(2), dO = 1.
struct Example {
  HostF64 q{{3, 2, 2}}, k{{5, 1, 2}}, v{{5, 1, 1}}, o{{3, 2, 1}, kPoison}, lse{{2, 3}, kPoison};
  HostF64 d_o{{3, 2, 1}, 1.0}, dq{{3, 2, 2}}, dk{{5, 1, 2}}, dv{{5, 1, 1}};
  Host<std::int32_t> cu_q{{3}}, cu_k{{3}};
  HostF64 row_bias{{1, 3, 3}}, key_bias{{1, 5}}, dbias;
  Host<std::uint8_t> mask{{1, 3, 3}, 1};

  Example() {
    q.data = {0.13, -0.13, 0.64, 0.1, -0.54, 0.36, 1.3, 0.95, -0.7, -1.27, -0.62, 0.04};
    k.data = {-2.33, -0.22, -1.25, -0.73, -0.54, -0.32, 0.41, 1.04, -0.13, 1.37};
    v.data = {-0.67, 0.35, 0.9, 0.09, -0.74};
    cu_q.data = {0, 2, 3};
    cu_k.data = {0, 3, 5};
    row_bias.data = {0.3, -0.2, 0, 0.3, -0.2, 0, 1, -1, 12345};  // 12345: column 2 of sequence 1, ignored
    key_bias.data = {0.3, -0.2, 0, 1, -1};
    mask.data[1 * 3 + 0] = 0;  // query 1 does not see key 0
  }
  FlashAttentionParams forward_params(HostF64& bias) {
    FlashAttentionParams p;
    p.q = q.view(), p.k = k.view(), p.v = v.view(), p.o = o.view(), p.lse = lse.view();
    p.mask = mask.view(), p.bias = bias.view();
    p.seqs_q.cu_seqlens = cu_q.view(), p.seqs_k.cu_seqlens = cu_k.view();
    p.scale = 1 / std::sqrt(2.0);
    return p;
  }
  void run(HostF64& bias) {
    const FlashAttentionParams f = forward_params(bias);
    flash_attention(f);
    dbias = bias;
    dbias.data.assign(dbias.data.size(), kPoison);
    FlashAttentionBackwardParams p;
    p.q = f.q, p.k = f.k, p.v = f.v, p.mask = f.mask, p.bias = f.bias, p.o = f.o, p.lse = f.lse;
    p.seqs_q = f.seqs_q, p.seqs_k = f.seqs_k, p.scale = f.scale;
    p.d_o = d_o.view(), p.dq = dq.view(), p.dk = dk.view(), p.dv = dv.view(), p.dbias = dbias.view();
    flash_attention_backward(p);
  }
  void expect_forward() const {
    // o [Nq, Hq, Dv] and lse [Hq, Nq] from the spec.
    const std::vector<double> o_expected = {0.142813, 0.319372, 0.629573, 0.765516, -0.006434, -0.032469};
    const std::vector<double> lse_expected = {1.055135, 0.801387, -0.013379, 0.513007, -0.430953, 1.009313};
    for (std::size_t i = 0; i < o_expected.size(); ++i) EXPECT_NEAR(o.data[i], o_expected[i], 1e-6) << i;
    for (std::size_t i = 0; i < lse_expected.size(); ++i) EXPECT_NEAR(lse.data[i], lse_expected[i], 1e-6) << i;
  }
};

TEST(FlashPackedMask, RowFormWorkedExample) {
  Example e;
  e.run(e.row_bias);
  e.expect_forward();
  const std::vector<double> expected = {-0.588891, 0.064397, 0.524494, 0, -0.239062, 0.239062, 0.189628, -0.189628};
  for (std::size_t i = 0; i < expected.size(); ++i) EXPECT_NEAR(e.dbias.data[i], expected[i], 1e-6) << i;
  EXPECT_EQ(e.dbias.data[1 * 3 + 0], 0.0);   // masked key: exactly 0
  EXPECT_EQ(e.dbias.data[8], kPoison);        // ignored column: left untouched by the C++ API
}

TEST(FlashPackedMask, KeyFormWorkedExampleSumsEachSequencesRows) {
  Example e;
  e.run(e.key_bias);
  e.expect_forward();
  const std::vector<double> expected = {-0.588891, -0.174665, 0.763556, 0.189628, -0.189628};
  for (std::size_t i = 0; i < expected.size(); ++i) EXPECT_NEAR(e.dbias.data[i], expected[i], 1e-6) << i;
  // The key form's dbias is the row form's summed over each sequence's rows, bit for bit up to the order.
  Example row;
  row.run(row.row_bias);
  EXPECT_NEAR(e.dbias.data[1], row.dbias.data[1] + row.dbias.data[4], 1e-15);
}

TEST(FlashPackedMask, SharedRowAndKeyFormMask) {
  // A row-form mask [1, 1, Lk] shared by every query row and a key-form mask [Hq, Nk] per query head.
  Example e;
  Host<std::uint8_t> shared({1, 1, 4}, 1), keys({2, 5}, 1);
  shared.data[1] = 0;          // key 1 of every sequence
  keys.data[1] = keys.data[4] = 0;  // head 0: packed keys 1 (sequence 0) and 4 (sequence 1, its key 1)
  keys.data[5 + 1] = keys.data[5 + 4] = 0;
  FlashAttentionParams p = e.forward_params(e.key_bias);
  p.mask = shared.view();
  flash_attention(p);
  const std::vector<double> o_shared = e.o.data, lse_shared = e.lse.data;
  p.mask = keys.view();
  flash_attention(p);
  for (std::size_t i = 0; i < o_shared.size(); ++i) EXPECT_DOUBLE_EQ(e.o.data[i], o_shared[i]);
  for (std::size_t i = 0; i < lse_shared.size(); ++i) EXPECT_DOUBLE_EQ(e.lse.data[i], lse_shared[i]);
  // Sequence 1 (query 2) then sees key 3 only: o = v[3], lse = its logit.
  EXPECT_NEAR(e.o.data[2 * 2 + 0], 0.09, 1e-12);
  const double logit = (-0.7 * 0.41 - 1.27 * 1.04) / std::sqrt(2.0) + 1.0;
  EXPECT_NEAR(e.lse.data[0 * 3 + 2], logit, 1e-12);
}

TEST(FlashPackedMask, Validation) {
  Example e;
  Host<std::uint8_t> rank4({1, 1, 3, 3}, 1), middle({1, 2, 3}, 1), heads({3, 3, 3}, 1);
  HostF64 narrow({1, 3, 2}), key_short({1, 4}), mask_f64({1, 3, 3});
  Host<float> bias_f32({1, 5});
  struct Case {
    const char* name;
    std::function<void(FlashAttentionParams&)> edit;
    ErrorKind kind;
    const char* argument;
  };
  const std::vector<Case> cases = {
      {"batched rank when packed", [&](auto& p) { p.mask = rank4.view(); }, ErrorKind::shape, "mask"},
      {"row form middle dimension", [&](auto& p) { p.mask = middle.view(); }, ErrorKind::shape, "mask"},
      {"head count", [&](auto& p) { p.mask = heads.view(); }, ErrorKind::shape, "mask"},
      {"Lk below the longest sequence", [&](auto& p) { p.bias = narrow.view(); }, ErrorKind::shape, "bias"},
      {"key form length", [&](auto& p) { p.bias = key_short.view(); }, ErrorKind::shape, "bias"},
      {"mask dtype", [&](auto& p) { p.mask = mask_f64.view(); }, ErrorKind::dtype, "mask"},
      {"bias dtype", [&](auto& p) { p.bias = bias_f32.view(); }, ErrorKind::dtype, "bias"},
  };
  for (const Case& test : cases) {
    SCOPED_TRACE(test.name);
    FlashAttentionParams p = e.forward_params(e.key_bias);
    flash_attention(p);  // valid as given
    e.o.data.assign(e.o.data.size(), kPoison);
    test.edit(p);
    expect_error([&] { flash_attention(p); }, test.kind, test.argument);
    for (double x : e.o.data) EXPECT_EQ(x, kPoison);
  }
  // dbias must have the bias's own shape.
  const FlashAttentionParams f = e.forward_params(e.key_bias);
  flash_attention(f);
  HostF64 dbias_wrong({1, 3, 3});
  FlashAttentionBackwardParams p;
  p.q = f.q, p.k = f.k, p.v = f.v, p.mask = f.mask, p.bias = f.bias, p.o = f.o, p.lse = f.lse;
  p.seqs_q = f.seqs_q, p.seqs_k = f.seqs_k;
  p.d_o = e.d_o.view(), p.dq = e.dq.view(), p.dk = e.dk.view(), p.dv = e.dv.view(), p.dbias = dbias_wrong.view();
  expect_error([&] { flash_attention_backward(p); }, ErrorKind::shape, "dbias");
}

TEST(FlashPackedMask, CudaRowFormChecksMaxSeqlenBeforeAnyLaunch) {
  // CUDA runs the packed forms (tests/python/test_cuda_flash_masks.py); cu_seqlens is not read on the host there,
  // so a row form is checked against max_seqlen_k, which it needs. These errors come before any launch.
  Example e;
  for (bool row_form : {true, false}) {
    SCOPED_TRACE(row_form ? "row form" : "key form");
    FlashAttentionParams p = e.forward_params(row_form ? e.row_bias : e.key_bias);
    for (TensorView* t : {&p.q, &p.k, &p.v, &p.o, &p.lse, &p.mask, &p.bias, &p.seqs_q.cu_seqlens,
                          &p.seqs_k.cu_seqlens}) {
      *t = on_cuda(*t);
    }
    p.q.dtype = p.k.dtype = p.v.dtype = p.o.dtype = p.bias.dtype = DType::float16;
    p.lse.dtype = DType::float32;
    p.seqs_q.max_seqlen = 2, p.seqs_k.max_seqlen = 3;
    if (!built_with_cuda()) {
      try {
        flash_attention(p);
        ADD_FAILURE() << "expected an error";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::unsupported) << e.what();  // no CUDA backend in this build
      }
    }
    if (!row_form) continue;
    p.seqs_k.max_seqlen = 4;  // above Lk = 3 (of the row-form mask, checked first)
    expect_error([&] { flash_attention(p); }, ErrorKind::shape, "mask");
    p.seqs_k.max_seqlen = 0;  // a row form on CUDA needs max_seqlen_k
    expect_error([&] { flash_attention(p); }, ErrorKind::config, "max_seqlen_k");
  }
}

}  // namespace
}  // namespace sparseattn::test
