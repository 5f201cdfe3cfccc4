// The split-KV decode kernels of flash_decode on mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate).
//
// Main kernel: a CTA of 4 warps owns (row block, KV split, sequence, KV head). Its rows are query rows of that KV
// head: row r = i * G + g is query i of head kv_head * G + g (the order of q's memory), so the G query heads and
// the Tq queries share one read of the KV head's K and V; rows are padded to the CTA's 16 * kWarpsM. The warps form
// a kWarpsM x kWarpsN grid: warp (wm, wn) computes rows [16 wm, 16 wm + 16) against keys
// [wn * kWarpKeys, (wn + 1) * kWarpKeys) of each 64-key tile, with its own online softmax (running max, sum and
// output accumulator); the epilogue merges the kWarpsN key slices in warp order through shared memory. K/V tiles
// stream through a ring of cp.async stages (plan.h); each 16-key chunk of a tile is one run of rows at one address
// (dense: the sequence's rows; paged: one page), so a paged cache costs four block-table reads per tile, issued a
// tile ahead of their use. With one split the epilogue writes o and lse; with several, float32 partials (o of the
// split's kept keys and their lse), and the CTAs merge them themselves: the last CTA of a merge group (kMergeFan
// consecutive splits of the same rows) to write its partial merges the group's partials in split order, and with
// several groups the last group merger merges the groups' results in group order (merge_partials). Arrivals are
// counted with one atomic per CTA and merge; the order of every sum is fixed, so the result is bit-identical run to
// run whichever CTA merges.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "cuda/decode/plan.h"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mma.cuh"
#include "cuda/primitives/softmax.cuh"
#include "cuda/primitives/swizzled_tile.cuh"

namespace sparseattn::cuda::decode {

using i64 = std::int64_t;

// A cache tensor: dense [B, S, H, D] (outer = batch) or paged [pages, page_size, H, D] (outer = page).
template <class T>
struct Cache {
  const T* data;
  i64 outer_stride, row_stride, head_stride;
};

template <class T>
struct DecodeArgs {
  Tokens<const T> q;         // [B, Tq, Hq, Dqk]
  Cache<T> k, v;
  const std::int32_t* block_table;  // paged: [B, max_pages]
  i64 table_batch_stride, table_page_stride;
  const std::int32_t* cache_seqlens;  // [B]; null: every length is the capacity
  i64 seqlens_stride;
  Tokens<T> o;               // [B, Tq, Hq, Dv]
  LseView<float> lse;        // [B, Hq, Tq]
  float* partial_o;          // [P, B, Hq, Tq, Dv] with several splits, else null
  float* partial_lse;        // [P, B, Hq, Tq]
  float* group_o;            // [Q, B, Hq, Tq, Dv] with more than one merge group, else null
  float* group_lse;          // [Q, B, Hq, Tq]
  std::int32_t* counters;    // [B, Hkv, row blocks, Q + 1] arrivals, zero at the kernel's start
  int batch, q_len, q_heads, kv_heads, group;
  int capacity, page_size, num_pages;
  int splits, split_keys, row_blocks;
  bool causal;
  i64 window_left, window_right;  // negative: unbounded
  float scale_log2;               // softmax scale * log2(e)
};

template <int Dqk, int Dv, int kWarpsM>
struct DecodeTile {
  static constexpr int kWarpsN = kWarps / kWarpsM;
  static constexpr int kRows = 16 * kWarpsM;
  static constexpr int kWarpKeys = kTileKeys / kWarpsN;  // 16, 32 or 64
  static constexpr int kStages = pipeline_stages(Dqk, Dv);
  static constexpr int kKElements = kTileKeys * Dqk, kVElements = kTileKeys * Dv;
  static constexpr int kStageElements = kKElements + kVElements;
  static constexpr int kAccPitch = Dv + 8;  // floats per row of the epilogue's accumulators (bank spread)
  // Q stays in registers (Dqk / 4 of them) up to Dqk = 128; larger Q is read from shared memory at each step.
  static constexpr bool kQInRegisters = Dqk <= 128;
  static constexpr std::size_t kSmemBytes = smem_bytes(Dqk, Dv, kWarpsM);
};

// The keys [lo, hi] query i of a sequence with `length` keys keeps (empty when lo > hi).
template <class T>
__device__ __forceinline__ void visible_keys(const DecodeArgs<T>& a, int length, int i, int& lo, int& hi) {
  const i64 position = i64{length} - a.q_len + i;  // bottom-right alignment
  i64 first = 0, last = i64{length} - 1;
  if (a.causal) last = min(last, position);
  if (a.window_right >= 0) last = min(last, position + a.window_right);
  if (a.window_left >= 0) first = max(first, position - a.window_left);
  lo = static_cast<int>(first);
  hi = static_cast<int>(max(last, first - 1));
}

// Where the chunks of a key tile start: chunk c's 16 rows are rows row[c] .. row[c] + 15 of page[c] (paged: a
// cache page; dense: the sequence's batch row, row[c] its first key).
struct TileChunks {
  int page[kChunks];
  int row[kChunks];
};

// Walks a sequence's tiles in order and gives each its chunks. Paged, it keeps the block-table entry and the row
// within that page of the next chunk (one division per CTA, none per tile) and reads the entries of the chunks
// that hold keys [0, length) only, clamped to the cache's pages.
template <bool kPaged, class T>
struct ChunkWalk {
  int entry, row;

