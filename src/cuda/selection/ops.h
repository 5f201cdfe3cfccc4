// CUDA entry points of NSA block selection and selected attention (torch-free). Params are validated by
// src/api before these run (dtype bf16/fp16, head dims from kSupportedHeadDims, block % 16 == 0); each
// function only enqueues work on params.stream and never synchronises or allocates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sparseattn/select_blocks.h"
#include "sparseattn/selected_attention.h"

namespace sparseattn::cuda {

// (Dqk, Dv) pairs the selected-attention kernels are instantiated for.
bool selected_attention_supports(std::int64_t dim_qk, std::int64_t dim_v);
// Largest Dqk select_blocks takes (the kernel keeps a key row in registers, 8 values per lane).
inline constexpr std::int64_t kSelectBlocksMaxDim = 256;
// Dynamic shared memory select_blocks needs for sequences of up to `max_length` tokens, and whether the
// device of `device_index` can give it.
bool select_blocks_fits(std::int64_t max_length, std::int64_t sel_block, std::int64_t heads_per_group,
                        std::int64_t dim, std::int64_t num_selected, int device_index);

void select_blocks(const SelectBlocksParams& params);
void selected_attention(const SelectedAttentionParams& params);
std::size_t selected_attention_backward_workspace_size(const SelectedAttentionBackwardParams& params);
void selected_attention_backward(const SelectedAttentionBackwardParams& params);

}  // namespace sparseattn::cuda
