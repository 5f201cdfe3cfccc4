// Pieces shared by the KV-block-outer kernels of selected_attention that walk runs of entries sorted by (KV head,
// block) (the forwards of forward_kv_block_outer.cu and forward_kv_block_outer_wgmma.cuh, the dQs of
// dq_kv_block_outer.cu and dq_kv_block_outer_wgmma.cuh): the kernel configuration,
// a CTA's slice of the sorted entries, where a run finds its keys, which query row a gathered tile row is, and
// how a warp writes the compact partials of its 16 rows.
#pragma once

#include <cuda_fp16.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "cuda/primitives/common.cuh"
#include "cuda/selected_attention/common.cuh"
#include "cuda/primitives/softmax.cuh"

namespace sparseattn::cuda::selection {

struct KvConfig {
  std::int64_t group, num_idx, block, rows, batch, blocks_per_seq;  // rows: T or N; B; batched only
  std::int64_t total_rows, pair0;  // B*T or N; the chunk's first (KV head, token row) pair (inverse_index.h)
  std::int64_t entries, per_cta;   // the chunk's entries, entries per CTA
  std::uint32_t blocks_bound, sentinel;
  std::uint32_t key_mask;  // the (KV head, block) bits of a sorted key (above them: the chunk, forward_plan.h)
  int key_rows;  // K/V rows in shared memory (the mma.sync kernel: round_up16(block))
  bool packed;
  float scale_log2;
};

// Copies this CTA's slice of the sorted entries (c.per_cta of them, fewer in the last CTA) into shared memory,
// keys without their chunk bits; returns its length. Ends with a barrier.
template <int kThreads>
__device__ __forceinline__ int load_cta_entries(const std::uint32_t* keys, const std::int32_t* values,
                                                const KvConfig& c, std::uint32_t* keys_s, std::int32_t* vals_s) {
  const std::int64_t e0 = std::int64_t{blockIdx.x} * c.per_cta;
  const int count = static_cast<int>(min(c.per_cta, c.entries - e0));
  for (int i = threadIdx.x; i < count; i += kThreads) {
    keys_s[i] = keys[e0 + i] & c.key_mask;
    vals_s[i] = values[e0 + i];
  }
  __syncthreads();
  return count;
}

// One past the last entry of the run that starts at entry cur (a run: the adjacent entries of one sort key). The
// slice is sorted (keys ascending, sentinels last), so a binary search: 8 dependent shared loads for a slice of
// 256 entries, where a linear scan takes one per entry (at G = 1 a run fills the slice, and such a scan becomes a
// large share of the forward's instructions and stalls).
__device__ __forceinline__ int run_end(const std::uint32_t* keys_s, int cur, int count) {
  const std::uint32_t key = keys_s[cur];
  int lo = cur + 1, hi = count;  // the end is in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (keys_s[mid] == key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The keys of one run of sorted entries (one KV head and selection block): KV head h, batch row, the first
// row of the sequence, the block's first position in it and how many of its keys exist.
struct KvRun {
  std::int64_t h, batch, begin, first;
  int keys;
};

// The token row (of B*T or N) of the chunk's pair `pair` if it is of KV head h (pairs are h * total_rows +
// row). In 32-bit arithmetic, modulo 2^32: the row itself is below 2^31 (checked by the API).
__device__ __forceinline__ std::uint32_t pair_row(const KvConfig& c, std::int64_t h, std::uint32_t pair) {
  return static_cast<std::uint32_t>(c.pair0) -
         static_cast<std::uint32_t>(h) * static_cast<std::uint32_t>(c.total_rows) + pair;
}

// key: the run's sort key; first_value: the entry index of its first entry (every entry of the run is in the
// same sequence).
__device__ __forceinline__ KvRun decode_run(std::uint32_t key, std::int32_t first_value, const KvConfig& c,
                                            const std::int32_t* cu_seqlens, const std::int32_t* offsets) {
  const std::int64_t h = key / c.blocks_bound, gblock = key % c.blocks_bound;
  std::int64_t begin = 0, length = c.rows, b = 0, batch = 0;
  if (c.packed) {
    // The sequence of the run's first token.
    const std::int64_t seq = last_at_most(cu_seqlens, c.batch, pair_row(c, h, first_value / c.num_idx));
    begin = cu_seqlens[seq];
    length = cu_seqlens[seq + 1] - begin;
    b = gblock - offsets[seq];
  } else {
    batch = gblock / c.blocks_per_seq;
    b = gblock % c.blocks_per_seq;
  }
  const std::int64_t first = b * c.block;
  return {h, batch, begin, first, static_cast<int>(min(c.block, length - first))};
}

// Keys [0, n) of a run's block that a row at position t sees: those <= t (0 for padding rows, t = -1).
__device__ __forceinline__ int visible_keys(int keys, std::int64_t first, int t) {
  return static_cast<int>(max(std::int64_t{0}, min(std::int64_t{keys}, std::int64_t{t} - first + 1)));
}

// Gathered row `pidx` of a run of `run_rows` rows ((token, group head) pairs, token-major): its q row, the
// slot of its partial, its position in the sequence, and its (batch, token row, query head) coordinates; past
// the run: null, -1, -1 (a padding row).
template <class T>
struct KvRow {
  const T* q;
  std::int64_t slot;
  int t;
  std::int64_t batch, row, hq;
};

template <class T>
__device__ __forceinline__ KvRow<T> describe_row(const Tokens<const T>& q, std::int64_t pidx, std::int64_t run_rows,
                                                 const std::int32_t* run_values, const KvRun& run,
                                                 const KvConfig& c) {
  if (pidx >= run_rows) return {nullptr, -1, -1, 0, 0, 0};
  // 32-bit arithmetic: entries, token rows and run rows stay below 2^31 (checked by the API).
  const auto p32 = static_cast<std::uint32_t>(pidx), group = static_cast<std::uint32_t>(c.group);
  const auto e = static_cast<std::uint32_t>(run_values[p32 / group]);
  const std::uint32_t pair = e / static_cast<std::uint32_t>(c.num_idx), j = e % static_cast<std::uint32_t>(c.num_idx);
  const std::uint32_t row_g = pair_row(c, run.h, pair);
  const std::uint32_t g = p32 % group;
  const std::int64_t hq = run.h * c.group + g;
  const auto rows = static_cast<std::uint32_t>(c.rows);
  const std::int64_t bt = c.packed ? 0 : row_g / rows, row = c.packed ? row_g : row_g % rows;
  // The chunk's partials are laid out (pair, group head, slot), as the merge kernels read them.
  return {q.row(bt, row, hq), (std::int64_t{pair} * c.group + g) * c.num_idx + j, static_cast<int>(row - run.begin),
          bt, row, hq};
}

// Stores a warp's 16 x D accumulator rows at their slots (slot < 0: a padding row, skipped) as fp16 of row /
// max|row| in dst[slot * D ...] with the scale max|row| * row_factor[i] (fp32) in scale_part[slot], for the
// thread's rows i = 0, 1 (lane / 4, lane / 4 + 8). The fp16 rows go through the warp's staging area `staged`
// (16 x D halves at staged_offset(r, c)) so that global writes are 16-byte pieces of whole rows; the caller
// makes sure nothing else uses that area meanwhile.
template <int D, class StagedOffset>
__device__ __forceinline__ void store_scaled_rows(const float (&acc)[D / 8][4], const float (&row_factor)[2],
                                                  const std::int64_t* slots, __half* staged,
                                                  StagedOffset&& staged_offset, __half* dst, float* scale_part) {
  const int lane = threadIdx.x % 32;
  float amax[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) amax[e / 2] = fmaxf(amax[e / 2], fabsf(acc[nt][e]));
  }
  float rs[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    amax[i] = quad_max(amax[i]);
    const std::int64_t slot = slots[lane / 4 + 8 * i];
    if (slot >= 0 && lane % 4 == 0) scale_part[slot] = amax[i] * row_factor[i];
    rs[i] = amax[i] >= FLT_MIN ? __frcp_rn(amax[i]) : 0.f;  // a row of subnormals would overflow 1 / max: zeros
  }
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int col = nt * 8 + 2 * (lane % 4);
    *reinterpret_cast<__half2*>(staged + staged_offset(lane / 4, col)) =
        __floats2half2_rn(acc[nt][0] * rs[0], acc[nt][1] * rs[0]);
    *reinterpret_cast<__half2*>(staged + staged_offset(lane / 4 + 8, col)) =
        __floats2half2_rn(acc[nt][2] * rs[1], acc[nt][3] * rs[1]);
  }
  __syncwarp();
  for (int i = lane; i < 16 * (D / 8); i += 32) {
    const int r = i / (D / 8), cc = i % (D / 8);
    const std::int64_t slot = slots[r];
    if (slot >= 0) {
      *reinterpret_cast<uint4*>(dst + slot * D + cc * 8) =
          *reinterpret_cast<const uint4*>(staged + staged_offset(r, cc * 8));
    }
  }
  __syncwarp();  // the lanes are done with the staging area
}

