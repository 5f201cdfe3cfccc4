// select_blocks on tensor cores: for each (token t, KV head h) the group-summed compressed-attention
// probabilities, pooled to selection blocks, and top-n with forced blocks (semantics.md sections 3-4).
//
// A persistent grid of CTAs (8 warps) walks over tiles of (consecutive tokens, KV head h). The tile's 128
// MMA rows are (token, group head) pairs; each token owns Gp rows, Gp = G rounded up to a power of two
// (empty rows give zero probability), so that a token's rows sit in one warp (Gp <= 16: 16 / Gp tokens per
// warp, row i holds token i % (16 / Gp) and head i / (16 / Gp)) or in whole warps (Gp > 16). Per column
// tile of kCols compressed blocks: S = Q K_cmp^T on tensor cores (fp32 accumulate; wgmma on sm_90a, whose
// accumulator rows are the rows each warp owns under mma.sync elsewhere), P = exp2(S * scale * log2e -
// lse * log2e) with the visibility rule (j*stride + block - 1 <= t), summed over the group heads in
// registers (the two rows a thread holds, then a reduce-scatter butterfly over the lanes of the same token:
// each step halves the columns a lane keeps), and pooled into the selection blocks whose compressed blocks
// the column tile holds (tiles overlap by the border blocks, cmp_block/stride - 1 columns, so every pooled
// score comes from one tile: fixed summation order, no atomics, deterministic); at Gp = 16 (one token per warp)
// the pooling takes the group sums from the lanes by shuffles, elsewhere from shared memory. Only the K tile pipeline
// (and, for Gp > 16, the sum across a token's warps) synchronises the CTA. Pooled scores go to the CTA's
// slot of the workspace ([tokens][blocks] fp32: O(T) per CTA, a fixed number of CTAs), then each warp picks
// the top-n of one token's row (choose_blocks: a threshold from the lanes' best blocks, then ranks among the
// few blocks that reach it; ties to the lower index, as the reference's stable sort).
// A query chunk (docs/semantics.md section 11): sequence b's T_b queries are the last of its S_b keys, so every
// rule (visible compressed blocks, candidates, forced blocks) applies at key position t + S_b - T_b; the key
// sequences (`keys`) give S_b and with it the sequence's compressed blocks.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/launch.cuh"
#include "cuda/primitives/sequences.cuh"
#include "cuda/primitives/softmax.cuh"
#include "cuda/primitives/pipeline.cuh"
#include "cuda/primitives/swizzled_tile.cuh"
#include "cuda/primitives/tma.cuh"
#include "cuda/primitives/wgmma.cuh"
#include "cuda/select_blocks/ops.h"
#include "cuda/select_blocks/plan.h"

namespace sparseattn::cuda {

namespace {

using i64 = std::int64_t;

using Config = selection::SelectConfig;

constexpr int kWarps = selection::kSelectWarps;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = selection::kSelectRows;  // MMA rows per tile: (token, group head) pairs
constexpr int kCols = kSelectColumns;          // compressed blocks per column tile
constexpr int kSumPitch = kCols + 8;        // fp32 pitch of the group sums: 64-bit stores hit distinct banks
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kListCap = 64;               // top-n: blocks ranked in the usual path (two per lane)
constexpr int kBins = 256;                 // top-n's fallback: histogram bins of its radix select (8 bits a pass)
// Shared memory per warp for the top-n: the usual path's list of 64-bit keys or the fallback's histogram.
constexpr int kWarpScratch = kListCap * 8 > kBins * 4 ? kListCap * 8 : kBins * 4;

template <int D>
struct Layout {
  static constexpr int kStages = D <= 192 ? 2 : 1;  // 256: one K buffer keeps the CTA within sm_80's 163 KB
  static constexpr std::size_t kQ = std::size_t{2} * kRows * D;
  static constexpr std::size_t kK = std::size_t{2} * kCols * D;
  // Group sums: one row per token (Gp <= 16) or per warp (Gp > 16), 128 rows at most (Gp = 1), after one row
  // whose padding is the zero border of row 0 (see the pooling).
  static constexpr std::size_t kSums = sizeof(float) * (kRows + 1) * kSumPitch;
  // The full barriers of the K stages and of the Q tile (TMA loads) after the top-n scratch.
  static constexpr std::size_t kBarriers = kQ + kStages * kK + kSums + std::size_t{kWarpScratch} * kWarps;
  static constexpr std::size_t kBytes = kBarriers + sizeof(std::uint64_t) * (kStages + 1) + wgmma::kTileAlignment;
};

// First compressed block overlapping selection block b: (b*sel_block - cmp_block) / stride + 1 for b >= 1
// (cmp_block <= sel_block, both multiples of the stride), 0 for b = 0.
__device__ __forceinline__ int first_cmp_block(const Config& c, int b) {
  return b == 0 ? 0 : b * c.cols_per_block - c.border;
}

// Fragments of the mma.sync path from the 128-byte swizzled tiles of wgmma.cuh (conflict-free for ldmatrix
// too): A = rows [r0, r0 + 16) x columns [c0, c0 + 16) of the Q tile; B = two n-tiles, K tile rows
// [n0, n0 + 16) as n and columns [k0, k0 + 16) as k.
template <class T>
__device__ __forceinline__ void load_q_fragment(std::uint32_t (&a)[4], const T* q_tile, int r0, int c0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, q_tile + wgmma::swizzled_offset<kRows>(r0 + lane % 16, c0 + (lane / 16) * 8));
}
template <class T>
__device__ __forceinline__ void load_k_fragments(std::uint32_t (&b)[4], const T* k_tile, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(b, k_tile + wgmma::swizzled_offset<kCols>(n0 + lane % 8 + (lane / 16) * 8, k0 + ((lane / 8) % 2) * 8));
}

// A candidate's rank value: NaN (garbage input) ranks last but still fills a slot (fmaxf returns the number).
// Scores are >= 0 or NaN.
__device__ __forceinline__ float rank_value(float v) { return fmaxf(v, -3.0e38f); }

// Order-preserving map of floats to unsigned integers (-inf lowest, then the negative NaN stand-in, then >= 0).
__device__ __forceinline__ unsigned order_key(float v) {
  const unsigned bits = __float_as_uint(v);
  return (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
}

// A candidate block as one integer: its rank value's order key above the complement of its index, so that
// the larger key is the better block, ties going to the lower index (the reference's stable sort). Keys are
// never 0 (0 stands for "no candidate").
__device__ __forceinline__ std::uint64_t candidate_key(float v, int b) {
  return (std::uint64_t{order_key(rank_value(v))} << 32) | (0xffffffffu - static_cast<unsigned>(b));
}
__device__ __forceinline__ int block_of(std::uint64_t key) {
  return static_cast<int>(0xffffffffu - static_cast<unsigned>(key));
}

// The n-th largest (1 <= n <= 32 * kPerLane) of the warp's values (element e * 32 + lane is value[e]): a
// bitonic sort of them across the warp, descending.
template <int kPerLane>
__device__ __forceinline__ float warp_nth_largest(float (&value)[kPerLane], int n) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 2; k <= 32 * kPerLane; k *= 2) {
#pragma unroll
    for (int j = k / 2; j > 0; j /= 2) {
      if (j == 32) {  // kPerLane == 2, k == 64: a lane's two elements are the pair, the first keeps the max
        const float larger = fmaxf(value[0], value[1]);
        value[1] = fminf(value[0], value[1]);
        value[0] = larger;
        continue;
      }
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int i = e * 32 + lane;
        const float other = __shfl_xor_sync(0xffffffffu, value[e], j);
        const bool keep_max = ((i & j) == 0) == ((i & k) == 0);
        value[e] = keep_max ? fmaxf(other, value[e]) : fminf(other, value[e]);
      }
    }
  }
  return __shfl_sync(0xffffffffu, n <= 32 ? value[0] : value[kPerLane - 1], (n - 1) % 32);
}

