// Limits of the CUDA kernels that the API checks before any launch (ErrorKind::unsupported), shared by the
// attention operations so that each limit is stated once.
#pragma once

#include <cstdint>
#include <string>

#include "api/check.h"
#include "sparseattn/sequences.h"

namespace sparseattn::detail {

// q is float16 or bfloat16 (float32 and float64 run on the CPU reference).
void check_cuda_half(const Check& check, const TensorView& q);

// (Dqk, Dv) is one of the pairs with kernels (sparseattn/head_dims.h); names v when Dqk alone is fine.
void check_cuda_head_dims(const Check& check, std::int64_t dim_qk, std::int64_t dim_v);

// t's rows can be copied in 16-byte pieces (cp.async): 16-byte aligned data and every stride but the
// innermost a multiple of 8 elements. Absent tensors pass.
void check_cuda_rows(const Check& check, const TensorView& t, const std::string& arg);

// The longest sequence of t (batched: T; packed: seqs.max_seqlen where given, else N) fits the attention
// kernels' grids: at most kCudaMaxTokens tokens (65535 tiles of 64 rows in a grid's y dimension).
inline constexpr std::int64_t kCudaMaxTokens = std::int64_t{65535} * 64;
void check_cuda_length(const Check& check, const TensorView& t, const Sequences& seqs, const std::string& arg);

}  // namespace sparseattn::detail
