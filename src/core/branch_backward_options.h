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

#include "sparseattn/tensor.h"

namespace sparseattn::detail {

struct BranchBackwardOptions {
  TensorView delta;            // optional: the branch's delta (see above); computed when absent
  TensorView d_o_scale;        // optional (CUDA): float32 like lse, the gate folded into d_o (see above); absent: 1
  bool accumulate_dq = false;  // dq += this branch's gradient instead of dq = it
};

}  // namespace sparseattn::detail