// Top-n of one token's pooled row (`row`, `candidates` blocks) by one warp; writes `out[0..n)` ascending, -1
// padded. The forced blocks (the first init, the last local) go straight to their places; `need` more come
// from the blocks between them, [init, local_lo).
//  - Usual path (need <= 32): the blocks fall into classes by their offset from init, modulo 32 (need <= 16) or
//    64 (need <= 32; lane l holds the classes l and l + 32). The need-th largest of the classes' best rank values
//    is a threshold that at least need blocks reach, so the chosen blocks are among those at or above it. With
//    scores of any spread these are few (about need + need / 2 for random rows; 64 classes from need = 17 on,
//    because with 32 classes and need = 29 about 70 blocks reach the threshold, more than the list holds): they
//    are compacted into `list` (ascending block order) as candidate keys and each is ranked against the others.
//    The two passes over the row compare floats; only the few kept blocks build a 64-bit key.
//  - Otherwise (need > 32, or more than kListCap blocks reach the threshold: ties, or the best blocks sharing
//    a class): an exact radix select of the need-th largest order key, 8 bits a pass (a 256-bin histogram in
//    the warp's scratch), then one ascending pass taking the blocks above it and, of those equal to it, the
//    first ones (ties to the lower index). Five passes over the row whatever need and the ties are, where
//    picking blocks one argmax at a time would take a warp reduction and a rescan per chosen block.
__device__ void choose_blocks(const float* row, int candidates, const Config& c, std::int32_t* out,
                              std::uint64_t* list) {
  const int lane = threadIdx.x % 32;
  const int init = static_cast<int>(min(c.num_init, i64{candidates}));
  const int local_lo = max(init, candidates - static_cast<int>(min(c.num_local, i64{candidates})));
  const int count = static_cast<int>(min(c.num_selected, i64{candidates}));
  const int need = count - init - (candidates - local_lo);  // >= 0: num_init + num_local <= num_selected
  for (int i = lane; i < init; i += 32) out[i] = i;
  for (int i = lane; i < candidates - local_lo; i += 32) out[init + need + i] = local_lo + i;
  for (i64 i = count + lane; i < c.num_selected; i += 32) out[i] = -1;
  if (need == 0) return;
  if (need <= 32) {
    // A class without blocks keeps -inf; [init, local_lo) holds >= need consecutive blocks, so >= need classes.
    float threshold;
    if (need <= 16) {
      float best[1] = {-INFINITY};
      for (int b = init + lane; b < local_lo; b += 32) best[0] = fmaxf(best[0], rank_value(row[b]));
      threshold = warp_nth_largest(best, need);
    } else {
      float best[2] = {-INFINITY, -INFINITY};
      for (int b = init + lane; b < local_lo; b += 64) {
        best[0] = fmaxf(best[0], rank_value(row[b]));
        if (b + 32 < local_lo) best[1] = fmaxf(best[1], rank_value(row[b + 32]));
      }
      threshold = warp_nth_largest(best, need);
    }
    int size = 0;
    for (int base = init; base < local_lo; base += 32) {
      const int b = base + lane;
      const bool keep = b < local_lo && rank_value(row[b]) >= threshold;
      const unsigned ballot = __ballot_sync(0xffffffffu, keep);
      const int slot = size + __popc(ballot & ((1u << lane) - 1u));
      if (keep && slot < kListCap) list[slot] = candidate_key(row[b], b);
      size += __popc(ballot);
    }
    if (size <= kListCap) {
      __syncwarp();
      std::uint64_t mine[2];
      int better[2] = {0, 0};
#pragma unroll
      for (int e = 0; e < 2; ++e) mine[e] = lane + 32 * e < size ? list[lane + 32 * e] : ~std::uint64_t{0};
      for (int j = 0; j < size; ++j) {
        const std::uint64_t other = list[j];
        better[0] += other > mine[0];
        better[1] += other > mine[1];
      }
      // The list is in ascending block order, so a chosen block's place is the number of chosen ones before it.
      const unsigned chosen0 = __ballot_sync(0xffffffffu, lane < size && better[0] < need);
      const unsigned chosen1 = __ballot_sync(0xffffffffu, lane + 32 < size && better[1] < need);
      const unsigned below = (1u << lane) - 1u;
      if ((chosen0 >> lane) & 1u) out[init + __popc(chosen0 & below)] = block_of(mine[0]);
      if ((chosen1 >> lane) & 1u) out[init + __popc(chosen0) + __popc(chosen1 & below)] = block_of(mine[1]);
      __syncwarp();  // the list is read before the warp's next token overwrites it
      return;
    }
  }
  unsigned* const histogram = reinterpret_cast<unsigned*>(list);
  const unsigned below = (1u << lane) - 1u;
  unsigned prefix = 0, prefix_mask = 0;  // the high bits of the need-th largest key found so far
  int remaining = need;                  // how many of the blocks under the prefix are still to choose
#pragma unroll 1
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = lane; i < kBins; i += 32) histogram[i] = 0;
    __syncwarp();
    for (int b = init + lane; b < local_lo; b += 32) {
      const unsigned key = order_key(rank_value(row[b]));
      if ((key & prefix_mask) == prefix) atomicAdd(&histogram[(key >> shift) & (kBins - 1)], 1u);
    }
    __syncwarp();
    // Lane l holds the 8 bins from the top down, 255 - 8 l .. 248 - 8 l; `above`: blocks in higher lanes' bins.
    unsigned count[8], mine = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) mine += count[i] = histogram[kBins - 1 - 8 * lane - i];
    unsigned above = mine;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const unsigned x = __shfl_up_sync(0xffffffffu, above, d);
      if (lane >= d) above += x;
    }
    above -= mine;
    const unsigned need_u = static_cast<unsigned>(remaining);
    const int owner = __ffs(__ballot_sync(0xffffffffu, above < need_u && need_u <= above + mine)) - 1;
    int bin = 0;
    bool found = false;
    unsigned higher = above;  // blocks in bins above the one holding the remaining-th
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (found) continue;
      found = higher + count[i] >= need_u;
      if (found) {
        bin = kBins - 1 - 8 * lane - i;
      } else {
        higher += count[i];
      }
    }
    bin = __shfl_sync(0xffffffffu, bin, owner);
    higher = __shfl_sync(0xffffffffu, higher, owner);
    prefix |= static_cast<unsigned>(bin) << shift;
    prefix_mask |= static_cast<unsigned>(kBins - 1) << shift;
    remaining -= static_cast<int>(higher);
    __syncwarp();  // the histogram is read before the next pass clears it
  }
  // prefix is the need-th largest key: every block above it is chosen, and the first `remaining` equal to it.
  int written = init, equal_seen = 0;
  for (int base = init; base < local_lo; base += 32) {
    const int b = base + lane;
    const bool inside = b < local_lo;
    const unsigned key = inside ? order_key(rank_value(row[b])) : 0u;
    const unsigned equal = __ballot_sync(0xffffffffu, inside && key == prefix);
    const bool chosen =
        inside && (key > prefix || (key == prefix && equal_seen + __popc(equal & below) < remaining));
    const unsigned ballot = __ballot_sync(0xffffffffu, chosen);
    if (chosen) out[written + __popc(ballot & below)] = b;
    written += __popc(ballot);
    equal_seen += __popc(equal);
  }
  __syncwarp();  // the histogram is read before the warp's next token overwrites it
}

