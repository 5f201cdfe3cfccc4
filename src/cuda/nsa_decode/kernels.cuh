// The kernels of nsa_decode on CUDA (bf16/fp16 in, fp32 accumulate), four launches per call:
//
//  1. nsa_decode_compressed_kernel: a CTA per (compressed split, KV head, query, sequence). Its 16 rows are the
//     group's query heads (G <= 16, padded), which share the query position a; it attends to the visible
//     compressed rows of its split on mma.sync, each of its 8 warps taking 8 rows of every 64-row tile (S on
//     m16n8k16, P V on m16n8k8; with SPARSEATTN_NSA_DECODE_WARPS=4, each of 4 warps one 16-row chunk, both on
//     m16n8k16: plan.h), and writes the split's partial o (normalised) and lse per head. It keeps the
//     split's scaled logits in shared memory and, with the split's final max and sum, pools the split-local
//     probabilities onto the selection blocks the split covers (overlap(j, b) / d weights): partial scores.
//  2. nsa_decode_select_kernel: a CTA per (KV head, query, sequence). The global lse of each head from the splits'
//     lse (a fixed merge order; 16 threads per head, each loading its first splits' lse together and keeping them
//     for the weights), then block b's score S[b] = sum over the splits p touching b and the heads h of
//     exp(lse_{p,h} - lse_h) * partial score (p, h, b): the same sum as semantics.md section 4's, regrouped (each
//     thread issues the partials' loads of two blocks, up to two splits each, before any sum; the first two blocks'
//     loads before the lse phase, which they do not need, so that they overlap it). Then the forced blocks
//     and the top n - forced of the other candidates in the order (score descending, index ascending): the
//     reference's tie rule, deterministic. A candidate is a 64-bit key (monotone score bits, complemented index)
//     whose unsigned order is that order. Each lane sorts its candidates' keys in registers (a bitonic network, up
//     to 16 per lane), each warp takes the top of its share by rounds of a two-redux.sync warp maximum over the
//     lanes' first keys (the winning lane shifts its list); then each pick's rank among all warps' picks (binary
//     searches in the sorted lists, in parallel) places the overall top at chosen[rank]. The chosen blocks lie
//     between the initial and the local ones, so the list (ascending, padded with -1) is the initial blocks, the
//     chosen ones at their rank among themselves, then the local ones.
//  3. nsa_decode_sparse_kernel: a CTA per (piece, KV head, query, sequence): the selected blocks' keys (16-key
//     chunks of the listed blocks, looked up in the block table) or the window's keys [a - w + 1, a] (16-key
//     chunks from the aligned chunk holding a - w + 1), the same tile loop as 1; partial o and lse per head.
//  4. nsa_decode_combine_kernel: a CTA of Dv threads per output row: each branch's partials merged in order
//     (M = max lse, weights exp(lse_p - M)), then o = g_cmp o_cmp + g_slc o_slc + g_swa o_swa. Where a row has
//     few partials (plan.h, kFusedCombineMax) there is no fourth launch: the sparse kernel's last CTA of each
//     list (counted with one atomic per CTA) does the same combine for the list's rows (combine_list), with the
//     same sums in the same order.
// Every partial is written by exactly one CTA and merged in a fixed order: the result is bit-identical run to run.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "cuda/nsa_decode/plan.h"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mma.cuh"
#include "cuda/primitives/softmax.cuh"
#include "cuda/primitives/swizzled_tile.cuh"

namespace sparseattn::cuda::nsa_dec {

using i64 = std::int64_t;

template <class T>
struct PagedCache {
  const T* data;  // [num_pages, page_size, Hkv, D]
  i64 page_stride, row_stride, head_stride;
};

template <class T>
struct NsaDecodeArgs {
  Tokens<const T> q;           // [B, Tq, Hq, Dqk]
  PagedCache<T> k, v;
  Tokens<const T> k_cmp, v_cmp;  // [B, max_cmp, Hkv, D]
  const std::int32_t* block_table;
  i64 table_batch_stride, table_page_stride;
  const std::int32_t* cache_seqlens;
  i64 seqlens_stride;
  PerHead<const T> gate[3];    // [B, Tq, Hq]; data null where the branch is absent
  Tokens<T> o;                 // [B, Tq, Hq, Dv]
  std::int32_t* indices_out;   // optional [B, Tq, Hkv, n]
  i64 indices_out_stride[4];
  // Workspace slices (plan.h).
  float* cmp_o;      // [P, B*Tq*Hq, Dv]
  float* cmp_lse;    // [P, B*Tq*Hq]
  float* cmp_score;  // [P, B*Tq*Hq, score_span]
  float* scores;     // [B*Tq*Hkv, max_blocks]
  std::int32_t* indices;  // [B*Tq*Hkv, n]
  float* piece_o;    // [pieces, B*Tq*Hq, Dv]
  float* piece_lse;  // [pieces, B*Tq*Hq]
  std::int32_t* counters;  // [B*Tq*Hkv] arrivals of the sparse kernel's CTAs, zero at its start (fused combine)
  int batch, q_len, q_heads, kv_heads, group;
  int page_size, num_pages, capacity, max_cmp;
  int cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, window;
  int split_rows, cmp_splits, score_span, max_blocks;
  int sel_chunks, swa_chunks, tiles_per_piece, sel_pieces, swa_pieces;
  bool has_cmp, has_sel, has_swa;
  bool fused_combine;  // the sparse kernel's last CTA of each list does the gated combine (plan.h)
  float scale_log2;  // softmax scale * log2(e)

