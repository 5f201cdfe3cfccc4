// The attention kernels: one FlashAttention-2 style mainloop on mma.sync m16n8k16 (bf16/fp16 in, fp32
// accumulate), templated on head dims and a masking policy (masking_policy.cuh).
//
// Forward: a CTA of 4 warps owns kM queries of one query head (two 16-row tiles per warp when Dv <= 128:
// kM = 128; else one: kM = 64); Q stays in shared memory, K/V tiles of kN keys are double-buffered with
// cp.async; online softmax in fp32 on log2e-prescaled scores with exp2. Backward (deterministic, no atomics):
// preprocess delta = rowsum(dO * O) into the workspace; a dK/dV kernel whose CTA owns 64 keys of one KV head
// (16 per warp) and loops over the query tiles of its share of the group's heads (head splits, see AttnArgs),
// computing S^T = K Q^T so that P^T and dS^T stay in registers as the A operands of dV += P^T dO and
// dK += dS^T Q; a dQ kernel tiled like the forward that loops over key tiles, recomputing P from lse.
//
// Tile choices (shared memory rows padded by 8 elements = 16 bytes against ldmatrix bank conflicts; limits:
// 163 KB sm_80 and 227 KB sm_90 per CTA). On sm_90 these loops are bound by shared-memory bandwidth, so more
// row tiles per warp (each B fragment feeds more MMAs) pays where the fp32 accumulators fit in registers:
//   forward: two row tiles and kN = 32 when Dv <= 128 (kN = 64 spills registers); 256/256: one, kN = 32.
//   dQ: two row tiles and kN = 32 when Dqk <= 128; 192/128 and 256/256: one, kN = 32.
//   dK/dV query tile kM: 64 for Dqk = 64, 32 above; 192/128 and 256/256 compute dV and dK in two passes (dK, dV
//   accumulators together would need 256 fp32 registers per thread), the others in one.
// Register use (-Xptxas -v): at most a few dozen bytes of spills, at 128/128.
//
// With FlashTermsMask (score_terms.cuh: flash_attention's mask, bias, tile map) the loops visit only the key tiles
// (forward, dQ) or (query head, query tile) steps (dK/dV) that are not absent, the scores start from the terms
// instead of 0, and the dK/dV kernels write the bias gradient's contributions.
// With the sparse-softmax threshold (the forward's kThreshold instantiation, FlashTermsMask) the forward CTA, the
// query tile of the decisions, votes on each key tile before its softmax step (warp ballots, a shared word,
// __syncthreads) and runs neither the softmax step nor P V of a skipped tile.
// With a gate (FlashTermsMask or FlashGateMask, gate_terms.cuh; the wgmma kernels alike) the raw scores gain
// g(alpha delta) before the softmax or the recomputation of P, the dQ kernels write dalpha and the dK/dV kernels
// their ddelta partials.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "cuda/attention/masking_policy.cuh"
#include "cuda/attention/score_terms.cuh"
#include "cuda/attention/tile_walk.cuh"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mma.cuh"
#include "cuda/primitives/sequences.cuh"
#include "cuda/primitives/softmax.cuh"

namespace sparseattn::cuda::attention {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// fp32 partial dK or dV of the head splits of the dK/dV kernel: [splits][B][rows][Hkv][D], contiguous.
struct Partials {
  float* data;
  i64 split_stride, batch_stride, row_stride, head_stride;
  __device__ __forceinline__ float* row(i64 split, i64 b, i64 r, i64 h) const {
    return data + split * split_stride + b * batch_stride + r * row_stride + h * head_stride;
  }
};

template <class T>
struct AttnArgs {
  Tokens<T> q, k, v, o;
  LseView<float> lse;  // [B, H, T] / packed [H, N]
  Tokens<T> d_o, dq, dk, dv;
  LseView<float> delta;  // laid out like lse
  // Per query row, the gate of an NSA branch folded into its backward: P is multiplied by it (data null: 1;
  // core/branch_backward_options.h).
  LseView<float> d_o_scale;
  SeqPairTable seqs;
  int group;          // Hq / Hkv
  float scale;        // softmax scale
  float scale_log2;   // scale * log2(e)
  // The dK/dV kernel's CTAs split each group's query heads into head_splits parts; with more than one,
  // they write fp32 partials that attention_dkv_reduce_kernel adds up in split order (deterministic).
  int head_splits;
  Partials dk_partial, dv_partial;
  bool accumulate_dq;  // dQ kernels: dq += the gradient (the NSA backward sums its branches in place)
};

template <int kDim>
__host__ __device__ constexpr int ld_of() { return kDim + 8; }

// Copies rows [row0, row0 + valid) (valid may be <= 0) of head h into a kRows x kDim shared tile, zero-
// filling the rest.
template <int kRows, int kDim, class T>
__device__ __forceinline__ void load_tile(T* smem, const Tokens<T>& g, i64 b, i64 row0, i64 valid, i64 h) {
  constexpr int kChunks = kDim / 8;
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool ok = r < valid;
    const T* src = ok ? g.row(b, row0 + r, h) + c * 8 : g.data;
    cp_async_16(smem + r * ld_of<kDim>() + c * 8, src, ok ? 16 : 0);
  }
}

// A operand (16 rows x 16 k) at rows [row0, row0+16), columns [k0, k0+16) of a row-major tile.
template <int kDim, class T>
__device__ __forceinline__ void load_a(std::uint32_t (&a)[4], const T* tile, int row0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, tile + (row0 + lane % 16) * ld_of<kDim>() + k0 + (lane / 16) * 8);
}

// B operands of two n8 tiles [n0, n0+16) for k-slice [k0, k0+16), the tile stored [n][k] (e.g. K for Q K^T).
template <int kDim, class T>
__device__ __forceinline__ void load_b_nk(std::uint32_t (&b)[4], const T* tile, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(b, tile + (n0 + lane % 8 + (lane / 16) * 8) * ld_of<kDim>() + k0 + ((lane / 8) % 2) * 8);
}

// The same from a tile stored [k][n] (e.g. V for P V), through the transposing ldmatrix.
template <int kDim, class T>
__device__ __forceinline__ void load_b_kn(std::uint32_t (&b)[4], const T* tile, int k0, int n0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4_trans(b, tile + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * ld_of<kDim>() + n0 + (lane / 16) * 8);
}

template <class T>
__device__ __forceinline__ void mma_pair(float (&c0)[4], float (&c1)[4], const std::uint32_t (&a)[4],
                                         const std::uint32_t (&b)[4]) {
  const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
  mma_16816<T>(c0, a, b0);
  mma_16816<T>(c1, a, b1);
}

// acc[mt][kN/8][4] += A(rows a_row0 + 16*mt .. +16, k in [0, kK), from the shared tile `a_tile`) * B where B
// is stored [n][k]. Each B fragment feeds all kMT row tiles: more row tiles per warp, fewer shared-memory
// loads per MMA (shared-memory bandwidth, not the tensor cores, bounds these loops on sm_90).
template <class T, int kN, int kK, int kLdA, int kLdB, int kMT>
__device__ __forceinline__ void gemm_ss_nk(float (&acc)[kMT][kN / 8][4], const T* a_tile, int a_row0,
                                           const T* b_tile) {
#pragma unroll
  for (int k0 = 0; k0 < kK; k0 += 16) {
    std::uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) load_a<kLdA - 8>(a[mt], a_tile, a_row0 + 16 * mt, k0);
#pragma unroll
    for (int n = 0; n < kN / 8; n += 2) {
      std::uint32_t b[4];
      load_b_nk<kLdB - 8>(b, b_tile, n * 8, k0);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) mma_pair<T>(acc[mt][n], acc[mt][n + 1], a[mt], b);
    }
  }
}

// One row tile (16 rows).
template <class T, int kN, int kK, int kLdA, int kLdB>
__device__ __forceinline__ void gemm_ss_nk(float (&acc)[kN / 8][4], const T* a_tile, int a_row0, const T* b_tile) {
  gemm_ss_nk<T, kN, kK, kLdA, kLdB, 1>(reinterpret_cast<float(&)[1][kN / 8][4]>(acc), a_tile, a_row0, b_tile);
}

