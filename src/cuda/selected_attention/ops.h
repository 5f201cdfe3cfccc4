// CUDA entry points of selected attention (torch-free). Params are validated by src/api before these run (dtype
// bf16/fp16, head dims from sparseattn/head_dims.h, block % 16 == 0); each function only enqueues work on params.stream
// and never synchronises or allocates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/branch_backward_options.h"
#include "sparseattn/selected_attention.h"

namespace sparseattn::cuda {

std::size_t selected_attention_workspace_size(const SelectedAttentionParams& params);
void selected_attention(const SelectedAttentionParams& params);
std::size_t selected_attention_backward_workspace_size(const SelectedAttentionBackwardParams& params);
// options: the NSA backward's (core/branch_backward_options.h); default: as the public function.
void selected_attention_backward(const SelectedAttentionBackwardParams& params,
                                 const detail::BranchBackwardOptions& options);

}  // namespace sparseattn::cuda