  // The sequence's key count, clamped to [Tq, capacity] (trusted device data, semantics in nsa_decode.h).
  __device__ __forceinline__ int length(int b) const {
    return min(max(__ldg(cache_seqlens + b * seqlens_stride), q_len), capacity);
  }
  // Compressed rows visible to the query at position a: blocks with j * d + l - 1 <= a, at most max_cmp.
  __device__ __forceinline__ int visible_cmp(int a) const {
    return a + 1 >= cmp_block ? min((a + 1 - cmp_block) / cmp_stride + 1, max_cmp) : 0;
  }
  // Row index of (b, t, h) in the [B*Tq*Hq] partial arrays.
  __device__ __forceinline__ i64 row_of(int b, int t, int h) const { return (i64{b} * q_len + t) * q_heads + h; }
  __device__ __forceinline__ i64 list_of(int b, int t, int kv_head) const {
    return (i64{b} * q_len + t) * kv_heads + kv_head;
  }
};

// A 16-key chunk of a tile: K and V rows (rows `rows` .. 15 zero-filled) and the keys a row keeps, [lo, hi]
// (chunk-relative; empty when lo > hi).
template <class T>
struct ChunkRef {
  const T* k;
  const T* v;
  i64 k_stride, v_stride;
  int rows, lo, hi;
};

template <int Dqk, int Dv>
struct AttendTile {
  static constexpr int kKElements = kTileKeys * Dqk, kVElements = kTileKeys * Dv;
  static constexpr int kStageElements = kKElements + kVElements;
  static constexpr int kAccPitch = Dv + 8;
  static constexpr bool kQInRegisters = Dqk <= 128;
  static constexpr std::size_t kSmemBytes = attend_smem_bytes(Dqk, Dv);  // the compressed kernel's logits follow
};

// The merged softmax state of a CTA's 16 rows after the tile loop: per row the max (log2 domain) and the sum.
struct RowState {
  float max[kRows];
  float sum[kRows];
};

// The tile loop shared by the compressed and the sparse kernels, on CTAs of Warps warps (4 or 8): each warp takes
// 64 / Warps keys of every 64-key tile (4 warps: a 16-key chunk each, S and P V on m16n8k16; 8 warps: half a chunk
// each, S on one m16n8k16 n-tile per k-step and P V on m16n8k8). chunk(tile, c) gives chunk c of tile `tile`;
// the group's rows of q are loaded for query t; the result is left in shared memory in the epilogue layout of four
// warps' accumulators, maxima and sums, merged by merge_rows (with 8 warps, warp w + 4 hands its state to warp w,
// which merges it into its own first: a fixed order). With kLogits, each key's scaled logit (-inf where masked)
// goes to logits[row * logit_pitch + tile * 64 + key].
template <class T, int Dqk, int Dv, bool kLogits, int Warps, class Chunk>
__device__ __forceinline__ void attend_tiles(const NsaDecodeArgs<T>& a, int b, int t, int kv_head, int tiles,
                                             Chunk&& chunk, unsigned char* smem, float* logits, int logit_pitch) {
  static_assert(Warps == kWarps || Warps == 2 * kWarps, "a 16-key chunk or half of one per warp");
  using Tile = AttendTile<Dqk, Dv>;
  constexpr int Threads = 32 * Warps;
  constexpr int kWarpKeys = kTileKeys / Warps;
  // With 8 warps, Q's fragments are read from shared memory at each tile: held in registers they would not fit the
  // 128 registers a thread of two resident 256-thread CTAs has beside the accumulator.
  constexpr bool kQInRegisters = Tile::kQInRegisters && Warps == kWarps;
  T* const sQ = reinterpret_cast<T*>(smem);
  T* const sPipe = sQ + kRows * Dqk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const SmemTile<T, kRows, Dqk> q_tile{sQ};
  load_rows<T, kRows, Dqk, Threads>(
      q_tile, [&](int r) -> const T* { return r < a.group ? a.q.row(b, t, kv_head * a.group + r) : nullptr; },
      a.q.data);

  const auto issue = [&](int tile, int slot) {
    T* const k_stage = sPipe + slot * Tile::kStageElements;
    T* const v_stage = k_stage + Tile::kKElements;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const ChunkRef<T> ref = chunk(tile, c);
      load_strided_rows<T, kChunkKeys, Dqk, Threads>(SmemTile<T, kChunkKeys, Dqk>{k_stage + c * kChunkKeys * Dqk},
                                                     ref.rows > 0 ? ref.k : a.k.data, ref.k_stride, ref.rows,
                                                     a.k.data);
      load_strided_rows<T, kChunkKeys, Dv, Threads>(SmemTile<T, kChunkKeys, Dv>{v_stage + c * kChunkKeys * Dv},
                                                    ref.rows > 0 ? ref.v : a.v.data, ref.v_stride, ref.rows,
                                                    a.v.data);
    }
  };

  float acc[Dv / 8][4];
#pragma unroll
  for (int n = 0; n < Dv / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  if (tiles > 0) issue(0, 0);
  cp_async_commit();  // group 0: Q and tile 0
  std::uint32_t q_frag[kQInRegisters ? Dqk / 16 : 1][4];
  for (int it = 0; it < tiles; ++it) {
    if (it + 1 < tiles) issue(it + 1, (it + 1) % 2);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // tile `it` (and Q) landed for every thread
    if constexpr (kQInRegisters) {
      if (it == 0) {
#pragma unroll
        for (int kk = 0; kk < Dqk / 16; ++kk) load_a(q_frag[kk], q_tile, 0, kk * 16);
      }
    }
    const int slot = it % 2;
    const SmemTile<T, kTileKeys, Dqk> k_tile{sPipe + slot * Tile::kStageElements};
    const SmemTile<T, kTileKeys, Dv> v_tile{sPipe + slot * Tile::kStageElements + Tile::kKElements};
    if constexpr (kWarpKeys == kChunkKeys) {
      const ChunkRef<T> ref = chunk(it, warp);

      float s[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < Dqk / 16; ++kk) {
        std::uint32_t qa[4];
        if constexpr (kQInRegisters) {
#pragma unroll
          for (int i = 0; i < 4; ++i) qa[i] = q_frag[kk][i];
        } else {
          load_a(qa, q_tile, 0, kk * 16);
        }
        std::uint32_t kb[4];
        load_b_rows(kb, k_tile, warp * kChunkKeys, kk * 16);
        mma_pair<T>(s[0], s[1], qa, kb);
      }
      if constexpr (kLogits) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = lane / 4 + (i / 2) * 8, col = n * 8 + 2 * (lane % 4) + (i % 2);
            const bool keep = col >= ref.lo && col <= ref.hi;
            logits[row * logit_pitch + it * kTileKeys + warp * kChunkKeys + col] =
                keep ? s[n][i] * a.scale_log2 : -INFINITY;
          }
        }
      }
      const bool masked = !(ref.lo == 0 && ref.hi == kChunkKeys - 1);
      float correction[2];
      const int col_lo[2] = {ref.lo, ref.lo}, col_hi[2] = {ref.hi, ref.hi};
      with_mask(masked, [&](auto mask) {
        softmax_probabilities<kChunkKeys, decltype(mask)::value>(s, m, l, col_lo, col_hi, a.scale_log2, correction);
      });
      rescale_rows<Dv>(acc, correction);
      const std::uint32_t pa[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]), pack2<T>(s[1][0], s[1][1]),
                                   pack2<T>(s[1][2], s[1][3])};
#pragma unroll
      for (int np = 0; np < Dv / 16; ++np) {
        std::uint32_t vb[4];
        load_b_cols(vb, v_tile, warp * kChunkKeys, np * 16);
        mma_pair<T>(acc[2 * np], acc[2 * np + 1], pa, vb);
      }
    } else {
      // Keys [key0, key0 + 8) of the tile: half of chunk key0 / 16, columns (chunk-relative) shifted by `shift`.
      const int key0 = warp * kWarpKeys, shift = key0 % kChunkKeys;
      const ChunkRef<T> ref = chunk(it, key0 / kChunkKeys);
      float s[1][4] = {{0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < Dqk / 32; ++kk) {
        // B of two k-steps at once: the 8 keys' columns [32 kk, 32 kk + 32) as four 8x8 matrices.
        std::uint32_t kb[4];
        ldmatrix_x4(kb, k_tile.at(key0 + lane % 8, kk * 32 + (lane / 8) * 8));
#pragma unroll
        for (int step = 0; step < 2; ++step) {
          std::uint32_t qa[4];
          if constexpr (kQInRegisters) {
#pragma unroll
            for (int i = 0; i < 4; ++i) qa[i] = q_frag[2 * kk + step][i];
          } else {
            load_a(qa, q_tile, 0, (2 * kk + step) * 16);
          }
          const std::uint32_t kb_step[2] = {kb[2 * step], kb[2 * step + 1]};
          mma_16816<T>(s[0], qa, kb_step);
        }
      }
      const int col_lo[2] = {ref.lo - shift, ref.lo - shift}, col_hi[2] = {ref.hi - shift, ref.hi - shift};
      if constexpr (kLogits) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = lane / 4 + (i / 2) * 8, col = 2 * (lane % 4) + (i % 2);
          const bool keep = col >= col_lo[0] && col <= col_hi[0];
          logits[row * logit_pitch + it * kTileKeys + key0 + col] = keep ? s[0][i] * a.scale_log2 : -INFINITY;
        }
      }
      const bool masked = !(col_lo[0] <= 0 && col_hi[0] >= kWarpKeys - 1);
      float correction[2];
      with_mask(masked, [&](auto mask) {
        softmax_probabilities<kWarpKeys, decltype(mask)::value>(s, m, l, col_lo, col_hi, a.scale_log2, correction);
      });
      rescale_rows<Dv>(acc, correction);
      const std::uint32_t pa[2] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3])};
