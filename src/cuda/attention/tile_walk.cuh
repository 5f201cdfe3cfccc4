// The walk of flash_attention's block-sparse tile map (FlashTermsMask, score_terms.cuh): which kernel tiles a CTA
// computes and their kinds, read a window of candidates at a time instead of one dependent map load per candidate.
//
// Candidates are the key tiles of a query tile (forward, dQ: key tiles [tile_begin, tile_end) of kN keys) or the
// (query head, query tile) steps of a dK/dV CTA. A warp classifies a window of kWindow = 32 x kPerLane consecutive
// candidates at once: lane l takes candidates first + kPerLane l + i (i < kPerLane), issues their map loads
// together and keeps their kinds (absent, exists, full, mixed: score_terms.cuh) in two bits each of one register.
// The next present candidate is then a ballot over the lanes and a shuffle, its kind a shuffle, and the walk
// classifies the next window only when it passes the current one. Every lane of the warp calls it together
// (ballots and shuffles), and every warp of a role walks the same candidates, so producer and consumers agree
// without exchanging anything; the window costs a thread three registers.
//
// A kernel tile covers map tiles [r0, r1] x [c0, c1] (block sizes need not match the kernel's tiles). Where it
// lies inside one map tile (the usual case: block sizes that are multiples of the kernel tiles) its kind is that
// tile's state, one byte load; otherwise classify_span combines the overlapped states (present if any is, full
// only if all are).
#pragma once

#include <cstdint>

#include "cuda/attention/score_terms.cuh"

namespace sparseattn::cuda::attention {

// The kind of a kernel tile inside one map tile of this state (0 absent, 2 full, other values exist).
__device__ __forceinline__ int kind_of_state(std::uint8_t state) {
  return state == 0 ? kTileAbsent : state == 2 ? kTileFull : kTileExists;
}

// A block size as an unsigned 32-bit divisor of positions inside one sequence (below 2^31): sizes of 2^31 or more
// put every such position into tile 0, as 2^31 does.
__device__ __forceinline__ unsigned block_divisor(i64 block) {
  return static_cast<unsigned>(block < (i64{1} << 31) ? block : i64{1} << 31);
}

// The kind of a kernel tile that overlaps map tiles [r0, r1] x [c0, c1] of (sequence, query head h): absent if
// every one is absent, full if every one is full, exists if every one exists and is partial, mixed otherwise
// (tiles past the map are absent).
__device__ __forceinline__ int classify_span(const TileMap& m, i64 sequence, i64 h, unsigned r0, unsigned r1,
                                             unsigned c0, unsigned c1) {
  bool any = false, all_full = true, all_partial = true;
  for (unsigned r = r0; r <= r1; ++r) {
    const std::uint8_t* row = m.row(sequence, h, r);
    for (unsigned c = c0; c <= c1; ++c) {
      const std::uint8_t state = TileMap::at(row, c, m.key_tiles);
      any = any || state != 0;
      all_full = all_full && state == 2;
      all_partial = all_partial && state != 0 && state != 2;
    }
  }
  if (!any) return kTileAbsent;
  return all_full ? kTileFull : all_partial ? kTileExists : kTileMixed;
}

// Candidates per lane of a window: 4 (a window of 128; the forward at T = 32K has 256 key tiles of 128 per query
// tile at most).
constexpr int kTileWindowPerLane = 4;

class TileWindow {
 public:
  static constexpr int kPerLane = kTileWindowPerLane;
  static constexpr int kWindow = 32 * kPerLane;

  // The first present candidate in [it, end), or end. classify(first, end) returns this lane's kinds of
  // candidates first + kPerLane lane + i in bits [2 i, 2 i + 2) (absent at or past end).
  template <class Classify>
  __device__ __forceinline__ i64 next(i64 it, i64 end, Classify&& classify) {
    const int lane = threadIdx.x % 32;
    while (it < end) {
      if (it < base_ || it >= base_ + kWindow) load(it, end, classify);
      const int below = static_cast<int>(it - base_) - kPerLane * lane;  // this lane's candidates before `it`
      const unsigned present = present_bits() & (below <= 0 ? ~0u : below >= kPerLane ? 0u : ~0u << below);
      const unsigned lanes = __ballot_sync(~0u, present != 0);
      if (lanes != 0) {
        const int first_lane = __ffs(static_cast<int>(lanes)) - 1;
        const unsigned bits = __shfl_sync(~0u, present, first_lane);
        return base_ + kPerLane * first_lane + (__ffs(static_cast<int>(bits)) - 1);
      }
      it = base_ + kWindow;
    }
    return end;
  }

  // The present candidates of [begin, end); leaves the window at the last one it classified.
  template <class Classify>
  __device__ __forceinline__ int count(i64 begin, i64 end, Classify&& classify) {
    int present = 0;
    for (i64 it = begin; it < end; it += kWindow) {
      load(it, end, classify);
      present += __popc(present_bits());
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) present += __shfl_xor_sync(~0u, present, offset);
    return present;
  }

  // The kind of candidate c of the current window (c as returned by the last next()).
  __device__ __forceinline__ int kind(i64 c) const {
    const int offset = static_cast<int>(c - base_);
    const unsigned kinds = __shfl_sync(~0u, kinds_, offset / kPerLane);
    return static_cast<int>((kinds >> (2 * (offset % kPerLane))) & 3u);
  }

