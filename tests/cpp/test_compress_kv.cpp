#include <gtest/gtest.h>

#include "api/compress_kv_backward.h"
#include "sparseattn/compress_kv.h"
#include "sparseattn/error.h"
#include "test_util.h"

namespace sparseattn::test {
namespace {

TEST(CompressKv, HandComputedMeansAndBackward) {
  // 7 tokens, block 4, stride 2: blocks cover [0, 4) and [2, 6); token 6 is covered by no block.
  HostF64 k({1, 7, 1, 1}), v({1, 7, 1, 2});
  k.data = {1, 2, 3, 4, 5, 6, 7};
  v.data = {1, -1, 2, -2, 3, -3, 4, -4, 5, -5, 6, -6, 7, -7};
  HostF64 k_cmp({1, 2, 1, 1}, -99), v_cmp({1, 2, 1, 2}, -99);
  CompressKvParams params;
  params.k = k.view();
  params.v = v.view();
  params.k_cmp = k_cmp.view();
  params.v_cmp = v_cmp.view();
  params.block = 4;
  params.stride = 2;
  compress_kv(params);
  EXPECT_EQ(k_cmp.data, (std::vector<double>{2.5, 4.5}));
  EXPECT_EQ(v_cmp.data, (std::vector<double>{2.5, -2.5, 4.5, -4.5}));

  HostF64 dk_cmp({1, 2, 1, 1}), dv_cmp({1, 2, 1, 2}), dk({1, 7, 1, 1}, -99), dv({1, 7, 1, 2}, -99);
  dk_cmp.data = {4, 8};
  dv_cmp.data = {4, 0, 0, 8};
  CompressKvBackwardParams back;
  back.dk_cmp = dk_cmp.view();
  back.dv_cmp = dv_cmp.view();
  back.dk = dk.view();
  back.dv = dv.view();
  back.block = 4;
  back.stride = 2;
  compress_kv_backward(back);
  EXPECT_EQ(dk.data, (std::vector<double>{1, 1, 3, 3, 2, 2, 0}));
  EXPECT_EQ(dv.data, (std::vector<double>{1, 0, 1, 0, 1, 2, 1, 2, 0, 2, 0, 2, 0, 0}));
}

TEST(CompressKv, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(3);
  const std::int64_t batch = 2, tokens = 14, heads = 2, dim_k = 3, dim_v = 2, block = 6, stride = 3;
  const std::int64_t blocks = num_compressed_blocks(tokens, block, stride);  // 3; tokens 12, 13 uncovered
  HostF64 k({batch, tokens, heads, dim_k}), v({batch, tokens, heads, dim_v});
  HostF64 wk({batch, blocks, heads, dim_k}), wv({batch, blocks, heads, dim_v});
  for (HostF64* t : {&k, &v, &wk, &wv}) fill_random(*t, rng);
  auto loss = [&] {
    HostF64 k_cmp({batch, blocks, heads, dim_k}), v_cmp({batch, blocks, heads, dim_v});
    CompressKvParams params;
    params.k = k.view();
    params.v = v.view();
    params.k_cmp = k_cmp.view();
    params.v_cmp = v_cmp.view();
    params.block = block;
    params.stride = stride;
    compress_kv(params);
    return dot(k_cmp.data, wk.data) + dot(v_cmp.data, wv.data);
  };
  HostF64 dk({batch, tokens, heads, dim_k}), dv({batch, tokens, heads, dim_v});
  CompressKvBackwardParams back;
  back.dk_cmp = wk.view();
  back.dv_cmp = wv.view();
  back.dk = dk.view();
  back.dv = dv.view();
  back.block = block;
  back.stride = stride;
  compress_kv_backward(back);
  EXPECT_LT(max_abs_diff(dk.data, numeric_gradient(k, loss)), 1e-8);
  EXPECT_LT(max_abs_diff(dv.data, numeric_gradient(v, loss)), 1e-8);
}

// Packed sequences of 3, 9 and 6 tokens (block 4, stride 2: 0, 3 and 2 compressed blocks) plus two rows
// past cu_seqlens[B]. Each sequence must match a batched run of its own, rows past cu_seqlens_cmp[B] of
// the output are zeroed, and rows past cu_seqlens[B] of the gradients stay untouched.
TEST(CompressKv, PackedMatchesBatchedPerSequence) {
  std::mt19937_64 rng(5);
  const std::vector<std::int64_t> lengths = {3, 9, 6};
  const std::int64_t rows = 20, cmp_rows = 7, heads = 2, dim = 3, block = 4, stride = 2;
  Host<std::int32_t> cu({4}), cu_cmp({4});
  cu.data = {0, 3, 12, 18};
  cu_cmp.data = {0, 0, 3, 5};
  HostF64 k({rows, heads, dim}), v({rows, heads, dim}), dk_cmp({cmp_rows, heads, dim}), dv_cmp({cmp_rows, heads, dim});
  for (HostF64* t : {&k, &v, &dk_cmp, &dv_cmp}) fill_random(*t, rng);
  HostF64 k_cmp({cmp_rows, heads, dim}, -99), v_cmp({cmp_rows, heads, dim}, -99);
  HostF64 dk({rows, heads, dim}, -99), dv({rows, heads, dim}, -99);
  CompressKvParams params;
  params.k = k.view();
  params.v = v.view();
  params.k_cmp = k_cmp.view();
  params.v_cmp = v_cmp.view();
  params.seqs.cu_seqlens = cu.view();
  params.cu_seqlens_cmp = cu_cmp.view();
  params.block = block;
  params.stride = stride;
  compress_kv(params);
  CompressKvBackwardParams back;
  back.dk_cmp = dk_cmp.view();
  back.dv_cmp = dv_cmp.view();
  back.dk = dk.view();
  back.dv = dv.view();
  back.seqs.cu_seqlens = cu.view();
  back.cu_seqlens_cmp = cu_cmp.view();
  back.block = block;
  back.stride = stride;
  compress_kv_backward(back);

  const std::int64_t row_size = heads * dim;
  auto slice = [&](const HostF64& t, std::int64_t begin, std::int64_t count) {
    HostF64 out({1, count, heads, dim});
    std::copy_n(t.data.begin() + begin * row_size, count * row_size, out.data.begin());
    return out;
  };
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    const std::int64_t blocks = cu_cmp.data[b + 1] - cu_cmp.data[b];
    HostF64 kb = slice(k, cu.data[b], lengths[b]), vb = slice(v, cu.data[b], lengths[b]);
    HostF64 k_cmp_b({1, blocks, heads, dim}), v_cmp_b({1, blocks, heads, dim});
    CompressKvParams single = params;
    single.k = kb.view();
    single.v = vb.view();
    single.k_cmp = k_cmp_b.view();
    single.v_cmp = v_cmp_b.view();
    single.seqs = {};
    single.cu_seqlens_cmp = {};
    compress_kv(single);
    EXPECT_EQ(k_cmp_b.data, slice(k_cmp, cu_cmp.data[b], blocks).data);
    EXPECT_EQ(v_cmp_b.data, slice(v_cmp, cu_cmp.data[b], blocks).data);

    HostF64 dk_cmp_b = slice(dk_cmp, cu_cmp.data[b], blocks), dv_cmp_b = slice(dv_cmp, cu_cmp.data[b], blocks);
    HostF64 dk_b({1, lengths[b], heads, dim}), dv_b({1, lengths[b], heads, dim});
    CompressKvBackwardParams single_back = back;
    single_back.dk_cmp = dk_cmp_b.view();
    single_back.dv_cmp = dv_cmp_b.view();
    single_back.dk = dk_b.view();
    single_back.dv = dv_b.view();
    single_back.seqs = {};
    single_back.cu_seqlens_cmp = {};
    compress_kv_backward(single_back);
    EXPECT_EQ(dk_b.data, slice(dk, cu.data[b], lengths[b]).data);
    EXPECT_EQ(dv_b.data, slice(dv, cu.data[b], lengths[b]).data);
  }
  for (std::int64_t e = cu_cmp.data[3] * row_size; e < cmp_rows * row_size; ++e) {
    EXPECT_EQ(k_cmp.data[e], 0.0);
    EXPECT_EQ(v_cmp.data[e], 0.0);
  }
  for (std::int64_t e = cu.data[3] * row_size; e < rows * row_size; ++e) {
    EXPECT_EQ(dk.data[e], -99.0);
    EXPECT_EQ(dv.data[e], -99.0);
  }
}

TEST(CompressKv, RoundsOnceToTheOutputDtype) {
  // float32 inputs: the mean is accumulated in float64 and rounded once.
  Host<float> k({1, 4, 1, 1}), v({1, 4, 1, 1}), k_cmp({1, 1, 1, 1}), v_cmp({1, 1, 1, 1});
  k.data = {1e8f, 1.0f, -1e8f, 3.0f};
  v.data = {0.1f, 0.2f, 0.3f, 0.4f};
  CompressKvParams params;
  params.k = k.view();
  params.v = v.view();
  params.k_cmp = k_cmp.view();
  params.v_cmp = v_cmp.view();
  params.block = 4;
  params.stride = 4;
  compress_kv(params);
  EXPECT_EQ(k_cmp.data[0], 1.0f);
  const double exact = (double{0.1f} + double{0.2f} + double{0.3f} + double{0.4f}) / 4;
  EXPECT_EQ(v_cmp.data[0], static_cast<float>(exact));
}

struct CompressKvCase {
  HostF64 k{1, 8, 2, 4}, v{1, 8, 2, 3}, k_cmp{1, 3, 2, 4}, v_cmp{1, 3, 2, 3};
  CompressKvParams params() {
    CompressKvParams p;
    p.k = k.view();
    p.v = v.view();
    p.k_cmp = k_cmp.view();
    p.v_cmp = v_cmp.view();
    p.block = 4;
    p.stride = 2;
    return p;
  }
};

void expect_error(const CompressKvParams& params, ErrorKind kind, const std::string& argument) {
  try {
    compress_kv(params);
    ADD_FAILURE() << "expected an error naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_EQ(e.op(), "compress_kv");
  }
}

TEST(CompressKv, ValidationNamesTheArgument) {
  CompressKvCase c;
  CompressKvParams p = c.params();
  p.stride = 3;
  expect_error(p, ErrorKind::config, "stride");
  p = c.params();
  p.block = 0;
  expect_error(p, ErrorKind::config, "block");
  p = c.params();
  p.k_cmp.shape[1] = 2;  // 8 tokens make 3 compressed blocks
  expect_error(p, ErrorKind::shape, "k_cmp");
  p = c.params();
  p.v.shape[2] = 1;
  expect_error(p, ErrorKind::shape, "v");
  p = c.params();
  p.v_cmp.dtype = DType::float32;
  expect_error(p, ErrorKind::dtype, "v_cmp");
  p = c.params();
  p.k.dtype = DType::int32;
  expect_error(p, ErrorKind::dtype, "k");
  p = c.params();
  p.v_cmp.stride[3] = 2;
  expect_error(p, ErrorKind::layout, "v_cmp");
  p = c.params();
  p.k_cmp.device = DeviceType::cuda;
  expect_error(p, ErrorKind::device, "k_cmp");

  // Packed: cu_seqlens_cmp must be given and agree with the sequence lengths.
  HostF64 k({8, 2, 4}), v({8, 2, 3}), k_cmp({4, 2, 4}), v_cmp({4, 2, 3});
  Host<std::int32_t> cu({3}), cu_cmp({3});
  cu.data = {0, 5, 8};      // 5 and 3 tokens: 1 and 0 compressed blocks
  cu_cmp.data = {0, 2, 2};  // wrong
  p = {};
  p.k = k.view();
  p.v = v.view();
  p.k_cmp = k_cmp.view();
  p.v_cmp = v_cmp.view();
  p.seqs.cu_seqlens = cu.view();
  p.block = 4;
  p.stride = 2;
  expect_error(p, ErrorKind::shape, "cu_seqlens_cmp");  // absent
  p.cu_seqlens_cmp = cu_cmp.view();
  expect_error(p, ErrorKind::value, "cu_seqlens_cmp");
  cu_cmp.data = {0, 1, 1};
  cu.data = {0, 9, 8};
  expect_error(p, ErrorKind::value, "cu_seqlens");
  cu.data = {0, 5, 8};
  HostF64 k_cmp_batched({1, 4, 2, 4});
  p.k_cmp = k_cmp_batched.view();
  expect_error(p, ErrorKind::shape, "k_cmp");
}

TEST(CompressKv, CudaFloat64IsUnsupported) {
  // float64 runs on the CPU reference only (and a build without CUDA kernels rejects every CUDA tensor).
  CompressKvCase c;
  CompressKvParams p = c.params();
  for (TensorView* t : {&p.k, &p.v, &p.k_cmp, &p.v_cmp}) t->device = DeviceType::cuda;
  expect_error(p, ErrorKind::unsupported, "k");
}

TEST(CompressKv, BackwardValidation) {
  CompressKvCase c;
  HostF64 dk({1, 8, 2, 4}), dv({1, 8, 2, 3});
  CompressKvBackwardParams back;
  back.dk_cmp = c.k_cmp.view();
  back.dv_cmp = c.v_cmp.view();
  back.dk = dk.view();
  back.dv = dv.view();
  back.block = 4;
  back.stride = 2;
  back.dv_cmp.shape[3] = 4;
  try {
    compress_kv_backward(back);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::shape);
    EXPECT_EQ(e.argument(), "dv_cmp");
    EXPECT_EQ(e.op(), "compress_kv_backward");
  }
  EXPECT_EQ(dk.data, std::vector<double>(dk.data.size(), 0.0));
}