#pragma unroll
      for (int nq = 0; nq < Dv / 32; ++nq) {
        // B of four n-tiles: the 8 keys' rows of V columns [32 nq, 32 nq + 32), transposed.
        std::uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_tile.at(key0 + lane % 8, nq * 32 + (lane / 8) * 8));
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_1688<T>(acc[4 * nq + j], pa, vb[j]);
      }
    }
    __syncthreads();  // every warp is done with this slot before tile it + 2 is issued into it
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue layout: sAcc [warp][row][kAccPitch], then sMax [warp][row], sSum [warp][row], for kWarps warps.
  float* const sAcc = reinterpret_cast<float*>(sPipe);
  float* const sMax = sAcc + kWarps * kRows * Tile::kAccPitch;
  float* const sSum = sMax + kWarps * kRows;
  // Stores the warp's max, sum (summed over the quad first where sum_quads) and accumulator in epilogue slot `slot`.
  const auto store_state = [&](int slot, bool sum_quads) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (sum_quads) l[half] = quad_sum(l[half]);
      const int r = slot * kRows + lane / 4 + half * 8;
#pragma unroll
      for (int n = 0; n < Dv / 8; ++n) {
        *reinterpret_cast<float2*>(sAcc + r * Tile::kAccPitch + n * 8 + 2 * (lane % 4)) =
            make_float2(acc[n][2 * half], acc[n][2 * half + 1]);
      }
      if (lane % 4 == 0) {
        sMax[r] = m[half];
        sSum[r] = l[half];
      }
    }
  };
  if constexpr (Warps > kWarps) {
    // Two rounds through the four-warp layout: warp w + 4 stores its state in slot w, then warp w merges it into
    // its own and stores the result there.
#pragma unroll
    for (int half = 0; half < 2; ++half) l[half] = quad_sum(l[half]);
    if (warp >= kWarps) store_state(warp - kWarps, false);
    __syncthreads();
    if (warp < kWarps) {
      // m = the larger maximum; l and acc rescaled to it, then added (own first, then warp w + 4's), one pair of
      // the other's accumulator at a time.
      float self_weight[2], other_weight[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp * kRows + lane / 4 + half * 8;
        const float m_other = sMax[r], l_other = sSum[r];
        const float mx = fmaxf(m[half], m_other);
        const float use = mx == -INFINITY ? 0.f : mx;
        self_weight[half] = exp2f(m[half] - use);  // 0 where the maximum is -inf
        other_weight[half] = exp2f(m_other - use);
        l[half] = l[half] * self_weight[half] + l_other * other_weight[half];
        m[half] = mx;
      }
      __syncwarp();  // the quad's reads of the maxima and sums come before its first lane overwrites them
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp * kRows + lane / 4 + half * 8;
#pragma unroll
        for (int n = 0; n < Dv / 8; ++n) {
          const float2 x = *reinterpret_cast<const float2*>(sAcc + r * Tile::kAccPitch + n * 8 + 2 * (lane % 4));
          acc[n][2 * half] = acc[n][2 * half] * self_weight[half] + x.x * other_weight[half];
          acc[n][2 * half + 1] = acc[n][2 * half + 1] * self_weight[half] + x.y * other_weight[half];
        }
      }
      store_state(warp, false);
    }
  } else {
    store_state(warp, true);
  }
  __syncthreads();
}

// The CTA's row states from the epilogue's per-warp maxima and sums (warp order), into `state` (shared).
template <int Dv>
__device__ __forceinline__ void merge_rows(const unsigned char* smem, int dqk, RowState& state) {
  const float* sAcc = reinterpret_cast<const float*>(smem + 2 * kRows * dqk);
  const float* sMax = sAcc + kWarps * kRows * (Dv + 8);
  const float* sSum = sMax + kWarps * kRows;
  if (threadIdx.x < kRows) {
    const int r = threadIdx.x;
    float row_max = -INFINITY;
    for (int w = 0; w < kWarps; ++w) row_max = fmaxf(row_max, sMax[w * kRows + r]);
    float sum = 0.f;
    if (row_max != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) sum += sSum[w * kRows + r] * exp2f(sMax[w * kRows + r] - row_max);
    }
    state.max[r] = row_max;
    state.sum[r] = sum;
  }
  __syncthreads();
}

// Writes the CTA's rows (the group's heads of query t) as normalised partial o [row][Dv] and lse (natural log);
// Threads: the CTA's threads.
template <int Dv, int Threads>
__device__ __forceinline__ void write_partials(const unsigned char* smem, int dqk, const RowState& state, int group,
                                               float* partial_o, float* partial_lse, i64 row0) {
  const float* sAcc = reinterpret_cast<const float*>(smem + 2 * kRows * dqk);
  const float* sMax = sAcc + kWarps * kRows * (Dv + 8);
  for (int item = threadIdx.x; item < group * Dv; item += Threads) {
    const int r = item / Dv, c = item % Dv;
    const float row_max = state.max[r], sum = state.sum[r];
    float out = 0.f;
    if (sum > 0.f) {
      for (int w = 0; w < kWarps; ++w) {
        out += sAcc[(w * kRows + r) * (Dv + 8) + c] * exp2f(sMax[w * kRows + r] - row_max);
      }
      out /= sum;
    }
    if (partial_o != nullptr) partial_o[(row0 + r) * Dv + c] = out;
  }
  for (int r = threadIdx.x; r < group; r += Threads) {
    partial_lse[row0 + r] = state.sum[r] > 0.f ? (state.max[r] + log2f(state.sum[r])) * kLn2 : -INFINITY;
  }
}

// Shared memory of an SM of compute capability 9.0 and what it reserves per CTA.
inline constexpr std::size_t kSm90SmemPerSm = 228 * 1024, kSmemReservedPerCta = 1024;
// CTAs of the compressed kernel resident per SM that its register budget assumes (__launch_bounds__): with 8 warps,
// two (16 warps per SM, at most 128 registers per thread) where two CTAs with the largest split's logits fit an
// SM's shared memory; otherwise 0, no constraint beyond the CTA size.
template <int Warps, int Dqk, int Dv>
inline constexpr int kCompressedMinBlocks =
    Warps > kWarps && 2 * (attend_smem_bytes(Dqk, Dv) + sizeof(float) * kRows * kMaxSplitRows + sizeof(RowState) +
                           kSmemReservedPerCta) <= kSm90SmemPerSm
        ? 2
        : 0;