// acc[mt][kN/8][4] += P[mt](16 x kK, C-fragments in registers, kK/8 tiles) * B where B is stored [k][n].
template <class T, int kN, int kK, int kLdB, int kMT>
__device__ __forceinline__ void gemm_rs_kn(float (&acc)[kMT][kN / 8][4], const float (&p)[kMT][kK / 8][4],
                                           const T* b_tile) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    std::uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      a[mt][0] = pack2<T>(p[mt][2 * kk][0], p[mt][2 * kk][1]);
      a[mt][1] = pack2<T>(p[mt][2 * kk][2], p[mt][2 * kk][3]);
      a[mt][2] = pack2<T>(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
      a[mt][3] = pack2<T>(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int n = 0; n < kN / 8; n += 2) {
      std::uint32_t b[4];
      load_b_kn<kLdB - 8>(b, b_tile, kk * 16, n * 8);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) mma_pair<T>(acc[mt][n], acc[mt][n + 1], a[mt], b);
    }
  }
}

template <class T, int kN, int kK, int kLdB>
__device__ __forceinline__ void gemm_rs_kn(float (&acc)[kN / 8][4], const float (&p)[kK / 8][4], const T* b_tile) {
  gemm_rs_kn<T, kN, kK, kLdB, 1>(reinterpret_cast<float(&)[1][kN / 8][4]>(acc),
                                 reinterpret_cast<const float(&)[1][kK / 8][4]>(p), b_tile);
}

template <int kN>
__device__ __forceinline__ void zero(float (&acc)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// Stores a warp's 16 x kDim fp32 C-fragment rows (times `mul`) to rows row0 + r of head h where r < valid; with
// `accumulate`, adds them to what the rows hold.
template <int kDim, class T>
__device__ __forceinline__ void store_rows(const float (&acc)[kDim / 8][4], float mul0, float mul1,
                                           const Tokens<T>& g, i64 b, i64 row0, i64 valid, i64 h,
                                           bool accumulate = false) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = lane / 4 + half * 8;
    if (r >= valid) continue;
    const float mul = half ? mul1 : mul0;
    T* dst = g.row(b, row0 + r, h);
#pragma unroll
    for (int n = 0; n < kDim / 8; ++n) {
      auto* pair = reinterpret_cast<std::uint32_t*>(dst + n * 8 + 2 * (lane % 4));
      float x = acc[n][2 * half] * mul, y = acc[n][2 * half + 1] * mul;
      if (accumulate) add_unpacked<T>(*pair, x, y);
      *pair = pack2<T>(x, y);
    }
  }
}

// The same as fp32 into head split `split` of a partials buffer.
template <int kDim>
__device__ __forceinline__ void store_partial_rows(const float (&acc)[kDim / 8][4], float mul, const Partials& part,
                                                   i64 split, i64 b, i64 row0, i64 valid, i64 h) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = lane / 4 + half * 8;
    if (r >= valid) continue;
    float* dst = part.row(split, b, row0 + r, h);
#pragma unroll
    for (int n = 0; n < kDim / 8; ++n) {
      *reinterpret_cast<float2*>(dst + n * 8 + 2 * (lane % 4)) =
          make_float2(acc[n][2 * half] * mul, acc[n][2 * half + 1] * mul);
    }
  }
}

// The K and V tiles of keys [j0, j0 + kN) of KV head hk (zero-filled past the sequence), into shared memory.
template <int kN, int Dqk, int Dv, class T, class Seq>
__device__ __forceinline__ void load_kv_tiles(T* k_tile, T* v_tile, const AttnArgs<T>& a, const Seq& seq, i64 j0,
                                              i64 hk) {
  load_tile<kN, Dqk>(k_tile, a.k, seq.batch, seq.k_begin + j0, seq.S - j0, hk);
  load_tile<kN, Dv>(v_tile, a.v, seq.batch, seq.k_begin + j0, seq.S - j0, hk);
}

// The visible key columns [col_lo, col_hi] (relative to j0, clamped to the tile) of this thread's two rows of
// the 16-row tile starting at query row0: computed once per row rather than tested per element.
template <int kN, class Mask>
__device__ __forceinline__ void visible_columns(const Mask& mask, i64 row0, i64 j0, int (&col_lo)[2],
                                                int (&col_hi)[2]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const i64 t = row0 + lane / 4 + half * 8;
    const i64 lo = mask.lo(t), hi = t < mask.T ? min(mask.hi(t), mask.S - 1) : i64{-1};
    col_lo[half] = static_cast<int>(max(i64{0}, min(lo - j0, i64{kN})));
    col_hi[half] = static_cast<int>(max(i64{-1}, min(hi - j0, i64{kN - 1})));
  }
}

