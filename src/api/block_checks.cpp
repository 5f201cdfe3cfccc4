#include "api/block_checks.h"

namespace sparseattn::detail {

void check_compression(const Check& check, std::int64_t block, const std::string& block_arg, std::int64_t stride,
                       const std::string& stride_arg) {
  check.positive(block, block_arg);
  check.positive(stride, stride_arg);
  check.require(block % stride == 0, ErrorKind::config, stride_arg,
                "must divide " + block_arg + " (" + std::to_string(block) + "), got " + std::to_string(stride));
}

void check_selection_config(const Check& check, const SelectionConfig& config) {
  check_compression(check, config.cmp_block, "cmp_block", config.cmp_stride, "cmp_stride");
  check.positive(config.sel_block, "sel_block");
  check.require(config.sel_block % config.cmp_stride == 0, ErrorKind::config, "cmp_stride",
                "must divide sel_block (" + std::to_string(config.sel_block) + "), got " +
                    std::to_string(config.cmp_stride));
  check.require(config.cmp_block <= config.sel_block, ErrorKind::config, "sel_block",
                "must be at least cmp_block (" + std::to_string(config.cmp_block) + "), got " +
                    std::to_string(config.sel_block));
  check.positive(config.num_selected, "num_selected");
  check.require(config.num_init >= 0, ErrorKind::config, "num_init",
                "expected a value >= 0, got " + std::to_string(config.num_init));
  check.require(config.num_local >= 0, ErrorKind::config, "num_local",
                "expected a value >= 0, got " + std::to_string(config.num_local));
  check.require(config.num_init + config.num_local <= config.num_selected, ErrorKind::config, "num_selected",
                "must be at least num_init + num_local (" + std::to_string(config.num_init + config.num_local) +
                    "), got " + std::to_string(config.num_selected));
}

std::int64_t compressed_rows(const Check& check, const TokenLayout& tokens, const TensorView& cmp,
                             const std::string& arg, std::int64_t block, std::int64_t stride) {
  if (!tokens.packed) return num_compressed_blocks(tokens.rows, block, stride);
  check.require(cmp.rank == 3, ErrorKind::shape, arg,
                "expected 3 dimensions [Nc, H, D] with the packed layout, got " + cmp.shape_string());
  return cmp.shape[0];
}

std::vector<std::int64_t> compressed_shape(const TokenLayout& tokens, std::int64_t rows, std::int64_t heads,
                                           std::int64_t dim) {
  if (tokens.packed) return {rows, heads, dim};
  return {tokens.batch, rows, heads, dim};
}

}  // namespace sparseattn::detail
