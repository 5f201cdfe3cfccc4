// CUDA entry points of the attention kernels (flash_attention, compressed_attention); torch-free. The API
// (src/api) validates params before these run: bf16/fp16, head dims (Dqk, Dv) from sparseattn/head_dims.h,
// 16-byte aligned rows, the shapes of flash_attention's mask, bias, dense tile map, gates, per-head windows and the
// forward's softmax-threshold decision map (no gate threshold or block lists). Each function only enqueues work on
// params.stream.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/branch_backward_options.h"
#include "sparseattn/compressed_attention.h"
#include "sparseattn/flash_attention.h"

namespace sparseattn::cuda {

void flash_attention(const FlashAttentionParams& params);
// The forward kernel's (query tile, key tile) for q's dtype and device and the head dims of q and v: the tiles
// softmax_threshold decides in (FlashTermsMask's forward on this device).
FlashThresholdTiles flash_attention_threshold_tiles(const FlashAttentionParams& params);
std::size_t flash_attention_backward_workspace_size(const FlashAttentionBackwardParams& params);
// options: the NSA backward's (core/branch_backward_options.h); default: as the public function.
void flash_attention_backward(const FlashAttentionBackwardParams& params, const detail::BranchBackwardOptions& options);

void compressed_attention(const CompressedAttentionParams& params);
std::size_t compressed_attention_backward_workspace_size(const CompressedAttentionBackwardParams& params);
void compressed_attention_backward(const CompressedAttentionBackwardParams& params,
                                   const detail::BranchBackwardOptions& options);

}  // namespace sparseattn::cuda
