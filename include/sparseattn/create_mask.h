// create_mask: the boolean top-k mask of dynamic-mask attention (flash-dmattn / flash-sparse-attention).
#pragma once

#include <cstdint>

#include "sparseattn/tensor.h"

namespace sparseattn {

// For each row (b, h, t) of bias: the visible keys are those the causal rule and the window allow (as in
// flash_attention: query t of T is aligned to key a = t + S - T; causal keeps keys <= a, the window keeps
// [a - window_left, a + window_right], a negative bound is unbounded), whose key_padding_mask[b, s] is true and
// whose bias is not NaN. The mask is true for the `keep` visible keys with the largest bias, ties broken toward
// the lower key index; all visible keys when at most `keep` are visible; a row with no visible key is all false.
// Values are ranked in float64 (exact for every input dtype). Not differentiable. CPU only today.
struct CreateMaskParams {
  TensorView bias;              // [B, H, T, S]: float16, bfloat16, float32 or float64
  TensorView key_padding_mask;  // optional bool [B, S]; true = a real key, false keys are never kept
  TensorView mask;              // out: bool [B, H, T, S]
  std::int64_t keep = 1;        // top-k count, >= 1
  bool causal = false;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  Stream stream = nullptr;
};

void create_mask(const CreateMaskParams& params);

}  // namespace sparseattn
