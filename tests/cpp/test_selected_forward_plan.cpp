// The host-only plan of the CUDA selected-attention forward (src/cuda/selection/forward_plan.h): which
// forward runs, its shared memory and its workspace chunks. Pure host code, so it runs without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <utility>

#include "test_util.h"

#include "cuda/selected_attention/forward_plan.h"
#include "cuda/selected_attention/group_sharing.h"
#include "sparseattn/head_dims.h"

namespace sparseattn::test {
namespace {

using namespace sparseattn::cuda::selection;

TEST(SelectedForwardPlan, SmallGroupsOfLongSequencesRunKvOuter) {
  for (std::int64_t g : {1, 2, 3, 4, 7, 8, 9}) {
    EXPECT_TRUE(use_kv_outer_forward(g, 128, 128, 16384, 16, 64, kH100)) << "G=" << g;
    EXPECT_TRUE(use_kv_outer_forward(g, 64, 64, 65536, 16, 64, kA100)) << "G=" << g;
  }
}

TEST(SelectedForwardPlan, FullTilesAndShortInputsRunQueryOuter) {
  for (std::int64_t g : {10, 12, 16, 32, 64}) EXPECT_FALSE(use_kv_outer_forward(g, 128, 128, 65536, 16, 64, kH100));
  EXPECT_FALSE(use_kv_outer_forward(1, 128, 128, kKvMinTokens - 1, 16, 64, kH100));
  EXPECT_TRUE(use_kv_outer_forward(1, 128, 128, kKvMinTokens, 16, 64, kH100));
  EXPECT_FALSE(use_kv_outer_forward(0, 128, 128, 65536, 16, 64, kH100));
  EXPECT_FALSE(use_kv_outer_forward(1, 128, 128, 65536, 0, 64, kH100));
}

TEST(SelectedForwardPlan, BlockAndSharedMemoryLimits) {
  for (std::int64_t block : {16, 32, 48, 64, 96, 112, 128}) {
    EXPECT_TRUE(kv_forward_supported(128, 128, block, kA100)) << block;
    EXPECT_TRUE(kv_forward_supported(192, 128, block, kA100)) << block;
    EXPECT_TRUE(kv_forward_supported(256, 256, block, kH100)) << block;
  }
  EXPECT_FALSE(kv_forward_supported(128, 128, 144, kH100));  // the block must fit one shared-memory tile
  EXPECT_FALSE(kv_forward_supported(128, 128, 256, kH100));
  EXPECT_FALSE(kv_forward_supported(256, 256, 128, kA100));  // 256/256 with 128-token blocks needs > 163 KB
  EXPECT_FALSE(use_kv_outer_forward(1, 256, 256, 65536, 16, 128, kA100));
  EXPECT_FALSE(kv_forward_supported(64, 64, 64, 0));  // no shared-memory information: query-outer
  // Grows with the head dims and the block (rounded up to 16 rows).
  EXPECT_LT(kv_forward_smem_bytes(64, 64, 64), kv_forward_smem_bytes(128, 128, 64));
  EXPECT_LT(kv_forward_smem_bytes(128, 128, 64), kv_forward_smem_bytes(128, 128, 128));
  EXPECT_EQ(kv_forward_smem_bytes(128, 128, 50), kv_forward_smem_bytes(128, 128, 64));
}

TEST(SelectedForwardPlan, GroupFormAt128UpTo128K) {
  EXPECT_TRUE(use_group_forward(128, 128, 8192, 16, kH100));
  EXPECT_TRUE(use_group_forward(128, 128, kGroupMaxLen, 16, kH100));
  EXPECT_TRUE(use_group_forward(128, 128, 1, 16, kH100));
  EXPECT_FALSE(use_group_forward(128, 128, kGroupMaxLen + 1, 16, kH100));  // longer: not measured
  EXPECT_FALSE(use_group_forward(128, 128, 0, 16, kH100));
  EXPECT_FALSE(use_group_forward(192, 128, 8192, 16, kH100));  // measured slower
  EXPECT_FALSE(use_group_forward(64, 64, 8192, 16, kH100));    // not measured
  EXPECT_FALSE(use_group_forward(128, 128, 8192, 16, kA100));  // its stages need more than 163 KB
  for (const sparseattn::HeadDims& dims : sparseattn::kCudaHeadDims) {
    EXPECT_TRUE(group_forward_supported(dims.qk, dims.v, 16, kH100)) << dims.qk;
    EXPECT_LE(group_forward_smem_bytes(dims.qk, dims.v, 16), 227u * 1024) << dims.qk;
  }
  // The index lists share the CTA's shared memory: 77 entries per token fit beside the stages, 78 do not.
  EXPECT_TRUE(group_forward_supported(256, 256, 77, kH100));
  EXPECT_FALSE(group_forward_supported(256, 256, 78, kH100));
  EXPECT_FALSE(use_group_forward(128, 128, 8192, 1000, kH100));
  EXPECT_EQ(group_forward_smem_bytes(128, 128, 16) - group_forward_smem_bytes(128, 128, 0), 8u * 16 * 4);
}

TEST(SelectedForwardPlan, ChooseForward) {
  const auto choose = [](PathChoice choice, std::int64_t group, std::int64_t dim, std::int64_t max_len,
                         std::size_t smem) {
    return choose_forward(choice, group, dim, dim, max_len, max_len, 16, 64, smem);
  };
  // Where the group form is supported the device chooses between it and the one-token forward.
  EXPECT_EQ(choose(PathChoice::automatic, 16, 128, 8192, kH100), ForwardPath::query_adaptive);
  EXPECT_EQ(choose(PathChoice::automatic, 16, 128, 65536, kH100), ForwardPath::query_adaptive);
  EXPECT_EQ(choose(PathChoice::automatic, 16, 128, 131072, kH100), ForwardPath::query_adaptive);
  EXPECT_EQ(choose(PathChoice::automatic, 16, 128, 262144, kH100), ForwardPath::query_outer);
  EXPECT_EQ(choose(PathChoice::automatic, 16, 128, 8192, kA100), ForwardPath::query_outer);
  EXPECT_EQ(choose(PathChoice::automatic, 4, 128, 8192, kH100), ForwardPath::kv_outer);
  EXPECT_EQ(choose(PathChoice::automatic, 4, 128, 512, kH100), ForwardPath::query_adaptive);  // too short for kv
  EXPECT_EQ(choose(PathChoice::query_outer, 16, 128, 8192, kH100), ForwardPath::query_outer);
  EXPECT_EQ(choose(PathChoice::query_group, 16, 256, 65536, kH100), ForwardPath::query_group);
  EXPECT_EQ(choose(PathChoice::query_group, 4, 128, 65536, kH100), ForwardPath::query_group);
  EXPECT_EQ(choose(PathChoice::query_group, 16, 128, 8192, kA100), ForwardPath::query_outer);  // unsupported
  EXPECT_EQ(choose(PathChoice::query_group, 16, 128, 8192, kH100), ForwardPath::query_group);  // forced: no choice
  EXPECT_EQ(choose(PathChoice::kv_outer, 16, 128, 8192, kH100), ForwardPath::kv_outer);
}

// The device chooses the group form where the sampled groups chose at most kGroupDistinctPerMille distinct blocks per
// 1000 visible entries, or where it sampled none.
TEST(SelectedForwardPlan, GroupFormPaysWhereTokensShare) {
  EXPECT_TRUE(group_form_pays(0, 0));
  EXPECT_TRUE(group_form_pays(16, 128));   // 8 tokens alike
  EXPECT_FALSE(group_form_pays(128, 128)); // no block shared
  EXPECT_TRUE(group_form_pays(kGroupDistinctPerMille, 1000));
  EXPECT_FALSE(group_form_pays(kGroupDistinctPerMille + 1, 1000));
  EXPECT_TRUE(group_form_pays(std::int64_t{1} << 40, std::int64_t{1} << 42));  // no overflow at large counts
}

TEST(SelectedForwardPlan, OverrideSwitch) {
  EXPECT_EQ(parse_path_choice(nullptr), PathChoice::automatic);
  EXPECT_EQ(parse_path_choice("query"), PathChoice::query_outer);
  EXPECT_EQ(parse_path_choice("group"), PathChoice::query_group);
  EXPECT_EQ(parse_path_choice("kv"), PathChoice::kv_outer);
  EXPECT_EQ(parse_path_choice("auto"), PathChoice::automatic);
  EXPECT_EQ(parse_path_choice("KV "), PathChoice::automatic);
  // Forced kv runs any group and length it supports; forced query always wins; automatic is the heuristic.
  EXPECT_TRUE(choose_kv_outer(PathChoice::kv_outer, 32, 256, 256, 1, 16, 64, kH100));
  EXPECT_FALSE(choose_kv_outer(PathChoice::kv_outer, 1, 128, 128, 65536, 16, 256, kH100));
  EXPECT_FALSE(choose_kv_outer(PathChoice::kv_outer, 1, 128, 128, 0, 16, 64, kH100));
  EXPECT_FALSE(choose_kv_outer(PathChoice::query_outer, 1, 128, 128, 65536, 16, 64, kH100));
  EXPECT_FALSE(choose_kv_outer(PathChoice::query_group, 1, 128, 128, 65536, 16, 64, kH100));
  EXPECT_EQ(choose_kv_outer(PathChoice::automatic, 2, 128, 128, 65536, 16, 64, kH100),
            use_kv_outer_forward(2, 128, 128, 65536, 16, 64, kH100));
}

TEST(SelectedForwardPlan, ChunksBoundTheWorkspace) {
  EXPECT_EQ(kv_chunk_pairs(0, 8, 16, 128), 0);
  EXPECT_EQ(kv_chunk_pairs(1000, 8, 16, 128), 1000);  // small inputs: one chunk
  struct Case {
    std::int64_t pairs, group, n, dv;
  };
  for (const Case& c : {Case{65536, 1, 16, 128}, Case{4 * 65536 * 8, 8, 16, 128}, Case{131072, 16, 32, 256},
                        Case{12345, 1, 16, 64}, Case{1 << 20, 2, 16, 128}, Case{32 * 65536, 1, 16, 128}}) {
    const std::int64_t pairs = kv_chunk_pairs(c.pairs, c.group, c.n, c.dv);
    ASSERT_GE(pairs, 1);
    EXPECT_LE(pairs, c.pairs);
    EXPECT_LE(static_cast<std::size_t>(pairs) * kv_bytes_per_pair(c.group, c.n, c.dv), kKvWorkspaceCap);
    const std::int64_t chunks = (c.pairs + pairs - 1) / pairs;
    EXPECT_GT(pairs * chunks, c.pairs - pairs);  // evened out: the last chunk is not a sliver
    EXPECT_LE(pairs * (chunks - 1), c.pairs);
  }
  // 32/32, T = 64K: a chunk holds at most 65536 pairs, so it spans at most two heads' K/V (forward_plan.h).
  EXPECT_LE(kv_chunk_pairs(32 * 65536, 1, 16, 128), 65536);
  // Huge groups: one pair per chunk, over the cap rather than no progress.
  EXPECT_EQ(kv_chunk_pairs(10, 1 << 14, 1024, 256), 1);
  EXPECT_EQ(kv_entries_per_cta(1), kKvCtaRows);
  EXPECT_EQ(kv_entries_per_cta(3), kKvCtaRows / 3);
  EXPECT_EQ(kv_entries_per_cta(1000), 1);
}

TEST(SelectedForwardPlan, SortGroupsShareOneSort) {
  // 32/32, T = 64K: 36 chunks of 0.93 M entries, 16-bit keys: 9 chunks per sort (128 MB of index at 16 bytes per
  // entry), 4 chunk bits above the key.
  SortGroup g = sort_group(36, 930000, 16, kKvIndexCap);
  EXPECT_EQ(g.chunks, 9);
  EXPECT_EQ(g.end_bit, 20);
  // All chunks where the cap allows: 32/8, T = 64K (34 chunks of 248 K entries).
  g = sort_group(34, 248000, 14, std::size_t{1} << 30);
  EXPECT_EQ(g.chunks, 34);
  EXPECT_EQ(g.end_bit, 20);
  g = sort_group(1000, 1 << 20, 16, kKvIndexCap);
  EXPECT_EQ(g.chunks, static_cast<std::int64_t>(kKvIndexCap / (kIndexBytesPerEntry << 20)));
  EXPECT_EQ(g.end_bit, 16 + 3);
  // No cap (the backward's dQ reuses buffers of every entry): all chunks, as far as 32-bit keys number them.
  g = sort_group(1000, 1 << 20, 16);
  EXPECT_EQ(g.chunks, 1000);
  EXPECT_EQ(g.end_bit, 26);
  g = sort_group(1000, 1 << 20, 29);
  EXPECT_EQ(g.chunks, 8);
  EXPECT_EQ(g.end_bit, 32);
  // Keys that take all 32 bits, a single chunk, a chunk larger than the cap: one chunk per sort, plain keys.
  for (const SortGroup& one :
       {sort_group(100, 10, 32), sort_group(1, 10, 20), sort_group(5, std::int64_t{1} << 30, 20, kKvIndexCap)}) {
    EXPECT_EQ(one.chunks, 1);
  }
  EXPECT_EQ(sort_group(100, 10, 32).end_bit, 32);
  EXPECT_EQ(sort_group(1, 10, 20).end_bit, 20);
  // Chunk index c of a group sits at c << key bits; key_mask strips it.
  EXPECT_EQ(key_mask(16), 0xffffu);
  EXPECT_EQ(key_mask(32), 0xffffffffu);
  EXPECT_EQ((std::uint32_t{35} << 16 | 1234u) & key_mask(16), 1234u);
}

}  // namespace
}  // namespace sparseattn::test
