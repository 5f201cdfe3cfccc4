// How the NSA backward runs its branches' attention backward on CUDA (internal):
//  - delta = rowsum(d_o * o), the per-row term every attention backward needs: combine_backward already reads d_o
//    and each branch's o, so it writes the branch's delta as it scales d_o, and the branch's backward reads it
//    instead of running its own delta kernel. A delta is float32, laid out like that branch's lse ([B, Hq, T]
//    or packed [Hq, N], rows contiguous).
//  - d_o_scale: the branch's gate g folded into its backward: its output gradient is g[row] * d_o. Its kernels
//    multiply P by g (dV = (g P)^T d_o, dS = g P (d_o V^T - delta)), so delta stays rowsum(d_o * o), without g,
//    and no scaled copy of d_o is read. combine_backward then reads d_o once for all branches and writes each
//    branch's delta and g (float32, laid out like lse) instead of the scaled d_o.
//  - accumulate_dq: the branch adds its dq to dq's contents (the branches' dq kernels own disjoint rows, so
//    this is deterministic), which replaces a dq buffer per branch and the sum over them.
// Default options behave as the public functions do.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "sparseattn/combine.h"
#include "sparseattn/compressed_attention.h"
#include "sparseattn/flash_attention.h"
#include "sparseattn/selected_attention.h"

namespace sparseattn::detail {

class Check;

struct BranchBackwardOptions {
  TensorView delta;            // optional: the branch's delta (see above); computed when absent
  TensorView d_o_scale;        // optional (CUDA): float32 like lse, the gate folded into d_o (see above); absent: 1
  bool accumulate_dq = false;  // dq += this branch's gradient instead of dq = it
};

// deltas[i] present: branch i's delta is written too. scales[i] present: branch i's gate is folded (see above):
// its gate goes to scales[i] as float32, params.d_outputs[i] must be absent, and its delta is rowsum(d_o * o)
// (without a folded gate: rowsum of the stored, rounded g * d_o times o, as the branch would compute it).
void combine_backward(const CombineBackwardParams& params, const std::array<TensorView, kNumBranches>& deltas,
                      const std::array<TensorView, kNumBranches>& scales);
void compressed_attention_backward(const CompressedAttentionBackwardParams& params,
                                   const BranchBackwardOptions& options);
void selected_attention_backward(const SelectedAttentionBackwardParams& params, const BranchBackwardOptions& options);
void flash_attention_backward(const FlashAttentionBackwardParams& params, const BranchBackwardOptions& options);

// Checks a present delta: on `anchor`'s CUDA device, float32, of shape `lse_shape`, rows contiguous.
void check_delta(const Check& check, const TensorView& delta, const std::string& arg,
                 const std::vector<std::int64_t>& lse_shape, const TensorView& anchor, const std::string& anchor_arg);
// Checks options for a backward on `q`'s device: CUDA only, and a delta of shape `lse_shape`.
void check_options(const Check& check, const BranchBackwardOptions& options, const std::vector<std::int64_t>& lse_shape,
                   const TensorView& q);

}  // namespace sparseattn::detail
