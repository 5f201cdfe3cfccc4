// combine: NSA's gated sum of the branch outputs, o = g_cmp*o_cmp + g_slc*o_slc + g_swa*o_swa.
#pragma once

#include <array>

#include "sparseattn/tensor.h"

namespace sparseattn {

inline constexpr int kNumBranches = 3;  // compressed, selected, sliding window (in that order)

// A branch takes part iff its gate is present; then its output must be present too. At least one branch.
// Gates are used as given (already activated). Layouts: batched or packed, all alike.
struct CombineParams {
  std::array<TensorView, kNumBranches> outputs;  // [B, T, Hq, Dv] or packed [N, Hq, Dv]
  std::array<TensorView, kNumBranches> gates;    // [B, T, Hq] or packed [N, Hq]
  TensorView o;                                  // out: [B, T, Hq, Dv] or packed [N, Hq, Dv]
  Stream stream = nullptr;
};

struct CombineBackwardParams {
  std::array<TensorView, kNumBranches> outputs;  // as in the forward
  std::array<TensorView, kNumBranches> gates;    // as in the forward
  TensorView d_o;                                // like o
  std::array<TensorView, kNumBranches> d_outputs;  // out, for each branch that takes part: g * d_o
  std::array<TensorView, kNumBranches> d_gates;    // out, optional per branch: sum over Dv of d_o * o_i
  Stream stream = nullptr;
};

void combine(const CombineParams& params);
void combine_backward(const CombineBackwardParams& params);

}  // namespace sparseattn
