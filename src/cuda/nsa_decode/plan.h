// Host-only planning of nsa_decode on CUDA: the splits of the compressed rows, the pieces of the selected and
// window keys, shared-memory sizes and the workspace layout, from shapes, config and the SM count only (never from
// cache_seqlens or block_table, so one plan serves every replay of a captured graph). Plain C++ (no CUDA headers).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>

namespace sparseattn::cuda::nsa_dec {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = 32 * kWarps;
// The compressed kernel runs on CTAs of 2 * kWarps warps (half a 16-key chunk per warp: twice the warps per SM in
// the same shared memory, for a kernel bound by its own instruction latency) or, where the environment sets
// kCompressedWarpsEnv=4, of kWarps warps: an A/B switch read on the host at each call (the plan's sizes do not
// depend on it).
inline constexpr const char* kCompressedWarpsEnv = "SPARSEATTN_NSA_DECODE_WARPS";
inline int compressed_warps_of(const char* value) {
  return value != nullptr && std::strcmp(value, "4") == 0 ? kWarps : 2 * kWarps;
}
inline constexpr int kRows = 16;        // one m16 tile of rows: the group's query heads (G <= 16), padded
inline constexpr int kTileKeys = 64;    // keys per pipeline stage: four 16-key chunks, one per warp
inline constexpr int kChunkKeys = 16;   // the unit of a page lookup and of a key mask interval
inline constexpr int kChunks = kTileKeys / kChunkKeys;
inline constexpr int kSelectThreads = 256;
// Split weights of the select kernel kept in shared memory (splits x group); more are recomputed where used.
inline constexpr int kSplitWeights = 4096;
// Candidate blocks whose scores the select kernel keeps in shared memory (256K tokens at l' = 64); longer
// sequences keep them in the workspace.
inline constexpr int kSelectSharedScores = 4096;
// Partials whose lse the combine kernel stages in shared memory per branch.
inline constexpr int kMergeShared = 1024;
// The compressed split's logits stay in shared memory for the pooling (16 rows x split_rows floats).
inline constexpr std::int64_t kMaxSplitRows = 512;
inline constexpr std::int64_t kMaxTilesPerPiece = 8;
// The select kernel keeps a query's chosen blocks in a fixed array.
inline constexpr std::int64_t kMaxSelected = 64;
// Up to this many partials per output row (compressed splits plus selected and window pieces), the last sparse CTA
// of a query's group does the gated combine itself (no combine launch); beyond, the combine kernel does it.
inline constexpr std::int64_t kFusedCombineMax = 16;

struct Plan {
  std::int64_t batch = 0, q_len = 0, q_heads = 0, kv_heads = 0, group = 0, dqk = 0, dv = 0;
  std::int64_t capacity = 0, max_cmp = 0;
  bool has_cmp = false, has_sel = false, has_swa = false;
  bool compressed = false;  // the compressed pass runs (g_cmp or g_slc)
  bool fused_combine = false;  // the sparse kernel's last CTA of each list combines (kFusedCombineMax)
  int cmp_warps = 2 * kWarps;  // warps per CTA of the compressed kernel (kCompressedWarpsEnv)
  // Compressed rows: split p covers rows [p * split_rows, (p + 1) * split_rows); its pooled scores cover selection
  // blocks [p * split_rows * d / l', + score_span).
  std::int64_t split_rows = 0, cmp_splits = 0, score_span = 0;
  std::int64_t max_blocks = 0;  // selection blocks of a full sequence: ceil(capacity / l')
  // Selected and window keys in 16-key chunks, cut into pieces of tiles_per_piece tiles (4 chunks each).
  std::int64_t sel_chunks = 0, swa_chunks = 0, tiles_per_piece = 1, sel_pieces = 0, swa_pieces = 0;
  // Workspace byte offsets (256-byte aligned) and total.
  std::size_t cmp_o = 0, cmp_lse = 0, cmp_score = 0, scores = 0, indices = 0, piece_o = 0, piece_lse = 0;
  std::size_t counters = 0, counter_bytes = 0, bytes = 0;  // int32 arrivals per list, zeroed by the call
  std::size_t attend_smem = 0, cmp_smem = 0;

