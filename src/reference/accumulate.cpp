#include "reference/accumulate.h"

#include "reference/dense.h"
#include "reference/sequence_rows.h"

namespace sparseattn::reference {

void accumulate(const detail::AccumulateParams& params) {
  const TensorView out = covered_rows(params.out, params.cu_seqlens);
  Dense sum = Dense::zeros({out.numel()});
  for (TensorView term : params.terms) {
    term.shape[0] = out.shape[0];  // the same rows as `out`
    const Dense values = load(term);
    for (std::int64_t e = 0; e < sum.numel(); ++e) sum.values[e] += values.values[e];
  }
  store(sum, out);
}

}  // namespace sparseattn::reference
