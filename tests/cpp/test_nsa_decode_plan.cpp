// The host-only plan of nsa_decode's CUDA kernels (plan.h), which needs no GPU: compressed splits start on
// selection-block boundaries and hold whole tiles, the pooled-score span covers every block a split's rows touch,
// the pieces cover the selected and window chunks, and nothing depends on sequence lengths.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/nsa_decode/plan.h"

namespace sparseattn::test {
namespace {

using cuda::nsa_dec::Plan;
using cuda::nsa_dec::plan_nsa_decode;

constexpr int kH100Sms = 132;
constexpr bool kAll[3] = {true, true, true};

Plan defaults(std::int64_t batch, std::int64_t capacity, std::int64_t splits = 0) {
  const std::int64_t max_cmp = (capacity - 32) / 16 + 1;
  return plan_nsa_decode(batch, 1, 64, 4, 128, 128, capacity, max_cmp, 32, 16, 64, 16, 512, kAll, splits, kH100Sms);
}

TEST(NsaDecodePlan, SplitsAlignAndCover) {
  for (const std::int64_t capacity : {std::int64_t{8192}, std::int64_t{131072}, std::int64_t{1000}}) {
    for (const std::int64_t batch : {1, 64}) {
      for (const std::int64_t splits : {0, 1, 3, 1000}) {
        const Plan p = defaults(batch, capacity, splits);
        EXPECT_EQ(p.split_rows % 64, 0);
        EXPECT_EQ(p.split_rows * 16 % 64, 0) << "splits start on selection-block boundaries";
        EXPECT_LE(p.split_rows, cuda::nsa_dec::kMaxSplitRows);
        EXPECT_GE(p.cmp_splits * p.split_rows, p.max_cmp);
        EXPECT_LT((p.cmp_splits - 1) * p.split_rows, p.max_cmp);
        // The last block a split's last row touches: floor(((p+1) J - 1) d + l - 1) / l') - p J d / l'.
        EXPECT_EQ(p.score_span, ((p.split_rows - 1) * 16 + 31) / 64 + 1);
        EXPECT_EQ(p.max_blocks, (capacity + 63) / 64);
      }
    }
  }
  EXPECT_EQ(defaults(1, 131072).split_rows, 128);  // 4 KV heads: 66 splits wanted, 64 of 128 rows cover 8191
  EXPECT_EQ(defaults(1, 131072).cmp_splits, 64);
  EXPECT_EQ(defaults(64, 32768).split_rows, 512);  // 256 CTAs without splitting: the largest split
}

TEST(NsaDecodePlan, PiecesCoverTheSelectedAndWindowChunks) {
  const Plan one = defaults(1, 131072);
  EXPECT_EQ(one.sel_chunks, 16 * 64 / 16);
  EXPECT_EQ(one.swa_chunks, (511 + 15) / 16 + 1);
  EXPECT_GE(one.sel_pieces * one.tiles_per_piece * 4, one.sel_chunks);
  EXPECT_GE(one.swa_pieces * one.tiles_per_piece * 4, one.swa_chunks);
  const Plan many = defaults(64, 32768);
  EXPECT_GT(many.tiles_per_piece, one.tiles_per_piece);  // fewer, longer pieces when the batch fills the GPU
  // A window wider than the cache reads at most the cache's chunks.
  const Plan wide = plan_nsa_decode(1, 1, 16, 1, 64, 64, 256, 15, 32, 16, 64, 4, 100000, kAll, 0, kH100Sms);
  EXPECT_EQ(wide.swa_chunks, 256 / 16);
}

TEST(NsaDecodePlan, WorkspaceSlicesAreAlignedAndOnlyForPresentBranches) {
  const Plan p = defaults(2, 65536);
  for (const std::size_t offset : {p.cmp_o, p.cmp_lse, p.cmp_score, p.scores, p.indices, p.piece_o, p.piece_lse}) {
    EXPECT_EQ(offset % 256, 0u);
    EXPECT_LT(offset, p.bytes);
  }
  constexpr bool kWindowOnly[3] = {false, false, true};
  const Plan w = plan_nsa_decode(2, 1, 64, 4, 128, 128, 65536, 0, 32, 16, 64, 16, 512, kWindowOnly, 0, kH100Sms);
  EXPECT_FALSE(w.compressed);
  EXPECT_EQ(w.sel_pieces, 0);
  EXPECT_LT(w.bytes, p.bytes);
}

TEST(NsaDecodePlan, TheSparseKernelCombinesWhereRowsHaveFewPartials) {
  // Batch 64 at 32K: 4 compressed splits of 512 rows, 2 selected and 2 window pieces of 8 tiles: 8 partials a row.
  const Plan batched = defaults(64, 32768);
  EXPECT_EQ(batched.cmp_splits, 4);
  EXPECT_EQ(batched.sel_pieces + batched.swa_pieces, 4);
  EXPECT_TRUE(batched.fused_combine);
  EXPECT_EQ(batched.counter_bytes, std::size_t{64} * 4 * 4);  // one int32 per (sequence, KV head)
  EXPECT_EQ(batched.counters % 256, 0u);
  EXPECT_GE(batched.bytes, batched.counters + batched.counter_bytes);
  // Batch 1 at 128K: 64 compressed splits and 25 one-tile pieces: the combine kernel merges them.
  const Plan single = defaults(1, 131072);
  EXPECT_FALSE(single.fused_combine);
  EXPECT_EQ(single.counter_bytes, 0u);
  // Only the window branch: its pieces alone.
  constexpr bool kWindowOnly[3] = {false, false, true};
  const Plan w = plan_nsa_decode(64, 1, 64, 4, 128, 128, 32768, 0, 32, 16, 64, 16, 512, kWindowOnly, 0, kH100Sms);
  EXPECT_EQ(w.fused_combine, w.swa_pieces <= cuda::nsa_dec::kFusedCombineMax);
}

TEST(NsaDecodePlan, TheCompressedWarpCountChangesNoSize) {
  using cuda::nsa_dec::compressed_warps_of;
  EXPECT_EQ(compressed_warps_of(nullptr), 8);
  EXPECT_EQ(compressed_warps_of("4"), 4);
  EXPECT_EQ(compressed_warps_of("8"), 8);
  EXPECT_EQ(compressed_warps_of("16"), 8);
  EXPECT_EQ(compressed_warps_of(""), 8);
  for (const std::int64_t capacity : {std::int64_t{1000}, std::int64_t{32768}, std::int64_t{131072}}) {
    for (const std::int64_t batch : {1, 64}) {
      const std::int64_t max_cmp = (capacity - 32) / 16 + 1;
      const Plan eight = defaults(batch, capacity);
      const Plan four =
          plan_nsa_decode(batch, 1, 64, 4, 128, 128, capacity, max_cmp, 32, 16, 64, 16, 512, kAll, 0, kH100Sms, 4);
      EXPECT_EQ(four.cmp_warps, 4);
      EXPECT_EQ(eight.cmp_warps, 8);
      // The size query and the launch may read the switch at different times: every size must agree.
      EXPECT_EQ(eight.bytes, four.bytes);
      EXPECT_EQ(eight.cmp_smem, four.cmp_smem);
      EXPECT_EQ(eight.attend_smem, four.attend_smem);
      EXPECT_EQ(eight.cmp_splits, four.cmp_splits);
      EXPECT_EQ(eight.split_rows, four.split_rows);
    }
  }
  // Any other count falls back to the default, 8 warps.
  const Plan odd = plan_nsa_decode(1, 1, 64, 4, 128, 128, 8192, 511, 32, 16, 64, 16, 512, kAll, 0, kH100Sms, 6);
  EXPECT_EQ(odd.cmp_warps, 8);
}

}  // namespace
}  // namespace sparseattn::test
