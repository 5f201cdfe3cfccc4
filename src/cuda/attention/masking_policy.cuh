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

// flash_attention's per-head window bounds on the device: int32 [Hq] (any stride), -1 (any negative) unbounded.
struct HeadBounds {
  const std::int32_t* data = nullptr;  // null: the scalar bound for every head
  i64 stride = 0;
  __device__ __forceinline__ i64 at(i64 h) const { return data[h * stride]; }
};

// Dense attention: causal bottom-right aligned (a = t + S - T, keys <= a) and window [a - left, a + right]
// (negative = unbounded). With per-head bounds (head_left / head_right) a side's bound is the query head's entry
// instead: for_head binds a policy to one head; the kernels call it where the head is known (a query-tile CTA
// once at its start, a dK/dV CTA per (query head, query tile) step).
struct FlashMask {
  struct Config {
    bool causal;
    i64 window_left, window_right;
  };
  // Whether the policy carries per-head bounds (head_left, head_right members; FlashTermsHeadMask) that for_head
  // and group_query_range read: a compile-time property, so that the other policies hold the scalar window alone.
  static constexpr bool kHeadWindows = false;
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

template <class Mask>
constexpr bool policy_has_head_windows() {
  if constexpr (std::is_base_of_v<FlashMask, Mask>) {
    return Mask::kHeadWindows;
  } else {
    return false;
  }
}

// Whether a policy's kernels read per-head window bounds (FlashTermsHeadMask).
template <class Mask>
inline constexpr bool kPerHeadWindows = policy_has_head_windows<Mask>();

// Whether the policy's window depends on the query head (flash_attention's per-head windows).
template <class Mask>
__device__ __forceinline__ bool has_head_windows(const Mask& m) {
  if constexpr (kPerHeadWindows<Mask>) {
    return m.head_left.data != nullptr || m.head_right.data != nullptr;
  } else {
    return false;
  }
}

// The policy of query head h: the per-head bounds read into the scalar ones (the policy itself without them).
template <class Mask>
__device__ __forceinline__ Mask for_head(const Mask& m, i64 h) {
  if constexpr (kPerHeadWindows<Mask>) {
    if (has_head_windows(m)) {
      Mask bound = m;
      if (m.head_left.data != nullptr) bound.c.window_left = m.head_left.at(h);
      if (m.head_right.data != nullptr) bound.c.window_right = m.head_right.at(h);
      return bound;
    }
  }
  return m;
}

// The queries [first, end) of query head h that see some key of [j_first, j_last] (end <= first: none).
template <class Mask>
__device__ __forceinline__ void head_query_range(const Mask& m, i64 h, i64 j_first, i64 j_last, i64& first,
                                                 i64& end) {
  const Mask hm = for_head(m, h);
  first = hm.first_query(j_first);
  end = hm.end_query(j_last);
}

// The queries [first, end) of any query head of [h_begin, h_begin + h_count) that see some key of [j_first, j_last]
// (the union of the heads' ranges, as one range; first = end = 0 when no head has any). Without per-head windows
// every head has the same range, read once.
template <class Mask>
__device__ __forceinline__ void group_query_range(const Mask& m, i64 h_begin, i64 h_count, i64 j_first, i64 j_last,
                                                  i64& first, i64& end) {
  if (!has_head_windows(m)) {
    first = m.first_query(j_first);
    end = m.end_query(j_last);
    return;
  }
  first = end = 0;
  for (i64 h = h_begin; h < h_begin + h_count; ++h) {
    i64 f, e;
    head_query_range(m, h, j_first, j_last, f, e);
    if (e <= f) continue;
    if (end <= first) {
      first = f, end = e;
    } else {
      first = f < first ? f : first;
      end = e > end ? e : end;
    }
  }
}

// Every element of queries [t0, t0 + rows) x keys [j0, j0 + cols) visible (lo, hi monotone).
template <class Mask>
__device__ __forceinline__ bool tile_full(const Mask& m, i64 t0, int rows, i64 j0, int cols) {
  return t0 + rows <= m.T && j0 + cols <= m.S && j0 + cols - 1 <= m.hi(t0) && j0 >= m.lo(t0 + rows - 1);
}

// CompressedMask: the same test without hi's division by the stride (the kernels ask it once per key tile): key j is
// visible to row t iff j * stride + block - 1 - offset <= t, so the tile's last key to its first row decides it
// (lo is 0).
__device__ __forceinline__ bool tile_full(const CompressedMask& m, i64 t0, int rows, i64 j0, int cols) {
  return t0 + rows <= m.T && j0 + cols <= m.S && (j0 + cols - 1) * m.c.stride + m.c.block - 1 - m.c.offset <= t0;
}

}  // namespace sparseattn::cuda::attention
