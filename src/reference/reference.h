// The CPU reference backend: float64 accumulation, simple loops, the oracle for every GPU kernel.
// Entry points take already-validated params (src/api validates, then dispatches here).
#pragma once

#include "sparseattn/combine.h"
#include "sparseattn/compress_kv.h"
#include "sparseattn/compressed_attention.h"
#include "sparseattn/create_mask.h"
#include "sparseattn/flash_attention.h"
#include "sparseattn/select_blocks.h"
#include "sparseattn/selected_attention.h"

namespace sparseattn::reference {

void compress_kv(const CompressKvParams& params);
void compress_kv_backward(const CompressKvBackwardParams& params);
void compressed_attention(const CompressedAttentionParams& params);
void compressed_attention_backward(const CompressedAttentionBackwardParams& params);
void select_blocks(const SelectBlocksParams& params);
void selected_attention(const SelectedAttentionParams& params);
void selected_attention_backward(const SelectedAttentionBackwardParams& params);
void flash_attention(const FlashAttentionParams& params);
void flash_attention_backward(const FlashAttentionBackwardParams& params);
void combine(const CombineParams& params);
void combine_backward(const CombineBackwardParams& params);
void create_mask(const CreateMaskParams& params);

}  // namespace sparseattn::reference
