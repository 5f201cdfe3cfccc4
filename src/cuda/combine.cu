// combine: o = sum over present branches of gate * branch output. Memory-bound; one warp per (token, head)
// row so the gate is read once per row and d_gate is a warp reduction (deterministic, no atomics).
#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace sparseattn::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;

template <class T>
struct Branches {
  Tokens<T> outputs[kNumBranches];
  PerHead<T> gates[kNumBranches];
  bool present[kNumBranches];
};

struct RowGrid {
  std::int64_t batch, rows, heads, dim;
};

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

template <class T>
__global__ void combine_kernel(Branches<T> branches, Tokens<T> o, RowGrid grid) {
  const std::int64_t row = std::int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= grid.batch * grid.rows * grid.heads) return;
  const std::int64_t h = row % grid.heads, t = row / grid.heads % grid.rows, b = row / grid.heads / grid.rows;
  float gate[kNumBranches];
  for (int i = 0; i < kNumBranches; ++i) gate[i] = branches.present[i] ? to_float(branches.gates[i].at(b, t, h)) : 0.f;
  T* out = o.row(b, t, h);
  for (std::int64_t d = threadIdx.x % 32; d < grid.dim; d += 32) {
    float sum = 0.f;
    for (int i = 0; i < kNumBranches; ++i) {
      if (branches.present[i]) sum += gate[i] * to_float(branches.outputs[i].row(b, t, h)[d]);
    }
    out[d] = from_float<T>(sum);
  }
}

template <class T>
__global__ void combine_backward_kernel(Branches<T> branches, Tokens<T> d_o, Tokens<T> d_outputs_0,
                                        Tokens<T> d_outputs_1, Tokens<T> d_outputs_2, PerHead<T> d_gate_0,
                                        PerHead<T> d_gate_1, PerHead<T> d_gate_2, RowGrid grid) {
  const std::int64_t row = std::int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= grid.batch * grid.rows * grid.heads) return;
  const std::int64_t h = row % grid.heads, t = row / grid.heads % grid.rows, b = row / grid.heads / grid.rows;
  const Tokens<T> d_outputs[kNumBranches] = {d_outputs_0, d_outputs_1, d_outputs_2};
  const PerHead<T> d_gates[kNumBranches] = {d_gate_0, d_gate_1, d_gate_2};
  const T* grad = d_o.row(b, t, h);
  for (int i = 0; i < kNumBranches; ++i) {
    if (!branches.present[i]) continue;
    const float gate = to_float(branches.gates[i].at(b, t, h));
    const T* out = branches.outputs[i].row(b, t, h);
    T* d_out = d_outputs[i].row(b, t, h);
    float partial = 0.f;
    for (std::int64_t d = threadIdx.x % 32; d < grid.dim; d += 32) {
      const float g = to_float(grad[d]);
      d_out[d] = from_float<T>(gate * g);
      partial += g * to_float(out[d]);
    }
    for (int offset = 16; offset > 0; offset /= 2) partial += __shfl_xor_sync(0xffffffffu, partial, offset);
    if (d_gates[i].data != nullptr && threadIdx.x % 32 == 0) d_gates[i].at(b, t, h) = from_float<T>(partial);
  }
}

unsigned blocks_for(const RowGrid& grid) {
  return static_cast<unsigned>(ceil_div(grid.batch * grid.rows * grid.heads, kWarpsPerBlock));
}

}  // namespace

void combine(const CombineParams& params) {
  const DeviceGuard device(params.o.device_index);
  const RowGrid grid = row_grid(params.o);
  if (blocks_for(grid) == 0) return;
  dispatch_float(params.o.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    combine_kernel<T><<<blocks_for(grid), kWarpsPerBlock * 32, 0, static_cast<cudaStream_t>(params.stream)>>>(
        branches_of<T>(params.outputs, params.gates), tokens_of<T>(params.o), grid);
    check_launch("combine_kernel");
  });
}

void combine_backward(const CombineBackwardParams& params) {
  const DeviceGuard device(params.d_o.device_index);
  const RowGrid grid = row_grid(params.d_o);
  if (blocks_for(grid) == 0) return;
  dispatch_float(params.d_o.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    Tokens<T> d_outputs[kNumBranches]{};
    PerHead<T> d_gates[kNumBranches]{};
    for (int i = 0; i < kNumBranches; ++i) {
      if (params.d_outputs[i].present()) d_outputs[i] = tokens_of<T>(params.d_outputs[i]);
      if (params.d_gates[i].present()) d_gates[i] = per_head_of<T>(params.d_gates[i]);
    }
    combine_backward_kernel<T><<<blocks_for(grid), kWarpsPerBlock * 32, 0,
                                 static_cast<cudaStream_t>(params.stream)>>>(
        branches_of<T>(params.outputs, params.gates), tokens_of<T>(params.d_o), d_outputs[0], d_outputs[1],
        d_outputs[2], d_gates[0], d_gates[1], d_gates[2], grid);
    check_launch("combine_backward_kernel");
  });
}

}  // namespace sparseattn::cuda
