// CUDA entry points of nsa_decode; torch-free. The API (src/api/nsa_decode.cpp) validates params before these run:
// bf16/fp16, head dims (Dqk, Dv) from sparseattn/head_dims.h, 16-byte aligned rows, a group of at most 16 query
// heads per KV head, page_size and sel_block multiples of 16, a capacity of at most kNsaDecodeMaxCapacity keys.
// nsa_decode only enqueues work on params.stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "sparseattn/nsa_decode.h"

namespace sparseattn::cuda {

// Key positions and compressed-row indices stay in int32 with room for a split's end.
inline constexpr std::int64_t kNsaDecodeMaxCapacity = std::int64_t{1} << 30;

std::size_t nsa_decode_workspace_size(const NsaDecodeParams& params);
// Empty when the launches fit the device (grid sizes, shared memory), else why not.
std::string nsa_decode_launch_limit(const NsaDecodeParams& params);
void nsa_decode(const NsaDecodeParams& params);

}  // namespace sparseattn::cuda
