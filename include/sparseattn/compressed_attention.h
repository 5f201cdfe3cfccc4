// compressed_attention: every query attends to the compressed blocks that end at or before it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "sparseattn/sequences.h"
#include "sparseattn/tensor.h"

namespace sparseattn {

// Query t sees compressed block j iff j*stride + block - 1 <= t. A query that sees no block returns
// o = 0 and lse = -inf and gets no gradient.
// Query chunks (docs/semantics.md section 11): with S >= T keys per sequence (the compressed blocks are those
// of the S keys), query t sits at key position a = t + S - T and sees block j iff j*stride + block - 1 <= a.
struct CompressedAttentionParams {
  TensorView q;      // [B, T, Hq, Dqk] or packed [N, Hq, Dqk]
  TensorView k_cmp;  // [B, Sc, Hkv, Dqk] or packed [Nc, Hkv, Dqk]; Sc = num_compressed_blocks(S)
  TensorView v_cmp;  // [B, Sc, Hkv, Dv]  or packed [Nc, Hkv, Dv]
  TensorView o;      // out: [B, T, Hq, Dv] or packed [N, Hq, Dv]
  TensorView lse;    // out: [B, Hq, T] or packed [Hq, N]; float32 (float64 for float64 inputs)
  Sequences seqs;             // of q
  Sequences seqs_k;           // packed chunks: the keys' sequences, S_b >= T_b (absent: seqs, S_b = T_b)
  std::int64_t seqlen_k = 0;  // batched chunks: S >= T keys per sequence (0: S = T)
  TensorView cu_seqlens_cmp;  // packed only: int32 [B+1], prefix sums of num_compressed_blocks(S_b)
  int block = 32;
  int stride = 16;
  std::optional<double> scale;  // default 1/sqrt(Dqk)
  Stream stream = nullptr;
};

struct CompressedAttentionBackwardParams {
  TensorView q, k_cmp, v_cmp, o, lse;  // as in the forward (o and lse are the forward's outputs)
  TensorView d_o;                      // [B, T, Hq, Dv] or packed [N, Hq, Dv]
  TensorView dq;                       // out: like q
  TensorView dk_cmp;                   // out: like k_cmp
  TensorView dv_cmp;                   // out: like v_cmp
  Sequences seqs;
  Sequences seqs_k;           // as in the forward
  std::int64_t seqlen_k = 0;  // as in the forward
  TensorView cu_seqlens_cmp;
  int block = 32;
  int stride = 16;
  std::optional<double> scale;
  void* workspace = nullptr;  // on q's device, 16-byte aligned, of the size the function below gives
  std::size_t workspace_bytes = 0;
  Stream stream = nullptr;
};

void compressed_attention(const CompressedAttentionParams& params);
// Bytes of device scratch the backward needs (0 on the CPU); depends on shapes, dtypes and device only.
std::size_t compressed_attention_backward_workspace_size(const CompressedAttentionBackwardParams& params);
void compressed_attention_backward(const CompressedAttentionBackwardParams& params);

}  // namespace sparseattn
