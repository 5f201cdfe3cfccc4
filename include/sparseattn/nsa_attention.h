// nsa_attention: the whole Native Sparse Attention pipeline as one call (compression, compressed attention,
// block selection, selected attention, sliding window, gated combination), forward and backward.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "sparseattn/combine.h"
#include "sparseattn/sequences.h"
#include "sparseattn/tensor.h"

namespace sparseattn {

// Defaults are the NSA paper's: l = 32, d = 16, l' = 64, n = 16, 1 initial and 2 local blocks, w = 512.
struct NsaConfig {
  int cmp_block = 32;          // l: tokens per compressed block
  int cmp_stride = 16;         // d: distance between compressed blocks; divides l and l'
  int sel_block = 64;          // l': tokens per selection block; l <= l'
  int num_selected = 16;       // n: selected blocks per query and KV head (forced ones included)
  int num_init = 1;            // forced initial blocks
  int num_local = 2;           // forced local blocks
  std::int64_t window = 512;   // w: sliding-window width, the query included
  std::optional<double> scale; // default 1/sqrt(Dqk); one scale for all three branches
};

// What the forward keeps for the backward (docs/perf/2026-11-27-nsa-memory-budget.md gives the bytes per token).
//  - none: the three branch outputs, their log-sum-exps, the selected block indices and the pooled compressed
//    K/V (at 64/4 heads, D = 128, bf16: about 50 KB per token).
//  - branches: only what the backward cannot cheaply recompute: the log-sum-exps of the present branches, the
//    indices and the pooled compressed K/V (about 1.2 KB per token). The branch outputs live in the forward's
//    scratch (batched layout: the last present branch writes its output into `o`, which must then be
//    contiguous, and combine turns it into the result in place), and the backward recomputes each branch's
//    output with the same call, one branch at a time, into one buffer: on the CPU scratch memory, just before that
//    branch's backward; on CUDA dq's memory where Dqk >= Dv (dq must then be contiguous), for the branch's delta
//    and gate gradient, before any branch backward writes dq (they read no output on CUDA). Outputs and gradients
//    are bit-identical to `none` (deterministic kernels, same order).
//  - selected_and_window: as `branches` for the selected and sliding-window outputs; the compressed branch's output
//    (whose forward costs the most to run again at long T) is kept (about 17.6 KB per token).
// The backward must get the mode its forward ran with (the workspace layout depends on it).
enum class NsaRecompute { none, branches, selected_and_window };

// Branch order of `gates` (and of combine's arrays): compressed, selected, sliding window.
// A branch whose gate is absent is skipped (compressed attention still runs when selection needs it).
// Query chunks (docs/semantics.md section 11): k and v may hold S >= T keys per sequence; query t then sits
// at key position a = t + S - T and its row is the full call's row a (T = S) on the same keys.
struct NsaParams {
  TensorView q;              // [B, T, Hq, Dqk] or packed [N, Hq, Dqk]
  TensorView k;              // [B, S, Hkv, Dqk] or packed [Nk, Hkv, Dqk]
  TensorView v;              // [B, S, Hkv, Dv]  or packed [Nk, Hkv, Dv]
  TensorView k_cmp, v_cmp;   // optional, both or neither: user-supplied compressed K/V (else mean pooling),
                             // [B, Sc, Hkv, D] or packed [Nc, Hkv, D] laid out by cu_seqlens_cmp
  TensorView block_indices;  // optional: user-supplied selection, int32 [B, T, Hkv, n] (skips selection)
  std::array<TensorView, kNumBranches> gates;  // [B, T, Hq] or packed [N, Hq]
  TensorView o;              // out: [B, T, Hq, Dv] or packed [N, Hq, Dv]
  Sequences seqs;            // of q (and of k without seqs_k)
  Sequences seqs_k;          // packed chunks: the keys' sequences, S_b >= T_b (absent: seqs)
  TensorView cu_seqlens_cmp;  // packed only: int32 [B+1], prefix sums of num_compressed_blocks(S_b)
  NsaConfig config;
  NsaRecompute recompute = NsaRecompute::none;  // what the workspace keeps for the backward (see above)
  void* workspace = nullptr;  // on q's device, 16-byte aligned, nsa_workspace_size(params) bytes, any
                              // contents (every byte is written: deterministic); the backward reads it
  std::size_t workspace_bytes = 0;
  void* scratch = nullptr;    // on q's device, 16-byte aligned, nsa_forward_scratch_size(params) bytes (often 0):
                              // temporary memory of the forward, free again once it returns
  std::size_t scratch_bytes = 0;
  Stream stream = nullptr;
};

struct NsaBackwardParams {
  NsaParams forward;          // as passed to nsa_attention (workspace unchanged since; scratch not read; o is
                              // not read either, only its shape and dtype are checked: d_o may stand in for it)
  TensorView d_o;             // like o
  TensorView dq, dk, dv;      // out: like q, k, v
  TensorView dk_cmp, dv_cmp;  // out iff k_cmp/v_cmp were supplied: like them
  std::array<TensorView, kNumBranches> d_gates;  // out, optional for each present gate: like the gate
  void* scratch = nullptr;    // on q's device, 16-byte aligned, nsa_backward_scratch_size(forward) bytes
  std::size_t scratch_bytes = 0;
};

// Bytes of the workspace nsa_attention fills and nsa_attention_backward reads (intermediate outputs,
// log-sum-exps and indices). Depends on shapes, dtypes, config, the recompute mode and which branches/inputs are
// present.
std::size_t nsa_workspace_size(const NsaParams& params);
// Bytes of temporary memory nsa_attention needs besides the workspace: the working memory of block selection
// and of the selected attention where the sliding window's output slice cannot hold it; with
// NsaRecompute::branches also the branch outputs the workspace does not keep.
std::size_t nsa_forward_scratch_size(const NsaParams& params);
// Bytes of temporary memory nsa_attention_backward needs beyond the forward workspace (with recomputation: a
// recomputed log-sum-exp and, on the CPU, one branch output).
std::size_t nsa_backward_scratch_size(const NsaParams& params);

void nsa_attention(const NsaParams& params);
void nsa_attention_backward(const NsaBackwardParams& params);

}  // namespace sparseattn