// Double buffering with cp.async: starts the next tile's loads (when there is one) and waits until the
// current tile's loads, committed one step earlier, have landed (in this thread; a barrier follows).
template <class LoadNext>
__device__ __forceinline__ void advance_pipeline(bool has_next, LoadNext&& load_next) {
  if (has_next) {
    load_next();
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
}

// Grid order (launchers.cuh): heads in x, tiles in y, sequences in z. CTAs start in x-fastest order, so all heads
// of one tile start together, and the tiles go heaviest first under causal masks (query tiles from the last,
// key tiles from the first): the last wave holds the lightest CTAs instead of a few long ones.
__device__ __forceinline__ i64 query_tile() { return i64{gridDim.y} - 1 - blockIdx.y; }

// What a query tile (forward, dQ) covers: queries [t0, t0 + rows) of query head h (from the grid, x: query head;
// y: query tiles of kM, heaviest first; z: sequence; or from a QueryTileOrder) against the key tiles [tile_begin, tile_end) of kN keys that
// hold visible keys of KV head hk. rows <= 0: the tile lies past the sequence.
struct QueryWork {
  i64 t0, h, hk, rows, tile_begin, tile_end, sequence;

  template <class T, class Mask, class Seq>
  __device__ __forceinline__ QueryWork(const AttnArgs<T>& a, const Mask& mask, const Seq& seq, int kM, int kN)
      : QueryWork(a, mask, seq, kM, kN, blockIdx.x, query_tile(), blockIdx.z) {}

  template <class T, class Mask, class Seq>
  __device__ __forceinline__ QueryWork(const AttnArgs<T>& a, const Mask& mask, const Seq& seq, int kM, int kN,
                                       i64 head, i64 tile, i64 sequence_index) {
    sequence = sequence_index;
    t0 = tile * kM;
    h = head;
    hk = h / a.group;
    rows = seq.T - t0 < kM ? seq.T - t0 : kM;
    tile_begin = tile_end = 0;
    if (rows <= 0) return;
    const i64 k_lo = mask.lo(t0), k_hi = mask.hi(t0 + rows - 1);
    tile_begin = k_lo / kN;
    tile_end = k_hi >= k_lo ? k_hi / kN + 1 : tile_begin;
  }
};

// The query tiles of a persistent kernel (grid: one CTA per SM; CTA c takes tiles c, c + gridDim.x, ...) in
// the order of the query-tile grid: heads fastest, then query tiles heaviest first, then sequences.
struct QueryTileOrder {
  i64 heads, tiles, count;  // tiles per sequence; count = heads x tiles x sequences

  struct Tile {
    i64 head, tile, sequence;
  };
  __device__ __forceinline__ Tile operator[](i64 index) const {
    const i64 rest = index / heads;
    return {index % heads, tiles - 1 - rest % tiles, rest / tiles};
  }
};

// Calls body(seq, mask, work) for each query tile of this CTA of a persistent kernel that lies inside its
// sequence: the producer and the consumers of a warp-specialised kernel walk the same tiles this way.
template <class Mask, int kM, int kN, class T, class Body>
__device__ __forceinline__ void for_each_query_tile(const AttnArgs<T>& a, const typename Mask::Config& mc,
                                                    const QueryTileOrder& order, Body&& body) {
  for (i64 index = blockIdx.x; index < order.count; index += gridDim.x) {
    const auto tile = order[index];
    const auto seq = a.seqs[tile.sequence];
    const Mask mask = for_head(bind_mask<Mask>(mc, seq, tile.sequence), tile.head);
    const QueryWork w(a, mask, seq, kM, kN, tile.head, tile.tile, tile.sequence);
    if (w.rows > 0) body(seq, mask, w);
  }
}

// The key tiles a query tile computes, in order, walked by one warp (every lane together): with a tile map
// (FlashTermsMask) the present ones of [tile_begin, tile_end) with their kinds, a window of them classified at a
// time (tile_walk.cuh); the other policies compute every tile of the range, of kind exists.
template <class Mask>
class KeyTileWalk {
 public:
  // The first key tile at or after `it` (below w.tile_end) that the query tile computes, or w.tile_end.
  template <class Seq>
  __device__ __forceinline__ i64 next(const typename Mask::Config& mc, const Seq& seq, const QueryWork& w, i64 it,
                                      int kN) {
    if constexpr (kHasTerms<Mask>) {
      if (mc.terms.tiles.states != nullptr) {
        return window_.next(it, w.tile_end, [&](i64 first, i64 end) {
          return classify_key_tiles(mc.terms, seq, w, kN, first, end);
        });
      }
    }
    return it;
  }
  // How many key tiles the query tile computes.
  template <class Seq>
  __device__ __forceinline__ int count(const typename Mask::Config& mc, const Seq& seq, const QueryWork& w, int kN) {
    if constexpr (kHasTerms<Mask>) {
      if (mc.terms.tiles.states != nullptr) {
        return window_.count(w.tile_begin, w.tile_end, [&](i64 first, i64 end) {
          return classify_key_tiles(mc.terms, seq, w, kN, first, end);
        });
      }
    }
    return static_cast<int>(w.tile_end - w.tile_begin);
  }
  // The kind (tile_walk.cuh) of key tile `it`, as the last next() returned it.
  __device__ __forceinline__ int kind(const typename Mask::Config& mc, i64 it) const {
    if constexpr (kHasTerms<Mask>) {
      if (mc.terms.tiles.states != nullptr) return window_.kind(it);
    }
    return kTileExists;
  }

 private:
  TileWindow window_;
};

// FlashTermsMask in a query-row kernel (forward, dQ): the kind of a kernel tile (KeyTileWalk::kind) and whether
// its scores start from the terms (init_scores) rather than 0.
struct QueryTileTerms {
  int kind;
  bool needs;
  __device__ __forceinline__ QueryTileTerms(const ScoreTerms& terms, int tile_kind) {
    kind = tile_kind;
    needs = tile_needs_terms(terms, kind);
  }
};

// FlashTermsMask's work counter: the query x key elements of the kernel tiles a query tile computes (one warp,
// every lane together).
template <class Mask, class Seq>
__device__ __forceinline__ unsigned long long query_tile_work(const typename Mask::Config& mc, const Seq& seq,
                                                              const QueryWork& w, int kN) {
  unsigned long long work = 0;
  KeyTileWalk<Mask> walk;
  for (i64 it = walk.next(mc, seq, w, w.tile_begin, kN); it < w.tile_end; it = walk.next(mc, seq, w, it + 1, kN)) {
    work += static_cast<unsigned long long>(w.rows * min(i64{kN}, seq.S - it * kN));
  }
  return work;
}

// The mma.sync query-row kernels' scores of a warp's kMT row tiles (rows row0 + 16 mt) against keys [j0, j0 + kN)
// (a kernel tile of this kind) before S = Q K^T accumulates onto them: 0, or with terms the terms: from key_terms
// (the tile's key terms, stage_query_key_terms) under FlashKeyTermsMask, from init_scores under FlashTermsMask.
template <class T, int kN, int kMT, class Mask, class Seq>
__device__ __forceinline__ void init_query_scores(float (&s)[kMT][kN / 8][4], const typename Mask::Config& mc,
                                                  const Seq& seq, const QueryWork& w, i64 row0, i64 j0,
                                                  [[maybe_unused]] int kind,
                                                  [[maybe_unused]] const float* key_terms) {
  if constexpr (kHasKeyTerms<Mask>) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) add_key_terms<kN, false>(s[mt], key_terms);
    return;
  } else if constexpr (kHasTerms<Mask>) {
    const QueryTileTerms tt(mc.terms, kind);
    if (tt.needs) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) init_scores<T, kN, true>(s[mt], mc.terms, seq, w.sequence, w.h, row0 + 16 * mt, j0, tt.kind);
      return;
    }
  }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) zero(s[mt]);
}

// What a dK/dV CTA covers: keys [j0, j0 + keys) of KV head hk (grid x: KV head x head split; y: key blocks of
// kN; z: sequence) and, for its share of the group's query heads, the query tiles of kM rows that can see
// them (with per-head windows, those of any of its heads: DkvStepWalk skips a head's steps outside its own);
// its steps run over (query head, query tile) pairs.
struct DkvWork {
  i64 j0, keys, hk, split, first_head, tile_begin, tiles, steps;

  template <class T, class Mask, class Seq>
  __device__ __forceinline__ DkvWork(const AttnArgs<T>& a, const Mask& mask, const Seq& seq, int kN, int kM) {
    j0 = i64{blockIdx.y} * kN;
    keys = seq.S - j0 < kN ? seq.S - j0 : kN;
    hk = blockIdx.x / a.head_splits;
    split = blockIdx.x % a.head_splits;
    const i64 g_begin = split * a.group / a.head_splits;
    const i64 g_count = (split + 1) * a.group / a.head_splits - g_begin;
    first_head = hk * a.group + g_begin;
    // The per-head range code is compiled for the policies with per-head windows only (kPerHeadWindows): the
    // others read the scalar window's range, and their dK/dV kernels keep the registers of that simpler prologue.
    i64 q_begin = 0, q_end = 0;
    if constexpr (kPerHeadWindows<Mask>) {
      if (keys > 0) group_query_range(mask, first_head, g_count, j0, j0 + keys - 1, q_begin, q_end);
    } else if (keys > 0) {
      q_begin = mask.first_query(j0);
      q_end = mask.end_query(j0 + keys - 1);
    }
    tile_begin = q_begin / kM;
    tiles = q_end > q_begin ? (q_end - 1) / kM + 1 - tile_begin : 0;
    steps = tiles * g_count;
  }
  // 32-bit arithmetic: steps (query tiles x heads of one sequence) stay far below 2^32.
  __device__ __forceinline__ i64 head(i64 step) const {
    return first_head + static_cast<std::uint32_t>(step) / static_cast<std::uint32_t>(tiles);
  }
  __device__ __forceinline__ i64 tile(i64 step) const {
    return tile_begin + static_cast<std::uint32_t>(step) % static_cast<std::uint32_t>(tiles);
  }
};

// FlashTermsMask's dK/dV steps that need a walk: those of a tile map or of per-head windows (flash_attention
// routes per-head windows to FlashTermsHeadMask, dispatch.cu).
template <class Mask>
__device__ __forceinline__ bool walks_dkv_steps(const typename Mask::Config& mc) {
  if constexpr (kPerHeadWindows<Mask>) {
    return mc.terms.tiles.states != nullptr || mc.head_left.data != nullptr || mc.head_right.data != nullptr;
  } else if constexpr (kHasTerms<Mask>) {
    return mc.terms.tiles.states != nullptr;
  } else {
    return false;
  }
}