template <class T, int Dqk, int Dv, int Warps>
__global__ void __launch_bounds__(32 * Warps, kCompressedMinBlocks<Warps, Dqk, Dv>)
    nsa_decode_compressed_kernel(NsaDecodeArgs<T> a) {
  constexpr int Threads = 32 * Warps;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ RowState state;
  i64 block = blockIdx.x;
  const int split = static_cast<int>(block % a.cmp_splits);
  block /= a.cmp_splits;
  const int kv_head = static_cast<int>(block % a.kv_heads);
  block /= a.kv_heads;
  const int t = static_cast<int>(block % a.q_len);
  const int b = static_cast<int>(block / a.q_len);

  const int pos = a.length(b) - a.q_len + t;
  const int visible = a.visible_cmp(pos);
  const int row_begin = split * a.split_rows;
  const int row_end = min(row_begin + a.split_rows, visible);
  if (row_begin >= row_end) return;  // the consumers read splits [0, ceil(visible / split_rows)) only
  const int tiles = (row_end - row_begin + kTileKeys - 1) / kTileKeys;
  float* const logits = reinterpret_cast<float*>(smem + AttendTile<Dqk, Dv>::kSmemBytes);

  const auto chunk = [&](int tile, int c) {
    const int first = row_begin + tile * kTileKeys + c * kChunkKeys;
    ChunkRef<T> ref;
    ref.rows = min(max(row_end - first, 0), kChunkKeys);
    ref.k = a.k_cmp.row(b, first, kv_head);
    ref.v = a.v_cmp.row(b, first, kv_head);
    ref.k_stride = a.k_cmp.row_stride;
    ref.v_stride = a.v_cmp.row_stride;
    ref.lo = 0;
    ref.hi = ref.rows - 1;
    return ref;
  };
  attend_tiles<T, Dqk, Dv, true, Warps>(a, b, t, kv_head, tiles, chunk, smem, logits, a.split_rows);
  allow_next_grid();
  merge_rows<Dv>(smem, Dqk, state);
  const i64 rows_q = i64{a.batch} * a.q_len * a.q_heads;
  const i64 row0 = split * rows_q + a.row_of(b, t, kv_head * a.group);
  write_partials<Dv, Threads>(smem, Dqk, state, a.group, a.has_cmp ? a.cmp_o : nullptr, a.cmp_lse, row0);
  if (!a.has_sel) return;

  // Pooled split-local probabilities: score(r, block) = sum_j overlap(j, block) / d * 2^(logit - max) / sum.
  const int first_block = static_cast<int>(i64{row_begin} * a.cmp_stride / a.sel_block);
  for (int item = threadIdx.x; item < a.group * a.score_span; item += Threads) {
    const int r = item / a.score_span, local = item % a.score_span;
    const i64 block_begin = i64{first_block + local} * a.sel_block, block_end = block_begin + a.sel_block;
    // Rows j overlapping the block: j * d < block_end and j * d + l > block_begin.
    const i64 j_lo = max(i64{row_begin}, block_begin - a.cmp_block >= 0
                                             ? (block_begin - a.cmp_block) / a.cmp_stride + 1
                                             : i64{0});
    const i64 j_hi = min(i64{row_end} - 1, (block_end - 1) / a.cmp_stride);
    float score = 0.f;
    if (state.sum[r] > 0.f) {
      for (i64 j = j_lo; j <= j_hi; ++j) {
        const i64 start = j * a.cmp_stride;
        const i64 overlap = min(start + a.cmp_block, block_end) - max(start, block_begin);
        const float p = exp2f(logits[r * a.split_rows + (j - row_begin)] - state.max[r]);
        score += static_cast<float>(overlap) * p;
      }
      score /= state.sum[r] * static_cast<float>(a.cmp_stride);
    }
    a.cmp_score[(row0 + r) * a.score_span + local] = score;
  }
}

// Merges (max, sum of exp(x - max)) pairs: the pair of the union of both sets.
__device__ __forceinline__ void merge_max_sum(float& m, float& sum, float m_other, float sum_other) {
  const float merged = fmaxf(m, m_other);
  if (merged == -INFINITY) return;
  sum = (m == -INFINITY ? 0.f : sum * expf(m - merged)) +
        (m_other == -INFINITY ? 0.f : sum_other * expf(m_other - merged));
  m = merged;
}

// A candidate (score, block) as one 64-bit key whose unsigned order is the selection order (a higher score first,
// then the lower block index): the high word is the score's bits made monotone (negative scores flipped, -0 as +0,
// NaN as 1, below every number), the low word the complemented block index. Key 0 is "no candidate": every
// candidate's key is above it, and the keys of distinct blocks differ.
__device__ __forceinline__ std::uint64_t selection_key(float score, int block_index) {
  std::uint32_t bits = __float_as_uint(score);
  if ((bits << 1) == 0u) bits = 0u;  // -0 ranks as +0 (equal scores)
  std::uint32_t high = (bits & 0x80000000u) != 0u ? ~bits : bits | 0x80000000u;
  if (score != score) high = 1u;
  return (std::uint64_t{high} << 32) | ~static_cast<std::uint32_t>(block_index);
}
__device__ __forceinline__ int key_block(std::uint64_t key) { return static_cast<int>(~static_cast<std::uint32_t>(key)); }

// The largest key of the warp, on every lane (0 where every lane holds 0): the maximum of the high words, then the
// maximum of the low words among the lanes holding that high word; two redux.sync, no shuffle tree.
__device__ __forceinline__ std::uint64_t warp_max_key(std::uint64_t key) {
  const std::uint32_t high = static_cast<std::uint32_t>(key >> 32);
  const std::uint32_t best_high = __reduce_max_sync(0xffffffffu, high);
  const std::uint32_t low = high == best_high ? static_cast<std::uint32_t>(key) : 0u;
  const std::uint32_t best_low = __reduce_max_sync(0xffffffffu, low);
  return (std::uint64_t{best_high} << 32) | best_low;
}

// Sorts M keys descending in registers (a bitonic network; every index is a compile-time constant).
template <int M>
__device__ __forceinline__ void sort_keys_descending(std::uint64_t (&key)[M]) {
  static_assert((M & (M - 1)) == 0, "a power of two");
#pragma unroll
  for (int size = 2; size <= M; size *= 2) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride /= 2) {
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const int j = i ^ stride;
        if (j > i) {
          const std::uint64_t x = key[i], y = key[j];
          const bool swap = (i & size) == 0 ? x < y : x > y;  // descending runs where bit `size` of i is clear
          key[i] = swap ? y : x;
          key[j] = swap ? x : y;
        }
      }
    }
  }
}