  __device__ __forceinline__ ChunkWalk(const DecodeArgs<T>& a, int first_tile) {
    const int key0 = first_tile * kTileKeys;
    entry = kPaged ? key0 / a.page_size : 0;
    row = kPaged ? key0 % a.page_size : key0;
  }
  // The chunks of the next tile (tiles are visited in order, one call each).
  __device__ __forceinline__ void next(const DecodeArgs<T>& a, int b, int length, TileChunks& chunks) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if constexpr (kPaged) {
        chunks.page[c] = 0;
        if (entry * a.page_size + row < length) {
          const int page = __ldg(a.block_table + b * a.table_batch_stride + entry * a.table_page_stride);
          chunks.page[c] = min(max(page, 0), a.num_pages - 1);
        }
        chunks.row[c] = row;
        row += kChunkKeys;
        if (row == a.page_size) {
          row = 0;
          ++entry;
        }
      } else {
        chunks.page[c] = b;
        chunks.row[c] = row;
        row += kChunkKeys;
      }
    }
  }
};

// Partials one merge reads per row at most: a group's kMergeFan splits, or the groups of kMaxSplits splits.
inline constexpr int kMaxMerged = kMaxSplits / kMergeFan > kMergeFan ? kMaxSplits / kMergeFan : kMergeFan;
inline constexpr int kMergePitch = kMaxMerged + 1;  // floats per row of the merge weights: the weights, then lse