// This lane's kinds (TileWindow's two bits per candidate) of dK/dV steps first + kTileWindowPerLane lane + i
// (< end): the tile map's (every step exists without one), absent where the step's query tile lies outside the
// query range of its head's window (per-head windows).
template <class Mask, class Seq>
__device__ __forceinline__ unsigned classify_dkv_window_steps(const typename Mask::Config& mc, const Seq& seq,
                                                              const DkvWork& w, int kM, i64 first, i64 end) {
  constexpr int kPerLane = kTileWindowPerLane;
  const i64 lane_first = first + kPerLane * (threadIdx.x % 32);
  unsigned kinds = 0;
  if (mc.terms.tiles.states != nullptr) {
    kinds = classify_dkv_steps(mc.terms, seq, w, kM, blockIdx.z, first, end);
  } else {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      kinds |= lane_first + i < end ? static_cast<unsigned>(kTileExists) << (2 * i) : 0u;
    }
  }
  const Mask mask = bind_mask<Mask>(mc, seq, blockIdx.z);
  if (!has_head_windows(mask)) return kinds;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const i64 step = lane_first + i;
    if (step >= end) continue;
    i64 q_first, q_end;
    head_query_range(mask, w.head(step), w.j0, w.j0 + w.keys - 1, q_first, q_end);
    const i64 t0 = w.tile(step) * kM;
    if (!(q_end > q_first && t0 < q_end && t0 + kM > q_first)) kinds &= ~(3u << (2 * i));
  }
  return kinds;
}

// The kinds of steps first + kTileWindowPerLane lane + i for this lane: classify_dkv_window_steps where the policy has
// per-head windows, the tile map's classify_dkv_steps otherwise (the code FlashTermsMask compiles to).
template <class Mask, class Seq>
__device__ __forceinline__ unsigned classify_walked_dkv_steps(const typename Mask::Config& mc, const Seq& seq,
                                                              const DkvWork& w, int kM, i64 first, i64 end) {
  if constexpr (kPerHeadWindows<Mask>) {
    return classify_dkv_window_steps<Mask>(mc, seq, w, kM, first, end);
  } else {
    return classify_dkv_steps(mc.terms, seq, w, kM, blockIdx.z, first, end);
  }
}

// The (query head, query tile) steps a dK/dV CTA computes, in order, walked by one warp (every lane together):
// with a tile map or per-head windows (FlashTermsMask) the steps whose kernel tile of kM queries is not absent
// and lies in its head's query range, with their kinds (tile_walk.cuh); otherwise every step, of kind exists.
template <class Mask>
class DkvStepWalk {
 public:
  // The first step at or after `step` that the CTA computes, or w.steps.
  template <class Seq>
  __device__ __forceinline__ i64 next(const typename Mask::Config& mc, const Seq& seq, const DkvWork& w, i64 step,
                                      int kM) {
    if constexpr (kHasTerms<Mask>) {
      if (walks_dkv_steps<Mask>(mc)) {
        return window_.next(step, w.steps, [&](i64 first, i64 end) {
          return classify_walked_dkv_steps<Mask>(mc, seq, w, kM, first, end);
        });
      }
    }
    return step;
  }
  // How many steps the CTA computes.
  template <class Seq>
  __device__ __forceinline__ int count(const typename Mask::Config& mc, const Seq& seq, const DkvWork& w, int kM) {
    if constexpr (kHasTerms<Mask>) {
      if (walks_dkv_steps<Mask>(mc)) {
        return window_.count(0, w.steps, [&](i64 first, i64 end) {
          return classify_walked_dkv_steps<Mask>(mc, seq, w, kM, first, end);
        });
      }
    }
    return static_cast<int>(w.steps);
  }
  // The kind (tile_walk.cuh) of step `step`, as the last next() returned it.
  __device__ __forceinline__ int kind(const typename Mask::Config& mc, i64 step) const {
    if constexpr (kHasTerms<Mask>) {
      if (walks_dkv_steps<Mask>(mc)) return window_.kind(step);
    }
    return kTileExists;
  }

 private:
  TileWindow window_;
};

// FlashTermsMask's work counter: the query x key elements of the steps a dK/dV CTA computes (one warp, every lane
// together).
template <class Mask, class Seq>
__device__ __forceinline__ unsigned long long dkv_work(const typename Mask::Config& mc, const Seq& seq,
                                                       const DkvWork& w, int kM) {
  unsigned long long work = 0;
  DkvStepWalk<Mask> walk;
  for (i64 step = walk.next(mc, seq, w, 0, kM); step < w.steps; step = walk.next(mc, seq, w, step + 1, kM)) {
    const i64 t0 = w.tile(step) * kM;
    work += static_cast<unsigned long long>(min(i64{kM}, seq.T - t0) * w.keys);
  }
  return work;
}

// The dK/dV kernels' transposed scores S^T of a warp's 16 keys (from key0) against the query tile [t0, t0 + kM) of
// head h (a kernel tile of this kind), before S^T = K Q^T accumulates onto them: 0, or with terms the terms (the
// key terms of the thread's two key rows under FlashKeyTermsMask, else init_scores).
template <class T, int kM, class Mask, class Seq>
__device__ __forceinline__ void init_key_scores(float (&s)[kM / 8][4], const typename Mask::Config& mc,
                                                const Seq& seq, i64 h, i64 t0, i64 key0, [[maybe_unused]] int kind) {
  if constexpr (kHasKeyTerms<Mask>) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float x = key_term<T>(mc.terms, seq, h, key0 + lane / 4 + 8 * half, kTileExists);
#pragma unroll
      for (int n = 0; n < kM / 8; ++n) s[n][2 * half] = s[n][2 * half + 1] = x;
    }
    return;
  } else if constexpr (kHasTerms<Mask>) {
    if (tile_needs_terms(mc.terms, kind)) {
      init_scores<T, kM, false>(s, mc.terms, seq, blockIdx.z, h, key0, t0, kind);
      return;
    }
  }
  zero(s);
}

// The lse (times log2 e), delta and P factor (d_o_scale) of query row t of head h (0 past the sequence), for a
// dQ thread's rows.
template <class T, class Seq>
__device__ __forceinline__ void row_stats(const AttnArgs<T>& a, const Seq& seq, i64 h, i64 t, float& lse2, float& delta,
                                          float& p_scale) {
  const bool in = t < seq.T;
  lse2 = in ? a.lse.at(seq.batch, seq.q_begin + t, h) * kLog2e : 0.f;
  delta = in ? a.delta.at(seq.batch, seq.q_begin + t, h) : 0.f;
  p_scale = a.d_o_scale.data == nullptr ? 1.f : in ? a.d_o_scale.at(seq.batch, seq.q_begin + t, h) : 0.f;
}

// Starts copying the lse, delta and P factor (d_o_scale) of query rows [t0, t0 + kM) of head h into shared rows
// (cp.async, 0 past the end): part of the step's load group, so no thread waits on a global load outside the
// pipeline. Without a d_o_scale the factors are 1 (plain stores, ordered by the same barrier).
template <int kM, int kThreadCount, class T, class Seq>
__device__ __forceinline__ void load_row_stats(float* lse, float* delta, float* p_scale, const AttnArgs<T>& a,
                                               const Seq& seq, i64 t0, i64 h) {
  for (int r = threadIdx.x; r < kM; r += kThreadCount) {
    const bool ok = t0 + r < seq.T;
    const i64 row = seq.q_begin + (ok ? t0 + r : 0);
    cp_async_4(lse + r, &a.lse.at(seq.batch, row, h), ok ? 4 : 0);
    cp_async_4(delta + r, &a.delta.at(seq.batch, row, h), ok ? 4 : 0);
    if (a.d_o_scale.data != nullptr) {
      cp_async_4(p_scale + r, &a.d_o_scale.at(seq.batch, row, h), ok ? 4 : 0);
    } else {
      p_scale[r] = 1.f;
    }
  }
}

// The queries [first, end) that see key j under a monotone mask (empty for keys past the sequence): a dK/dV
// thread's key rows are fixed, so its per-element mask test is two comparisons.
template <class Mask>
__device__ __forceinline__ void visible_queries(const Mask& m, i64 j, i64& first, i64& end) {
  first = j < m.S ? m.first_query(j) : 0;
  end = j < m.S ? min(m.end_query(j), m.T) : 0;
}