// The warp's top `rounds` keys, best first, into picks[0 .. rounds) (0 past the warp's candidates). The lane's
// candidates are i = first + k * step < end, k < M (the caller guarantees no more), their keys key_of(i): each lane
// sorts its M keys once, then each round takes the largest of the lanes' first keys (warp_max_key) and the lane
// that held it shifts its list by one. No candidate is read twice.
template <int M, class KeyOf>
__device__ __forceinline__ void warp_top_sorted(int first, int end, int step, int rounds, KeyOf&& key_of,
                                                std::uint64_t* picks) {
  std::uint64_t key[M];
#pragma unroll
  for (int k = 0; k < M; ++k) {
    const int i = first + k * step;
    key[k] = i < end ? key_of(i) : std::uint64_t{0};
  }
  sort_keys_descending(key);
  for (int round = 0; round < rounds; ++round) {
    const std::uint64_t best = warp_max_key(key[0]);
    if (threadIdx.x % 32 == 0) picks[round] = best;
    const bool won = best != 0u && key[0] == best;
#pragma unroll
    for (int k = 0; k + 1 < M; ++k) key[k] = won ? key[k + 1] : key[k];
    key[M - 1] = won ? std::uint64_t{0} : key[M - 1];
  }
}

// warp_top_sorted for any number of candidates per lane: each round every lane rescans its candidates for the
// largest key below the previous round's pick.
template <class KeyOf>
__device__ __forceinline__ void warp_top_rescan(int first, int end, int step, int rounds, KeyOf&& key_of,
                                                std::uint64_t* picks) {
  std::uint64_t previous = ~std::uint64_t{0};
  for (int round = 0; round < rounds; ++round) {
    std::uint64_t best = 0;
    for (int i = first; i < end; i += step) {
      const std::uint64_t key = key_of(i);
      if (key < previous && key > best) best = key;
    }
    best = warp_max_key(best);
    if (threadIdx.x % 32 == 0) picks[round] = best;
    if (best == 0u) {  // the warp's candidates are exhausted: the rest of its picks are empty
      for (int r = round + 1 + static_cast<int>(threadIdx.x % 32); r < rounds; r += 32) picks[r] = 0u;
      break;
    }
    previous = best;
  }
}