// A warp's epilogue for its 16 gathered rows: o = acc / l of each row, stored by store_scaled_rows (acc itself in
// fp16, 1 / l folded into the row's scale: o / max|o| = acc / max|acc|), and the fp32 lse (log2) at the row's slot.
// l >= 1 for a row that saw a key (its largest probability is 2^0), so the MUFU reciprocal and log2 are exact to
// about 2^-22; l = 0 marks a padding row.
template <int DV, class StagedOffset>
__device__ __forceinline__ void store_partials(const float (&acc)[DV / 8][4], const float (&m)[2], float (&l)[2],
                                               const std::int64_t* slots, __half* staged,
                                               StagedOffset&& staged_offset, __half* o_part, float* scale_part,
                                               float* lse_part) {
  const int lane = threadIdx.x % 32;
  float inv[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] = quad_sum(l[i]);
    inv[i] = l[i] > 0.f ? __frcp_rn(l[i]) : 0.f;
    const std::int64_t slot = slots[lane / 4 + 8 * i];
    if (slot >= 0 && lane % 4 == 0) lse_part[slot] = l[i] > 0.f ? m[i] + __log2f(l[i]) : -INFINITY;
  }
  store_scaled_rows<DV>(acc, inv, slots, staged, staged_offset, o_part, scale_part);
}

}  // namespace sparseattn::cuda::selection
