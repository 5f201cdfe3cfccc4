// selected_attention: every query attends to the tokens of its KV head's selected blocks.
#pragma once

#include <cstddef>
#include <optional>

#include "sparseattn/sequences.h"
#include "sparseattn/tensor.h"

namespace sparseattn {

// Query t of KV head h attends to the tokens at positions <= t of the blocks listed in
// indices[t, h, :] (block b covers [b*block, (b+1)*block)). Indices follow the sparse index convention:
// int32, strictly ascending, -1 padding at the tail, every index < num_selection_blocks(S).
// Query chunks (docs/semantics.md section 11): with S >= T keys per sequence, query t sits at key position
// a = t + S - T and attends to the listed blocks' tokens at positions <= a.
struct SelectedAttentionParams {
  TensorView q;        // [B, T, Hq, Dqk] or packed [N, Hq, Dqk]
  TensorView k;        // [B, S, Hkv, Dqk] or packed [Nk, Hkv, Dqk]
  TensorView v;        // [B, S, Hkv, Dv]  or packed [Nk, Hkv, Dv]
  TensorView indices;  // int32 [B, T, Hkv, n] or packed [N, Hkv, n]
  TensorView o;        // out: [B, T, Hq, Dv] or packed [N, Hq, Dv]
  TensorView lse;      // out: [B, Hq, T] or packed [Hq, N]; float32 (float64 for float64 inputs)
  Sequences seqs;      // of q
  Sequences seqs_k;    // packed chunks: the keys' sequences, S_b >= T_b (absent: seqs, S_b = T_b)
  int block = 64;  // l'
  std::optional<double> scale;
  void* workspace = nullptr;  // on q's device, 16-byte aligned, of the size the function below gives
  std::size_t workspace_bytes = 0;
  Stream stream = nullptr;
};

struct SelectedAttentionBackwardParams {
  TensorView q, k, v, indices, o, lse;  // as in the forward
  TensorView d_o;                       // like o
  TensorView dq, dk, dv;                // out: like q, k, v
  Sequences seqs;
  Sequences seqs_k;
  int block = 64;
  std::optional<double> scale;
  void* workspace = nullptr;  // on q's device, 16-byte aligned, of the size the function below gives
  std::size_t workspace_bytes = 0;
  Stream stream = nullptr;
};

// Bytes of device scratch the forward needs (0 on the CPU); depends on shapes, dtypes and device only.
std::size_t selected_attention_workspace_size(const SelectedAttentionParams& params);
void selected_attention(const SelectedAttentionParams& params);
// Bytes of device scratch the backward needs (0 on the CPU); depends on shapes, dtypes and device only.
std::size_t selected_attention_backward_workspace_size(const SelectedAttentionBackwardParams& params);
void selected_attention_backward(const SelectedAttentionBackwardParams& params);

}  // namespace sparseattn