  std::int64_t rows_q() const { return batch * q_len * q_heads; }
  std::int64_t pieces() const { return sel_pieces + swa_pieces; }
};

inline std::int64_t ceil_div_host(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }
inline std::size_t align256(std::size_t x) { return (x + 255) / 256 * 256; }

// Shared memory of the attention kernels: the Q tile, then two K/V stages, which the epilogue reuses for the four
// warps' accumulators (rows padded to Dv + 8 floats) and their row maxima and sums; the compressed kernel adds its
// split's logits.
constexpr std::size_t attend_smem_bytes(std::int64_t dqk, std::int64_t dv) {
  const std::size_t q = 2 * kRows * static_cast<std::size_t>(dqk);
  const std::size_t pipe = 2 * 2 * kTileKeys * static_cast<std::size_t>(dqk + dv);
  const std::size_t epilogue = 4 * kWarps * kRows * static_cast<std::size_t>(dv + 8 + 2);
  return q + std::max(pipe, epilogue);
}

inline Plan plan_nsa_decode(std::int64_t batch, std::int64_t q_len, std::int64_t q_heads, std::int64_t kv_heads,
                            std::int64_t dqk, std::int64_t dv, std::int64_t capacity, std::int64_t max_cmp,
                            std::int64_t cmp_block, std::int64_t cmp_stride, std::int64_t sel_block,
                            std::int64_t num_selected, std::int64_t window, const bool (&branch)[3],
                            std::int64_t requested_splits, int sms, int cmp_warps = 2 * kWarps) {
  Plan p;
  if (kv_heads <= 0 || q_heads % kv_heads != 0 || cmp_stride <= 0 || sel_block <= 0) return p;
  p.batch = batch, p.q_len = q_len, p.q_heads = q_heads, p.kv_heads = kv_heads, p.group = q_heads / kv_heads;
  p.dqk = dqk, p.dv = dv, p.capacity = capacity, p.max_cmp = max_cmp;
  p.has_cmp = branch[0], p.has_sel = branch[1], p.has_swa = branch[2];
  p.compressed = p.has_cmp || p.has_sel;
  p.cmp_warps = cmp_warps == kWarps ? kWarps : 2 * kWarps;
  const std::int64_t base = std::max<std::int64_t>(batch * q_len * kv_heads, 1);
  const std::int64_t slots = 2 * std::int64_t{std::max(sms, 1)};
  if (p.compressed) {
    // Splits start on selection-block boundaries (split_rows * d a multiple of l') and hold whole tiles.
    const std::int64_t unit = std::lcm<std::int64_t>(kTileKeys, sel_block / std::gcd(sel_block, cmp_stride));
    const std::int64_t cap = std::max(kMaxSplitRows / unit * unit, unit);
    const std::int64_t wanted =
        requested_splits > 0 ? requested_splits : std::max<std::int64_t>(slots / base, 1);
    p.split_rows = std::clamp(ceil_div_host(ceil_div_host(std::max<std::int64_t>(max_cmp, 1), wanted), unit) * unit,
                              unit, cap);
    p.cmp_splits = std::max<std::int64_t>(ceil_div_host(max_cmp, p.split_rows), 1);
    p.score_span = (p.split_rows * cmp_stride - cmp_stride + cmp_block - 1) / sel_block + 1;
    p.max_blocks = ceil_div_host(capacity, sel_block);
  }
  const std::int64_t sel_tiles = p.has_sel ? ceil_div_host(num_selected * sel_block / kChunkKeys, kChunks) : 0;
  if (p.has_sel) p.sel_chunks = num_selected * sel_block / kChunkKeys;
  if (p.has_swa) {
    p.swa_chunks = std::min(ceil_div_host(window - 1, kChunkKeys) + 1, ceil_div_host(capacity, kChunkKeys));
    p.swa_chunks = std::max<std::int64_t>(p.swa_chunks, 1);
  }
  const std::int64_t swa_tiles = ceil_div_host(p.swa_chunks, kChunks);
  p.tiles_per_piece =
      std::clamp<std::int64_t>(ceil_div_host(base * (sel_tiles + swa_tiles), slots), 1, kMaxTilesPerPiece);
  p.sel_pieces = ceil_div_host(sel_tiles, p.tiles_per_piece);
  p.swa_pieces = ceil_div_host(swa_tiles, p.tiles_per_piece);
  p.fused_combine = p.pieces() > 0 && (p.has_cmp ? p.cmp_splits : 0) + p.pieces() <= kFusedCombineMax;

  const auto rows = static_cast<std::size_t>(p.rows_q());
  std::size_t at = 0;
  const auto slice = [&](std::size_t bytes) {
    const std::size_t offset = at;
    at = align256(at + bytes);
    return offset;
  };
  const auto splits = static_cast<std::size_t>(p.cmp_splits);
  if (p.compressed) {
    p.cmp_o = slice(p.has_cmp ? splits * rows * static_cast<std::size_t>(dv) * 4 : 0);
    p.cmp_lse = slice(splits * rows * 4);
  }
  if (p.has_sel) {
    p.cmp_score = slice(splits * rows * static_cast<std::size_t>(p.score_span) * 4);
    const auto lists = static_cast<std::size_t>(batch * q_len * kv_heads);
    p.scores = slice(lists * static_cast<std::size_t>(p.max_blocks) * 4);
    p.indices = slice(lists * static_cast<std::size_t>(num_selected) * 4);
  }
  const auto pieces = static_cast<std::size_t>(p.pieces());
  p.piece_o = slice(pieces * rows * static_cast<std::size_t>(dv) * 4);
  p.piece_lse = slice(pieces * rows * 4);
  if (p.fused_combine) {
    p.counter_bytes = static_cast<std::size_t>(batch * q_len * kv_heads) * 4;
    p.counters = slice(p.counter_bytes);
  }
  p.bytes = at == 0 ? 0 : at + 256;  // slack for aligning the caller's 16-byte aligned base
  p.attend_smem = attend_smem_bytes(dqk, dv);
  p.cmp_smem = p.attend_smem + (p.compressed ? 4 * kRows * static_cast<std::size_t>(p.split_rows) : 0);
  return p;
}

}  // namespace sparseattn::cuda::nsa_dec
