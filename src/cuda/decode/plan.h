// Host-only planning of flash_decode on CUDA: the tile of the split-KV kernel (rows, warps, pipeline stages,
// shared memory) and the number and length of the KV splits, from shapes and the device's SM count only.
// Plain C++ (no CUDA headers) so that tests/cpp checks it on machines without a GPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace sparseattn::cuda::decode {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = 32 * kWarps;
// Keys per K/V tile, and per chunk: a chunk of 16 keys is the unit of the paged address lookup, so a page size
// that is a multiple of 16 never lets a chunk straddle two pages.
inline constexpr int kTileKeys = 64;
inline constexpr int kChunkKeys = 16;
inline constexpr int kChunks = kTileKeys / kChunkKeys;
inline constexpr int kMaxQueries = 16;  // Tq
// The heuristic's bounds: at most this many splits, and splits of at least this many keys, so that writing and
// merging the float32 partials (G * Tq rows of Dv floats per split) stays small next to reading the split's K/V.
inline constexpr std::int64_t kMaxHeuristicSplits = 128;
// Splits a call may ask for (more are capped here): the combine kernel keeps a row's split weights in shared memory.
inline constexpr int kMaxSplits = 256;
inline constexpr std::int64_t kMinSplitKeys = 512;
// The shared memory the K/V pipeline aims for: 96 KB (two CTAs per SM on sm_90 at head dim 128); at least two
// stages, at most six.
inline constexpr std::size_t kPipelineTargetBytes = 96 * 1024;

// The rows of a CTA (16 per warp row) come from the query rows of one KV head: G * Tq rows. Four warps are
// arranged as kWarpsM x kWarpsN: kWarpsM 16-row tiles, and each K/V tile's keys split kWarpsN ways.
constexpr int warps_m_for(std::int64_t rows) { return rows <= 16 ? 1 : rows <= 32 ? 2 : 4; }

constexpr int pipeline_stages(int dqk, int dv) {
  const std::size_t stage = std::size_t{2} * kTileKeys * static_cast<std::size_t>(dqk + dv);
  return static_cast<int>(std::clamp<std::size_t>(kPipelineTargetBytes / stage, 2, 6));
}

// Dynamic shared memory of a CTA: the Q tile, then the K/V stages, which the epilogue reuses for the kWarpsN
// partial accumulators (rows padded to Dv + 8 floats) and their row maxima and sums.
constexpr std::size_t q_tile_bytes(int dqk, int warps_m) { return std::size_t{2} * 16 * warps_m * dqk; }
constexpr std::size_t pipeline_bytes(int dqk, int dv) {
  return std::size_t{2} * kTileKeys * static_cast<std::size_t>(dqk + dv) * pipeline_stages(dqk, dv);
}
constexpr std::size_t epilogue_bytes(int dv, int warps_m) {
  const std::size_t warps_n = kWarps / warps_m, rows = 16 * static_cast<std::size_t>(warps_m);
  return 4 * warps_n * rows * (static_cast<std::size_t>(dv) + 8 + 2);
}
constexpr std::size_t smem_bytes(int dqk, int dv, int warps_m) {
  return q_tile_bytes(dqk, warps_m) + std::max(pipeline_bytes(dqk, dv), epilogue_bytes(dv, warps_m));
}

struct DecodePlan {
  int warps_m = 1;
  std::int64_t rows = 0;        // G * Tq query rows per (sequence, KV head)
  std::int64_t row_blocks = 0;  // CTAs over those rows: ceil(rows / (16 * warps_m))
  std::int64_t capacity = 0;    // keys a sequence can hold: S, or max_pages * page_size
  std::int64_t splits = 1;      // P
  std::int64_t split_keys = kTileKeys;  // keys per split, a multiple of kTileKeys; split p: [p * L, (p + 1) * L)
  std::size_t smem = 0;
  std::int64_t ctas() const { return row_blocks * splits; }  // per (sequence, KV head)
};

