// CUDA entry points of NSA block selection and selected attention (torch-free). Params are validated by
// src/api before these run (dtype bf16/fp16, head dims from kSupportedHeadDims, block % 16 == 0); each
// function only enqueues work on params.stream and never synchronises or allocates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "api/branch_backward.h"
#include "sparseattn/select_blocks.h"
#include "sparseattn/selected_attention.h"

namespace sparseattn::cuda {

// (Dqk, Dv) pairs the selected-attention kernels are instantiated for.
bool selected_attention_supports(std::int64_t dim_qk, std::int64_t dim_v);
// Whether the select_blocks kernel takes this configuration: one tile of kSelectColumns compressed blocks
// must cover at least one selection block with its border blocks (sel_block/stride + block/stride - 1).
inline constexpr std::int64_t kSelectColumns = 64;
// The kernel's tile holds 128 (token, group head) rows, so at most 128 query heads per KV head.
inline constexpr std::int64_t kSelectMaxGroup = 128;
inline bool select_blocks_config_supported(std::int64_t cmp_block, std::int64_t cmp_stride, std::int64_t sel_block) {
  return sel_block / cmp_stride + cmp_block / cmp_stride - 1 <= kSelectColumns;
}

std::size_t select_blocks_workspace_size(const SelectBlocksParams& params);
void select_blocks(const SelectBlocksParams& params);
std::size_t selected_attention_workspace_size(const SelectedAttentionParams& params);
void selected_attention(const SelectedAttentionParams& params);
std::size_t selected_attention_backward_workspace_size(const SelectedAttentionBackwardParams& params);
// options: the NSA backward's (api/branch_backward.h); default: as the public function.
void selected_attention_backward(const SelectedAttentionBackwardParams& params,
                                 const detail::BranchBackwardOptions& options);

}  // namespace sparseattn::cuda