// Sums the probabilities p (the warp's 16 x kCols accumulator tile) over the rows of each token, for Gp >= 2. A
// thread's two rows (lane / 4 and lane / 4 + 8) belong to one token from Gp = 2 on; from Gp = 4 on, lanes whose
// lane / 4 differ in the bits 16 / Gp .. 4 do too. Each butterfly step exchanges half of the n-tiles a lane keeps
// with its partner (xor 16, 8, 4): after s steps a lane keeps 8 >> s n-tiles, from n-tile `first` on, in `v`.
// At Gp >= 16 (three steps) lane l keeps columns 2l and 2l + 1 of the warp's token.
template <int kRowsPerToken>
struct GroupSumSteps {
  static constexpr int kSteps = kRowsPerToken >= 16 ? 3 : kRowsPerToken == 8 ? 2 : kRowsPerToken == 4 ? 1 : 0;
  static constexpr int kTokens = kRowsPerToken >= 16 ? 1 : 16 / kRowsPerToken;  // tokens per warp
  static constexpr int kKept = (kCols / 8) >> kSteps;                            // n-tiles a lane keeps
};
template <int kRowsPerToken>
__device__ __forceinline__ int reduce_scatter_group_sums(const float (&p)[kCols / 8][4],
                                                         float (&v)[kCols / 8][2]) {
  constexpr int kTiles = kCols / 8;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
    v[n][0] = p[n][0] + p[n][2];
    v[n][1] = p[n][1] + p[n][3];
  }
  int first = 0;
#pragma unroll
  for (int step = 0; step < GroupSumSteps<kRowsPerToken>::kSteps; ++step) {
    const int half = (kTiles / 2) >> step, mask = 16 >> step;
    const bool upper = (lane & mask) != 0;  // keeps the upper half of its n-tiles
#pragma unroll
    for (int n = 0; n < half; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float send = upper ? v[n][e] : v[n + half][e];
        const float keep = upper ? v[n + half][e] : v[n][e];
        v[n][e] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
      }
    }
    if (upper) first += half;
  }
  return first;
}

