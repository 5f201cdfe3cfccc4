// The NSA backward's shortcut for delta = rowsum(d_o * o), the per-row term every attention backward needs:
// combine_backward already reads d_o and each branch's o, so it writes each branch's delta as it scales d_o,
// and the branch's attention backward reads it instead of running its own delta kernel. Internal and CUDA
// only: a delta is float32, laid out like that branch's lse ([B, Hq, T] or packed [Hq, N], rows contiguous).
// An absent delta behaves as the public functions do.
#pragma once

#include <array>
#include <vector>

#include "api/check.h"
#include "sparseattn/combine.h"
#include "sparseattn/compressed_attention.h"
#include "sparseattn/flash_attention.h"
#include "sparseattn/selected_attention.h"

namespace sparseattn::detail {

void combine_backward(const CombineBackwardParams& params, const std::array<TensorView, kNumBranches>& deltas);
void compressed_attention_backward(const CompressedAttentionBackwardParams& params, const TensorView& delta);
void selected_attention_backward(const SelectedAttentionBackwardParams& params, const TensorView& delta);
void flash_attention_backward(const FlashAttentionBackwardParams& params, const TensorView& delta);

// Checks a present delta: on `anchor`'s CUDA device, float32, of shape `lse_shape`, rows contiguous.
void check_delta(const Check& check, const TensorView& delta, const std::string& arg,
                 const std::vector<std::int64_t>& lse_shape, const TensorView& anchor, const std::string& anchor_arg);

}  // namespace sparseattn::detail
