// CUDA entry points of select_blocks (torch-free). Params are validated by src/api before these run; each
// function only enqueues work on params.stream and never synchronises or allocates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sparseattn/select_blocks.h"

namespace sparseattn::cuda {

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

}  // namespace sparseattn::cuda
