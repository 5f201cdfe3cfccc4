// How one nsa_attention call runs: its validated shapes, which steps run, and where every intermediate
// lives in the caller's workspace and scratch. nsa_attention, nsa_attention_backward and the two size
// queries all go through these functions, so the sizes they compute cannot disagree.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "api/block_checks.h"
#include "api/check.h"
#include "sparseattn/nsa_attention.h"

namespace sparseattn::detail {

struct NsaPlan {
  TokenLayout layout;                // of q, o and the gates
  ChunkKeys keys;                    // of k and v: S_b >= T_b keys per sequence (docs/semantics.md section 11)
  DType dtype = DType::float32;      // of every float tensor and intermediate
  DType lse_dtype = DType::float32;  // of the log-sum-exps
  DeviceType device = DeviceType::cpu;
  int device_index = 0;
  std::int64_t heads_q = 0, heads_kv = 0, dim_qk = 0, dim_v = 0;
  std::int64_t cmp_rows = 0;      // first dimension of compressed K/V: Sc (batched) or Nc (packed)
  std::int64_t num_selected = 0;  // slots per row of the indices selected attention reads
  std::array<bool, kNumBranches> branch{};  // which gates are given
  bool user_cmp = false;                    // k_cmp and v_cmp come from the caller
  bool run_compression = false;             // mean pooling into the workspace
  bool run_compressed_attention = false;    // for the compressed branch or for selection
  bool run_selection = false;               // the selected branch without user block_indices
  NsaRecompute recompute = NsaRecompute::none;
  std::array<bool, kNumBranches> recompute_output{};  // the present branches whose output the backward recomputes
  bool recomputes = false;                            // any of them
  // CUDA with recomputation: the recomputed outputs go into the caller's dq before the branch backwards write it
  // (those read no o: they get each branch's delta), instead of a scratch buffer. Needs Dqk >= Dv.
  bool outputs_in_dq = false;
  // Batched layout with recomputation: the branch whose forward writes its output into the caller's o (the last
  // one recomputed; combine then reads it there and writes the result over it, element by element). -1: none.
  int output_in_o = -1;
};

// Validates everything nsa_attention needs: config, shapes, dtypes, devices and strides; with
// `read_contents`, also data pointers and (on the CPU) the contents of cu_seqlens, cu_seqlens_cmp and
// block_indices. The size queries pass false: they may be called with shape-only views (null data).
NsaPlan plan_nsa(const Check& check, const NsaParams& params, bool read_contents);

// The forward's intermediates. Views are absent where a step does not run. The workspace holds what the backward
// reads again; with recomputation the recomputed branch outputs (and what only the forward reads) are carved from
// the forward's scratch instead, or are the caller's o (NsaPlan::output_in_o).
struct NsaWorkspace {
  TensorView k_cmp, v_cmp;                         // when compression runs
  std::array<TensorView, kNumBranches> o, lse;     // [0] when compressed attention runs, others per gate
  TensorView indices;                              // when selection runs
  TensorView combined;  // packed layout: combine's output, whose rows of sequences are then copied to o
                        // (combine writes every row; rows past cu_seqlens[B] of o must stay untouched)
  // uint8: the workspace of select_blocks and then selected_attention, in the sliding window's output slice
  // when that is large enough (the window runs after them), else in the caller's forward scratch: it is not
  // kept for the backward.
  TensorView step_workspace;
  // What the steps leave unwritten, as float16 views the forward zero-fills so that every byte of the
  // workspace is deterministic: the alignment gaps after the slices and, for the packed layout (whose rows
  // outside the sequences no step writes), the whole workspace.
  std::vector<TensorView> unwritten;
  TensorView whole;
  std::size_t bytes = 0;
  std::size_t scratch_bytes = 0;  // the forward scratch: the step workspace where the window's output slice cannot
                                  // hold it, and with recomputation the intermediates not kept
};

// The backward's temporaries. The branches run one after another, so on the CPU one output-gradient buffer
// serves them all (on CUDA each branch's gate is folded into its backward: branch_backward.h); the last branch
// writes its dq straight into the caller's dq, which then adds the others.
struct NsaScratch {
  TensorView d_o;  // CPU: the output gradient of the branch running now
  // CUDA, per gate: float32 like lse, the branch's delta and its gate (branch_backward.h)
  std::array<TensorView, kNumBranches> deltas, d_o_scales;
  std::array<TensorView, kNumBranches> dq;          // CPU, per gate but the last: the branch's dq
  std::array<TensorView, kNumBranches> dk, dv;      // per gate but the compressed one: the branch's
                                                    // contribution (the pooling's goes straight into dk, dv)
  // CUDA: the branch (1 or 2, the last present one) whose dk/dv go straight into the caller's dk/dv, which the
  // final sum then reads in place; its dk/dv above are shape-only views (no bytes). -1 on the CPU (the reference's
  // pooling gradient overwrites dk before it adds the terms).
  int kv_direct = -1;
  TensorView dk_cmp, dv_cmp;                        // compressed branch with pooled K/V: their gradient
  std::array<TensorView, kNumBranches> d_gates;     // packed layout, per gate: combine_backward's gate
                                                    // gradient, copied to the caller's like `combined`
  // With recomputation: the output (unless NsaPlan::outputs_in_dq) and log-sum-exp of the branch recomputed last
  // (one buffer for all branches: they run in order).
  TensorView o, lse;
  TensorView recomputed;  // float16 view of the bytes of o and lse (zero-filled before each recomputation into o,
                          // packed)
  TensorView branch_workspace;  // uint8: the workspace of each branch's backward in turn (they run in order) and,
                                // when it is recomputed, of the selected branch's forward
  std::size_t bytes = 0;
};

// Views carved from `base` (null: sizes only, views with null data). Slices start at 256-byte offsets
// from `base`, which must be 16-byte aligned (checked by nsa_attention).
// `step_workspace_bytes`: the largest workspace a forward step asks for (0 while sizing); `scratch`: the
// forward scratch that holds it where the window's output slice does not, and the intermediates not kept (null:
// sizes only); `o`: the caller's output (NsaPlan::output_in_o).
NsaWorkspace nsa_workspace(const NsaPlan& plan, void* base, std::size_t step_workspace_bytes, void* scratch,
                           const TensorView& o);
// `branch_workspace_bytes`: the largest workspace a branch's backward asks for (0 while sizing).
NsaScratch nsa_scratch(const NsaPlan& plan, void* base, std::size_t branch_workspace_bytes);

}  // namespace sparseattn::detail
