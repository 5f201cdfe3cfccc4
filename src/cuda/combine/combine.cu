// combine: o = sum over present branches of gate * branch output. Memory-bound: each (token, head) row is
// handled by up to 32 lanes of one warp moving 16 bytes at a time where the rows are aligned, so the gate is
// read once per lane and d_gate is a shuffle reduction over the row's lanes (deterministic, no atomics).
// A lane group takes a run of kHeadsPerGroup heads of one token, so that the 64-bit index arithmetic of
// finding a row is paid once per run: paid once per row, it makes the backward issue-bound. The backward of the
// NSA path (every gate folded into its branch's backward) has its own kernel, which keeps the loads of several
// heads in flight together instead of one branch's row at a time.
#include "cuda/primitives/common.cuh"
#include "cuda/combine/ops.h"

namespace sparseattn::cuda {

namespace {

template <class T>
struct Branches {
  Tokens<T> outputs[kNumBranches];
  PerHead<T> gates[kNumBranches];
  bool present[kNumBranches];
};

struct RowGrid {
  std::int64_t batch, rows, heads, dim;
};

constexpr int kHeadsPerGroup = 8;
constexpr int kThreadsPerBlock = 256;

RowGrid row_grid(const TensorView& o) {
  const bool packed = o.rank == 3;
  return {packed ? 1 : o.shape[0], o.shape[packed ? 0 : 1], o.shape[packed ? 1 : 2], o.shape[packed ? 2 : 3]};
}

template <class T>
Branches<T> branches_of(const std::array<TensorView, kNumBranches>& outputs,
                        const std::array<TensorView, kNumBranches>& gates) {
  Branches<T> branches{};
  for (int i = 0; i < kNumBranches; ++i) {
    branches.present[i] = gates[i].present();
    if (!branches.present[i]) continue;
    branches.outputs[i] = tokens_of<T>(outputs[i]);
    branches.gates[i] = per_head_of<T>(gates[i]);
  }
  return branches;
}

// Rows are split over L = lanes_per_row(dim, kVec) consecutive lanes (a power of two <= 32, so a row's lanes
// share a warp), each moving kVec elements at a time: 16 bytes where every row is 16-byte aligned
// (vector_width), single elements otherwise.
int lanes_per_row(std::int64_t dim, int vec) {
  int lanes = 1;
  while (lanes < 32 && lanes * vec < dim) lanes *= 2;
  return lanes;
}

template <class T, int kVec>
__device__ __forceinline__ void load_vec(float (&out)[kVec], const T* src) {
  if constexpr (kVec == 1) {
    out[0] = to_float(*src);
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = to_float(x[i]);
  }
}

template <class T, int kVec>
__device__ __forceinline__ void store_vec(T* dst, const float (&in)[kVec]) {
  if constexpr (kVec == 1) {
    *dst = from_float<T>(in[0]);
  } else {
    uint4 raw;
    T* x = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) x[i] = from_float<T>(in[i]);
    *reinterpret_cast<uint4*>(dst) = raw;
  }
}

// The rows of this thread's lane group: token (b, t), heads [h, h_end), and its lane among the row's
// `lanes`; false past the end.
struct RowsOf {
  std::int64_t b, t;
  int h, h_end, lane;
};

__device__ __forceinline__ bool rows_of(const RowGrid& grid, int lanes, RowsOf& r) {
  const std::int64_t thread = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::int64_t group = thread / lanes;
  const std::int64_t runs = (grid.heads + kHeadsPerGroup - 1) / kHeadsPerGroup;
  if (group >= grid.batch * grid.rows * runs) return false;
  const std::int64_t token = group / runs;
  r.b = token / grid.rows;
  r.t = token % grid.rows;
  r.h = static_cast<int>(group % runs) * kHeadsPerGroup;
  r.h_end = static_cast<int>(min(grid.heads, std::int64_t{r.h} + kHeadsPerGroup));
  r.lane = static_cast<int>(thread % lanes);
  return true;
}

template <class T, int kVec>
__global__ void combine_kernel(Branches<T> branches, Tokens<T> o, RowGrid grid, int lanes) {
  RowsOf r;
  if (!rows_of(grid, lanes, r)) return;
  for (int h = r.h; h < r.h_end; ++h) {
    float gate[kNumBranches];
    for (int i = 0; i < kNumBranches; ++i) {
      gate[i] = branches.present[i] ? to_float(branches.gates[i].at(r.b, r.t, h)) : 0.f;
    }
    T* out = o.row(r.b, r.t, h);
    for (std::int64_t d = std::int64_t{r.lane} * kVec; d < grid.dim; d += std::int64_t{lanes} * kVec) {
      float sum[kVec] = {};
      for (int i = 0; i < kNumBranches; ++i) {
        if (!branches.present[i]) continue;
        float x[kVec];
        load_vec<T, kVec>(x, branches.outputs[i].row(r.b, r.t, h) + d);
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum[e] += gate[i] * x[e];
      }
      store_vec<T, kVec>(out + d, sum);
    }
  }
}

template <class T>
struct BackwardOutputs {
  Tokens<T> d_outputs[kNumBranches];  // data null: the branch's gate is folded into its backward
  PerHead<T> d_gates[kNumBranches];
  LseView<float> deltas[kNumBranches], scales[kNumBranches];  // data null: not wanted
};

// Reads d_o once for all branches. Every row's lanes stay active to the end: d_gate and delta are shuffle
// reductions over them. With a stored d_out, delta is sum(d_out * o) over the d_out values as stored (rounded
// to T), exactly what the branch's backward computes from that tensor; with the gate folded into the branch's
// backward (no d_out), it is sum(d_o * o) (= d_gate in fp32), as that backward applies the gate to P.
// Five CTAs per SM (48 registers, no spills; 56 would leave room for four): the fifth CTA's loads in flight
// keep more bytes moving.
template <class T, int kVec>
__global__ void __launch_bounds__(kThreadsPerBlock, 5)
    combine_backward_kernel(Branches<T> branches, Tokens<T> d_o, BackwardOutputs<T> outs, RowGrid grid, int lanes) {
  RowsOf r;
  const bool active = rows_of(grid, lanes, r);
  if (__all_sync(0xffffffffu, !active)) return;
  // A warp's groups run the same number of heads, but for the last run of a token when heads % 8 != 0 (the
  // groups of a warp may then belong to different tokens): the shuffles need every lane of the warp.
  const int runs = __reduce_max_sync(0xffffffffu, active ? r.h_end - r.h : 0);
  for (int run = 0; run < runs; ++run) {
    const int h = active ? r.h + run : 0;
    const bool row_active = active && h < r.h_end;
    float gate[kNumBranches] = {}, d_gate[kNumBranches] = {}, delta[kNumBranches] = {};
    if (row_active) {
#pragma unroll
      for (int i = 0; i < kNumBranches; ++i) {
        if (branches.present[i]) gate[i] = to_float(branches.gates[i].at(r.b, r.t, h));
      }
      const T* grad = d_o.row(r.b, r.t, h);
      for (std::int64_t d = std::int64_t{r.lane} * kVec; d < grid.dim; d += std::int64_t{lanes} * kVec) {
        float g[kVec];
        load_vec<T, kVec>(g, grad + d);
#pragma unroll
        for (int i = 0; i < kNumBranches; ++i) {
          if (!branches.present[i]) continue;
          float x[kVec];
          load_vec<T, kVec>(x, branches.outputs[i].row(r.b, r.t, h) + d);
          T* d_out = outs.d_outputs[i].data != nullptr ? outs.d_outputs[i].row(r.b, r.t, h) + d : nullptr;
          float scaled[kVec];
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            scaled[e] = gate[i] * g[e];
            d_gate[i] += g[e] * x[e];
            if (d_out != nullptr) delta[i] += to_float(from_float<T>(scaled[e])) * x[e];
          }
          if (d_out != nullptr) store_vec<T, kVec>(d_out, scaled);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kNumBranches; ++i) {
      if (!branches.present[i]) continue;
      const bool folded = outs.d_outputs[i].data == nullptr;  // delta is d_gate (see above)
      for (int offset = lanes / 2; offset > 0; offset /= 2) {
        d_gate[i] += __shfl_xor_sync(0xffffffffu, d_gate[i], offset);
        if (!folded) delta[i] += __shfl_xor_sync(0xffffffffu, delta[i], offset);
      }
      if (!row_active || r.lane != 0) continue;
      if (outs.d_gates[i].data != nullptr) outs.d_gates[i].at(r.b, r.t, h) = from_float<T>(d_gate[i]);
      if (outs.deltas[i].data != nullptr) outs.deltas[i].at(r.b, r.t, h) = folded ? d_gate[i] : delta[i];
      if (outs.scales[i].data != nullptr) outs.scales[i].at(r.b, r.t, h) = gate[i];
    }
  }
}

// combine_backward_kernel where every branch's gate is folded into its backward (no d_out: the NSA path on CUDA)
// and the rows are one 16-byte piece per lane: d_gate = delta = sum(d_o * o) per row, and the gate as the branch's P
// factor. The loads of kBatch heads are issued together and without branches between them (a lane past its run,
// or an absent branch, reads a valid row and drops the product), so that they are in flight together;
// the row sums are reduced over the row's lanes afterwards, every head's at once. Two heads per batch at four CTAs
// per SM (64 registers, no spills) keep the most bytes moving (docs/perf/2026-11-28-combine-backward-and-dkv-gather.md).
constexpr int kFoldedBatch = 2, kFoldedBlocksPerSm = 4;

template <class T>
__global__ void __launch_bounds__(kThreadsPerBlock, kFoldedBlocksPerSm)
    combine_backward_folded_kernel(Branches<T> branches, Tokens<T> d_o, BackwardOutputs<T> outs, RowGrid grid,
                                   int lanes) {
  constexpr int kVec = 16 / sizeof(T), kBatch = kFoldedBatch;
  static_assert(kHeadsPerGroup % kBatch == 0, "whole batches of heads");
  RowsOf r;
  const bool active = rows_of(grid, lanes, r);
  if (__all_sync(0xffffffffu, !active)) return;
  const int heads = active ? r.h_end - r.h : 0;
  const int runs = __reduce_max_sync(0xffffffffu, heads);
  const std::int64_t d0 = std::int64_t{r.lane} * kVec;  // the lanes' pieces are the row (launcher)
  const T* const fallback = d_o.data;
  float d_gate[kHeadsPerGroup][kNumBranches] = {};
#pragma unroll
  for (int run0 = 0; run0 < kHeadsPerGroup; run0 += kBatch) {
    if (run0 >= runs) break;  // the same for the whole warp
    uint4 raw[kBatch][1 + kNumBranches];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const bool in = run0 + b < heads;
      const int h = r.h + run0 + b;
      const T* grad = in ? d_o.row(r.b, r.t, h) + d0 : fallback;
      raw[b][0] = *reinterpret_cast<const uint4*>(grad);
#pragma unroll
      for (int i = 0; i < kNumBranches; ++i) {
        const T* x = in && branches.present[i] ? branches.outputs[i].row(r.b, r.t, h) + d0 : grad;
        raw[b][1 + i] = *reinterpret_cast<const uint4*>(x);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const T* g = reinterpret_cast<const T*>(&raw[b][0]);
#pragma unroll
      for (int i = 0; i < kNumBranches; ++i) {
        const T* x = reinterpret_cast<const T*>(&raw[b][1 + i]);
        float sum = 0.f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum += to_float(g[e]) * to_float(x[e]);
        if (run0 + b < heads) d_gate[run0 + b][i] += sum;
      }
    }
  }
#pragma unroll
  for (int run = 0; run < kHeadsPerGroup; ++run) {
    if (run >= runs) break;
#pragma unroll
    for (int i = 0; i < kNumBranches; ++i) {
      if (!branches.present[i]) continue;
      for (int offset = lanes / 2; offset > 0; offset /= 2) {
        d_gate[run][i] += __shfl_xor_sync(0xffffffffu, d_gate[run][i], offset);
      }
    }
  }
  if (!active || r.lane != 0) return;
#pragma unroll
  for (int run = 0; run < kHeadsPerGroup; ++run) {
    if (run >= heads) break;
    const int h = r.h + run;
#pragma unroll
    for (int i = 0; i < kNumBranches; ++i) {
      if (!branches.present[i]) continue;
      if (outs.d_gates[i].data != nullptr) outs.d_gates[i].at(r.b, r.t, h) = from_float<T>(d_gate[run][i]);
      if (outs.deltas[i].data != nullptr) outs.deltas[i].at(r.b, r.t, h) = d_gate[run][i];
      if (outs.scales[i].data != nullptr) outs.scales[i].at(r.b, r.t, h) = to_float(branches.gates[i].at(r.b, r.t, h));
    }
  }
}

// 16 / sizeof(T) when every row of these token tensors starts 16-byte aligned and dim is a multiple of it; else 1.
template <class T, class... Views>
int vector_width(std::int64_t dim, const Views&... views) {
  constexpr int kWide = 16 / sizeof(T);
  bool aligned = dim % kWide == 0;
  auto check = [&](const TensorView& view) {
    if (!view.present()) return;
    aligned = aligned && reinterpret_cast<std::uintptr_t>(view.data) % 16 == 0;
    for (int d = 0; d + 1 < view.rank; ++d) aligned = aligned && view.stride[d] % kWide == 0;
  };
  (check(views), ...);
  return aligned ? kWide : 1;
}

unsigned blocks_for(const RowGrid& grid, int lanes) {
  const std::int64_t runs = ceil_div(grid.heads, std::int64_t{kHeadsPerGroup});
  return static_cast<unsigned>(ceil_div(grid.batch * grid.rows * runs * lanes, kThreadsPerBlock));
}

}  // namespace

void combine(const CombineParams& params) {
  const DeviceGuard device(params.o.device_index);
  const RowGrid grid = row_grid(params.o);
  if (grid.batch * grid.rows * grid.heads == 0) return;
  dispatch_float(params.o.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto& outs = params.outputs;
    const auto stream = static_cast<cudaStream_t>(params.stream);
    auto launch = [&](auto kernel, int vec) {
      const int lanes = lanes_per_row(grid.dim, vec);
      kernel<<<blocks_for(grid, lanes), kThreadsPerBlock, 0, stream>>>(branches_of<T>(outs, params.gates),
                                                                       tokens_of<T>(params.o), grid, lanes);
    };
    if (vector_width<T>(grid.dim, params.o, outs[0], outs[1], outs[2]) > 1) {
      launch(combine_kernel<T, 16 / sizeof(T)>, 16 / sizeof(T));
    } else {
      launch(combine_kernel<T, 1>, 1);
    }
    check_launch("combine_kernel");
  });
}

