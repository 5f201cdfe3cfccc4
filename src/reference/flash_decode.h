// The CPU reference of flash_decode: gathers each sequence's cache rows and runs flash_attention's reference on
// them (packed layout, float64), so the two operations share one definition of the result.
#pragma once

#include "sparseattn/flash_decode.h"

namespace sparseattn::reference {

// Takes already-validated params (src/api/flash_decode.cpp; cache_seqlens and block_table contents included).
void flash_decode(const FlashDecodeParams& params);

}  // namespace sparseattn::reference
