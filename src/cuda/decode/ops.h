// CUDA entry points of flash_decode; torch-free. The API (src/api/flash_decode.cpp) validates params before these
// run: bf16/fp16, head dims (Dqk, Dv) from sparseattn/head_dims.h, 16-byte aligned rows, a page size that is a
// multiple of 16, a capacity of at most kCudaDecodeMaxCapacity keys. Each function only enqueues work on
// params.stream.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sparseattn/flash_decode.h"

namespace sparseattn::cuda {

// The kernels' limit on a sequence's capacity (S, or max_pages * page_size): key positions stay in int32 with room
// for a split's end.
inline constexpr std::int64_t kCudaDecodeMaxCapacity = std::int64_t{1} << 30;

std::int64_t flash_decode_num_splits(const FlashDecodeParams& params);
std::size_t flash_decode_workspace_size(const FlashDecodeParams& params);
void flash_decode(const FlashDecodeParams& params);

}  // namespace sparseattn::cuda