void combine_backward(const CombineBackwardParams& params, const std::array<TensorView, kNumBranches>& deltas,
                      const std::array<TensorView, kNumBranches>& scales) {
  const DeviceGuard device(params.d_o.device_index);
  const RowGrid grid = row_grid(params.d_o);
  if (grid.batch * grid.rows * grid.heads == 0) return;
  dispatch_float(params.d_o.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    BackwardOutputs<T> backward_outputs{};
    for (int i = 0; i < kNumBranches; ++i) {
      if (params.d_outputs[i].present()) backward_outputs.d_outputs[i] = tokens_of<T>(params.d_outputs[i]);
      if (params.d_gates[i].present()) backward_outputs.d_gates[i] = per_head_of<T>(params.d_gates[i]);
      if (deltas[i].present()) backward_outputs.deltas[i] = lse_of<float>(deltas[i]);
      if (scales[i].present()) backward_outputs.scales[i] = lse_of<float>(scales[i]);
    }
    const auto& outs = params.outputs;
    const auto& d_outs = params.d_outputs;
    const auto stream = static_cast<cudaStream_t>(params.stream);
    auto launch = [&](auto kernel, int vec) {
      const int lanes = lanes_per_row(grid.dim, vec);
      kernel<<<blocks_for(grid, lanes), kThreadsPerBlock, 0, stream>>>(
          branches_of<T>(outs, params.gates), tokens_of<T>(params.d_o), backward_outputs, grid, lanes);
    };
    // The folded kernel where no branch stores d_out and the rows are 16-byte pieces, one per lane.
    const int wide = vector_width<T>(grid.dim, params.d_o, outs[0], outs[1], outs[2], d_outs[0], d_outs[1], d_outs[2]);
    bool folded = wide > 1 && lanes_per_row(grid.dim, wide) * wide == grid.dim;
    for (int i = 0; i < kNumBranches; ++i) folded = folded && !d_outs[i].present();
    if (folded) {
      launch(combine_backward_folded_kernel<T>, wide);
    } else if (wide > 1) {
      launch(combine_backward_kernel<T, 16 / sizeof(T)>, wide);
    } else {
      launch(combine_backward_kernel<T, 1>, 1);
    }
    check_launch("combine_backward_kernel");
  });
}

}  // namespace sparseattn::cuda