 private:
  template <class Classify>
  __device__ __forceinline__ void load(i64 first, i64 end, Classify&& classify) {
    base_ = first;
    kinds_ = classify(first, end);
  }
  // Bit i: this lane's candidate i is present.
  __device__ __forceinline__ unsigned present_bits() const {
    unsigned bits = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) bits |= ((kinds_ >> (2 * i)) & 3u) != 0 ? 1u << i : 0u;
    return bits;
  }

  i64 base_ = -(i64{1} << 62);  // no window yet
  unsigned kinds_ = 0;
};

// This lane's kinds (TileWindow's two bits per candidate) of key tiles first + kTileWindowPerLane lane + i (< end)
// of kN keys for the query tile of w (forward, dQ).
template <class Work, class Seq>
__device__ __forceinline__ unsigned classify_key_tiles(const ScoreTerms& terms, const Seq& seq, const Work& w, int kN,
                                                       i64 first, i64 end) {
  constexpr int kPerLane = kTileWindowPerLane;
  const TileMap& m = terms.tiles;
  const i64 lane_first = first + kPerLane * (threadIdx.x % 32);
  const unsigned block_q = block_divisor(m.block_q), block_k = block_divisor(m.block_k);
  const unsigned r0 = static_cast<unsigned>(w.t0) / block_q;
  const bool one_row = r0 == static_cast<unsigned>(w.t0 + w.rows - 1) / block_q;
  const std::uint8_t* row = m.row(w.sequence, w.h, r0);
  const int S = static_cast<int>(seq.S);
  unsigned kinds = 0, straddling = 0;
  // The loads first, independent of one another; the rare tiles that straddle map tiles after.
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const bool in = lane_first + i < end;
    const int j0 = in ? static_cast<int>((lane_first + i) * kN) : 0;
    const unsigned c0 = static_cast<unsigned>(j0) / block_k;
    const bool single = one_row && c0 == static_cast<unsigned>(j0 + min(kN, S - j0) - 1) / block_k;
    const std::uint8_t state = TileMap::at(in && single ? row : nullptr, c0, m.key_tiles);
    kinds |= static_cast<unsigned>(kind_of_state(state)) << (2 * i);
    straddling |= in && !single ? 1u << i : 0u;
  }
  if (straddling != 0) {
    const unsigned r1 = static_cast<unsigned>(w.t0 + w.rows - 1) / block_q;
    for (; straddling != 0; straddling &= straddling - 1) {
      const int i = __ffs(static_cast<int>(straddling)) - 1;
      const int j0 = static_cast<int>((lane_first + i) * kN);
      const unsigned c0 = static_cast<unsigned>(j0) / block_k;
      const unsigned c1 = static_cast<unsigned>(j0 + min(kN, S - j0) - 1) / block_k;
      kinds |= static_cast<unsigned>(classify_span(m, w.sequence, w.h, r0, r1, c0, c1)) << (2 * i);
    }
  }
  return kinds;
}

// This lane's kinds of dK/dV steps first + kTileWindowPerLane lane + i (< end) of the CTA of w: (query head, query
// tile of kM queries) against its keys [j0, j0 + keys).
template <class Work, class Seq>
__device__ __forceinline__ unsigned classify_dkv_steps(const ScoreTerms& terms, const Seq& seq, const Work& w, int kM,
                                                       i64 sequence, i64 first, i64 end) {
  constexpr int kPerLane = kTileWindowPerLane;
  const TileMap& m = terms.tiles;
  const i64 lane_first = first + kPerLane * (threadIdx.x % 32);
  const unsigned block_q = block_divisor(m.block_q), block_k = block_divisor(m.block_k);
  const unsigned c0 = static_cast<unsigned>(w.j0) / block_k;
  const unsigned c1 = static_cast<unsigned>(w.j0 + w.keys - 1) / block_k;
  const int T = static_cast<int>(seq.T);
  unsigned kinds = 0, straddling = 0;
  // The loads first, independent of one another; the rare steps that straddle map tiles after.
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const bool in = lane_first + i < end;
    const int t0 = in ? static_cast<int>(w.tile(lane_first + i) * kM) : 0;
    const unsigned r0 = static_cast<unsigned>(t0) / block_q;
    const bool single = c0 == c1 && r0 == static_cast<unsigned>(t0 + min(kM, T - t0) - 1) / block_q;
    const std::uint8_t* row = in && single ? m.row(sequence, w.head(lane_first + i), r0) : nullptr;
    const std::uint8_t state = TileMap::at(row, c0, m.key_tiles);
    kinds |= static_cast<unsigned>(kind_of_state(state)) << (2 * i);
    straddling |= in && !single ? 1u << i : 0u;
  }
  for (; straddling != 0; straddling &= straddling - 1) {
    const int i = __ffs(static_cast<int>(straddling)) - 1;
    const int t0 = static_cast<int>(w.tile(lane_first + i) * kM);
    const unsigned r0 = static_cast<unsigned>(t0) / block_q;
    const unsigned r1 = static_cast<unsigned>(t0 + min(kM, T - t0) - 1) / block_q;
    kinds |= static_cast<unsigned>(classify_span(m, sequence, w.head(lane_first + i), r0, r1, c0, c1)) << (2 * i);
  }
  return kinds;
}

}  // namespace sparseattn::cuda::attention