// Merges partials [first, first + count) (slot p: o at src_o[p][row][Dv], lse at src_lse[p][row], rows indexed as
// [B, Hq, Tq]) of the CTA's rows in slot order (docs/semantics.md section 8): M = max_p lse_p; lse = M + log sum_p
// exp(lse_p - M); o = sum_p exp(lse_p - lse) o_p, p ascending, in float32. Rows that no partial sees get o = 0 and
// lse = -inf. kFinal writes o (rounded to T) and lse; otherwise partial slot `dst_slot` of dst_o and dst_lse.
// `weights` is shared memory of kRows x kMergePitch floats. Partials written by other CTAs are read through L2.
template <bool kFinal, int Dv, class T>
__device__ void merge_partials(const DecodeArgs<T>& a, const float* src_o, const float* src_lse, int first,
                               int count, float* dst_o, float* dst_lse, int dst_slot, int b, int kv_head, int row0,
                               int real_rows, float* weights) {
  const i64 slot_rows = i64{a.batch} * a.q_heads * a.q_len;
  const auto index_of = [&](int r, int& i, int& h) {
    const int row = row0 + r;
    i = row / a.group;
    h = kv_head * a.group + row % a.group;
    return (i64{b} * a.q_heads + h) * a.q_len + i;
  };
  for (int r = threadIdx.x; r < real_rows; r += kThreads) {
    int i, h;
    const i64 index = index_of(r, i, h);
    float* const w = weights + r * kMergePitch;
    float row_max = -INFINITY;
    for (int p = 0; p < count; ++p) {
      w[p] = __ldcg(src_lse + (first + p) * slot_rows + index);
      row_max = fmaxf(row_max, w[p]);
    }
    float lse = -INFINITY;
    if (row_max != -INFINITY) {
      float sum = 0.f;
      for (int p = 0; p < count; ++p) sum += expf(w[p] - row_max);
      lse = row_max + logf(sum);
    }
    for (int p = 0; p < count; ++p) w[p] = lse == -INFINITY ? 0.f : expf(w[p] - lse);
    w[kMaxMerged] = lse;
  }
  __syncthreads();
  constexpr int kQuads = Dv / 4;
  for (int item = threadIdx.x; item < real_rows * kQuads; item += kThreads) {
    const int r = item / kQuads, c = (item % kQuads) * 4;
    int i, h;
    const i64 index = index_of(r, i, h);
    const float* const w = weights + r * kMergePitch;
    float4 out = make_float4(0.f, 0.f, 0.f, 0.f);
    if (w[kMaxMerged] != -INFINITY) {
      const float* const src = src_o + index * Dv + c;
      for (int p0 = 0; p0 < count; p0 += kMergeFan) {
        float4 x[kMergeFan];
#pragma unroll
        for (int j = 0; j < kMergeFan; ++j) {
          x[j] = p0 + j < count ? __ldcg(reinterpret_cast<const float4*>(src + (first + p0 + j) * slot_rows * Dv))
                                : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < kMergeFan; ++j) {
          if (p0 + j < count) {
            const float weight = w[p0 + j];
            out.x += weight * x[j].x;
            out.y += weight * x[j].y;
            out.z += weight * x[j].z;
            out.w += weight * x[j].w;
          }
        }
      }
    }
    if constexpr (kFinal) {
      uint2 packed;
      packed.x = pack2<T>(out.x, out.y);
      packed.y = pack2<T>(out.z, out.w);
      *reinterpret_cast<uint2*>(a.o.row(b, i, h) + c) = packed;
    } else {
      *reinterpret_cast<float4*>(dst_o + (dst_slot * slot_rows + index) * Dv + c) = out;
    }
  }
  for (int r = threadIdx.x; r < real_rows; r += kThreads) {
    int i, h;
    const i64 index = index_of(r, i, h);
    const float lse = weights[r * kMergePitch + kMaxMerged];
    if constexpr (kFinal) {
      a.lse.at(b, i, h) = lse;
    } else {
      dst_lse[dst_slot * slot_rows + index] = lse;
    }
  }
}

