// delta = rowsum(dO * O), the per-row term of every attention backward (dS = P (dP - delta)), in fp32: the one
// kernel the attention and selected-attention backwards run when the caller gives no delta.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/primitives/common.cuh"

namespace sparseattn::cuda {

inline constexpr int kDeltaWarps = 4;

// One warp per (batch b, row r, head h) of o and d_o ([B, T, H, Dv] / packed as B = 1); each lane sums pairs of
// columns (2 lane, 2 lane + 1) + 64 j, then the warp adds its lanes up in a butterfly. Dv is even.
template <class T>
__global__ void __launch_bounds__(kDeltaWarps * 32)
    delta_kernel(Tokens<const T> o, Tokens<const T> d_o, PerHead<float> delta, std::int64_t batch, std::int64_t rows,
                 std::int64_t heads, int dim_v) {
  const std::int64_t item = std::int64_t{blockIdx.x} * kDeltaWarps + threadIdx.x / 32;
  if (item >= batch * rows * heads) return;
  const std::int64_t h = item % heads, r = (item / heads) % rows, b = item / (heads * rows);
  const T* o_row = o.row(b, r, h);
  const T* d_o_row = d_o.row(b, r, h);
  const int lane = threadIdx.x % 32;
  float sum = 0.f;
  for (int d = lane * 2; d < dim_v; d += 64) {
    sum += to_float(o_row[d]) * to_float(d_o_row[d]) + to_float(o_row[d + 1]) * to_float(d_o_row[d + 1]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) delta.at(b, r, h) = sum;
}

// Enqueues delta_kernel over batch x rows x heads rows; delta is any per-(batch, row, head) view, e.g. lse_of()'s.
template <class T>
void launch_delta(const Tokens<const T>& o, const Tokens<const T>& d_o, const PerHead<float>& delta, std::int64_t batch,
                  std::int64_t rows, std::int64_t heads, int dim_v, cudaStream_t stream) {
  const std::int64_t items = batch * rows * heads;
  if (items <= 0) return;
  delta_kernel<T><<<static_cast<unsigned>(ceil_div(items, kDeltaWarps)), kDeltaWarps * 32, 0, stream>>>(
      o, d_o, delta, batch, rows, heads, dim_v);
  check_launch("delta_kernel");
}

}  // namespace sparseattn::cuda
