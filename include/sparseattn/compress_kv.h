// compress_kv: mean-pool keys and values over overlapping blocks (NSA's compression branch input).
#pragma once

#include "sparseattn/sequences.h"
#include "sparseattn/tensor.h"

namespace sparseattn {

// Compressed block j of a sequence covers tokens [j*stride, j*stride + block); k_cmp[j] is the fp32 mean
// of k over those tokens, rounded once to the output dtype (the same for v).
struct CompressKvParams {
  TensorView k;      // [B, S, Hkv, Dqk] or packed [N, Hkv, Dqk]
  TensorView v;      // [B, S, Hkv, Dv]  or packed [N, Hkv, Dv]
  TensorView k_cmp;  // out: [B, num_compressed_blocks(S), Hkv, Dqk] or packed [Nc, Hkv, Dqk]
  TensorView v_cmp;  // out: [B, num_compressed_blocks(S), Hkv, Dv]  or packed [Nc, Hkv, Dv]
  Sequences seqs;                // of k and v
  TensorView cu_seqlens_cmp;     // packed only: int32 [B+1], prefix sums of num_compressed_blocks(T_b)
  int block = 32;                // l
  int stride = 16;               // d; must divide block
  Stream stream = nullptr;
};

struct CompressKvBackwardParams {
  TensorView dk_cmp;  // [B, Sc, Hkv, Dqk] or packed [Nc, Hkv, Dqk]
  TensorView dv_cmp;  // [B, Sc, Hkv, Dv]  or packed [Nc, Hkv, Dv]
  TensorView dk;      // out: like k (rows of tokens covered by no block get 0)
  TensorView dv;      // out: like v
  Sequences seqs;
  TensorView cu_seqlens_cmp;
  int block = 32;
  int stride = 16;
  Stream stream = nullptr;
};

void compress_kv(const CompressKvParams& params);
void compress_kv_backward(const CompressKvBackwardParams& params);

}  // namespace sparseattn
