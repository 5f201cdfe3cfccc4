// The online softmax of the attention kernels, on the accumulator layout that mma.sync m16n8 C fragments and
// wgmma m64 accumulators share: a thread holds two rows of its warp's 16-row tile (lane / 4 and lane / 4 + 8)
// and, per 8 columns, two adjacent columns; the four threads of a quad hold one row between them.
#pragma once

#include <cmath>

namespace sparseattn::cuda {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// One key tile of the online softmax for a warp's 16-row tile: masks the raw scores s to the visible columns
// [col_lo, col_hi] of each of the thread's two rows, turns them into exp2-probabilities against the updated
// running max m (log2e-prescaled), and rescales the output accumulator and the running sum l.
template <int kN, int Dv>
__device__ __forceinline__ void online_softmax_step(float (&s)[kN / 8][4], float (&acc)[Dv / 8][4], float (&m)[2],
                                                    float (&l)[2], const int (&col_lo)[2], const int (&col_hi)[2],
                                                    float scale_log2) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = n * 8 + 2 * (lane % 4) + (i % 2);
      const bool shown = col >= col_lo[i / 2] && col <= col_hi[i / 2];
      s[n][i] = shown ? s[n][i] * scale_log2 : -INFINITY;
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = m[half];
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
    mx = quad_max(mx);
    const float use = mx == -INFINITY ? 0.f : mx;
    const float correction = exp2f(m[half] - use);  // 0 when m was -inf
    m[half] = mx;
    l[half] *= correction;
#pragma unroll
    for (int n = 0; n < Dv / 8; ++n) {
      acc[n][2 * half] *= correction;
      acc[n][2 * half + 1] *= correction;
    }
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) {
      s[n][2 * half] = exp2f(s[n][2 * half] - use);
      s[n][2 * half + 1] = exp2f(s[n][2 * half + 1] - use);
      l[half] += s[n][2 * half] + s[n][2 * half + 1];
    }
  }
}

}  // namespace sparseattn::cuda
