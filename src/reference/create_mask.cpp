// create_mask on the CPU: per row of the bias, the top-k visible keys (ties to the lower index, NaN never kept).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "reference/dense.h"
#include "reference/reference.h"

namespace sparseattn::reference {

void create_mask(const CreateMaskParams& params) {
  const TensorView& out = params.mask;
  if (out.numel() == 0) return;
  const Dense bias = load(params.bias);  // exact float64 copy: the ranking is the input dtype's
  const std::int64_t batch = bias.dim(0), heads = bias.dim(1), rows = bias.dim(2), keys = bias.dim(3);
  const bool padded = params.key_padding_mask.present();
  const std::vector<std::uint8_t> padding = padded ? load_bool(params.key_padding_mask) : std::vector<std::uint8_t>{};
  auto* data = static_cast<std::uint8_t*>(out.data);

  parallel_for(batch * heads, [&](std::int64_t bh) {
    const std::int64_t b = bh / heads, h = bh % heads;
    std::vector<std::int64_t> candidates;
    candidates.reserve(static_cast<std::size_t>(keys));
    std::vector<std::uint8_t> kept(static_cast<std::size_t>(keys));
    for (std::int64_t t = 0; t < rows; ++t) {
      const double* values = bias.row(b, h, t);
      const std::int64_t aligned = t + keys - rows;  // bottom-right alignment, as flash_attention
      std::int64_t first = 0, last = keys - 1;
      if (params.causal) last = std::min(last, aligned);
      // Bounds clamped to keys + rows (beyond every key of any row), so huge windows cannot overflow.
      if (params.window_right >= 0) last = std::min(last, aligned + std::min(params.window_right, keys + rows));
      if (params.window_left >= 0) first = std::max(first, aligned - std::min(params.window_left, keys + rows));
      candidates.clear();
      for (std::int64_t s = first; s <= last; ++s) {
        if (padded && !padding[b * keys + s]) continue;
        if (std::isnan(values[s])) continue;
        candidates.push_back(s);
      }
      if (static_cast<std::int64_t>(candidates.size()) > params.keep) {
        // Larger bias first, then the lower index: a strict total order on distinct indices (no NaN left).
        const auto before = [values](std::int64_t x, std::int64_t y) {
          return values[x] > values[y] || (values[x] == values[y] && x < y);
        };
        std::nth_element(candidates.begin(), candidates.begin() + params.keep, candidates.end(), before);
        candidates.resize(static_cast<std::size_t>(params.keep));
      }
      std::fill(kept.begin(), kept.end(), std::uint8_t{0});
      for (std::int64_t s : candidates) kept[s] = 1;
      std::uint8_t* row = data + b * out.stride[0] + h * out.stride[1] + t * out.stride[2];
      for (std::int64_t s = 0; s < keys; ++s) row[s * out.stride[3]] = kept[s];
    }
  });
}

}  // namespace sparseattn::reference