template <class T, int Dqk, int Dv, int kWarpsM, bool kPaged>
__global__ void __launch_bounds__(kThreads) flash_decode_kernel(DecodeArgs<T> a) {
  using Tile = DecodeTile<Dqk, Dv, kWarpsM>;
  constexpr int kRows = Tile::kRows, kWarpsN = Tile::kWarpsN, kWarpKeys = Tile::kWarpKeys;
  constexpr int kStages = Tile::kStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* const sQ = reinterpret_cast<T*>(smem_raw);
  T* const sPipe = sQ + kRows * Dqk;

  // Block order: row blocks fastest (they read the same K/V), then splits, then (sequence, KV head).
  i64 block = blockIdx.x;
  const int row_block = static_cast<int>(block % a.row_blocks);
  block /= a.row_blocks;
  const int split = static_cast<int>(block % a.splits);
  block /= a.splits;
  const int kv_head = static_cast<int>(block % a.kv_heads);
  const int b = static_cast<int>(block / a.kv_heads);

  const int length =
      a.cache_seqlens == nullptr ? a.capacity : min(max(__ldg(a.cache_seqlens + b * a.seqlens_stride), 0), a.capacity);
  const int rows = a.group * a.q_len;
  const int row0 = row_block * kRows;
  const int real_rows = min(kRows, rows - row0);

  // The union of the rows' visible keys (what the CTA reads) and their intersection (where no key is masked).
  int union_lo = INT_MAX, union_hi = -1, common_lo = 0, common_hi = INT_MAX;
  for (int i = row0 / a.group; i <= (row0 + real_rows - 1) / a.group; ++i) {
    int lo, hi;
    visible_keys(a, length, i, lo, hi);
    common_lo = max(common_lo, lo);
    common_hi = min(common_hi, hi);
    if (lo <= hi) {
      union_lo = min(union_lo, lo);
      union_hi = max(union_hi, hi);
    }
  }
  const int split_begin = split * a.split_keys;
  const int key_begin = max(split_begin, union_lo);
  const int key_end = min(min(split_begin + a.split_keys, length), union_hi + 1);
  const int tile_begin = key_begin / kTileKeys;
  const int tiles = key_end > key_begin ? (key_end - 1) / kTileKeys + 1 - tile_begin : 0;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  // The visible keys of this thread's two rows (wm's rows lane / 4 and lane / 4 + 8); padding rows see none.
  int row_lo[2], row_hi[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + wm * 16 + lane / 4 + half * 8;
    row_lo[half] = 1;
    row_hi[half] = 0;
    if (r < rows) visible_keys(a, length, r / a.group, row_lo[half], row_hi[half]);
  }

  float acc[Dv / 8][4];
#pragma unroll
  for (int n = 0; n < Dv / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  if (tiles > 0) {
    const SmemTile<T, kRows, Dqk> q_tile{sQ};
    load_rows<T, kRows, Dqk, kThreads>(
        q_tile,
        [&](int r) -> const T* {
          if (r >= real_rows) return nullptr;
          const int row = row0 + r;
          return a.q.row(b, row / a.group, kv_head * a.group + row % a.group);
        },
        a.q.data);
    cp_async_commit();

    const auto issue_tile = [&](int tile, int slot, const TileChunks& chunks) {
      T* const k_stage = sPipe + slot * Tile::kStageElements;
      T* const v_stage = k_stage + Tile::kKElements;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int valid = min(max(length - (tile * kTileKeys + c * kChunkKeys), 0), kChunkKeys);
        const T* k_rows = a.k.data, *v_rows = a.v.data;
        if (valid > 0) {
          k_rows += chunks.page[c] * a.k.outer_stride + chunks.row[c] * a.k.row_stride + kv_head * a.k.head_stride;
          v_rows += chunks.page[c] * a.v.outer_stride + chunks.row[c] * a.v.row_stride + kv_head * a.v.head_stride;
        }
        load_strided_rows<T, kChunkKeys, Dqk, kThreads>(SmemTile<T, kChunkKeys, Dqk>{k_stage + c * kChunkKeys * Dqk},
                                                        k_rows, a.k.row_stride, valid, a.k.data);
        load_strided_rows<T, kChunkKeys, Dv, kThreads>(SmemTile<T, kChunkKeys, Dv>{v_stage + c * kChunkKeys * Dv},
                                                       v_rows, a.v.row_stride, valid, a.v.data);
      }
    };

    // Prologue: the first kStages - 1 tiles, one commit group each (empty groups past the last tile keep the
    // group count, and so the wait below, uniform). The chunks of the next tile to issue are looked up one
    // iteration ahead of their use.
    ChunkWalk<kPaged, T> walk(a, tile_begin);
    TileChunks chunks;
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < tiles) {
        walk.next(a, b, length, chunks);
        issue_tile(tile_begin + s, s, chunks);
      }
      cp_async_commit();
    }
    if (kStages - 1 < tiles) walk.next(a, b, length, chunks);

    cp_async_wait<kStages - 1>();  // the Q group
    __syncthreads();
    std::uint32_t q_frag[Tile::kQInRegisters ? Dqk / 16 : 1][4];
    if constexpr (Tile::kQInRegisters) {
#pragma unroll
      for (int kk = 0; kk < Dqk / 16; ++kk) load_a(q_frag[kk], q_tile, wm * 16, kk * 16);
    }

    for (int it = 0; it < tiles; ++it) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // tile `it` has landed for every thread; every warp is done with tile it - 1's slot
      const int next = it + kStages - 1;
      if (next < tiles) {
        issue_tile(tile_begin + next, next % kStages, chunks);
        if (next + 1 < tiles) walk.next(a, b, length, chunks);
      }
      cp_async_commit();

      const int slot = it % kStages;
      const SmemTile<T, kTileKeys, Dqk> k_tile{sPipe + slot * Tile::kStageElements};
      const SmemTile<T, kTileKeys, Dv> v_tile{sPipe + slot * Tile::kStageElements + Tile::kKElements};
      const int warp_key0 = (tile_begin + it) * kTileKeys + wn * kWarpKeys;

      // S = Q K^T for the warp's 16 rows and kWarpKeys keys.
      float s[kWarpKeys / 8][4];
