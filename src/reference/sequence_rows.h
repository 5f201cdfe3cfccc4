// The rows of a packed output that the reference backend may write.
#pragma once

#include "reference/dense.h"

namespace sparseattn::reference {

// The part of an output that belongs to sequences: all of a batched tensor (absent cu_seqlens); the rows
// before cu_seqlens[B] of a packed one, so that the rows after it are left untouched.
inline TensorView covered_rows(TensorView t, const TensorView& cu_seqlens) {
  if (cu_seqlens.present()) t.shape[0] = load_int32(cu_seqlens).back();
  return t;
}

}  // namespace sparseattn::reference
