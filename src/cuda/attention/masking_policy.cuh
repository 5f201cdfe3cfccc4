// Masking policies of the attention mainloop. A policy is bound to one sequence (T queries, S keys) and
// answers, per query t, the visible key interval [lo(t), hi(t)] (both nondecreasing in t; hi < lo means
// none), and per key range the queries that may see it. From these the kernels derive which tiles are
// skipped (no visible element: no loads, no math), full (every element visible: no per-element mask) or
// masked (per-row bounds: lo/hi of a query row, first_query/end_query of a key row).
#pragma once

#include <cstdint>
#include <type_traits>

namespace sparseattn::cuda::attention {

using i64 = std::int64_t;

// Dense attention: causal bottom-right aligned (a = t + S - T, keys <= a) and window [a - left, a + right]
// (negative = unbounded).
struct FlashMask {
  struct Config {
    bool causal;
    i64 window_left, window_right;
  };
  Config c;
  i64 T, S;

  __device__ __forceinline__ i64 lo(i64 t) const {
    const i64 a = t + S - T;
    return c.window_left >= 0 ? (a - c.window_left > 0 ? a - c.window_left : 0) : 0;
  }
  // Offset of hi(t) = t + shift (before clipping to S - 1), and whether any such bound exists.
  __device__ __forceinline__ bool bounded_right() const { return c.causal || c.window_right >= 0; }
  __device__ __forceinline__ i64 right_shift() const {
    i64 r = S - T;
    if (c.window_right >= 0) r = S - T + c.window_right;
    if (c.causal && S - T < r) r = S - T;
    return r;
  }
  __device__ __forceinline__ i64 hi(i64 t) const {
    i64 h = S - 1;
    if (bounded_right() && t + right_shift() < h) h = t + right_shift();
    return h;
  }
  // Smallest query t >= 0 with hi(t) >= j (j < S).
  __device__ __forceinline__ i64 first_query(i64 j) const {
    if (!bounded_right()) return 0;
    const i64 t = j - right_shift();
    return t > 0 ? t : 0;
  }
  // One past the largest query t < T with lo(t) <= j.
  __device__ __forceinline__ i64 end_query(i64 j) const {
    if (c.window_left < 0) return T;
    const i64 t = j + c.window_left - (S - T) + 1;
    return t < T ? t : T;
  }
};

// Compressed attention: compressed key j is visible to query t iff j*stride + block - 1 <= a, where a = t + offset
// is the query's key position (a query chunk: offset = keys - queries of the sequence; 0 otherwise). A packed
// query chunk's offset differs per sequence: Config::cu_seqlens_k (the keys' cu_seqlens on the device) then gives
// it when bind_mask binds the policy to sequence b.
struct CompressedMask {
  struct Config {
    i64 block, stride;
    i64 offset = 0;
    const std::int32_t* cu_seqlens_k = nullptr;
  };
  Config c;
  i64 T, S;

  __device__ __forceinline__ i64 lo(i64) const { return 0; }
  __device__ __forceinline__ i64 hi(i64 t) const {
    const i64 a = t + c.offset;
    if (a < c.block - 1) return -1;
    const i64 h = (a - c.block + 1) / c.stride;
    return h < S - 1 ? h : S - 1;
  }
  __device__ __forceinline__ i64 first_query(i64 j) const {
    const i64 t = j * c.stride + c.block - 1 - c.offset;
    return t > 0 ? t : 0;
  }
  __device__ __forceinline__ i64 end_query(i64) const { return T; }
};

// The policy of sequence b (seq: its query count T and key count S): a packed query chunk's compressed mask reads
// the sequence's key count from the device; every other policy is its config and the two counts.
template <class Mask, class Seq>
__device__ __forceinline__ Mask bind_mask(const typename Mask::Config& config, const Seq& seq, i64 b) {
  if constexpr (std::is_same_v<Mask, CompressedMask>) {
    if (config.cu_seqlens_k != nullptr) {
      typename Mask::Config bound = config;
      bound.offset = i64{config.cu_seqlens_k[b + 1]} - config.cu_seqlens_k[b] - seq.T;
      return Mask{bound, seq.T, seq.S};
    }
  }
  return Mask{config, seq.T, seq.S};
}

// Every element of queries [t0, t0 + rows) x keys [j0, j0 + cols) visible (lo, hi monotone).
template <class Mask>
__device__ __forceinline__ bool tile_full(const Mask& m, i64 t0, int rows, i64 j0, int cols) {
  return t0 + rows <= m.T && j0 + cols <= m.S && j0 + cols - 1 <= m.hi(t0) && j0 >= m.lo(t0 + rows - 1);
}

}  // namespace sparseattn::cuda::attention