// Stores the group sums to `sums`, one row of kSumPitch floats per token of the warp (Gp <= 16: 16 / Gp tokens;
// Gp >= 16: the warp's share of its token).
template <int kRowsPerToken>
__device__ __forceinline__ void store_group_sums(const float (&p)[kCols / 8][4], float* sums) {
  constexpr int kTiles = kCols / 8;
  const int lane = threadIdx.x % 32, quad = lane % 4, g = lane / 4;
  if constexpr (kRowsPerToken == 1) {  // row i is token i of the warp
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
      *reinterpret_cast<float2*>(sums + g * kSumPitch + n * 8 + 2 * quad) = make_float2(p[n][0], p[n][1]);
      *reinterpret_cast<float2*>(sums + (g + 8) * kSumPitch + n * 8 + 2 * quad) = make_float2(p[n][2], p[n][3]);
    }
  } else {
    using Steps = GroupSumSteps<kRowsPerToken>;
    float v[kTiles][2];
    const int first = reduce_scatter_group_sums<kRowsPerToken>(p, v);
    float* row = sums + (g % Steps::kTokens) * kSumPitch;
#pragma unroll
    for (int n = 0; n < Steps::kKept; ++n) {
      *reinterpret_cast<float2*>(row + (first + n) * 8 + 2 * quad) = make_float2(v[n][0], v[n][1]);
    }
  }
}

// The pooling of one warp's token at Gp = 16 straight from the lanes' group sums (`pair`: columns 2l and 2l + 1
// of lane l), for an even cols_per_block: lane bb computes selection block bb of the column tile, sum_s taps[s] *
// column(bb * cols_per_block + s - shift) in the shared-memory pooling's order (columns before 0 read 0), so the
// scores are bit for bit that pooling's. A tap's column parity is the same in every lane, so one shuffle fetches it.
template <int kTaps>
__device__ __forceinline__ float pool_from_lanes(const float (&pair)[2], const Config& c, int shift) {
  const int bb = threadIdx.x % 32;
  float score = 0.f;
#pragma unroll
  for (int s = 0; s < kTaps; ++s) {
    const int col = bb * c.cols_per_block + s - shift;
    const float x = __shfl_sync(0xffffffffu, ((s - shift) & 1) != 0 ? pair[1] : pair[0], (col >> 1) & 31);
    score = fmaf(c.taps[s], col >= 0 ? x : 0.f, score);
  }
  return score;
}

// A CTA's work item `tile`: KV head h of the sequence's tokens [t0, t0 + tokens_per_tile). Longest tokens first
// (position tiles descending), so that the CTAs' round-robin over the items ends with the cheap ones.
struct TileCoordinates {
  i64 h, sequence, t0;
};
__device__ __forceinline__ TileCoordinates tile_coordinates(const Config& c, i64 tile) {
  const i64 rest = tile / c.heads_kv;
  return {tile % c.heads_kv, rest % c.batch, (c.position_tiles - 1 - rest / c.batch) * c.tokens_per_tile};
}

