// Where the tokens of a set of sequences live, and the shapes of the tensors laid out over them. Shared by the
// API's validation and the backends.
#pragma once

#include <cstdint>
#include <vector>

namespace sparseattn::detail {

// Batched: `rows` is T. Packed: `batch` is B from cu_seqlens and `rows` is N, the first dimension of the packed
// tensors.
struct TokenLayout {
  bool packed = false;
  std::int64_t batch = 0;
  std::int64_t rows = 0;
  // The token-tensor shape [B, T, heads, dim] or packed [N, heads, dim].
  std::vector<std::int64_t> tokens(std::int64_t heads, std::int64_t dim) const;
  // The log-sum-exp shape [B, heads, T] or packed [heads, N].
  std::vector<std::int64_t> lse(std::int64_t heads) const;
  // The gate shape [B, T, heads] or packed [N, heads].
  std::vector<std::int64_t> per_head(std::int64_t heads) const;
};

}  // namespace sparseattn::detail
