// The NSA backward's entry points of the branches' attention backward with BranchBackwardOptions
// (core/branch_backward_options.h says what the options do), and their checks. Internal.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "core/branch_backward_options.h"
#include "sparseattn/combine.h"
#include "sparseattn/compressed_attention.h"
#include "sparseattn/flash_attention.h"
#include "sparseattn/selected_attention.h"

namespace sparseattn::detail {

class Check;

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
