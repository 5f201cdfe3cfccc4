// flash_decode on the CPU (the semantics example, paged against dense, validation) and the host-only plan of
// its CUDA kernels (split counts and workspace from shapes and the device's SMs), which needs no GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/decode/plan.h"
#include "sparseattn/error.h"
#include "sparseattn/flash_decode.h"
#include "test_util.h"

namespace sparseattn::test {
namespace {

// A float64 decode call on host tensors: q [B, Tq, Hq, D], a cache, cache_seqlens, outputs.
struct DecodeCall {
  HostF64 q, k, v, o, lse;
  Host<std::int32_t> seqlens, table;
  FlashDecodeParams params() {
    FlashDecodeParams p;
    p.q = q.view();
    p.k_cache = k.view();
    p.v_cache = v.view();
    if (!seqlens.data.empty()) p.cache_seqlens = seqlens.view();
    if (!table.data.empty()) p.block_table = table.view();
    p.o = o.view();
    p.lse = lse.view();
    return p;
  }
};

// docs/semantics.md section 8, "Decode against a KV cache".
TEST(FlashDecode, PagedWorkedExample) {
  DecodeCall c;
  c.q = HostF64({1, 1, 1, 2});
  c.q.data = {1.0, 0.5};
  c.k = HostF64({4, 2, 1, 2});
  c.k.data = {0.5, -1, 1, 0, 2, 1, 9, 9, -1, 0.5, 0, 2, 1.5, -0.5, 7, 7};
  c.v = HostF64({4, 2, 1, 2});
  c.v.data = {1, 0, 0, 1, 5, 5, 9, 9, 2, 2, -1, 3, 4, -2, 7, 7};
  c.table = Host<std::int32_t>({1, 3});
  c.table.data = {2, 0, 3};
  c.seqlens = Host<std::int32_t>({1});
  c.seqlens.data = {5};
  c.o = HostF64({1, 1, 1, 2});
  c.lse = HostF64({1, 1, 1});
  FlashDecodeParams p = c.params();
  p.scale = 1.0;
  flash_decode(p);
  EXPECT_NEAR(c.o.data[0], 1.268149, 5e-7);
  EXPECT_NEAR(c.o.data[1], 0.465145, 5e-7);
  EXPECT_NEAR(c.lse.data[0], 2.341736, 5e-7);
  p.window_left = 2;
  p.window_right = 0;
  flash_decode(p);
  EXPECT_NEAR(c.o.data[0], 2.075482, 5e-7);
  EXPECT_NEAR(c.o.data[1], -0.591292, 5e-7);
  EXPECT_NEAR(c.lse.data[0], 1.975278, 5e-7);
}

// The same keys dense and paged (page size 3, shuffled pages, lengths 0 .. S) give bit-identical results.
TEST(FlashDecode, PagedMatchesDense) {
  const std::int64_t B = 3, Tq = 2, Hq = 4, Hkv = 2, D = 5, Dv = 3, S = 10, page = 3, max_pages = 4;
  std::mt19937_64 rng(7);
  DecodeCall dense, paged;
  dense.q = HostF64({B, Tq, Hq, D});
  fill_random(dense.q, rng);
  dense.k = HostF64({B, S, Hkv, D});
  dense.v = HostF64({B, S, Hkv, Dv});
  fill_random(dense.k, rng);
  fill_random(dense.v, rng);
  dense.seqlens = Host<std::int32_t>({B});
  dense.seqlens.data = {0, 7, 10};
  dense.o = HostF64({B, Tq, Hq, Dv});
  dense.lse = HostF64({B, Hq, Tq});
  paged.q = dense.q;
  paged.seqlens = dense.seqlens;
  paged.o = dense.o;
  paged.lse = dense.lse;
  const std::int64_t pages = B * max_pages + 1;
  std::vector<std::int32_t> order(pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  paged.table = Host<std::int32_t>({B, max_pages});
  std::copy(order.begin(), order.begin() + B * max_pages, paged.table.data.begin());
  paged.k = HostF64({pages, page, Hkv, D}, 100.0);
  paged.v = HostF64({pages, page, Hkv, Dv}, -100.0);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t s = 0; s < S; ++s) {
      const std::int64_t where = paged.table.data[b * max_pages + s / page] * page + s % page;
      std::copy_n(&dense.k.data[(b * S + s) * Hkv * D], Hkv * D, &paged.k.data[where * Hkv * D]);
      std::copy_n(&dense.v.data[(b * S + s) * Hkv * Dv], Hkv * Dv, &paged.v.data[where * Hkv * Dv]);
    }
  }
  for (bool causal : {true, false}) {
    FlashDecodeParams pd = dense.params(), pp = paged.params();
    pd.causal = pp.causal = causal;
    pd.window_left = pp.window_left = 4;
    flash_decode(pd);
    flash_decode(pp);
    EXPECT_EQ(dense.o.data, paged.o.data);
    EXPECT_EQ(dense.lse.data, paged.lse.data);
    // Sequence 0 has no key: o = 0, lse = -inf.
    for (std::int64_t i = 0; i < Tq * Hq * Dv; ++i) EXPECT_EQ(paged.o.data[i], 0.0);
    EXPECT_TRUE(std::isinf(paged.lse.data[0]) && paged.lse.data[0] < 0);
  }
}

void expect_error(const FlashDecodeParams& p, ErrorKind kind, const std::string& argument) {
  try {
    flash_decode(p);
    ADD_FAILURE() << "no error for argument " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_EQ(e.op(), "flash_decode");
  }
}

TEST(FlashDecode, Validation) {
  DecodeCall c;
  c.q = HostF64({2, 1, 4, 8});
  c.k = HostF64({6, 4, 2, 8});
  c.v = HostF64({6, 4, 2, 8});
  c.table = Host<std::int32_t>({2, 3});
  c.table.data = {0, 1, 2, 3, 4, 5};
  c.seqlens = Host<std::int32_t>({2});
  c.seqlens.data = {12, 5};
  c.o = HostF64({2, 1, 4, 8});
  c.lse = HostF64({2, 4, 1});
  flash_decode(c.params());  // valid

  FlashDecodeParams p = c.params();
  p.cache_seqlens = {};
  expect_error(p, ErrorKind::config, "cache_seqlens");
  c.seqlens.data = {13, 5};
  expect_error(c.params(), ErrorKind::value, "cache_seqlens");
  c.seqlens.data = {12, 5};
  c.table.data[4] = 6;  // sequence 1 reads entries 0 and 1
  expect_error(c.params(), ErrorKind::value, "block_table");
  c.table.data[4] = 4;
  c.table.data[5] = -3;  // never read
  flash_decode(c.params());
  p = c.params();
  p.num_splits = -1;
  expect_error(p, ErrorKind::config, "num_splits");
  p = c.params();
  p.q.shape[1] = 17;
  expect_error(p, ErrorKind::shape, "q");
  p = c.params();
  p.lse.shape[2] = 2;
  expect_error(p, ErrorKind::shape, "lse");
  p = c.params();
  p.v_cache.shape[1] = 3;
  expect_error(p, ErrorKind::shape, "v_cache");
  p = c.params();
  p.k_cache.dtype = DType::float32;
  expect_error(p, ErrorKind::dtype, "k_cache");
  p = c.params();
  p.block_table.shape[0] = 1;
  expect_error(p, ErrorKind::shape, "block_table");
}

using cuda::decode::plan_decode;
using cuda::decode::plan_splits;

constexpr int kH100Sms = 132;
constexpr std::size_t kH100SmemPerSm = 228 * 1024;

TEST(FlashDecodePlan, HeuristicFillsOneWave) {
  // Tq = 1, D = 128, 128K keys: 32/8 heads (4 rows per KV head), 64/4 heads (16 rows); two CTAs fit an SM.
  const auto plan = [](std::int64_t batch, std::int64_t q_heads, std::int64_t kv_heads) {
    return plan_decode(batch, 1, q_heads, kv_heads, 128, 128, 131072, 0, kH100Sms, kH100SmemPerSm);
  };
  EXPECT_EQ(plan(1, 32, 8).warps_m, 1);
  EXPECT_EQ(plan(1, 32, 8).splits, 33);  // 8 x 33 = 264 = 132 SMs x 2 CTAs
  EXPECT_EQ(plan(1, 64, 4).splits, 64);  // 66 asked: 2048-key splits, 64 of them cover 128K
  EXPECT_EQ(plan(32, 32, 8).splits, 1);   // 256 CTAs without splitting
  EXPECT_EQ(plan(32, 64, 4).splits, 2);
  for (const auto& p : {plan(1, 32, 8), plan(1, 64, 4), plan(32, 64, 4)}) {
    EXPECT_EQ(p.split_keys % cuda::decode::kTileKeys, 0);
    EXPECT_GE(p.split_keys * p.splits, 131072);
    EXPECT_LT(p.split_keys * (p.splits - 1), 131072);
  }
  // Short caches get fewer splits (at least kMinSplitKeys keys each), never fewer than one.
  EXPECT_EQ(plan_decode(1, 1, 32, 8, 128, 128, 2048, 0, kH100Sms, kH100SmemPerSm).splits, 4);
  EXPECT_EQ(plan_decode(1, 1, 32, 8, 128, 128, 0, 0, kH100Sms, kH100SmemPerSm).splits, 1);
  // Rows: G * Tq = 16 * 16 = 256 rows take 4 row blocks of 64.
  const auto wide = plan_decode(2, 16, 16, 1, 64, 64, 4096, 0, kH100Sms, kH100SmemPerSm);
  EXPECT_EQ(wide.warps_m, 4);
  EXPECT_EQ(wide.row_blocks, 4);
}

TEST(FlashDecodePlan, RequestedSplitsRoundToTiles) {
  std::int64_t keys = 0;
  EXPECT_EQ(plan_splits(700, 1, kH100Sms, 2, 3, &keys), 3);
  EXPECT_EQ(keys, 256);
  EXPECT_EQ(plan_splits(700, 1, kH100Sms, 2, 11, &keys), 11);  // 11 x 64 keys (the last one short)
  EXPECT_EQ(keys, 64);
  EXPECT_EQ(plan_splits(700, 1, kH100Sms, 2, 7, &keys), 6);  // 7 asked: 128-key splits, 6 of them cover 700
  EXPECT_EQ(plan_splits(100, 1, kH100Sms, 2, 50, &keys), 2);  // at most one split per 64-key tile
  EXPECT_EQ(keys, 64);
  EXPECT_EQ(plan_splits(std::int64_t{1} << 20, 1, kH100Sms, 2, 1000, &keys), cuda::decode::kMaxSplits);
}

TEST(FlashDecodePlan, WorkspaceOnlyWithSplits) {
  auto plan = plan_decode(2, 3, 8, 2, 128, 128, 1000, 1, kH100Sms, kH100SmemPerSm);
  EXPECT_EQ(cuda::decode::decode_workspace(plan, 2, 8, 2, 3, 128).bytes, 0u);
  plan = plan_decode(2, 3, 8, 2, 128, 128, 1000, 4, kH100Sms, kH100SmemPerSm);
  ASSERT_EQ(plan.splits, 4);
  const auto w = cuda::decode::decode_workspace(plan, 2, 8, 2, 3, 128);
  EXPECT_EQ(w.o_bytes, std::size_t{4} * 2 * 8 * 3 * 128 * 4);
  EXPECT_EQ(w.lse_offset % 256, 0u);
  // One merge group (4 splits <= kMergeFan): no group partials; 2 counters per (sequence, KV head, row block).
  EXPECT_EQ(w.group_lse_offset, w.group_o_offset);
  EXPECT_EQ(w.counters_offset, w.group_o_offset);
  EXPECT_EQ(w.counter_bytes, std::size_t{2} * 2 * plan.row_blocks * 2 * 4);
  EXPECT_GE(w.group_o_offset, w.lse_offset + std::size_t{4} * 2 * 8 * 3 * 4);
  EXPECT_GE(w.bytes, w.counters_offset + w.counter_bytes);
  // 20 splits: three groups of at most kMergeFan, whose partials follow the splits'.
  plan = plan_decode(2, 3, 8, 2, 128, 128, 20 * 64, 20, kH100Sms, kH100SmemPerSm);
  ASSERT_EQ(plan.splits, 20);
  ASSERT_EQ(cuda::decode::merge_groups(plan.splits), 3);
  const auto grouped = cuda::decode::decode_workspace(plan, 2, 8, 2, 3, 128);
  EXPECT_EQ(grouped.group_lse_offset - grouped.group_o_offset, std::size_t{3} * 2 * 8 * 3 * 128 * 4);
  EXPECT_EQ(grouped.counters_offset % 256, 0u);
  EXPECT_EQ(grouped.counter_bytes, std::size_t{2} * 2 * plan.row_blocks * 4 * 4);
  EXPECT_GE(grouped.bytes, grouped.counters_offset + grouped.counter_bytes);
  // Every tile configuration fits an A100's opt-in shared memory (163 KB).
  for (int warps_m : {1, 2, 4}) {
    for (auto [dqk, dv] : {std::pair{64, 64}, std::pair{128, 128}, std::pair{192, 128}, std::pair{256, 256}}) {
      EXPECT_LE(cuda::decode::smem_bytes(dqk, dv, warps_m), kA100) << dqk << " " << dv << " " << warps_m;
    }
  }
}

}  // namespace
}  // namespace sparseattn::test