#pragma unroll
      for (int n = 0; n < kWarpKeys / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < Dqk / 16; ++kk) {
        std::uint32_t qa[4];
        if constexpr (Tile::kQInRegisters) {
#pragma unroll
          for (int i = 0; i < 4; ++i) qa[i] = q_frag[kk][i];
        } else {
          load_a(qa, q_tile, wm * 16, kk * 16);
        }
#pragma unroll
        for (int np = 0; np < kWarpKeys / 16; ++np) {
          std::uint32_t kb[4];
          load_b_rows(kb, k_tile, wn * kWarpKeys + np * 16, kk * 16);
          mma_pair<T>(s[2 * np], s[2 * np + 1], qa, kb);
        }
      }

      // Online softmax; the per-element mask only where some row does not see all of the warp's keys.
      const bool masked = !(warp_key0 >= common_lo && warp_key0 + kWarpKeys - 1 <= common_hi);
      float correction[2];
      with_mask(masked, [&](auto mask) {
        const int col_lo[2] = {row_lo[0] - warp_key0, row_lo[1] - warp_key0};
        const int col_hi[2] = {row_hi[0] - warp_key0, row_hi[1] - warp_key0};
        softmax_probabilities<kWarpKeys, decltype(mask)::value>(s, m, l, col_lo, col_hi, a.scale_log2, correction);
      });
      rescale_rows<Dv>(acc, correction);

      // O += P V: P (the probabilities, rounded to T) as the A operand, 16 keys per step.
