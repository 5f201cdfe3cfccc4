// Checks shared by the NSA operations: block-size arithmetic of the config and the shape of compressed K/V.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "api/check.h"

namespace sparseattn::detail {

// Compression blocks: both sizes positive and `stride` divides `block` (ErrorKind::config).
void check_compression(const Check& check, std::int64_t block, const std::string& block_arg, std::int64_t stride,
                       const std::string& stride_arg);

// The block arithmetic of selection, shared by select_blocks and nsa_attention.
struct SelectionConfig {
  std::int64_t cmp_block = 0;
  std::int64_t cmp_stride = 0;
  std::int64_t sel_block = 0;
  std::int64_t num_selected = 0;
  std::int64_t num_init = 0;
  std::int64_t num_local = 0;
};

// ErrorKind::config naming the field: cmp_stride divides cmp_block and sel_block, cmp_block <= sel_block,
// num_selected >= 1, num_init >= 0, num_local >= 0, num_init + num_local <= num_selected.
void check_selection_config(const Check& check, const SelectionConfig& config);

// The first dimension of compressed K/V: num_compressed_blocks(T) for the batched layout; for the packed
// layout the rows of `cmp` itself (which must then have 3 dimensions).
std::int64_t compressed_rows(const Check& check, const TokenLayout& tokens, const TensorView& cmp,
                             const std::string& arg, std::int64_t block, std::int64_t stride);

// [B, rows, heads, dim] or packed [rows, heads, dim].
std::vector<std::int64_t> compressed_shape(const TokenLayout& tokens, std::int64_t rows, std::int64_t heads,
                                           std::int64_t dim);

}  // namespace sparseattn::detail