// The key tiles of kN keys that some of the query rows [row0, row0 + kRows) see under a monotone mask, as the steps
// [first, last] of a walk of `steps` tiles from tile tile_begin (last < first: none). The rows' visible intervals
// lie in [lo(row0), hi(last row)], so a step outside it has no visible element; a step inside may still have none
// (rows with hi < lo), which the caller's per-element mask covers.
template <int kN, int kRows, class Mask>
__device__ __forceinline__ void rows_key_steps(const Mask& m, i64 row0, i64 tile_begin, int steps, int& first,
                                               int& last) {
  first = 0;
  last = -1;
  if (row0 >= m.T) return;
  const i64 row1 = min(row0 + kRows - 1, m.T - 1);
  const i64 lo = m.lo(row0), hi = min(m.hi(row1), m.S - 1);
  if (hi < lo || hi < 0) return;
  first = static_cast<int>(max(i64{0}, lo / kN - tile_begin));
  last = static_cast<int>(min(i64{steps - 1}, hi / kN - tile_begin));
}

// The queries [first, end) that see some of the keys [j0, j0 + kKeys) under a monotone mask (empty when j0 is past
// the sequence): first_query and end_query are nondecreasing in the key.
template <int kKeys, class Mask>
__device__ __forceinline__ void keys_visible_queries(const Mask& m, i64 j0, i64& first, i64& end) {
  i64 unused;
  visible_queries(m, j0, first, unused);
  visible_queries(m, min(j0 + kKeys - 1, m.S - 1), unused, end);
  if (j0 >= m.S) first = end = 0;
}

// The forward's epilogue for a warp's 16 rows starting at query row0: O = acc / l and lse = (m + log2 l) ln 2
// (-inf for rows that see no key, whose O is 0).
template <int Dv, class T, class Seq>
__device__ __forceinline__ void store_forward_rows(const float (&acc)[Dv / 8][4], float (&m)[2], float (&l)[2],
                                                   const AttnArgs<T>& a, const Seq& seq, i64 row0, i64 h) {
  const int lane = threadIdx.x % 32;
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] = quad_sum(l[half]);
    inv[half] = l[half] > 0.f ? 1.f / l[half] : 0.f;
  }
  store_rows<Dv>(acc, inv[0], inv[1], a.o, seq.batch, seq.q_begin + row0, seq.T - row0, h);
  if (lane % 4 != 0) return;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const i64 t = row0 + lane / 4 + half * 8;
    if (t < seq.T) {
      a.lse.at(seq.batch, seq.q_begin + t, h) = l[half] > 0.f ? (m[half] + log2f(l[half])) * kLn2 : -INFINITY;
    }
  }
}

// ------------------------------------------------------------------------------------------------ forward

// Two shared words of a CTA for the sparse-softmax threshold's agreement (cta_votes, consumers_vote).
__device__ __forceinline__ unsigned* threshold_vote_words() {
  __shared__ unsigned words[2];
  return words;
}

// Whether some thread of the CTA votes: the warps with a vote write `tag` (unique per decision of the CTA, not 0)
// into words[0], then a CTA barrier. The caller's next barrier orders these reads before the next decision's writes.
__device__ __forceinline__ bool cta_votes(bool vote, unsigned* words, unsigned tag) {
  if (__any_sync(~0u, vote) && threadIdx.x % 32 == 0) words[0] = tag;
  __syncthreads();
  return words[0] == tag;
}

template <int Dqk, int Dv>
struct FwdTile {
  // Row tiles (16 rows) per warp: two where the output accumulator fits (Dv <= 128: 128 + 64 fp32 registers
  // for O and S), one for Dv = 256.
  static constexpr int kMT = Dv <= 128 ? 2 : 1;
  static constexpr int kM = 16 * kMT * kWarps;
  static constexpr int kN = kMT == 2 || Dqk > 192 ? 32 : 64;  // 32 with two row tiles: 64 spills registers
  static constexpr int kQ = kM * ld_of<Dqk>(), kK = kN * ld_of<Dqk>(), kV = kN * ld_of<Dv>();
  // Q, 2 x K, 2 x V (2-byte elements), then the key tile's gate delta and key terms (kN floats each; policies with
  // a gate, with terms).
  static constexpr std::size_t kSmemBytes = 2 * (kQ + 2 * kK + 2 * kV) + 2 * kN * sizeof(float);
};

