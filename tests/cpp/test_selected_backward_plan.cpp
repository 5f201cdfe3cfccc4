// The host-only plan of the CUDA selected-attention backward (src/cuda/selection/backward_plan.h): which dQ
// runs, its shared memory and partial chunks, and the dK/dV chunk length. Pure host code, so it runs without
// a GPU.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/selected_attention/backward_plan.h"
#include "sparseattn/head_dims.h"
#include "test_util.h"

namespace sparseattn::test {
namespace {

using namespace sparseattn::cuda::selection;

TEST(SelectedBackwardPlan, SmallGroupsOfLongSequencesRunKvOuterDq) {
  for (std::int64_t g : {1, 2, 3, 4, 7, 8}) {
    EXPECT_TRUE(use_kv_outer_dq(g, 128, 128, 16384, 16, 64, kH100)) << "G=" << g;
    EXPECT_TRUE(use_kv_outer_dq(g, 192, 128, 65536, 16, 64, kH100)) << "G=" << g;
    EXPECT_TRUE(use_kv_outer_dq(g, 64, 64, 65536, 16, 128, kA100)) << "G=" << g;
  }
}

TEST(SelectedBackwardPlan, FullTilesShortInputsAndLargeHeadsRunQueryOuterDq) {
  for (std::int64_t g : {9, 12, 16, 32, 64}) EXPECT_FALSE(use_kv_outer_dq(g, 128, 128, 65536, 16, 64, kH100));
  EXPECT_FALSE(use_kv_outer_dq(1, 128, 128, kDqKvMinTokens - 1, 16, 64, kH100));
  EXPECT_TRUE(use_kv_outer_dq(1, 128, 128, kDqKvMinTokens, 16, 64, kH100));
  EXPECT_FALSE(use_kv_outer_dq(1, 256, 256, 65536, 16, 64, kH100));  // supported, but its tiles spill
  EXPECT_TRUE(dq_kv_supported(256, 256, 64, kH100));
  EXPECT_FALSE(use_kv_outer_dq(0, 128, 128, 65536, 16, 64, kH100));
  EXPECT_FALSE(use_kv_outer_dq(1, 128, 128, 65536, 0, 64, kH100));
}

TEST(SelectedBackwardPlan, BlockAndSharedMemoryLimits) {
  for (std::int64_t block : {16, 32, 48, 64, 96, 112, 128}) {
    EXPECT_TRUE(dq_kv_supported(128, 128, block, kA100)) << block;
    EXPECT_TRUE(dq_kv_supported(192, 128, block, kH100)) << block;
  }
  EXPECT_TRUE(dq_kv_supported(192, 128, 112, kA100));
  EXPECT_FALSE(dq_kv_supported(192, 128, 128, kA100));  // 128 rows of 192 + 128 columns, twice: > 163 KB
  EXPECT_FALSE(dq_kv_supported(128, 128, 0, kH100));
  EXPECT_FALSE(dq_kv_supported(128, 128, 144, kH100));  // the block must fit one shared-memory tile
  EXPECT_FALSE(dq_kv_supported(256, 256, 64, kA100));   // 256/256 needs > 163 KB
  EXPECT_FALSE(dq_kv_supported(256, 256, 128, kH100));  // and > 227 KB with 128-token blocks
  EXPECT_FALSE(dq_kv_supported(64, 64, 64, 0));         // no shared-memory information: query-outer
  EXPECT_LT(dq_kv_smem_bytes(64, 64, 64), dq_kv_smem_bytes(128, 128, 64));
  EXPECT_LT(dq_kv_smem_bytes(128, 128, 64), dq_kv_smem_bytes(128, 128, 128));
  EXPECT_EQ(dq_kv_smem_bytes(128, 128, 50), dq_kv_smem_bytes(128, 128, 64));  // rounded up to 16 rows
}

TEST(SelectedBackwardPlan, OverrideSwitch) {
  // Forced kv runs any group and length it supports; forced query always wins; automatic is the heuristic.
  EXPECT_TRUE(choose_kv_outer_dq(PathChoice::kv_outer, 32, 256, 256, 1, 16, 64, kH100));
  EXPECT_FALSE(choose_kv_outer_dq(PathChoice::kv_outer, 1, 128, 128, 65536, 16, 256, kH100));
  EXPECT_FALSE(choose_kv_outer_dq(PathChoice::kv_outer, 1, 128, 128, 0, 16, 64, kH100));
  EXPECT_FALSE(choose_kv_outer_dq(PathChoice::kv_outer, 0, 128, 128, 65536, 16, 64, kH100));
  EXPECT_FALSE(choose_kv_outer_dq(PathChoice::query_outer, 1, 128, 128, 65536, 16, 64, kH100));
  for (std::int64_t g : {1, 8, 9, 16}) {
    EXPECT_EQ(choose_kv_outer_dq(PathChoice::automatic, g, 128, 128, 65536, 16, 64, kH100),
              use_kv_outer_dq(g, 128, 128, 65536, 16, 64, kH100));
  }
}

TEST(SelectedBackwardPlan, GroupDqCandidateAt128UpTo128K) {
  EXPECT_TRUE(use_group_dq(128, 128, 1, 16, kH100));
  EXPECT_TRUE(use_group_dq(128, 128, 8192, 16, kH100));
  EXPECT_TRUE(use_group_dq(128, 128, 65536, 16, kH100));  // a candidate: the device chooses
  EXPECT_TRUE(use_group_dq(128, 128, kGroupMaxLen, 16, kH100));
  EXPECT_FALSE(use_group_dq(128, 128, kGroupMaxLen + 1, 16, kH100));  // not measured
  EXPECT_FALSE(use_group_dq(128, 128, 0, 16, kH100));
  EXPECT_FALSE(use_group_dq(192, 128, 8192, 16, kH100));
  EXPECT_FALSE(use_group_dq(128, 128, 8192, 16, kA100));  // rows and stages need more than 163 KB
  // dO's rows of the 8 tokens (16 heads each), and Q's from Dqk + Dv > 256 on; the stages get the rest of 224 KB.
  EXPECT_EQ(group_dq_rows_bytes(128, 128), 8u * 16 * 128 * 2);
  EXPECT_EQ(group_dq_rows_bytes(192, 128), 8u * 16 * 320 * 2);
  EXPECT_EQ(group_dq_smem_bytes(128, 128, 0), 32u * 1024 + 6 * 32 * 1024 + 6 * 2 * 8 + 8 * 13 * 4);
  for (const sparseattn::HeadDims& dims : sparseattn::kCudaHeadDims) {
    EXPECT_TRUE(group_dq_supported(dims.qk, dims.v, 16, kH100)) << dims.qk;
    EXPECT_LE(group_dq_smem_bytes(dims.qk, dims.v, 16), 227u * 1024) << dims.qk;
    EXPECT_GE(group_dq_smem_bytes(dims.qk, dims.v, 0) - group_dq_rows_bytes(dims.qk, dims.v),
              2u * 32 * (dims.qk + dims.v) * 2)
        << "two stages at least, " << dims.qk;
  }
}

TEST(SelectedBackwardPlan, GroupDqSwitch) {
  EXPECT_EQ(choose_dq_form(PathChoice::query_group, 192, 128, 8192, 16, kH100), DqForm::group);  // where supported
  EXPECT_EQ(choose_dq_form(PathChoice::query_group, 128, 128, 8192, 16, kA100), DqForm::one_token);
  EXPECT_EQ(choose_dq_form(PathChoice::query_outer, 128, 128, 8192, 16, kH100), DqForm::one_token);
  EXPECT_EQ(choose_dq_form(PathChoice::kv_outer, 128, 128, 8192, 16, kH100), DqForm::one_token);
  EXPECT_EQ(choose_dq_form(PathChoice::query_group, 128, 128, 8192, 0, kH100), DqForm::one_token);
  EXPECT_EQ(choose_dq_form(PathChoice::automatic, 128, 128, 65536, 16, kH100), DqForm::adaptive);
  EXPECT_EQ(choose_dq_form(PathChoice::automatic, 128, 128, 262144, 16, kH100), DqForm::one_token);
  EXPECT_EQ(choose_dq_form(PathChoice::automatic, 192, 128, 8192, 16, kH100), DqForm::one_token);
  EXPECT_EQ(choose_dq_form(PathChoice::automatic, 128, 128, 8192, 16, kA100), DqForm::one_token);
}

TEST(SelectedBackwardPlan, DqChunksBoundThePartials) {
  EXPECT_EQ(dq_kv_chunk_pairs(0, 8, 16, 128), 0);
  EXPECT_EQ(dq_kv_chunk_pairs(1000, 8, 16, 128), 1000);  // small inputs: one chunk
  struct Case {
    std::int64_t pairs, group, n, dqk;
  };
  for (const Case& c : {Case{65536 * 32, 1, 16, 128}, Case{262144 * 8, 8, 16, 128}, Case{131072, 16, 32, 192},
                        Case{12345, 1, 16, 64}, Case{1 << 20, 2, 16, 128}}) {
    const std::int64_t pairs = dq_kv_chunk_pairs(c.pairs, c.group, c.n, c.dqk);
    ASSERT_GE(pairs, 1);
    EXPECT_LE(pairs, c.pairs);
    EXPECT_LE(static_cast<std::size_t>(pairs) * dq_kv_bytes_per_pair(c.group, c.n, c.dqk), kDqKvPartialCap);
    const std::int64_t chunks = (c.pairs + pairs - 1) / pairs;
    EXPECT_GT(pairs * chunks, c.pairs - pairs);  // evened out: the last chunk is not a sliver
  }
  EXPECT_EQ(dq_kv_chunk_pairs(10, 1 << 14, 1024, 256), 1);  // huge groups: one pair per chunk, over the cap
}

TEST(SelectedBackwardPlan, DkvChunksSplitOnlyLongSegmentsAndBoundThePartials) {
  // The examples of the comment: T = 64K, n = 16, block 64, D = 128 at Hkv = 4 (G = 16) and Hkv = 32 (G = 1)
  // (the partials' cap decides), and T = 8K at 64/4 (half the mean segment: 512 tokens).
  EXPECT_EQ(dkv_chunk_tokens(std::int64_t{65536} * 4 * 16, 16, 16, 64, 128, 128), 2048);
  EXPECT_EQ(dkv_chunk_tokens(std::int64_t{65536} * 32 * 16, 1, 16, 64, 128, 128), 16384);
  EXPECT_EQ(dkv_chunk_tokens(std::int64_t{8192} * 4 * 16, 16, 16, 64, 128, 128), 512);
  struct Case {
    std::int64_t entries, group, n, block, dqk, dv;
  };
  for (const Case& c : {Case{1, 1, 1, 16, 64, 64}, Case{4096, 3, 8, 128, 192, 128}, Case{1 << 26, 1, 16, 64, 256, 256},
                        Case{1 << 20, 32, 16, 64, 128, 128}, Case{777, 7, 5, 48, 64, 64}}) {
    const std::int64_t tokens = dkv_chunk_tokens(c.entries, c.group, c.n, c.block, c.dqk, c.dv);
    EXPECT_EQ(tokens % 32, 0);
    EXPECT_GE(tokens, c.n * c.block / 2);               // only segments longer than half the mean are split
    EXPECT_GE(tokens * c.group, kDkvMinChunkRows);      // enough query rows per chunk
    const std::int64_t slots = 2 * c.entries / tokens;  // the backward's bound on the partial slots
    EXPECT_LE(static_cast<std::size_t>(slots * c.block * (c.dqk + c.dv) * 4), kDkvPartialCap);
  }
}

}  // namespace
}  // namespace sparseattn::test
