// The reference backend of the internal accumulate operation (src/api/accumulate.h).
#pragma once

#include "core/accumulate_params.h"

namespace sparseattn::reference {

void accumulate(const detail::AccumulateParams& params);

}  // namespace sparseattn::reference