// kThreshold: the variant with flash_attention's sparse-softmax threshold (FlashTermsMask with terms.threshold).
template <class T, int Dqk, int Dv, class Mask, bool kThreshold = false>
__global__ void __launch_bounds__(kThreads) attention_forward_kernel(AttnArgs<T> a, typename Mask::Config mc) {
  static_assert(!kThreshold || kHasTerms<Mask>, "the threshold comes with FlashTermsMask");
  using Tile = FwdTile<Dqk, Dv>;
  constexpr int kM = Tile::kM, kN = Tile::kN, kMT = Tile::kMT;
  extern __shared__ __align__(128) unsigned char smem_raw[];  // as the wgmma kernels of this unit declare it
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Tile::kQ;
  T* sV = sK + 2 * Tile::kK;
  [[maybe_unused]] float* sGateKeys = reinterpret_cast<float*>(sV + 2 * Tile::kV);  // [kN]: delta of the key tile
  [[maybe_unused]] float* sKeyTerms = sGateKeys + kN;  // [kN]: the key tile's key terms (stage_query_key_terms)

  const auto seq = a.seqs[blockIdx.z];
  const Mask mask = for_head(bind_mask<Mask>(mc, seq, blockIdx.z), blockIdx.x);  // the CTA's query head
  const QueryWork w(a, mask, seq, kM, kN);
  if (w.rows <= 0) return;
  const i64 t0 = w.t0, h = w.h, hk = w.hk, rows = w.rows, tile_begin = w.tile_begin, tile_end = w.tile_end;
  const int warp = threadIdx.x / 32;
  const int warp_row0 = warp * kMT * 16;  // this warp's rows: [warp_row0, warp_row0 + 16 * kMT)
  [[maybe_unused]] float gate_alpha_rows[kMT][2];  // With a gate (kHasGate): alpha of the thread's rows
  if constexpr (kHasGate<Mask>) {
    const GateTerms& gate = gate_of<Mask>(mc);
    if (gate.on()) load_gate_alpha_rows<T, kMT>(gate_alpha_rows, gate, seq, h, t0 + warp_row0);
  }

  float acc[kMT][Dv / 8][4];
  float m[kMT][2], l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    zero(acc[mt]);
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }
  // With the sparse-softmax threshold (score_terms.cuh): log2(tau_row) of the thread's rows; the CTA is the query
  // tile of the decisions (kM rows) and its key tiles are theirs (kN keys).
  [[maybe_unused]] float threshold_log2_tau_rows[kMT][2];
  [[maybe_unused]] unsigned* vote_words = nullptr;
  if constexpr (kThreshold) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      threshold_rows(mc.terms.threshold, mask, t0 + warp_row0 + 16 * mt, threshold_log2_tau_rows[mt]);
    }
    vote_words = threshold_vote_words();
    if (threadIdx.x == 0) vote_words[0] = 0;  // before the loop's first barrier
  }

  KeyTileWalk<Mask> walk;
  const i64 first = walk.next(mc, seq, w, tile_begin, kN);
  if (first < tile_end) {
    load_tile<kM, Dqk>(sQ, a.q, seq.batch, seq.q_begin + t0, rows, h);
    load_kv_tiles<kN, Dqk, Dv>(sK, sV, a, seq, first * kN, hk);
    cp_async_commit();
    int computed = 0;
    for (i64 it = first; it < tile_end; ++computed) {
      const int kind = walk.kind(mc, it);  // before next() moves the window on
      const i64 next = walk.next(mc, seq, w, it + 1, kN);
      const int buf = (kHasTerms<Mask> ? computed : static_cast<int>(it - tile_begin)) & 1;
      advance_pipeline(next < tile_end, [&] {
        load_kv_tiles<kN, Dqk, Dv>(sK + (buf ^ 1) * Tile::kK, sV + (buf ^ 1) * Tile::kV, a, seq, next * kN, hk);
      });
      stage_query_gate<T, kN, Mask>(sGateKeys, mc, seq, it * kN, hk, threadIdx.x, kThreads);  // read after the barrier
      stage_query_key_terms<T, kN, Mask>(sKeyTerms, mc, seq, h, it * kN, threadIdx.x, kThreads);
      __syncthreads();
      const T* k_tile = sK + buf * Tile::kK;
      const T* v_tile = sV + buf * Tile::kV;
      const i64 j0 = it * kN;
      it = next;

      float s[kMT][kN / 8][4];
      init_query_scores<T, kN, kMT, Mask>(s, mc, seq, w, t0 + warp_row0, j0, kind, sKeyTerms);
      gemm_ss_nk<T, kN, Dqk, ld_of<Dqk>(), ld_of<Dqk>(), kMT>(s, sQ, warp_row0, k_tile);
      with_gate_of<Mask>(mc, [&](auto gate) {
        if constexpr (decltype(gate)::value != kNoGate) {
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            add_query_gate<kN, decltype(gate)::value>(s[mt], gate_alpha_rows[mt], sGateKeys);
          }
        }
      });

      const bool full = tile_full(mask, t0, kM, j0, kN);
      bool keep_tile = true;
      if constexpr (kThreshold) {
        // The threshold's decision on this key tile, from every row of the CTA's query tile: the scores masked to
        // the visible columns here (the softmax's own masking below repeats it), then one vote per thread.
        bool reaches = false;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          if (!full) {
            int col_lo[2], col_hi[2];
            visible_columns<kN>(mask, t0 + warp_row0 + 16 * mt, j0, col_lo, col_hi);
            mask_columns<kN>(s[mt], col_lo, col_hi);
          }
          float row_max[2];
          tile_row_maxima<kN>(s[mt], row_max);
          reaches = rows_reach_bar(row_max, m[mt], threshold_log2_tau_rows[mt], a.scale_log2) || reaches;
        }
        keep_tile = cta_votes(reaches, vote_words, static_cast<unsigned>(computed) + 1);
        if (keep_tile && threadIdx.x == 0) record_kept_tile(mc.terms.threshold, w.sequence, h, t0 / kM, j0 / kN);
      }
      if (keep_tile) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          with_mask(!full, [&](auto masked) {
            int col_lo[2] = {0, 0}, col_hi[2] = {kN - 1, kN - 1};
            if constexpr (decltype(masked)::value) {
              visible_columns<kN>(mask, t0 + warp_row0 + 16 * mt, j0, col_lo, col_hi);
            }
            online_softmax_step<kN, Dv, decltype(masked)::value>(s[mt], acc[mt], m[mt], l[mt], col_lo, col_hi,
                                                                 a.scale_log2);
          });
        }
        gemm_rs_kn<T, Dv, kN, ld_of<Dv>(), kMT>(acc, s, v_tile);
      }
      __syncthreads();
    }
  }

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) store_forward_rows<Dv>(acc[mt], m[mt], l[mt], a, seq, t0 + warp_row0 + 16 * mt, h);
  if constexpr (kHasTerms<Mask>) {
    if (threadIdx.x < 32 && mc.terms.work_counter != nullptr) {
      const unsigned long long work = query_tile_work<Mask>(mc, seq, w, kN);
      if (threadIdx.x == 0) add_work(mc.terms, work);
    }
  }
}

// ------------------------------------------------------------------------------------------------ backward

template <int Dqk, int Dv>
struct DqTile {
  // As the forward: two 16-row tiles per warp where the dQ accumulator leaves room (Dqk <= 128).
  static constexpr int kMT = Dqk <= 128 ? 2 : 1;
  static constexpr int kM = 16 * kMT * kWarps;
  static constexpr int kN = kMT == 2 || Dqk > 128 ? 32 : 64;
  static constexpr int kQ = kM * ld_of<Dqk>(), kDO = kM * ld_of<Dv>(), kK = kN * ld_of<Dqk>(), kV = kN * ld_of<Dv>();
  // Q, dO, 2 x K, 2 x V, then the key tile's gate delta and key terms (kN floats each; policies with a gate, with
  // terms).
  static constexpr std::size_t kSmemBytes = 2 * (kQ + kDO + 2 * kK + 2 * kV) + 2 * kN * sizeof(float);
};

