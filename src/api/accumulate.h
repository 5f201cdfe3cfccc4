// accumulate: the elementwise sum of same-shaped tensors. Internal: composed operations use it to add up
// contributions (nsa_attention_backward sums the gradients of its branches).
#pragma once

#include "core/accumulate_params.h"

namespace sparseattn::detail {

void accumulate(const AccumulateParams& params);

}  // namespace sparseattn::detail