// Two CTAs per SM fit in shared memory up to D = 128 (109 KB each at 128); registers are capped to match.
// kWgmma: S on warpgroup MMAs (sm_90a; warpgroup g computes rows 64g..64g+63, the warps' rows of mma.sync);
// otherwise on mma.sync. Both read the same swizzled Q and K tiles.
// c.k_by_tma (wgmma kernels on sm_90a only): thread 0 loads each K tile with TMA boxes of `k_map` (128-byte swizzled
// panels, the layout load_swizzled_tile writes) whose bytes complete the stage's full barrier; every thread waits on
// it. Rows past the sequence's compressed blocks then hold the next sequence's keys or zeros (past the tensor), not
// the zeros cp.async writes: their columns are past every row's visible blocks, so the mask zeroes them.
template <class T, int D, bool kWgmma>
__global__ void __launch_bounds__(kThreads, D <= 128 ? 2 : 1)
    select_blocks_kernel(Tokens<const T> q, Tokens<const T> k_cmp, LseView<const float> lse, Tokens<std::int32_t> out,
                         SeqTable seqs, SeqTable keys, const std::int32_t* cu_seqlens_cmp, Config c, float* slots,
                         const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap q_map) {
  if constexpr (kWgmma && !SPARSEATTN_WGMMA_ENABLED) return;  // not launched: wgmma::kernel_runs is false
  using L = Layout<D>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + (-shared_address(smem_raw) & (wgmma::kTileAlignment - 1));
  T* const q_tile = reinterpret_cast<T*>(smem);
  T* const k_base = reinterpret_cast<T*>(smem + L::kQ);
  float* const sums = reinterpret_cast<float*>(smem + L::kQ + L::kStages * L::kK) + kSumPitch;  // [kRows][kSumPitch]
  float* const slot = slots + static_cast<i64>(blockIdx.x) * c.tokens_per_tile * c.slot_blocks;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  std::uint64_t* const list =
      reinterpret_cast<std::uint64_t*>(reinterpret_cast<unsigned char*>(sums + kRows * kSumPitch) + warp * kWarpScratch);
  // The top-n's row copies: each warp's share of the Q, K and sums space, or (Q by TMA, whose next tile's copy is in
  // flight during the top-n) of the K and sums space only.
  constexpr int kStageFloats =
      static_cast<int>((L::kQ + L::kStages * L::kK + L::kSums) / sizeof(float) / kWarps) / 8 * 8;
  constexpr int kStageFloatsPastQ = static_cast<int>((L::kStages * L::kK + L::kSums) / sizeof(float) / kWarps) / 8 * 8;
  static_assert(kStageFloats % 8 == 0 && kStageFloatsPastQ % 8 == 0,
                "stages and their halves start at 16-byte boundaries (cp.async)");
  const bool k_by_tma = kWgmma && c.k_by_tma, q_by_tma = k_by_tma && c.q_by_tma;
  const int stage_floats = q_by_tma ? kStageFloatsPastQ : kStageFloats;
  float* const stage = reinterpret_cast<float*>(smem + (q_by_tma ? L::kQ : 0)) + warp * stage_floats;
  std::uint64_t* const k_full = reinterpret_cast<std::uint64_t*>(smem + L::kBarriers);  // TMA: one per K stage
  std::uint64_t* const q_full = k_full + L::kStages;                                   // TMA: the Q tile's
  unsigned k_phases = 0;  // TMA: bit s is the parity of stage s's next full phase
  unsigned q_phase = 0;   // TMA: the parity of the Q tile's next full phase
  // Q by TMA (G = 16): the tile's 8 tokens x 16 heads are box rows token * 16 + head, the kernel's row order at one
  // token per warp. Thread 0 issues tile `tile`'s copy (every tile index, also one the loop skips, so that each
  // phase has one wait).
  const auto load_q_tile = [&](i64 tile) {
    const TileCoordinates at = tile_coordinates(c, tile);
    const auto seq = seqs[at.sequence];
    tma::load_tile<kRows, D>(q_tile, &q_map, q_full, static_cast<int>(at.h * c.group),
                             static_cast<int>(seq.begin + at.t0), static_cast<int>(seq.batch));
  };
  if (k_by_tma) {
    if (tid == 0) {
      for (int s = 0; s < L::kStages + 1; ++s) pipeline::init(k_full + s, 1);
      pipeline::fence_init();
      tma::prefetch_map(&k_map);
      if (q_by_tma) {
        tma::prefetch_map(&q_map);
        if (blockIdx.x < c.position_tiles * c.batch * c.heads_kv) load_q_tile(blockIdx.x);
      }
    }
    __syncthreads();
  }
  const i64 G = c.group, M = c.tokens_per_tile;
  const int tpw = c.tokens_per_warp, wpt = c.warps_per_token;
  // The tile token and group head of tile row 16 * w + i (see the header: Gp rows per token).
  const auto token_of = [&](int w, int i) { return (w / wpt) * tpw + i % tpw; };
  const auto head_of = [&](int w, int i) { return (w % wpt) * 16 + i / tpw; };
  // This thread's rows: lane / 4 and lane / 4 + 8 of the warp's 16.
  const int row_token[2] = {token_of(warp, lane / 4), token_of(warp, lane / 4 + 8)};
  const int row_head[2] = {head_of(warp, lane / 4), head_of(warp, lane / 4 + 8)};
  // Pooling: Gp <= 16, each warp pools its own tokens; Gp > 16, the CTA pools all tokens after a barrier.
  // A pooling thread takes a token and every block_lanes-th selection block of a column tile, then the next token
  // token_lanes on. block_lanes is at least 8 so that a warp's stores cover 32-byte pieces of its tokens' rows
  // (with one token per thread, a store at G = 1 touches 16 rows); otherwise every token has its own thread.
  const int pool_thread = wpt == 1 ? lane : tid, pool_threads = wpt == 1 ? 32 : kThreads;
  const int pool_tokens = wpt == 1 ? tpw : static_cast<int>(M);
  const int block_lanes = max(pool_threads / pool_tokens, 8), token_lanes = pool_threads / block_lanes;
  const int pool_block = pool_thread / token_lanes;                                 // this thread's first block
  const int pool_first = (wpt == 1 ? warp * tpw : 0) + pool_thread % token_lanes;  // this thread's first token
  const int pool_end = wpt == 1 ? (warp + 1) * tpw : static_cast<int>(M);          // past the pooled tokens

  // wgmma descriptors of this warpgroup's 64 Q rows and of K stage 0 (the loops add offsets).
  const std::uint64_t q_desc = wgmma::k_major_descriptor<kRows>(q_tile, 64 * wgmma::warpgroup_index(), 0);
  const std::uint64_t k_desc0 = wgmma::k_major_descriptor<kCols>(k_base, 0, 0);

  const i64 tiles = c.position_tiles * c.batch * c.heads_kv;
  for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const TileCoordinates at = tile_coordinates(c, tile);
    const i64 h = at.h, sq = at.sequence, t0 = at.t0;
    const auto seq = seqs[sq];
    if (t0 >= seq.length) {
      if (q_by_tma) {  // the copy of this tile's Q lands before the next one starts
        pipeline::wait(q_full, q_phase);
        q_phase ^= 1u;
        __syncthreads();  // every thread has seen this phase complete before the next one can
        if (tid == 0 && tile + gridDim.x < tiles) load_q_tile(tile + gridDim.x);
      }
      continue;
    }
    const int tokens = static_cast<int>(min(M, seq.length - t0));
    const i64 key_count = keys[sq].length;
    const i64 a0 = t0 + key_count - seq.length;  // the key position of token t0 (t0 without a query chunk)
    const i64 cmp_begin = cu_seqlens_cmp != nullptr ? cu_seqlens_cmp[sq] : 0;
    const int cmp_count =
        key_count >= c.cmp_block ? static_cast<int>((key_count - c.cmp_block) / c.cmp_stride + 1) : 0;

    // The top-n's shared-memory rows (generic proxy) precede the next tile's TMA writes there (async proxy).
    if (k_by_tma) wgmma::fence_shared_for_async();
    __syncthreads();  // the previous tile is done with shared memory
    // Zero the padding of the sums rows (and of the row before row 0): the unrolled pooling reads the border
    // blocks of selection block 0 there, from before the tile's first column.
    for (int i = tid; i < (kRows + 1) * (kSumPitch - kCols); i += kThreads) {
      sums[(i / (kSumPitch - kCols) - 1) * kSumPitch + kCols + i % (kSumPitch - kCols)] = 0.f;
    }
    if (!q_by_tma) {
      wgmma::gather_swizzled_rows<kRows, D, kThreads>(
          q_tile,
          [&](int r) -> const T* {
            const int m = token_of(r / 16, r % 16), head = head_of(r / 16, r % 16);
            return m < tokens && head < G ? q.row(seq.batch, seq.begin + t0 + m, h * G + head) : nullptr;
          },
          q.data);
    }
    // Per row: lse * log2e and the compressed blocks its token sees (0 for empty rows).
    float row_lse[2];
    int visible_end[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = row_token[half];
      const bool used = m < tokens && row_head[half] < G;
      const i64 a = a0 + m;
      row_lse[half] = used ? lse.at(seq.batch, seq.begin + t0 + m, h * G + row_head[half]) * kLog2e : -INFINITY;
      const bool sees = used && row_lse[half] != -INFINITY && a >= c.cmp_block - 1;  // j visible iff j*d + l - 1 <= a
      visible_end[half] = sees ? static_cast<int>(min((a - c.cmp_block + 1) / c.cmp_stride + 1, i64{cmp_count})) : 0;
    }
    const int warp_visible_end = __reduce_max_sync(0xffffffffu, max(visible_end[0], visible_end[1]));
    // Compressed blocks that every row of the warp sees; 0 if the warp holds an unused row (a padded group head
    // or a token past the sequence), whose probabilities are zeroed by the mask, not by its lse.
    const bool rows_used = row_token[0] < tokens && row_token[1] < tokens && row_head[0] < G && row_head[1] < G;
    const int warp_all_visible =
        __reduce_min_sync(0xffffffffu, rows_used ? min(visible_end[0], visible_end[1]) : 0);
    // Through a shuffle: uniform to the compiler (the 64-bit divisions are subroutine calls), so that the K
    // descriptors of the loop below stay in uniform registers.
    const int col_tiles = __shfl_sync(
        0xffffffffu, static_cast<int>(ceil_div((a0 + tokens - 1) / c.sel_block + 1, c.blocks_per_tile)), 0);
    const auto k_stage = [&](int k) { return k_base + (k % L::kStages) * (kCols * D); };
    const auto first_col = [&](int k) { return first_cmp_block(c, k * c.blocks_per_tile); };
    // Compressed blocks [j0, j0 + kCols) of the sequence's KV head, zero rows past cmp_count (cp.async).
    const auto load_k_tile = [&](int k) {
      const int j0 = first_col(k);
      if (k_by_tma) {
        if (tid == 0) {
          tma::load_tile<kCols, D>(k_stage(k), &k_map, k_full + k % L::kStages, static_cast<int>(h),
                                   static_cast<int>(cmp_begin + j0), static_cast<int>(seq.batch));
        }
      } else {
        wgmma::load_swizzled_tile<kCols, D, kThreads>(k_stage(k), k_cmp, seq.batch, cmp_begin + j0, cmp_count - j0, h);
      }
      cp_async_commit();  // with TMA, the group of tile 0 holds the Q tile's copies alone
    };
    load_k_tile(0);

    for (int k = 0; k < col_tiles; ++k) {  // an int counter: from a 64-bit one each MMA descriptor costs more
      if (k_by_tma) {
        if (k == 0) {  // the Q tile
          if (q_by_tma) {
            pipeline::wait(q_full, q_phase);
            q_phase ^= 1u;
          } else {
            cp_async_wait<0>();
          }
        }
        const int s = k % L::kStages;
        pipeline::wait(k_full + s, (k_phases >> s) & 1u);
        k_phases ^= 1u << s;
      } else {
        cp_async_wait<0>();
      }
      if constexpr (kWgmma) wgmma::fence_shared_for_async();
      __syncthreads();  // K stage k has landed for all; every warp is done with the other stage and the sums
      if (L::kStages == 2 && k + 1 < col_tiles) load_k_tile(k + 1);
      const int j0 = first_col(k);
      const T* const k_tile = k_stage(k);
      float acc[kCols / 8][4] = {};
      if constexpr (kWgmma) {  // warpgroup-wide, so not skipped for warps that see none of the tile
        const std::uint64_t k_desc =
            wgmma::advance(k_desc0, static_cast<std::uint32_t>((k % L::kStages) * kCols * D * sizeof(T)));
        wgmma::fence();
#pragma unroll
        for (int k0 = 0; k0 < D; k0 += 16) {
          wgmma::mma_ss<T, kCols, 0>(wgmma::flat<kCols>(acc),
                                     wgmma::advance(q_desc, wgmma::operand_offset<kRows>(0, k0)),
                                     wgmma::advance(k_desc, wgmma::operand_offset<kCols>(0, k0)), k0 > 0);
        }
        wgmma::commit();
        wgmma::wait<0>();
        wgmma::fence_operand(wgmma::flat<kCols>(acc));
      } else if (j0 < warp_visible_end) {
#pragma unroll
        for (int k0 = 0; k0 < D; k0 += 16) {
          std::uint32_t a[4];
          load_q_fragment(a, q_tile, 16 * warp, k0);
#pragma unroll
          for (int n = 0; n < kCols / 8; n += 2) {
            std::uint32_t b[4];
            load_k_fragments(b, k_tile, n * 8, k0);
            mma_pair<T>(acc[n], acc[n + 1], a, b);
          }
        }
      }
      if (L::kStages == 1 && k + 1 < col_tiles) {
        __syncthreads();  // every warp is done with the single K stage
        load_k_tile(k + 1);
      }
      if (j0 + kCols <= warp_all_visible) {  // no masking: 2 instructions per probability instead of 4
#pragma unroll
        for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[n][e] = fast_exp2(fmaf(acc[n][e], c.scale_log2, -row_lse[e / 2]));
        }
      } else {
#pragma unroll
        for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n * 8 + 2 * (lane % 4) + e % 2;
            acc[n][e] = col < visible_end[e / 2] - j0 ? fast_exp2(fmaf(acc[n][e], c.scale_log2, -row_lse[e / 2])) : 0.f;
          }
        }
      }
      // Pool: selection block b gets sum_s w[s] * P[b * cols_per_block - border + s] (blocks j >= 0), for the
      // blocks that start at or before the token. Tile 0 starts at compressed block 0 rather than at block 0's
      // first border block. Positions and block starts fit int32 (see SelectConfig).
      const int nb = c.blocks_per_tile, b0 = k * nb, shift = k == 0 ? c.border : 0;
      const int last_token = min(pool_end, tokens), sel_block = static_cast<int>(c.sel_block);
      if (c.pool_in_lanes) {  // Gp = 16, one token per warp (token `warp`): no shared-memory round trip
        float v[kCols / 8][2];
        reduce_scatter_group_sums<16>(acc, v);
        const float pair[2] = {v[0][0], v[0][1]};
        float score;
        switch (c.stencil) {
          case 2: score = pool_from_lanes<2>(pair, c, shift); break;
          case 5: score = pool_from_lanes<5>(pair, c, shift); break;
          default: score = pool_from_lanes<9>(pair, c, shift); break;
        }
        if (warp < tokens && lane < nb && (b0 + lane) * sel_block <= static_cast<int>(a0) + warp) {
          slot[warp * c.slot_blocks + b0 + lane] = score;
        }
        continue;
      }
      float* const warp_sums = sums + warp * tpw * kSumPitch;
      switch (c.rows_per_token) {
        case 1: store_group_sums<1>(acc, warp_sums); break;
        case 2: store_group_sums<2>(acc, warp_sums); break;
        case 4: store_group_sums<4>(acc, warp_sums); break;
        case 8: store_group_sums<8>(acc, warp_sums); break;
        default: store_group_sums<16>(acc, warp_sums); break;
      }
      if (wpt == 1) {
        __syncwarp();
      } else {
        __syncthreads();
      }
      // column(x, s): the token's group sum x[s]. kTaps: the stencil, unrolled with the taps as constant operands
      // (small groups pool as many scores as they compute probabilities), or 0: c.stencil at run time.
      const auto pool = [&](auto column, auto taps_tag) {
        constexpr int kTaps = decltype(taps_tag)::value;
        for (int m = pool_first; m < last_token; m += token_lanes) {
          const float* const row = sums + m * wpt * kSumPitch - shift;  // the token's group sums (wpt rows)
          float* const scores = slot + m * c.slot_blocks + b0;
          const int position = static_cast<int>(a0) + m;
          for (int bb = pool_block; bb < nb && (b0 + bb) * sel_block <= position; bb += block_lanes) {
            const float* x = row + bb * c.cols_per_block;  // x[s]: the block's s-th compressed block
            float score = 0.f;
            if constexpr (kTaps > 0) {  // block 0's border blocks (before column 0) read the zero padding
#pragma unroll
              for (int s = 0; s < kTaps; ++s) score = fmaf(c.taps[s], column(x, s), score);
            } else {  // block 0 has no border blocks before it
              for (int s = b0 + bb == 0 ? c.border : 0; s < c.stencil; ++s) {
                score = fmaf(c.taps[s], column(x, s), score);
              }
            }
            scores[bb] = score;
          }
        }
      };
      if (wpt == 1) {
        const auto own_row = [](const float* x, int s) { return x[s]; };
        // The stencils of 32/16 and 64/64 compression with 64- and 128-token blocks. Their border (at most
        // stencil - 1 <= 8 blocks) stays within the 8 floats of zero padding before a row.
        switch (c.stencil) {
          case 1: pool(own_row, std::integral_constant<int, 1>{}); break;
          case 2: pool(own_row, std::integral_constant<int, 2>{}); break;
          case 5: pool(own_row, std::integral_constant<int, 5>{}); break;
          case 9: pool(own_row, std::integral_constant<int, 9>{}); break;
          default: pool(own_row, std::integral_constant<int, 0>{}); break;
        }
      } else {
        const auto token_warps = [wpt](const float* x, int s) {
          float sum = x[s];
          for (int w = 1; w < wpt; ++w) sum += x[w * kSumPitch + s];  // the token's other warps
          return sum;
        };
        pool(token_warps, std::integral_constant<int, 0>{});
      }
      if (wpt == 1) __syncwarp();  // the warp's sums are read before the next tile overwrites them
    }
    __syncthreads();  // pooled rows complete; Q, K and the sums are free
    if (q_by_tma && tid == 0 && tile + gridDim.x < tiles) load_q_tile(tile + gridDim.x);  // during the top-n
    // The top-n reads a row at least twice: from this warp's share of shared memory where it fits (L2 latency
    // per pass otherwise, which dominates small groups' time). Where two rows fit, the warp's next row is copied
    // while this one is ranked.
    const i64 most_candidates = (a0 + tokens - 1) / c.sel_block + 1;
    const int buffers = 2 * most_candidates <= stage_floats ? 2 : most_candidates <= stage_floats ? 1 : 0;
    const auto buffer = [&](int i) { return stage + (i % buffers) * (stage_floats / buffers); };
    const auto stage_row = [&](int m, float* dst) {  // one 16-byte cp.async per 4 blocks, all in flight at once
      if (m < tokens) {
        const float* const row = slot + m * c.slot_blocks;
        const int candidates = static_cast<int>((a0 + m) / c.sel_block + 1);
        // Whole 16-byte pieces, then the row's last scores one by one: the pooling writes no more of the row, and a
        // whole piece there would read unwritten bytes, which the top-n never uses but initcheck reports.
        for (int b = 4 * lane; b < candidates; b += 4 * 32) {
          if (b + 4 <= candidates) {
            cp_async_16(dst + b, row + b);
          } else {
            for (int e = b; e < candidates; ++e) cp_async_4(dst + e, row + e);
          }
        }
      }
      cp_async_commit();
    };
    if (buffers > 0) stage_row(warp, buffer(0));
    for (int m = warp, i = 0; m < tokens; m += kWarps, ++i) {
      const i64 t = t0 + m;
      float* row = slot + m * c.slot_blocks;
      if (buffers > 0) {
        if (buffers == 2) {
          stage_row(m + kWarps, buffer(i + 1));
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        __syncwarp();
        row = buffer(i);
      }
      choose_blocks(row, static_cast<int>((a0 + m) / c.sel_block + 1), c, out.row(seq.batch, seq.begin + t, h), list);
      __syncwarp();  // the stage is read before the warp's next row overwrites it
      if (buffers == 1) stage_row(m + kWarps, buffer(i + 1));
    }
  }
}