// At most 128 registers a thread (two CTAs per SM): at B = 64 the 256 CTAs of 64/4 heads run in one wave.
template <class T>
__global__ void __launch_bounds__(kSelectThreads, 2) nsa_decode_select_kernel(NsaDecodeArgs<T> a) {
  constexpr int kWarps = kSelectThreads / 32;
  // Splits whose lse each of a head's 16 threads holds in registers from the lse phase to the weights.
  constexpr int kLseSlots = 4;
  // Candidate blocks scored per pass of a thread (their loads in flight together), and the splits loaded per block.
  constexpr int kBlocksPerPass = 2, kSplitsPerBlock = 2;
  static_assert(kMaxSelected <= 64, "the picks and the chosen list hold 64 entries");
  __shared__ float lse_of_head[kRows];
  __shared__ int chosen[64];
  // Each warp's picks as selection keys, best first (at most 64 rounds), and the candidates' scores where they fit.
  __shared__ std::uint64_t picks[kWarps][64];
  __shared__ float shared_scores[kSelectSharedScores];
  __shared__ float split_weight[kSplitWeights];
  wait_for_previous_grid();  // the compressed splits' partials
  i64 block = blockIdx.x;
  const int kv_head = static_cast<int>(block % a.kv_heads);
  block /= a.kv_heads;
  const int t = static_cast<int>(block % a.q_len);
  const int b = static_cast<int>(block / a.q_len);
  const int pos = a.length(b) - a.q_len + t;
  const int visible = a.visible_cmp(pos);
  const int used = (visible + a.split_rows - 1) / a.split_rows;
  const i64 rows_q = i64{a.batch} * a.q_len * a.q_heads;
  const i64 head_row0 = a.row_of(b, t, kv_head * a.group);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool weights_shared = used * a.group <= kSplitWeights;

  // Block b's score: the sum over the splits p touching it (ascending) and the heads h (ascending) of
  // weight(p, h) * partial score (p, h, b). A thread scores kBlocksPerPass blocks per pass: the group's partials of
  // each block's first kSplitsPerBlock splits are loaded together (load_pass), then summed in that order. The first
  // pass's loads are issued before the lse phase, which needs none of them, so that their latency overlaps it.
  const int candidates = pos >= 0 ? pos / a.sel_block + 1 : 0;
  float* const scores =
      candidates <= kSelectSharedScores ? shared_scores : a.scores + a.list_of(b, t, kv_head) * a.max_blocks;
  const i64 span_blocks = i64{a.split_rows} * a.cmp_stride / a.sel_block;  // blocks per split
  const auto partials = [&](int blk, int p) {
    return a.cmp_score + (p * rows_q + head_row0) * a.score_span + (blk - p * span_blocks);
  };
  // The splits [p_first, p_last] whose pooled scores cover block blk (p_last < p_first: none, or blk >= candidates).
  const auto splits_of = [&](int blk, int& p_first, int& p_last) {
    // Positions and rows are below kNsaDecodeMaxCapacity = 2^30 (ops.h), so 32-bit arithmetic (and division) is
    // exact: the block's first token is at most pos, its last below 2^30 + sel_block (unsigned).
    const int block_begin = max(min(blk, candidates - 1), 0) * a.sel_block;
    const unsigned block_last = static_cast<unsigned>(block_begin) + static_cast<unsigned>(a.sel_block - 1);
    const int j_lo = block_begin - a.cmp_block >= 0 ? (block_begin - a.cmp_block) / a.cmp_stride + 1 : 0;
    const int j_hi = visible > 0 ? static_cast<int>(min(static_cast<unsigned>(visible - 1),
                                                        block_last / static_cast<unsigned>(a.cmp_stride)))
                                 : -1;
    const bool any = blk < candidates && j_lo <= j_hi;
    p_first = any ? j_lo / a.split_rows : 0;
    p_last = any ? j_hi / a.split_rows : -1;
  };
  float value[kBlocksPerPass][kSplitsPerBlock][kRows];
  const auto load_pass = [&](int first) {
#pragma unroll
    for (int u = 0; u < kBlocksPerPass; ++u) {
      const int blk = first + u * kSelectThreads;
      int p_first, p_last;
      splits_of(blk, p_first, p_last);
#pragma unroll
      for (int s = 0; s < kSplitsPerBlock; ++s) {
        const int p = p_first + s;
        const bool live = p <= p_last;
        const float* const partial = live ? partials(blk, p) : a.cmp_score;
#pragma unroll
        for (int h = 0; h < kRows; ++h) value[u][s][h] = live && h < a.group ? partial[h * a.score_span] : 0.f;
      }
    }
  };
  load_pass(threadIdx.x);

  // Each head's lse over the splits: 16 threads per head (kSelectThreads = 16 x kRows) take every 16th split (the
  // first kLseSlots of them loaded together), merge them in split order, then merge the 16 (max, sum) pairs in a
  // fixed butterfly order; thread 0 of the head's 16 has the lse, which the others take by shuffle. Each thread then
  // turns its own splits' lse into the weights exp(lse_{p,h} - lse_h) of split p's pooled scores of head h, in
  // shared memory where they fit (one barrier for both phases).
  {
    static_assert(kSelectThreads == 16 * kRows, "16 threads per head of the group");
    const int h = threadIdx.x / 16, part = threadIdx.x % 16;
    const bool head = h < a.group;
    const float* const head_lse = a.cmp_lse + head_row0 + h;
    float split_lse[kLseSlots];
#pragma unroll
    for (int k = 0; k < kLseSlots; ++k) {
      const int p = part + 16 * k;
      split_lse[k] = head && p < used ? head_lse[p * rows_q] : -INFINITY;
    }
    float m = -INFINITY, sum = 0.f;
    if (head) {
#pragma unroll
      for (int k = 0; k < kLseSlots; ++k) {
        if (part + 16 * k < used) merge_max_sum(m, sum, split_lse[k], 1.f);
      }
      for (int p = part + 16 * kLseSlots; p < used; p += 16) merge_max_sum(m, sum, head_lse[p * rows_q], 1.f);
    }
#pragma unroll
    for (int offset = 8; offset > 0; offset /= 2) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m, offset);
      const float sum_other = __shfl_xor_sync(0xffffffffu, sum, offset);
      merge_max_sum(m, sum, m_other, sum_other);
    }
    const int leader = lane & ~15;  // part 0 of this head
    m = __shfl_sync(0xffffffffu, m, leader);
    sum = __shfl_sync(0xffffffffu, sum, leader);
    const float lse = m == -INFINITY ? -INFINITY : m + logf(sum);
    if (head && part == 0) lse_of_head[h] = lse;
    if (head && weights_shared) {
      const auto weight = [&](float split) { return lse == -INFINITY || split == -INFINITY ? 0.f : expf(split - lse); };
#pragma unroll
      for (int k = 0; k < kLseSlots; ++k) {
        const int p = part + 16 * k;
        if (p < used) split_weight[p * a.group + h] = weight(split_lse[k]);
      }
      for (int p = part + 16 * kLseSlots; p < used; p += 16) split_weight[p * a.group + h] = weight(head_lse[p * rows_q]);
    }
  }
  __syncthreads();

  // Block blk's score, summed over its splits in order, each split's heads in order. With the weights in shared
  // memory (the usual case) the first kSplitsPerBlock splits' partials come from the pass's registers (`value`);
  // otherwise every weight is recomputed from the lse and every partial reloaded, in compact loops (the rare path
  // stays out of the common path's instructions).
  const auto block_score = [&](int u, int blk) {
    int p_first, p_last;  // recomputed rather than kept in registers across the lse phase
    splits_of(blk, p_first, p_last);
    float score = 0.f;
    if (weights_shared) {
#pragma unroll
      for (int s = 0; s < kSplitsPerBlock; ++s) {
        const int p = p_first + s;
        if (p <= p_last) {
#pragma unroll
          for (int h = 0; h < kRows; ++h) {
            if (h < a.group) score += split_weight[p * a.group + h] * value[u][s][h];
          }
        }
      }
      for (int p = p_first + kSplitsPerBlock; p <= p_last; ++p) {
        const float* const partial = partials(blk, p);
        float more[kRows];
#pragma unroll
        for (int h = 0; h < kRows; ++h) more[h] = h < a.group ? partial[h * a.score_span] : 0.f;
#pragma unroll
        for (int h = 0; h < kRows; ++h) {
          if (h < a.group) score += split_weight[p * a.group + h] * more[h];
        }
      }
    } else {
#pragma unroll 1
      for (int p = p_first; p <= p_last; ++p) {
        const float* const partial = partials(blk, p);
#pragma unroll 1
        for (int h = 0; h < a.group; ++h) {
          const float lse = lse_of_head[h], split_lse = a.cmp_lse[p * rows_q + head_row0 + h];
          const float weight = lse == -INFINITY || split_lse == -INFINITY ? 0.f : expf(split_lse - lse);
          score += weight * partial[h * a.score_span];
        }
      }
    }
    return score;
  };
  // Passes of kBlocksPerPass blocks per thread; the first pass's loads were issued before the lse phase.
  for (int first = threadIdx.x; first < candidates; first += kBlocksPerPass * kSelectThreads) {
    if (first != static_cast<int>(threadIdx.x)) load_pass(first);
#pragma unroll
    for (int u = 0; u < kBlocksPerPass; ++u) {
      const int blk = first + u * kSelectThreads;
      if (blk < candidates) scores[blk] = block_score(u, blk);
    }
  }

  // Forced blocks: the initial ones and the local ones ending at the query's block.
  const int last = candidates - 1;
  const int init_end = min(a.num_init, candidates);
  const int local_begin = max(init_end, last - a.num_local + 1);
  const int forced = init_end + max(candidates - local_begin, 0);
  const int take = min(a.num_selected, candidates);
  const int rounds = max(take - forced, 0);
  __syncthreads();  // the scores are written

  // The top `rounds` of the other candidates [init_end, local_begin) in the order (score descending, index
  // ascending), as selection keys (one unsigned order, distinct per block). Each warp takes the top `rounds` of its
  // share (every kWarps-th group of 32 candidates) with no block barrier; the overall top `rounds` are among the
  // warps' picks.
  {
    const auto key_of = [&](int blk) { return selection_key(scores[blk], blk); };
    const int first = init_end + warp * 32 + lane;
    const int per_lane = (local_begin - init_end + kSelectThreads - 1) / kSelectThreads;  // at most, any lane
    if (rounds > 0) {
      if (per_lane <= 4) {
        warp_top_sorted<4>(first, local_begin, kSelectThreads, rounds, key_of, picks[warp]);
      } else if (per_lane <= 8) {
        warp_top_sorted<8>(first, local_begin, kSelectThreads, rounds, key_of, picks[warp]);
      } else if (per_lane <= 16) {
        warp_top_sorted<16>(first, local_begin, kSelectThreads, rounds, key_of, picks[warp]);
      } else {
        warp_top_rescan(first, local_begin, kSelectThreads, rounds, key_of, picks[warp]);
      }
    }
  }
  __syncthreads();  // the warps' picks are written
  allow_next_grid();

  // The overall top `rounds` from the warps' picks, without rounds: a pick's rank among all the picks is the count
  // of picks above it, summed over the warps' lists (sorted: a binary search each, all eight in flight together).
  // A pick in the overall top `rounds` ranks the same among the picks as among all candidates (every candidate
  // above it is in its warp's top `rounds` too); every other pick ranks at least `rounds`. So chosen[rank] is the
  // same best-first list as `rounds` rounds of a maximum over the picks would give.
  for (int i = threadIdx.x; i < kWarps * rounds; i += kSelectThreads) {
    const std::uint64_t key = picks[i / rounds][i % rounds];
    if (key == 0u) continue;  // past the end of its warp's candidates
    int rank = 0;
    int above[kWarps];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) above[w] = 0;
#pragma unroll 1
    for (int step = 64; step > 0; step /= 2) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        if (above[w] + step <= rounds && picks[w][above[w] + step - 1] > key) above[w] += step;
      }
    }
