// The host-only plan of the CUDA select_blocks kernel (src/cuda/selection/select_plan.h): its configuration
// (rows per token, pooling stencil) and its workspace, which stays within a fixed cap however long the
// sequences are. Pure host code, so it runs without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>

#include "cuda/select_blocks/plan.h"

namespace sparseattn::test {
namespace {

using namespace sparseattn::cuda::selection;

constexpr int kH100Sms = 132;

SelectBlocksParams params(std::int64_t heads_q, std::int64_t heads_kv, int cmp_block = 32, int cmp_stride = 16,
                          int sel_block = 64) {
  SelectBlocksParams p;
  p.q.rank = 4;
  p.q.shape = {1, 1, heads_q, 128};
  p.k_cmp.rank = 4;
  p.k_cmp.shape = {1, 1, heads_kv, 128};
  p.cmp_block = cmp_block;
  p.cmp_stride = cmp_stride;
  p.sel_block = sel_block;
  return p;
}

TEST(SelectBlocksPlan, RowsOfAToken) {
  struct Case {
    std::int64_t group;
    int rows, tokens_per_warp, warps_per_token;
  };
  for (const Case& c : {Case{1, 1, 16, 1}, Case{2, 2, 8, 1}, Case{3, 4, 4, 1}, Case{7, 8, 2, 1}, Case{16, 16, 1, 1},
                        Case{24, 32, 1, 2}, Case{128, 128, 1, 8}}) {
    const SelectPlan plan = plan_select_blocks(params(2 * c.group, 2), 1, 65536, kH100Sms);
    ASSERT_GT(plan.ctas, 0) << "G=" << c.group;
    EXPECT_EQ(plan.config.group, c.group);
    EXPECT_EQ(plan.config.rows_per_token, c.rows) << "G=" << c.group;
    EXPECT_EQ(plan.config.tokens_per_warp, c.tokens_per_warp) << "G=" << c.group;
    EXPECT_EQ(plan.config.warps_per_token, c.warps_per_token) << "G=" << c.group;
    EXPECT_EQ(plan.config.tokens_per_tile * c.rows, kSelectRows);  // a tile's rows are whole tokens
  }
}

TEST(SelectBlocksPlan, PoolingStencils) {
  // 32/16 compression, 64-token selection blocks: compressed blocks 4b-1 .. 4b+3 overlap block b by 16, 32,
  // 32, 32 and 16 tokens.
  const SelectConfig c = plan_select_blocks(params(64, 4), 1, 8192, kH100Sms).config;
  EXPECT_EQ(c.cols_per_block, 4);
  EXPECT_EQ(c.border, 1);
  ASSERT_EQ(c.stencil, 5);
  const float taps[] = {1, 2, 2, 2, 1};
  for (int s = 0; s < 5; ++s) EXPECT_EQ(c.taps[s], taps[s]) << s;
  EXPECT_EQ(c.blocks_per_tile, 15);  // (64 columns - 1 border) / 4
  // 64/64 compression: one compressed block per selection block.
  const SelectConfig d = plan_select_blocks(params(64, 4, 64, 64, 64), 1, 8192, kH100Sms).config;
  EXPECT_EQ(d.stencil, 1);
  EXPECT_EQ(d.taps[0], 1.f);
  EXPECT_EQ(d.blocks_per_tile, 64);
  // Every configuration: the taps add up to the tokens the compressed blocks cover in the block, per stride.
  for (const auto& [l, stride, sel] :
       {std::array<int, 3>{32, 16, 64}, {32, 16, 128}, {64, 64, 64}, {32, 8, 64}, {64, 32, 128}, {16, 16, 32}}) {
    const SelectConfig e = plan_select_blocks(params(8, 2, l, stride, sel), 1, 4096, kH100Sms).config;
    EXPECT_FLOAT_EQ(std::accumulate(e.taps, e.taps + e.stencil, 0.f), float(sel) * l / stride / stride)
        << l << "/" << stride << "/" << sel;
    EXPECT_GE(e.blocks_per_tile, 1);
    EXPECT_LE(e.blocks_per_tile * e.cols_per_block + e.border, cuda::kSelectColumns);  // a tile holds its stencils
  }
}

TEST(SelectBlocksPlan, PoolingInLanesAtGroupSixteen) {
  // Gp = 16 (one token per warp) with an even cols_per_block and a 2-, 5- or 9-tap stencil pools from the lanes.
  EXPECT_TRUE(plan_select_blocks(params(64, 4), 1, 8192, kH100Sms).config.pool_in_lanes);   // G 16, 32/16/64
  EXPECT_TRUE(plan_select_blocks(params(36, 4), 1, 8192, kH100Sms).config.pool_in_lanes);   // G 9: Gp 16
  EXPECT_TRUE(plan_select_blocks(params(64, 4, 32, 16, 128), 1, 8192, kH100Sms).config.pool_in_lanes);  // 9 taps
  EXPECT_TRUE(plan_select_blocks(params(64, 4, 64, 64, 128), 1, 8192, kH100Sms).config.pool_in_lanes);  // 2 taps
  EXPECT_FALSE(plan_select_blocks(params(64, 4, 64, 64, 64), 1, 8192, kH100Sms).config.pool_in_lanes);  // 1 tap
  EXPECT_FALSE(plan_select_blocks(params(32, 4), 1, 8192, kH100Sms).config.pool_in_lanes);  // G 8
  EXPECT_FALSE(plan_select_blocks(params(48, 2), 1, 8192, kH100Sms).config.pool_in_lanes);  // G 24: two warps
  for (const auto& [l, stride, sel] :
       {std::array<int, 3>{32, 16, 64}, {32, 16, 128}, {64, 64, 128}, {32, 8, 64}, {64, 32, 128}, {16, 16, 32}}) {
    const SelectConfig e = plan_select_blocks(params(64, 4, l, stride, sel), 1, 4096, kH100Sms).config;
    if (e.pool_in_lanes) EXPECT_LE(e.blocks_per_tile, 32) << l << "/" << stride << "/" << sel;  // a block per lane
  }
}

TEST(SelectBlocksPlan, WorkspaceIsCappedWhateverTheLength) {
  for (std::int64_t group : {1, 4, 16, 128}) {
    std::size_t previous = 0;
    for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{1000}, std::int64_t{65536}, std::int64_t{262144},
                                std::int64_t{1} << 20, std::int64_t{1} << 22}) {
      const SelectPlan plan = plan_select_blocks(params(group, 1), 1, tokens, kH100Sms);
      ASSERT_GT(plan.ctas, 0);
      EXPECT_LE(plan.ctas, 2 * kH100Sms);
      // One slot per CTA: a tile's tokens x the blocks of the longest sequence, padded to 4.
      EXPECT_EQ(plan.slot_bytes,
                static_cast<std::size_t>(plan.config.tokens_per_tile * ((tokens + 64 * 4 - 1) / (64 * 4) * 4) * 4));
      EXPECT_LE(plan.workspace_bytes(), std::max(kSelectWorkspaceCap, plan.slot_bytes)) << group << " " << tokens;
      EXPECT_GE(plan.workspace_bytes(), previous / 2);  // fewer CTAs only where the slots outgrow the cap
      previous = plan.workspace_bytes();
    }
  }
  // Batches: slots sized by the longest sequence, CTAs bounded by the tiles there are.
  const SelectPlan small = plan_select_blocks(params(16, 1), 3, 100, kH100Sms);
  EXPECT_EQ(small.ctas, 3 * ((100 + 7) / 8));
}

TEST(SelectBlocksPlan, ShapesTheKernelDoesNotTake) {
  EXPECT_EQ(plan_select_blocks(params(129, 1), 1, 4096, kH100Sms).ctas, 0);           // more than 128 heads per KV head
  EXPECT_EQ(plan_select_blocks(params(6, 4), 1, 4096, kH100Sms).ctas, 0);             // heads_q not a multiple
  EXPECT_EQ(plan_select_blocks(params(8, 2, 32, 1, 64), 1, 4096, kH100Sms).ctas, 0);  // 95 columns per block
  EXPECT_EQ(plan_select_blocks(params(8, 2), 0, 4096, kH100Sms).ctas, 0);
  EXPECT_EQ(plan_select_blocks(params(8, 2), 1, 0, kH100Sms).ctas, 0);
  EXPECT_EQ(plan_select_blocks(params(8, 2), 1, 0, kH100Sms).workspace_bytes(), 0u);
}

}  // namespace
}  // namespace sparseattn::test