struct LaunchPlan {
  HostShape shape;
  SeqTable keys;  // the keys' sequences: batched S (seqlen_k, else T) rows; packed cu_seqlens_k (else cu_seqlens)
  selection::SelectPlan select;
  i64 dim = 0;
};

// Everything from shapes, config and the device's SM count (plan.h): the workspace size query and the
// launch agree.
LaunchPlan plan_of(const SelectBlocksParams& p) {
  LaunchPlan plan;
  plan.shape = host_shape(p.q, p.seqs);
  plan.dim = p.q.shape[p.q.rank - 1];
  // The longest key sequence: batched S; packed max_seqlen_k where given, else the most that the compressed rows
  // allow (a sequence of Sc blocks has at most Sc * stride + block - 1 keys).
  i64 max_keys = plan.shape.max_len;
  if (!plan.shape.packed) {
    max_keys = p.seqlen_k > 0 ? p.seqlen_k : plan.shape.rows;
    plan.keys = {nullptr, max_keys, plan.shape.batch};
  } else if (p.seqs_k.cu_seqlens.present()) {
    max_keys = p.seqs_k.max_seqlen > 0 ? p.seqs_k.max_seqlen : p.k_cmp.shape[0] * p.cmp_stride + p.cmp_block - 1;
    plan.keys = {static_cast<const std::int32_t*>(p.seqs_k.cu_seqlens.data), 0, plan.shape.batch};
  } else {
    plan.keys = seq_table(plan.shape, p.seqs);
  }
  plan.select = selection::plan_select_blocks(p, plan.shape.batch, plan.shape.max_len,
                                              multiprocessors(p.q.device_index), max_keys);
  plan.select.config.scale_log2 = static_cast<float>(softmax_scale(p.scale, plan.dim) * kLog2eDouble);
  return plan;
}