template <class T, int Dqk, int Dv, class Mask>
__global__ void __launch_bounds__(kThreads) attention_dq_kernel(AttnArgs<T> a, typename Mask::Config mc) {
  using Tile = DqTile<Dqk, Dv>;
  constexpr int kM = Tile::kM, kN = Tile::kN, kMT = Tile::kMT;
  extern __shared__ __align__(128) unsigned char smem_raw[];  // as the wgmma kernels of this unit declare it
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sDO = sQ + Tile::kQ;
  T* sK = sDO + Tile::kDO;
  T* sV = sK + 2 * Tile::kK;
  [[maybe_unused]] float* sGateKeys = reinterpret_cast<float*>(sV + 2 * Tile::kV);  // [kN]: delta of the key tile
  [[maybe_unused]] float* sKeyTerms = sGateKeys + kN;  // [kN]: the key tile's key terms (stage_query_key_terms)

  const auto seq = a.seqs[blockIdx.z];
  const Mask mask = for_head(bind_mask<Mask>(mc, seq, blockIdx.z), blockIdx.x);  // the CTA's query head
  const QueryWork w(a, mask, seq, kM, kN);
  if (w.rows <= 0) return;
  const i64 t0 = w.t0, h = w.h, hk = w.hk, rows = w.rows, tile_begin = w.tile_begin, tile_end = w.tile_end;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row0 = warp * kMT * 16;
  // With a gate (kHasGate): alpha of the thread's rows and their dalpha sums.
  [[maybe_unused]] float gate_alpha_rows[kMT][2], dalpha_sums[kMT][2];
  if constexpr (kHasGate<Mask>) {
    const GateTerms& gate = gate_of<Mask>(mc);
    if (gate.on()) load_gate_alpha_rows<T, kMT>(gate_alpha_rows, gate, seq, h, t0 + warp_row0);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) dalpha_sums[mt][0] = dalpha_sums[mt][1] = 0.f;
  }

  float acc[kMT][Dqk / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) zero(acc[mt]);
  KeyTileWalk<Mask> walk;
  const i64 first = walk.next(mc, seq, w, tile_begin, kN);
  if (first < tile_end) {
    float lse2[kMT][2], delta[kMT][2], p_scale[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        row_stats(a, seq, h, t0 + warp_row0 + 16 * mt + lane / 4 + half * 8, lse2[mt][half], delta[mt][half],
                  p_scale[mt][half]);
        delta[mt][half] *= p_scale[mt][half];  // dS = g P (dP - delta) = P (g dP - g delta)
        if constexpr (kHasAnyTerms<Mask>) lse2[mt][half] = finite_lse(lse2[mt][half]);
      }
    }
    load_tile<kM, Dqk>(sQ, a.q, seq.batch, seq.q_begin + t0, rows, h);
    load_tile<kM, Dv>(sDO, a.d_o, seq.batch, seq.q_begin + t0, rows, h);
    load_kv_tiles<kN, Dqk, Dv>(sK, sV, a, seq, first * kN, hk);
    cp_async_commit();
    int computed = 0;
    for (i64 it = first; it < tile_end; ++computed) {
      const int kind = walk.kind(mc, it);  // before next() moves the window on
      const i64 next = walk.next(mc, seq, w, it + 1, kN);
      const int buf = (kHasTerms<Mask> ? computed : static_cast<int>(it - tile_begin)) & 1;
      advance_pipeline(next < tile_end, [&] {
        load_kv_tiles<kN, Dqk, Dv>(sK + (buf ^ 1) * Tile::kK, sV + (buf ^ 1) * Tile::kV, a, seq, next * kN, hk);
      });
      stage_query_gate<T, kN, Mask>(sGateKeys, mc, seq, it * kN, hk, threadIdx.x, kThreads);  // read after the barrier
      stage_query_key_terms<T, kN, Mask>(sKeyTerms, mc, seq, h, it * kN, threadIdx.x, kThreads);
      __syncthreads();
      const T* k_tile = sK + buf * Tile::kK;
      const T* v_tile = sV + buf * Tile::kV;
      const i64 j0 = it * kN;
      it = next;

      float s[kMT][kN / 8][4], dp[kMT][kN / 8][4];
      init_query_scores<T, kN, kMT, Mask>(s, mc, seq, w, t0 + warp_row0, j0, kind, sKeyTerms);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) zero(dp[mt]);
      gemm_ss_nk<T, kN, Dqk, ld_of<Dqk>(), ld_of<Dqk>(), kMT>(s, sQ, warp_row0, k_tile);
      gemm_ss_nk<T, kN, Dv, ld_of<Dv>(), ld_of<Dv>(), kMT>(dp, sDO, warp_row0, v_tile);
      const bool full = tile_full(mask, t0, kM, j0, kN);
      with_gate_of<Mask>(mc, [&](auto gate) {
        constexpr int kGate = decltype(gate)::value;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          int col_lo[2] = {0, 0}, col_hi[2] = {kN - 1, kN - 1};
          if (!full) visible_columns<kN>(mask, t0 + warp_row0 + 16 * mt, j0, col_lo, col_hi);
#pragma unroll
          for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int col = n * 8 + 2 * (lane % 4) + (i % 2);
              const bool shown = full || (col >= col_lo[i / 2] && col <= col_hi[i / 2]);
              float score = s[mt][n][i];
              [[maybe_unused]] float slope = 0.f, gate_delta_col = 0.f;
              if constexpr (kGate != kNoGate) {
                gate_delta_col = sGateKeys[col];
                score += gate_value_slope<kGate>(gate_alpha_rows[mt][i / 2] * gate_delta_col, slope);
              }
              const float p = shown ? fast_exp2(fmaf(score, a.scale_log2, -lse2[mt][i / 2])) : 0.f;
              const float ds = p * fmaf(p_scale[mt][i / 2], dp[mt][n][i], -delta[mt][i / 2]);  // without the scale
              s[mt][n][i] = ds;
              if constexpr (kGate != kNoGate) dalpha_sums[mt][i / 2] += ds * slope * gate_delta_col;
            }
          }
        }
      });
      gemm_rs_kn<T, Dqk, kN, ld_of<Dqk>(), kMT>(acc, s, k_tile);
      __syncthreads();
    }
  }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const i64 row0 = t0 + warp_row0 + 16 * mt;
    store_rows<Dqk>(acc[mt], a.scale, a.scale, a.dq, seq.batch, seq.q_begin + row0, seq.T - row0, h,
                    a.accumulate_dq);
    if constexpr (kHasGate<Mask>) {
      if (gate_of<Mask>(mc).on()) store_dalpha<T>(gate_of<Mask>(mc), dalpha_sums[mt], a.scale, seq, h, row0);
    }
  }
  if constexpr (kHasTerms<Mask>) {
    if (threadIdx.x < 32 && mc.terms.work_counter != nullptr) {
      const unsigned long long work = query_tile_work<Mask>(mc, seq, w, kN);
      if (threadIdx.x == 0) add_work(mc.terms, work);
    }
  }
}

// The dK/dV kernels' epilogue for a warp's 16 key rows starting at row0: dK (times the softmax scale) and dV
// into the outputs, or with head splits into split `split` of the fp32 partials.
template <bool kDoDK, bool kDoDV, int kDK, int kDV, class T, class Seq>
__device__ __forceinline__ void store_dkv_rows(const float (&dk)[kDK][4], const float (&dv)[kDV][4],
                                               const AttnArgs<T>& a, const Seq& seq, i64 split, i64 row0, i64 hk) {
  const i64 row = seq.k_begin + row0, valid = seq.S - row0;
  if (a.head_splits > 1) {
    if constexpr (kDoDK) store_partial_rows<kDK * 8>(dk, a.scale, a.dk_partial, split, seq.batch, row, valid, hk);
    if constexpr (kDoDV) store_partial_rows<kDV * 8>(dv, 1.f, a.dv_partial, split, seq.batch, row, valid, hk);
    return;
  }
  if constexpr (kDoDK) store_rows<kDK * 8>(dk, a.scale, a.scale, a.dk, seq.batch, row, valid, hk);
  if constexpr (kDoDV) store_rows<kDV * 8>(dv, 1.f, 1.f, a.dv, seq.batch, row, valid, hk);
}

// Pass: 0 computes dK and dV, 1 only dV, 2 only dK.
template <int Dqk, int Dv>
struct DkvTile {
  static constexpr int kN = 64;  // keys per CTA, 16 per warp
  static constexpr int kM = Dqk == 64 ? 64 : 32;
  static constexpr bool kSplit = Dqk + Dv >= 320;
  static constexpr int kK = kN * ld_of<Dqk>(), kV = kN * ld_of<Dv>(), kQ = kM * ld_of<Dqk>(), kDO = kM * ld_of<Dv>();
  // K, V, 2 x Q, 2 x dO (2-byte elements), then 2 x (lse, delta, P factor, gate alpha) rows of kM floats.
  static constexpr std::size_t kSmemBytes = 2 * (kK + kV + 2 * kQ + 2 * kDO) + 2 * 4 * kM * sizeof(float);
};

