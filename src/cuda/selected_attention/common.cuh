// Views shared by the selected-attention kernels: the block indices, and the P factor of a folded gate.
#pragma once

#include <cstdint>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/sequences.cuh"
#include "cuda/primitives/softmax.cuh"
#include "sparseattn/tensor.h"

namespace sparseattn::cuda::selection {

// The P factor of row (b, row, h) in a backward: the gate of an NSA branch folded into it
// (core/branch_backward_options.h: P becomes g P); 1 without one (data null).
__device__ __forceinline__ float p_scale_at(const LseView<const float>& p_scale, std::int64_t b, std::int64_t row,
                                            std::int64_t h) {
  return p_scale.data == nullptr ? 1.f : p_scale.at(b, row, h);
}

// Indices [B, T, Hkv, n] (packed [N, Hkv, n]); the innermost stride is 1.
struct IndexView {
  const std::int32_t* data;
  std::int64_t batch_stride, row_stride, head_stride;
  __device__ __forceinline__ const std::int32_t* row(std::int64_t b, std::int64_t t, std::int64_t h) const {
    return data + b * batch_stride + t * row_stride + h * head_stride;
  }
};

inline IndexView index_of(const TensorView& view) {
  const bool packed = view.rank == 3;
  return {static_cast<const std::int32_t*>(view.data), packed ? 0 : view.stride[0], view.stride[packed ? 0 : 1],
          view.stride[packed ? 1 : 2]};
}

}  // namespace sparseattn::cuda::selection