#pragma unroll
      for (int kk = 0; kk < kWarpKeys / 16; ++kk) {
        const std::uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                     pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                     pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int np = 0; np < Dv / 16; ++np) {
          std::uint32_t vb[4];
          load_b_cols(vb, v_tile, wn * kWarpKeys + kk * 16, np * 16);
          mma_pair<T>(acc[2 * np], acc[2 * np + 1], pa, vb);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's shared memory is free for the epilogue

  // Epilogue: every warp's accumulators, row maxima and sums to shared memory, [kWarpsN][kRows] rows.
  float* const sAcc = reinterpret_cast<float*>(sPipe);
  float* const sMax = sAcc + kWarpsN * kRows * Tile::kAccPitch;
  float* const sSum = sMax + kWarpsN * kRows;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] = quad_sum(l[half]);
    const int r = wn * kRows + wm * 16 + lane / 4 + half * 8;
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
  __syncthreads();

  // Merges the kWarpsN key slices of a row (in warp order): each slice's weight 2^(m_w - M), the row's sum.
  const auto row_merge = [&](int r, float (&weight)[kWarpsN], float& row_max, float& sum) {
    row_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarpsN; ++w) row_max = fmaxf(row_max, sMax[w * kRows + r]);
    sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsN; ++w) {
      weight[w] = row_max == -INFINITY ? 0.f : exp2f(sMax[w * kRows + r] - row_max);
      sum += sSum[w * kRows + r] * weight[w];
    }
  };
  const bool single = a.splits == 1;
  const i64 partial_rows = i64{a.batch} * a.q_heads * a.q_len;  // rows of one split's partials
  constexpr int kPieces = Dv / 8;                               // 8 columns per piece
  for (int item = threadIdx.x; item < real_rows * kPieces; item += kThreads) {
    const int r = item / kPieces, c = (item % kPieces) * 8;
    float weight[kWarpsN], row_max, sum;
    row_merge(r, weight, row_max, sum);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    float out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsN; ++w) {
      const float* src = sAcc + (w * kRows + r) * Tile::kAccPitch + c;
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] += src[e] * weight[w];
    }
    const int row = row0 + r, i = row / a.group, h = kv_head * a.group + row % a.group;
    if (single) {
      uint4 packed;
      packed.x = pack2<T>(out[0] * inv, out[1] * inv);
      packed.y = pack2<T>(out[2] * inv, out[3] * inv);
      packed.z = pack2<T>(out[4] * inv, out[5] * inv);
      packed.w = pack2<T>(out[6] * inv, out[7] * inv);
      *reinterpret_cast<uint4*>(a.o.row(b, i, h) + c) = packed;
    } else {
      float* dst = a.partial_o + ((split * partial_rows + (i64{b} * a.q_heads + h) * a.q_len + i) * Dv + c);
      *reinterpret_cast<float4*>(dst) = make_float4(out[0] * inv, out[1] * inv, out[2] * inv, out[3] * inv);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(out[4] * inv, out[5] * inv, out[6] * inv, out[7] * inv);
    }
  }
  for (int r = threadIdx.x; r < real_rows; r += kThreads) {
    float weight[kWarpsN], row_max, sum;
    row_merge(r, weight, row_max, sum);
    const float lse = sum > 0.f ? (row_max + log2f(sum)) * kLn2 : -INFINITY;
    const int row = row0 + r, i = row / a.group, h = kv_head * a.group + row % a.group;
    if (single) {
      a.lse.at(b, i, h) = lse;
    } else {
      a.partial_lse[split * partial_rows + (i64{b} * a.q_heads + h) * a.q_len + i] = lse;
    }
  }
  if (single) return;

  // The merges: the last CTA of this split's group merges the group; with several groups, the last group merger
  // merges the groups. The weights reuse the pipeline's shared memory (free once every thread has arrived).
  static_assert(std::size_t{kRows} * kMergePitch * sizeof(float) <= std::size_t{kStages} * Tile::kStageElements * sizeof(T),
                "the merge weights fit the pipeline's shared memory");
  __shared__ int last_flag;
  float* const sWeights = reinterpret_cast<float*>(sPipe);
  const int groups = (a.splits + kMergeFan - 1) / kMergeFan;
  std::int32_t* const counters = a.counters + ((i64{b} * a.kv_heads + kv_head) * a.row_blocks + row_block) * (groups + 1);
  const int group = split / kMergeFan, first = group * kMergeFan, count = min(kMergeFan, a.splits - first);
  if (!last_to_arrive(counters + group, count, last_flag)) return;
  if (groups == 1) {
    merge_partials<true, Dv>(a, a.partial_o, a.partial_lse, first, count, nullptr, nullptr, 0, b, kv_head, row0,
                             real_rows, sWeights);
    return;
  }
  merge_partials<false, Dv>(a, a.partial_o, a.partial_lse, first, count, a.group_o, a.group_lse, group, b, kv_head,
                            row0, real_rows, sWeights);
  if (!last_to_arrive(counters + groups, groups, last_flag)) return;
  merge_partials<true, Dv>(a, a.group_o, a.group_lse, 0, groups, nullptr, nullptr, 0, b, kv_head, row0, real_rows,
                           sWeights);
}

}  // namespace sparseattn::cuda::decode