inline std::int64_t ceil_div_host(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The splits of `capacity` keys when `base_ctas` CTAs (sequences x KV heads x row blocks) share a device of `sms`
// SMs that each hold `ctas_per_sm` of them. requested > 0 is the caller's count (at most one split per tile of
// keys and at most kMaxSplits); 0 asks for the heuristic: as many splits as keep every CTA resident at once (one
// wave), at most kMaxHeuristicSplits and none shorter than kMinSplitKeys. The split length is rounded up to whole
// tiles, so the count actually used (returned) can be below the one asked for.
inline std::int64_t plan_splits(std::int64_t capacity, std::int64_t base_ctas, int sms, int ctas_per_sm,
                                std::int64_t requested, std::int64_t* split_keys) {
  const std::int64_t tiles = ceil_div_host(capacity, kTileKeys);
  std::int64_t splits = requested;
  if (splits <= 0) {
    const std::int64_t slots = std::int64_t{std::max(sms, 1)} * std::max(ctas_per_sm, 1);
    splits = std::min({slots / std::max<std::int64_t>(base_ctas, 1), kMaxHeuristicSplits,
                       ceil_div_host(capacity, kMinSplitKeys)});
  }
  splits = std::clamp<std::int64_t>(splits, 1, std::max<std::int64_t>(std::min<std::int64_t>(tiles, kMaxSplits), 1));
  const std::int64_t tiles_per_split =
      std::max<std::int64_t>(ceil_div_host(ceil_div_host(capacity, splits), kTileKeys), 1);
  const std::int64_t keys = tiles_per_split * kTileKeys;
  *split_keys = keys;
  return std::max<std::int64_t>(ceil_div_host(capacity, keys), 1);
}

inline DecodePlan plan_decode(std::int64_t batch, std::int64_t q_len, std::int64_t q_heads, std::int64_t kv_heads,
                              int dqk, int dv, std::int64_t capacity, std::int64_t requested_splits, int sms,
                              std::size_t smem_per_sm) {
  DecodePlan plan;
  if (kv_heads <= 0 || q_heads % kv_heads != 0) return plan;
  plan.rows = q_heads / kv_heads * q_len;
  plan.warps_m = warps_m_for(plan.rows);
  plan.row_blocks = ceil_div_host(plan.rows, 16 * plan.warps_m);
  plan.capacity = capacity;
  plan.smem = smem_bytes(dqk, dv, plan.warps_m);
  // Each resident CTA also takes 1 KB of shared memory the runtime reserves.
  const int ctas_per_sm = static_cast<int>(std::clamp<std::size_t>(smem_per_sm / (plan.smem + 1024), 1, 8));
  plan.splits = plan_splits(capacity, batch * kv_heads * plan.row_blocks, sms, ctas_per_sm, requested_splits,
                            &plan.split_keys);
  return plan;
}

// Splits merge in groups of kMergeFan (group g: splits [g * kMergeFan, (g + 1) * kMergeFan)): the last CTA of a
// group to finish merges the group's partials, and with more than one group the last group merger merges the
// groups' results. Each merge reads at most max(kMergeFan, groups) partials per row.
inline constexpr int kMergeFan = 8;
constexpr std::int64_t merge_groups(std::int64_t splits) { return (splits + kMergeFan - 1) / kMergeFan; }

// Workspace: the float32 partial outputs [P, B, Hq, Tq, Dv], then the partial lse [P, B, Hq, Tq]; with more than
// one merge group the groups' outputs [Q, B, Hq, Tq, Dv] and lse [Q, B, Hq, Tq]; then the int32 arrival counters,
// Q + 1 per (sequence, KV head, row block) (Q for the groups, one for the groups' merge), which the call zeroes
// before the kernel. Each slice at a 256-byte offset; none with a single split (the kernel writes o directly).
struct DecodeWorkspace {
  std::size_t o_bytes = 0, lse_offset = 0, group_o_offset = 0, group_lse_offset = 0, counters_offset = 0;
  std::size_t counter_bytes = 0, bytes = 0;
};

inline DecodeWorkspace decode_workspace(const DecodePlan& plan, std::int64_t batch, std::int64_t q_heads,
                                        std::int64_t kv_heads, std::int64_t q_len, std::int64_t dv) {
  DecodeWorkspace w;
  if (plan.splits <= 1) return w;
  const auto align = [](std::size_t x) { return (x + 255) / 256 * 256; };
  const auto rows_per_slot = static_cast<std::size_t>(batch * q_heads * q_len);
  const auto rows = static_cast<std::size_t>(plan.splits) * rows_per_slot;
  const std::int64_t groups = merge_groups(plan.splits);
  const auto group_rows = groups > 1 ? static_cast<std::size_t>(groups) * rows_per_slot : 0;
  w.o_bytes = rows * static_cast<std::size_t>(dv) * sizeof(float);
  w.lse_offset = align(w.o_bytes);
  w.group_o_offset = w.lse_offset + align(rows * sizeof(float));
  w.group_lse_offset = w.group_o_offset + align(group_rows * static_cast<std::size_t>(dv) * sizeof(float));
  w.counters_offset = w.group_lse_offset + align(group_rows * sizeof(float));
  w.counter_bytes = static_cast<std::size_t>(batch * kv_heads) * static_cast<std::size_t>(plan.row_blocks) *
                    static_cast<std::size_t>(groups + 1) * sizeof(std::int32_t);
  w.bytes = w.counters_offset + align(w.counter_bytes);
  return w;
}

}  // namespace sparseattn::cuda::decode