// The internal variant nsa_attention_backward uses: dk = the terms + the pooling's gradient (dv alike), packed rows
// past cu_seqlens[B] untouched; a dk term without its dv term is an error naming it.
TEST(CompressKv, BackwardAddingSumsTheTerms) {
  std::mt19937_64 rng(8);
  const std::int64_t rows = 14, cmp_rows = 5, heads = 2, dim_k = 3, dim_v = 2;
  Host<std::int32_t> cu({3}), cu_cmp({3});
  cu.data = {0, 5, 12};  // 5 and 7 tokens (block 4, stride 2: 1 and 2 compressed blocks), 2 rows past the end
  cu_cmp.data = {0, 1, 3};
  HostF64 dk_cmp({cmp_rows, heads, dim_k}), dv_cmp({cmp_rows, heads, dim_v});
  HostF64 t0k({rows, heads, dim_k}), t0v({rows, heads, dim_v}), t1k({rows, heads, dim_k}), t1v({rows, heads, dim_v});
  for (HostF64* t : {&dk_cmp, &dv_cmp, &t0k, &t0v, &t1k, &t1v}) fill_random(*t, rng);
  CompressKvBackwardParams back;
  back.dk_cmp = dk_cmp.view();
  back.dv_cmp = dv_cmp.view();
  back.seqs.cu_seqlens = cu.view();
  back.cu_seqlens_cmp = cu_cmp.view();
  back.block = 4;
  back.stride = 2;
  HostF64 dk_plain({rows, heads, dim_k}, 0), dv_plain({rows, heads, dim_v}, 0);
  back.dk = dk_plain.view();
  back.dv = dv_plain.view();
  compress_kv_backward(back);

  HostF64 dk({rows, heads, dim_k}, -99), dv({rows, heads, dim_v}, -99);
  back.dk = dk.view();
  back.dv = dv.view();
  detail::CompressBackwardTerms terms;
  terms.dk = {t0k.view(), t1k.view()};
  terms.dv = {t0v.view(), t1v.view()};
  detail::compress_kv_backward_adding(back, terms);
  for (std::int64_t i = 0; i < rows * heads * dim_k; ++i) {
    const double want = i < cu.data[2] * heads * dim_k ? dk_plain.data[i] + t0k.data[i] + t1k.data[i] : -99;
    EXPECT_NEAR(dk.data[i], want, 1e-12) << i;
  }
  for (std::int64_t i = 0; i < rows * heads * dim_v; ++i) {
    const double want = i < cu.data[2] * heads * dim_v ? dv_plain.data[i] + t0v.data[i] + t1v.data[i] : -99;
    EXPECT_NEAR(dv.data[i], want, 1e-12) << i;
  }

  terms.dv[1] = {};
  try {
    detail::compress_kv_backward_adding(back, terms);
    ADD_FAILURE() << "expected an error naming terms.dv[1]";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "terms.dv[1]") << e.what();
  }
}

}  // namespace
}  // namespace sparseattn::test