template <class T, int D>
void launch(const SelectBlocksParams& p, const LaunchPlan& plan) {
  const bool wgmma_runs = wgmma::kernel_runs(select_blocks_kernel<T, D, true>);
  auto kernel = wgmma_runs ? select_blocks_kernel<T, D, true> : select_blocks_kernel<T, D, false>;
  constexpr std::size_t smem = Layout<D>::kBytes;
  set_dynamic_smem(kernel, smem);
  // The K tiles by TMA where the wgmma kernel runs, the device and driver take it and the tensor map describes
  // k_cmp; SPARSEATTN_SELECT_TMA=0 turns it off (=1 or unset: on).
  Config config = plan.select.config;
  CUtensorMap k_map{}, q_map{};
  config.k_by_tma = wgmma_runs && tma::switch_on("SPARSEATTN_SELECT_TMA", true) &&
                    tma::device_supports(p.q.device_index) && tma::token_map(&k_map, p.k_cmp, kCols);
  // The Q tile by TMA too at G = 16 (a tile is 8 tokens x the 16 heads, one box per 64 columns).
  config.q_by_tma = config.k_by_tma && config.group == 16 && tma::switch_on("SPARSEATTN_SELECT_Q_TMA", true) &&
                    tma::token_map(&q_map, p.q, static_cast<int>(config.tokens_per_tile), 16);
  kernel<<<plan.select.ctas, kThreads, smem, static_cast<cudaStream_t>(p.stream)>>>(
      tokens_of<const T>(p.q), tokens_of<const T>(p.k_cmp), lse_of<const float>(p.lse_cmp),
      tokens_of<std::int32_t>(p.indices), seq_table(plan.shape, p.seqs), plan.keys,
      static_cast<const std::int32_t*>(p.cu_seqlens_cmp.data), config, static_cast<float*>(p.workspace), k_map, q_map);
  check_launch("select_blocks_kernel");
}

}  // namespace

std::size_t select_blocks_workspace_size(const SelectBlocksParams& p) {
  const LaunchPlan plan = plan_of(p);
  return plan.select.workspace_bytes();
}

void select_blocks(const SelectBlocksParams& p) {
  const DeviceGuard device(p.q.device_index);
  const LaunchPlan plan = plan_of(p);
  if (plan.select.ctas == 0) return;
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_head_dim_qk(plan.dim, [&](auto dim) { launch<T, decltype(dim)::value>(p, plan); });
  });
}

}  // namespace sparseattn::cuda
