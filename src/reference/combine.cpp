#include "reference/dense.h"
#include "reference/reference.h"

namespace sparseattn::reference {

// Gates are [rows, heads] and outputs [rows, heads, dim] once flattened: each (row, head) pair owns one
// gate and one output row, so the flat views below serve the batched and the packed layout alike.

void combine(const CombineParams& params) {
  Dense o = Dense::zeros({params.o.numel()});
  const std::int64_t dim = params.o.shape[params.o.rank - 1];
  for (int i = 0; i < kNumBranches; ++i) {
    if (!params.gates[i].present()) continue;
    const Dense gate = load(params.gates[i]);
    const Dense out = load(params.outputs[i]);
    for (std::int64_t e = 0; e < o.numel(); ++e) o.values[e] += gate.values[e / dim] * out.values[e];
  }
  store(o, params.o);
}

void combine_backward(const CombineBackwardParams& params) {
  const Dense d_o = load(params.d_o);
  const std::int64_t dim = params.d_o.shape[params.d_o.rank - 1];
  for (int i = 0; i < kNumBranches; ++i) {
    if (!params.gates[i].present()) continue;
    const Dense gate = load(params.gates[i]);
    Dense d_out = Dense::zeros({d_o.numel()});
    for (std::int64_t e = 0; e < d_o.numel(); ++e) d_out.values[e] = gate.values[e / dim] * d_o.values[e];
    store(d_out, params.d_outputs[i]);
    if (!params.d_gates[i].present()) continue;
    const Dense out = load(params.outputs[i]);
    Dense d_gate = Dense::zeros({gate.numel()});
    for (std::int64_t e = 0; e < d_o.numel(); ++e) d_gate.values[e / dim] += d_o.values[e] * out.values[e];
    store(d_gate, params.d_gates[i]);
  }
}

}  // namespace sparseattn::reference
