#include "core/token_layout.h"

namespace sparseattn::detail {

std::vector<std::int64_t> TokenLayout::tokens(std::int64_t heads, std::int64_t dim) const {
  if (packed) return {rows, heads, dim};
  return {batch, rows, heads, dim};
}

std::vector<std::int64_t> TokenLayout::lse(std::int64_t heads) const {
  if (packed) return {heads, rows};
  return {batch, heads, rows};
}

std::vector<std::int64_t> TokenLayout::per_head(std::int64_t heads) const {
  if (packed) return {rows, heads};
  return {batch, rows, heads};
}

}  // namespace sparseattn::detail
