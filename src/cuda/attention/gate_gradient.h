// flash_attention's gate in the backward on CUDA (gate_terms.cuh): the fp32 copies of alpha and delta that the
// kernels read ([B, H, rows], packed [H, N]: a query step's or key tile's values are contiguous), the ddelta
// partials of the dK/dV kernels' head splits, and the kernels that make the copies and add the partials up.
// All of it lives in the backward's workspace, after the parts dispatch.cu lays out.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/attention/gate_terms.cuh"
#include "cuda/primitives/sequences.cuh"
#include "sparseattn/flash_attention.h"

namespace sparseattn::cuda {

struct GateGradientPlan {
  bool present = false;  // alpha and delta given
  bool ddelta = false;   // the call asks for ddelta (partials and their reduction)
  std::int64_t batch = 0;          // B (packed: 1)
  std::int64_t q_rows = 0, k_rows = 0;  // T and S (packed: Nq and Nk)
  std::int64_t q_heads = 0, kv_heads = 0;
  int head_splits = 1;
  std::size_t alpha_bytes = 0, delta_bytes = 0, partial_bytes = 0;  // each a multiple of 256
  std::size_t bytes() const { return alpha_bytes + delta_bytes + partial_bytes; }

  // The kernels' view of the gate, its copies and outputs at `workspace` (this plan's slice).
  attention::GateTerms terms(const FlashAttentionBackwardParams& params, void* workspace) const;
};

// The plan of a backward call with head_splits head splits of the dK/dV kernels; depends on shapes only.
GateGradientPlan gate_gradient_plan(const FlashAttentionBackwardParams& params, int head_splits);

// Before the backward's kernels: alpha and delta into their fp32 copies.
void prepare_gate_copies(const FlashAttentionBackwardParams& params, const GateGradientPlan& plan, void* workspace,
                         cudaStream_t stream);

// After the dK/dV kernels: ddelta = the head splits' partials summed in split order, in delta's dtype, for the keys
// of every sequence (packed rows past the sequences stay untouched).
void reduce_gate_gradient(const FlashAttentionBackwardParams& params, const GateGradientPlan& plan, void* workspace,
                          const SeqTable& keys, std::int64_t max_keys, cudaStream_t stream);

}  // namespace sparseattn::cuda