template <class T, int Dqk, int Dv, class Mask, int kPass>
__global__ void __launch_bounds__(kThreads) attention_dkv_kernel(AttnArgs<T> a, typename Mask::Config mc) {
  using Tile = DkvTile<Dqk, Dv>;
  constexpr int kM = Tile::kM, kN = Tile::kN;
  constexpr bool kDoDV = kPass != 2, kDoDK = kPass != 1;
  extern __shared__ __align__(128) unsigned char smem_raw[];  // as the wgmma kernels of this unit declare it
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + Tile::kK;
  T* sQ = sV + Tile::kV;
  T* sDO = sQ + 2 * Tile::kQ;
  float* sLse = reinterpret_cast<float*>(sDO + 2 * Tile::kDO);  // [2][kM]
  float* sDelta = sLse + 2 * kM;                                // [2][kM]
  float* sScale = sDelta + 2 * kM;                              // [2][kM]: P factor (AttnArgs::d_o_scale)
  [[maybe_unused]] float* sGateAlpha = sScale + 2 * kM;         // [2][kM]: gate alpha (kHasGate)

  const auto seq = a.seqs[blockIdx.z];
  const Mask mask = bind_mask<Mask>(mc, seq, blockIdx.z);
  const DkvWork w(a, mask, seq, kN, kM);
  if (w.keys <= 0) return;
  const i64 j0 = w.j0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // With a gate (kHasGate): delta of the thread's two key rows and their ddelta sums.
  [[maybe_unused]] float gate_delta_rows[2] = {0.f, 0.f}, ddelta_sums[2] = {0.f, 0.f};
  if constexpr (kHasGate<Mask>) {
    if (gate_of<Mask>(mc).on()) load_gate_delta_rows<T>(gate_delta_rows, gate_of<Mask>(mc), seq, w.hk, j0 + warp * 16);
  }
  i64 q_first[2], q_end[2];  // queries that see this thread's two key rows
  for (int half = 0; half < 2; ++half) {
    visible_queries(mask, j0 + warp * 16 + lane / 4 + half * 8, q_first[half], q_end[half]);
  }

  float dk[kDoDK ? Dqk / 8 : 1][4];
  float dv[kDoDV ? Dv / 8 : 1][4];
  zero(dk);
  zero(dv);

  auto load_step = [&](i64 step, int buf) {
    const i64 h = w.head(step), t0 = w.tile(step) * kM;
    load_tile<kM, Dqk>(sQ + buf * Tile::kQ, a.q, seq.batch, seq.q_begin + t0, seq.T - t0, h);
    load_tile<kM, Dv>(sDO + buf * Tile::kDO, a.d_o, seq.batch, seq.q_begin + t0, seq.T - t0, h);
    load_row_stats<kM, kThreads>(sLse + buf * kM, sDelta + buf * kM, sScale + buf * kM, a, seq, t0, h);
    if constexpr (kHasGate<Mask>) {
      if (gate_of<Mask>(mc).on()) load_gate_rows<kM, kThreads>(sGateAlpha + buf * kM, gate_of<Mask>(mc), seq, t0, h);
    }
  };

  [[maybe_unused]] float key_sums[2] = {0.f, 0.f};  // FlashTermsMask: the bias gradient of a shared bias row
  DkvStepWalk<Mask> walk;
  const i64 first = walk.next(mc, seq, w, 0, kM);
  if (first < w.steps) {
    load_tile<kN, Dqk>(sK, a.k, seq.batch, seq.k_begin + j0, w.keys, w.hk);
    load_tile<kN, Dv>(sV, a.v, seq.batch, seq.k_begin + j0, w.keys, w.hk);
    load_step(first, 0);
    cp_async_commit();
    int computed = 0;
    for (i64 step = first; step < w.steps; ++computed) {
      [[maybe_unused]] const int kind = walk.kind(mc, step);  // before next() moves the window on
      const i64 next = walk.next(mc, seq, w, step + 1, kM);
      const int buf = (kHasTerms<Mask> ? computed : static_cast<int>(step)) & 1;
      advance_pipeline(next < w.steps, [&] { load_step(next, buf ^ 1); });
      __syncthreads();
      const T* q_tile = sQ + buf * Tile::kQ;
      const T* do_tile = sDO + buf * Tile::kDO;
      const float* lse = sLse + buf * kM;
      const float* delta = sDelta + buf * kM;
      const float* p_scale = sScale + buf * kM;
      const i64 t0 = w.tile(step) * kM;

      // S^T (keys x queries) = K Q^T; this warp's 16 keys.
      float s[kM / 8][4];
      [[maybe_unused]] const i64 h = w.head(step);
      init_key_scores<T, kM, Mask>(s, mc, seq, h, t0, j0 + warp * 16, kind);
      gemm_ss_nk<T, kM, Dqk, ld_of<Dqk>(), ld_of<Dqk>()>(s, sK, warp * 16, q_tile);
      bool full;
      if constexpr (kPerHeadWindows<Mask>) {  // the step's head's bounds; the other policies keep the CTA's
        const Mask step_mask = for_head(mask, h);
        if (has_head_windows(mask)) {
          for (int half = 0; half < 2; ++half) {
            visible_queries(step_mask, j0 + warp * 16 + lane / 4 + half * 8, q_first[half], q_end[half]);
          }
        }
        full = tile_full(step_mask, t0, kM, j0, kN);
      } else {
        full = tile_full(mask, t0, kM, j0, kN);
      }
      [[maybe_unused]] const float* gate_alpha = sGateAlpha + buf * kM;
      with_gate_of<Mask>(mc, [&](auto gate) {
        if constexpr (decltype(gate)::value != kNoGate) {
          add_key_gate<kM, decltype(gate)::value>(s, gate_delta_rows, gate_alpha);
        }
      });
#pragma unroll
      for (int n = 0; n < kM / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col = n * 8 + 2 * (lane % 4) + (i % 2);
          const float row_lse = kHasAnyTerms<Mask> ? finite_lse(lse[col]) : lse[col];
          const float p = fast_exp2(fmaf(s[n][i], a.scale_log2, -row_lse * kLog2e)) * p_scale[col];
          s[n][i] = full || (t0 + col >= q_first[i / 2] && t0 + col < q_end[i / 2]) ? p : 0.f;
        }
      }
      if constexpr (kDoDV) gemm_rs_kn<T, Dv, kM, ld_of<Dv>()>(dv, s, do_tile);
      if constexpr (kDoDK) {
        float dp[kM / 8][4];
        zero(dp);
        gemm_ss_nk<T, kM, Dv, ld_of<Dv>(), ld_of<Dv>()>(dp, sV, warp * 16, do_tile);
        with_gate_of<Mask>(mc, [&](auto gate) {
          constexpr int kGate = decltype(gate)::value;
#pragma unroll
          for (int n = 0; n < kM / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int col = n * 8 + 2 * (lane % 4) + (i % 2);
              s[n][i] = s[n][i] * (dp[n][i] - delta[col]);
              if constexpr (kGate != kNoGate) {  // ddelta: ds g'(x) alpha, x = alpha delta
                float slope;
                gate_value_slope<kGate>(gate_alpha[col] * gate_delta_rows[i / 2], slope);
                ddelta_sums[i / 2] += s[n][i] * slope * gate_alpha[col];
              }
            }
          }
        });
        if constexpr (kHasAnyTerms<Mask>) {
          const BiasGradientSink& sink = mc.terms.dbias;
          if (sink.data != nullptr) {
            if constexpr (kHasKeyTerms<Mask>) {  // a key sum (dispatch.cu)
              add_key_sums<kM>(s, key_sums);
            } else {
              add_bias_gradient<kM>(sink, s, key_sums, seq, h, j0 + warp * 16, t0);
            }
            if (sink.key_sums && (next >= w.steps || w.head(next) != h)) {
              flush_key_sums(sink, key_sums, seq, h, j0 + warp * 16);
            }
          }
        }
        gemm_rs_kn<T, Dqk, kM, ld_of<Dqk>()>(dk, s, q_tile);
      }
      __syncthreads();
      step = next;
    }
  }
  store_dkv_rows<kDoDK, kDoDV>(dk, dv, a, seq, w.split, j0 + warp * 16, w.hk);
  if constexpr (kHasGate<Mask> && kDoDK) {
    const GateTerms& gate = gate_of<Mask>(mc);
    if (gate.on()) store_ddelta_partial(gate, ddelta_sums, a.scale, seq, w.split, w.hk, j0 + warp * 16);
  }
  if constexpr (kHasTerms<Mask> && kDoDK) {
    if (threadIdx.x < 32 && mc.terms.work_counter != nullptr) {
      const unsigned long long work = dkv_work<Mask>(mc, seq, w, kM);
      if (threadIdx.x == 0) add_work(mc.terms, work);
    }
  }
}

// dK or dV = the sum of the head splits' partials (in split order), for key rows [j0, j0 + rows_per_cta) of one
// KV head.
template <class T, int kDim>
__global__ void __launch_bounds__(kThreads) attention_dkv_reduce_kernel(Tokens<T> out, Partials part, SeqPairTable seqs,
                                                                       int splits, int rows_per_cta) {
  const auto seq = seqs[blockIdx.z];
  const i64 j0 = i64{blockIdx.y} * rows_per_cta, hk = blockIdx.x;
  const i64 rows = seq.S - j0 < rows_per_cta ? seq.S - j0 : rows_per_cta;
  for (i64 i = threadIdx.x; i < rows * (kDim / 4); i += kThreads) {
    const i64 r = seq.k_begin + j0 + i / (kDim / 4), d = (i % (kDim / 4)) * 4;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int sp = 0; sp < splits; ++sp) {
      const float4 x = *reinterpret_cast<const float4*>(part.row(sp, seq.batch, r, hk) + d);
      sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w;
    }
    T* dst = out.row(seq.batch, r, hk) + d;
    *reinterpret_cast<std::uint32_t*>(dst) = pack2<T>(sum.x, sum.y);
    *reinterpret_cast<std::uint32_t*>(dst + 2) = pack2<T>(sum.z, sum.w);
  }
}

}  // namespace sparseattn::cuda::attention
