// The online softmax of the attention kernels, on the accumulator layout that mma.sync m16n8 C fragments and
// wgmma m64 accumulators share: a thread holds two rows of its warp's 16-row tile (lane / 4 and lane / 4 + 8)
// and, per 8 columns, two adjacent columns; the four threads of a quad hold one row between them.
#pragma once

#include <cmath>
#include <type_traits>

namespace sparseattn::cuda {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// 2^x on the MUFU unit alone (ex2.approx.ftz: relative error below 2^-22, results below 2^-126 flushed to
// zero, 2^-inf = 0). exp2f adds a range check and two multiplies per call to keep denormal results, which
// cost as much as the rest of the softmax in the attention loops and do not matter for probabilities.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Sets the scores s outside the visible columns [col_lo, col_hi] of each of the thread's two rows to -inf.
template <int kN>
__device__ __forceinline__ void mask_columns(float (&s)[kN / 8][4], const int (&col_lo)[2], const int (&col_hi)[2]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = n * 8 + 2 * (lane % 4) + (i % 2);
      if (col < col_lo[i / 2] || col > col_hi[i / 2]) s[n][i] = -INFINITY;
    }
  }
}

// The largest raw score of each of the thread's two rows in a key tile (s masked to -inf outside the visible
// columns; -inf for a row without one); the four threads of a quad get the same.
template <int kN>
__device__ __forceinline__ void tile_row_maxima(const float (&s)[kN / 8][4], float (&row_max)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float raw_max = -INFINITY;
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) raw_max = fmaxf(raw_max, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
    row_max[half] = quad_max(raw_max);
  }
}

// The sparse-softmax threshold's vote of the thread's two rows on a key tile: whether some row's largest raw score
// (row_max, tile_row_maxima), log2e-prescaled like the running max m, reaches m + log2(tau_row) (log2_tau). A row
// with no visible score sets no condition; a row whose m is still -inf votes for any tile where it sees a key.
__device__ __forceinline__ bool rows_reach_bar(const float (&row_max)[2], const float (&m)[2],
                                               const float (&log2_tau)[2], float scale_log2) {
  bool reaches = false;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    reaches = reaches || (row_max[half] != -INFINITY && !(row_max[half] * scale_log2 < m[half] + log2_tau[half]));
  }
  return reaches;
}

// softmax_probabilities for the sparse-softmax threshold, from the rows' maxima (tile_row_maxima of the masked s):
// a kept tile is the usual step; a skipped one leaves m and l as they are, with correction 1 and every probability
// 0 (its exponent is -inf), so that its P V adds nothing. Per-row selects only, no per-element branch.
template <int kN>
__device__ __forceinline__ void threshold_softmax_probabilities(float (&s)[kN / 8][4], float (&m)[2], float (&l)[2],
                                                                const float (&row_max)[2], bool kept,
                                                                float scale_log2, float (&correction)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float mx = kept ? fmaxf(m[half], row_max[half] * scale_log2) : m[half];
    const float use = !kept ? INFINITY : mx == -INFINITY ? 0.f : mx;
    correction[half] = kept ? fast_exp2(m[half] - use) : 1.f;  // kept: 0 when m was -inf
    m[half] = mx;
    float sum = l[half] * correction[half];
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) {
      s[n][2 * half] = fast_exp2(fmaf(s[n][2 * half], scale_log2, -use));
      s[n][2 * half + 1] = fast_exp2(fmaf(s[n][2 * half + 1], scale_log2, -use));
      sum += s[n][2 * half] + s[n][2 * half + 1];
    }
    l[half] = sum;
  }
}

// One key tile of the online softmax for a warp's 16-row tile, without the output: masks the raw scores s to
// the visible columns [col_lo, col_hi] of each of the thread's two rows (kMasked; a tile whose every element is
// visible skips it), turns them into exp2-probabilities against the updated running max m (log2e-prescaled:
// scale_log2 > 0, so the max of the raw scores times scale_log2 is the max of the scaled ones, and each
// probability takes one FFMA and one MUFU), rescales the running sum l and returns in `correction` the factor
// by which the output accumulator's rows must be rescaled (rescale_rows; separate so that a kernel can do it
// after the previous tile's P V product, in flight meanwhile, has landed).
template <int kN, bool kMasked>
__device__ __forceinline__ void softmax_probabilities(float (&s)[kN / 8][4], float (&m)[2], float (&l)[2],
                                                      const int (&col_lo)[2], const int (&col_hi)[2],
                                                      float scale_log2, float (&correction)[2]) {
  if constexpr (kMasked) mask_columns<kN>(s, col_lo, col_hi);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float raw_max = -INFINITY;
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) raw_max = fmaxf(raw_max, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
    const float mx = fmaxf(m[half], quad_max(raw_max) * scale_log2);
    const float use = mx == -INFINITY ? 0.f : mx;
    correction[half] = fast_exp2(m[half] - use);  // 0 when m was -inf
    m[half] = mx;
    float sum = l[half] * correction[half];
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) {
      s[n][2 * half] = fast_exp2(fmaf(s[n][2 * half], scale_log2, -use));
      s[n][2 * half + 1] = fast_exp2(fmaf(s[n][2 * half + 1], scale_log2, -use));
      sum += s[n][2 * half] + s[n][2 * half + 1];
    }
    l[half] = sum;
  }
}

template <int Dv>
__device__ __forceinline__ void rescale_rows(float (&acc)[Dv / 8][4], const float (&correction)[2]) {
#pragma unroll
  for (int n = 0; n < Dv / 8; ++n) {
    acc[n][0] *= correction[0];
    acc[n][1] *= correction[0];
    acc[n][2] *= correction[1];
    acc[n][3] *= correction[1];
  }
}

// The whole online softmax step: softmax_probabilities, then rescale_rows of the output accumulator.
template <int kN, int Dv, bool kMasked>
__device__ __forceinline__ void online_softmax_step(float (&s)[kN / 8][4], float (&acc)[Dv / 8][4], float (&m)[2],
                                                    float (&l)[2], const int (&col_lo)[2], const int (&col_hi)[2],
                                                    float scale_log2) {
  float correction[2];
  softmax_probabilities<kN, kMasked>(s, m, l, col_lo, col_hi, scale_log2, correction);
  rescale_rows<Dv>(acc, correction);
}

// Runs body(std::true_type{}) when masked, body(std::false_type{}) otherwise: the per-element masks of a key
// tile compile away where the whole tile is visible.
template <class Body>
__device__ __forceinline__ void with_mask(bool masked, Body&& body) {
  if (masked) {
    body(std::true_type{});
  } else {
    body(std::false_type{});
  }
}

}  // namespace sparseattn::cuda
