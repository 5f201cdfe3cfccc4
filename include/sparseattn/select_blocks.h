// select_blocks: group-shared top-n selection of key blocks from compressed-attention probabilities.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "sparseattn/sequences.h"
#include "sparseattn/tensor.h"

namespace sparseattn {

// For query t and KV head h: P[t, j] = sum over the query heads of group h of exp(s - lse) with the
// compressed-attention logits s and log-sum-exp lse; selection block b (tokens [b*sel_block,
// (b+1)*sel_block)) scores sum_j overlap_tokens(j, b) / stride * P[t, j]. Candidates are blocks with
// b*sel_block <= t; blocks 0..num_init-1 and the num_local blocks ending at floor(t/sel_block) are forced;
// the rest of the min(num_selected, candidates) slots go to the highest scores, ties to the lower index.
// Indices are written ascending, -1 padded. Not differentiable.
// Query chunks (docs/semantics.md section 11): with S >= T keys per sequence, every rule applies to query t's
// key position a = t + S - T (visible compressed blocks, candidates b*sel_block <= a, forced blocks).
struct SelectBlocksParams {
  TensorView q;        // [B, T, Hq, Dqk] or packed [N, Hq, Dqk]
  TensorView k_cmp;    // [B, Sc, Hkv, Dqk] or packed [Nc, Hkv, Dqk]; Sc = num_compressed_blocks(S)
  TensorView lse_cmp;  // [B, Hq, T] or packed [Hq, N]: compressed attention's log-sum-exp
  TensorView indices;  // out: int32 [B, T, Hkv, num_selected] or packed [N, Hkv, num_selected]
  Sequences seqs;             // of q
  Sequences seqs_k;           // packed chunks: the keys' sequences, S_b >= T_b (absent: seqs, S_b = T_b)
  std::int64_t seqlen_k = 0;  // batched chunks: S >= T keys per sequence (0: S = T)
  TensorView cu_seqlens_cmp;  // packed only: int32 [B+1], prefix sums of num_compressed_blocks(S_b)
  int cmp_block = 32;     // l
  int cmp_stride = 16;    // d; divides cmp_block and sel_block
  int sel_block = 64;     // l'; cmp_block <= sel_block
  int num_selected = 16;  // n
  int num_init = 1;       // forced initial blocks
  int num_local = 2;      // forced local blocks (the query's own block and the ones before it)
  std::optional<double> scale;  // must be the scale compressed attention used; default 1/sqrt(Dqk)
  void* workspace = nullptr;    // on q's device, 16-byte aligned, of the size the function below gives
  std::size_t workspace_bytes = 0;
  Stream stream = nullptr;
};

// Bytes of device scratch select_blocks needs (0 on the CPU): pooled scores of a bounded number of tiles,
// one row of scores per tile row, so it grows with T up to 256 MB and then stays there (fewer tiles in
// flight), never with T^2. Depends on shapes, config and device only (views may have no data).
std::size_t select_blocks_workspace_size(const SelectBlocksParams& params);
void select_blocks(const SelectBlocksParams& params);

}  // namespace sparseattn