#pragma unroll
    for (int w = 0; w < kWarps; ++w) rank += above[w];
    if (rank < rounds) chosen[rank] = key_block(key);
  }
  __syncthreads();
  if (warp != 0) return;

  // The list, ascending, then -1: the initial blocks, the chosen blocks (all in [init_end, local_begin)) each at
  // init_end + its rank among them (the count of chosen blocks below it), the local blocks.
  const int forced_local = candidates - local_begin;
  const int count = init_end + rounds + forced_local;
  std::int32_t* const out = a.indices + a.list_of(b, t, kv_head) * a.num_selected;
  const auto store = [&](int slot, int value) {
    out[slot] = value;
    if (a.indices_out != nullptr) {
      a.indices_out[b * a.indices_out_stride[0] + t * a.indices_out_stride[1] + kv_head * a.indices_out_stride[2] +
                    slot * a.indices_out_stride[3]] = value;
    }
  };
  for (int i = lane; i < rounds; i += 32) {
    const int value = chosen[i];
    int rank = 0;
    for (int j = 0; j < rounds; ++j) rank += chosen[j] < value;
    store(init_end + rank, value);
  }
  for (int slot = lane; slot < a.num_selected; slot += 32) {
    if (slot < init_end) {
      store(slot, slot);
    } else if (slot >= init_end + rounds) {
      store(slot, slot < count ? local_begin + (slot - init_end - rounds) : -1);
    }
  }
}

// The gated combine of one list's rows (the group's query heads of query t of sequence b), by one CTA of
// kThreads threads once every partial of the list is written: per row and branch, M = max lse_p, weights
// w_p = exp(lse_p - M) and their sum in the order of p (phase 1, into `scratch`); then for each 4 columns the
// partials' loads in flight together, o_branch = (sum_p w_p o_p) / sum_p w_p in the order of p, and
// o = g_cmp o_cmp + g_slc o_slc + g_swa o_swa in that order (phase 2): nsa_decode_combine_kernel's arithmetic.
// The partials are flat entries e: compressed splits e < used, then the pieces (selected, then window) at piece
// slot e - used. `scratch` is shared memory of kRows x (kFusedCombineMax + 6) floats.
template <class T, int Dv>
__device__ void combine_list(const NsaDecodeArgs<T>& a, int b, int t, int kv_head, float* scratch) {
  constexpr int kMax = static_cast<int>(kFusedCombineMax), kPitch = kMax + 6, kBatch = 8;
  const i64 rows_q = i64{a.batch} * a.q_len * a.q_heads;
  const i64 row0 = a.row_of(b, t, kv_head * a.group);
  const int used = a.has_cmp ? (a.visible_cmp(a.length(b) - a.q_len + t) + a.split_rows - 1) / a.split_rows : 0;
  const int sel_end = used + a.sel_pieces, total = sel_end + a.swa_pieces;
  const auto lse_at = [&](int e, int g) {
    return e < used ? __ldcg(a.cmp_lse + e * rows_q + row0 + g) : __ldcg(a.piece_lse + (e - used) * rows_q + row0 + g);
  };
  // Row g's weights at scratch[g * kPitch + e]; branch br's max and sum at kMax + 2 br and kMax + 2 br + 1.
  for (int item = threadIdx.x; item < a.group * 3; item += kThreads) {
    const int g = item / 3, br = item % 3;
    const int lo = br == 0 ? 0 : br == 1 ? used : sel_end, hi = br == 0 ? used : br == 1 ? sel_end : total;
    float* const w = scratch + g * kPitch;
    float row_max = -INFINITY, sum = 0.f;
    for (int e = lo; e < hi; ++e) {
      w[e] = lse_at(e, g);
      row_max = fmaxf(row_max, w[e]);
    }
    if (row_max != -INFINITY) {
      for (int e = lo; e < hi; ++e) {
        w[e] = expf(w[e] - row_max);
        sum += w[e];
      }
    }
    w[kMax + 2 * br] = row_max;
    w[kMax + 2 * br + 1] = sum;
  }
  __syncthreads();
  constexpr int kQuads = Dv / 4;
  for (int item = threadIdx.x; item < a.group * kQuads; item += kThreads) {
    const int g = item / kQuads, c = (item % kQuads) * 4;
    const float* const w = scratch + g * kPitch;
    // Each branch's sum over its entries in ascending order: the entries are visited in order, kBatch loads at a
    // time in flight, each added to its branch's accumulator.
    float4 acc[3];
#pragma unroll
    for (int br = 0; br < 3; ++br) acc[br] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int e0 = 0; e0 < total; e0 += kBatch) {
      float4 x[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int e = e0 + j;
        x[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (e < total) {
          const float* const src = e < used ? a.cmp_o + (e * rows_q + row0 + g) * Dv + c
                                            : a.piece_o + ((e - used) * rows_q + row0 + g) * Dv + c;
          x[j] = __ldcg(reinterpret_cast<const float4*>(src));
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int e = e0 + j;
        if (e >= total) break;
        const float we = w[e];
        const auto add = [&](float4& into) {
          into.x += we * x[j].x;
          into.y += we * x[j].y;
          into.z += we * x[j].z;
          into.w += we * x[j].w;
        };
        if (e < used) {
          add(acc[0]);
        } else if (e < sel_end) {
          add(acc[1]);
        } else {
          add(acc[2]);
        }
      }
    }
    const int h = kv_head * a.group + g;
    const bool active[3] = {a.has_cmp, a.has_sel, a.has_swa};
    float out[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int br = 0; br < 3; ++br) {
      if (!active[br]) continue;
      float merged[4] = {0.f, 0.f, 0.f, 0.f};
      if (w[kMax + 2 * br] != -INFINITY) {
        const float sum = w[kMax + 2 * br + 1];
        merged[0] = acc[br].x / sum;
        merged[1] = acc[br].y / sum;
        merged[2] = acc[br].z / sum;
        merged[3] = acc[br].w / sum;
      }
      const float gate = to_float(a.gate[br].at(b, t, h));
#pragma unroll
      for (int j = 0; j < 4; ++j) out[j] += gate * merged[j];
    }
    T* const dst = a.o.row(b, t, h) + c;
#pragma unroll
    for (int j = 0; j < 4; ++j) dst[j] = from_float<T>(out[j]);
  }
}

template <class T, int Dqk, int Dv>
__global__ void __launch_bounds__(kThreads) nsa_decode_sparse_kernel(NsaDecodeArgs<T> a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ RowState state;
  wait_for_previous_grid();  // the selection
  const int pieces = a.sel_pieces + a.swa_pieces;
  i64 block = blockIdx.x;
  const int piece = static_cast<int>(block % pieces);
  block /= pieces;
  const int kv_head = static_cast<int>(block % a.kv_heads);
  block /= a.kv_heads;
  const int t = static_cast<int>(block % a.q_len);
  const int b = static_cast<int>(block / a.q_len);

  const int length = a.length(b);
  const int pos = length - a.q_len + t;
  const bool selected = piece < a.sel_pieces;
  const int local_piece = selected ? piece : piece - a.sel_pieces;
  const int chunk_begin = local_piece * a.tiles_per_piece * kChunks;
  const int chunk_end = min(chunk_begin + a.tiles_per_piece * kChunks, selected ? a.sel_chunks : a.swa_chunks);
  const int tiles = (chunk_end - chunk_begin + kChunks - 1) / kChunks;
  const std::int32_t* const list = a.indices + a.list_of(b, t, kv_head) * a.num_selected;
  const int chunks_per_block = a.sel_block / kChunkKeys;
  const int window_first = max(pos - a.window + 1, 0);
  const std::int32_t* const table = a.block_table + b * a.table_batch_stride;

  const auto chunk = [&](int tile, int c) {
    const int index = chunk_begin + tile * kChunks + c;
    ChunkRef<T> ref;
    ref.rows = 0;
    ref.lo = 1;
    ref.hi = 0;
    ref.k = a.k.data;
    ref.v = a.v.data;
    ref.k_stride = a.k.row_stride;
    ref.v_stride = a.v.row_stride;
    if (index >= chunk_end || pos < 0) return ref;
    i64 start;
    if (selected) {
      const int blk = list[index / chunks_per_block];
      if (blk < 0) return ref;
      start = i64{blk} * a.sel_block + (index % chunks_per_block) * kChunkKeys;
      ref.lo = 0;
    } else {
      start = i64{window_first / kChunkKeys + index} * kChunkKeys;
      ref.lo = static_cast<int>(max(i64{window_first} - start, i64{0}));
    }
    if (start > pos) {
      ref.lo = 1;
      return ref;
    }
    ref.hi = static_cast<int>(min(i64{pos} - start, i64{kChunkKeys - 1}));
    ref.rows = ref.hi + 1;
    const int entry = static_cast<int>(start / a.page_size);
    const int page = min(max(__ldg(table + entry * a.table_page_stride), 0), a.num_pages - 1);
    const i64 row = start % a.page_size;
    ref.k = a.k.data + page * a.k.page_stride + row * a.k.row_stride + kv_head * a.k.head_stride;
    ref.v = a.v.data + page * a.v.page_stride + row * a.v.row_stride + kv_head * a.v.head_stride;
    return ref;
  };
  attend_tiles<T, Dqk, Dv, false, kWarps>(a, b, t, kv_head, tiles, chunk, smem, nullptr, 0);
  allow_next_grid();
  merge_rows<Dv>(smem, Dqk, state);
  const i64 rows_q = i64{a.batch} * a.q_len * a.q_heads;
  write_partials<Dv, kThreads>(smem, Dqk, state, a.group, a.piece_o, a.piece_lse,
                     piece * rows_q + a.row_of(b, t, kv_head * a.group));
  if (!a.fused_combine) return;
  // The list's last CTA to finish combines its rows (the pipeline's shared memory is free once all have arrived).
  static_assert(std::size_t{kRows} * (kFusedCombineMax + 6) * sizeof(float) <= AttendTile<Dqk, Dv>::kSmemBytes,
                "the combine's weights fit the sparse kernel's shared memory");
  __shared__ int last_flag;
  if (!last_to_arrive(a.counters + a.list_of(b, t, kv_head), pieces, last_flag)) return;
  combine_list<T, Dv>(a, b, t, kv_head, reinterpret_cast<float*>(smem));
}

// o of one row from `count` partials at partial_o[p * rows_q * Dv + row * Dv], p = first .. first + count - 1 in
// order, for column c: M = max lse_p, o = sum_p exp(lse_p - M) o_p / sum_p exp(lse_p - M), the sums in the order of
// p. Up to kMergeShared partials, the CTA stages the weights exp(lse_p - M) in shared memory (M from a block-wide
// max), and each thread's loop keeps several partials' loads in flight; beyond, each thread reads the lse values
// itself. Every thread forms the same weights and sums them in the same order, so all agree.
template <int Dv>
__device__ __forceinline__ float merge_partials(const float* partial_o, const float* partial_lse, i64 rows_q, i64 row,
                                                int first, int count, int c, float* staged_weight) {
  constexpr int kWarps = Dv / 32;
  __shared__ float warp_max[kWarps];
  if (count <= kMergeShared) {
    __syncthreads();  // the previous branch's weights and maxima are read
    float lse_max = -INFINITY;
    for (int p = c; p < count; p += Dv) {
      staged_weight[p] = partial_lse[(first + p) * rows_q + row];
      lse_max = fmaxf(lse_max, staged_weight[p]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, offset));
    }
    if (c % 32 == 0) warp_max[c / 32] = lse_max;
    __syncthreads();
    float row_max = warp_max[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) row_max = fmaxf(row_max, warp_max[w]);
    if (row_max == -INFINITY) return 0.f;
    for (int p = c; p < count; p += Dv) staged_weight[p] = expf(staged_weight[p] - row_max);
    __syncthreads();
    float sum = 0.f, out = 0.f;
    const float* o = partial_o + (first * rows_q + row) * Dv + c;
    const i64 step = rows_q * Dv;
#pragma unroll 16
    for (int p = 0; p < count; ++p) {
      const float w = staged_weight[p];
      sum += w;
      out += w * o[p * step];
    }
    return out / sum;
  }
  const auto lse_at = [&](int p) { return partial_lse[(first + p) * rows_q + row]; };
  float row_max = -INFINITY;
  for (int p = 0; p < count; ++p) row_max = fmaxf(row_max, lse_at(p));
  if (row_max == -INFINITY) return 0.f;
  float sum = 0.f, out = 0.f;
  for (int p = 0; p < count; ++p) {
    const float w = expf(lse_at(p) - row_max);
    sum += w;
    out += w * partial_o[((first + p) * rows_q + row) * Dv + c];
  }
  return out / sum;
}

template <class T, int Dv>
__global__ void __launch_bounds__(Dv) nsa_decode_combine_kernel(NsaDecodeArgs<T> a) {
  __shared__ float staged_weight[kMergeShared];
  wait_for_previous_grid();  // every branch's partials
  const i64 row = blockIdx.x;  // (b, t, h)
  const int h = static_cast<int>(row % a.q_heads);
  const int t = static_cast<int>(row / a.q_heads % a.q_len);
  const int b = static_cast<int>(row / (i64{a.q_heads} * a.q_len));
  const int c = threadIdx.x;
  const i64 rows_q = i64{a.batch} * a.q_len * a.q_heads;
  float out = 0.f;
  if (a.has_cmp) {
    const int pos = a.length(b) - a.q_len + t;
    const int used = (a.visible_cmp(pos) + a.split_rows - 1) / a.split_rows;
    out += to_float(a.gate[0].at(b, t, h)) *
           merge_partials<Dv>(a.cmp_o, a.cmp_lse, rows_q, row, 0, used, c, staged_weight);
  }
  if (a.has_sel) {
    out += to_float(a.gate[1].at(b, t, h)) *
           merge_partials<Dv>(a.piece_o, a.piece_lse, rows_q, row, 0, a.sel_pieces, c, staged_weight);
  }
  if (a.has_swa) {
    out += to_float(a.gate[2].at(b, t, h)) *
           merge_partials<Dv>(a.piece_o, a.piece_lse, rows_q, row, a.sel_pieces, a.swa_pieces, c, staged_weight);
  }
  a.o.row(b, t, h)[c] = from_float<T>(out);
}

}  // namespace sparseattn::cuda::nsa_dec
