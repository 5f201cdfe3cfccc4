// flash_attention: dense attention with causal/window masking, broadcastable mask and bias, GQA and varlen.
// NSA's sliding-window branch is this operation with causal = true, window_left = w - 1.
#pragma once

#include <cstdint>
#include <cstddef>
#include <optional>

#include "sparseattn/sequences.h"
#include "sparseattn/tensor.h"

namespace sparseattn {

// s = scale * q.k + bias, kept where mask is true, the causal rule and the window allow; o = softmax(s) v.
// Query t of a sequence with T queries and S keys is aligned to key position a = t + S - T (bottom-right,
// as FlashAttention): causal keeps keys <= a; the window keeps keys in [a - window_left, a + window_right]
// (a negative bound means unbounded). A row with no kept key returns o = 0 and lse = -inf.
// mask and bias (CPU and CUDA) broadcast as [B|1, Hq|Hkv|1, T|1, S] in the batched layout; packed, they take the row
// form [Hm|1, Nq|1, Lk] (column j: key j of the row's own sequence; Lk >= every key count, on CUDA >=
// seqs_k.max_seqlen, which is then required) or the key form [Hm|1, Nk] (entry m: packed key m for every query of
// its sequence), told apart by rank; Hm is Hq, Hkv or 1. With Hkv heads, query head h uses mask/bias head
// h / (Hq / Hkv). A packed dbias leaves the entries no sequence reads untouched. On CUDA, dbias is summed in fp32
// through the backward's workspace in a fixed order (deterministic, no atomics).
//
// Gated attention and thresholds, see docs/semantics.md section 8: with alpha [B, T, Hq] and delta [B, S, Hkv] the
// logits are scale * (q.k + g), g = logsigmoid(alpha_t * delta_s) (GateMode::logsigmoid) or alpha_t * delta_s
// (GateMode::product). The gate runs on the CPU and on CUDA (forward and backward, both kernel families, every head
// dim; alpha and delta of q's dtype or float32, any strides; on CUDA dalpha and ddelta are summed in fp32 in a
// fixed order, deterministic, and the backward's workspace holds fp32 copies of alpha and delta). The gate
// threshold is CPU only here (CUDA tensors raise ErrorKind::unsupported naming it); the Python function takes it on
// CUDA by passing its decisions as the tile map `blocks` (python/sparseattn/_tiles.py). softmax_threshold runs in
// the CUDA forward when threshold_block is the forward kernel's (query tile, key tile) (128 x 128 on sm_90a for
// head dims up to (192, 128); the mma.sync kernels' tiles otherwise, see FlashAttentionParams::threshold_tiles;
// other sizes raise ErrorKind::unsupported naming threshold_block): the kernel decides per key tile and records
// its decisions in threshold_tiles; the CUDA backward takes those decisions as the tile map `blocks` instead of the
// threshold (softmax_threshold there raises ErrorKind::unsupported).
// gate_threshold skips a (query tile, key tile) pair whose upper bound on g is below it; softmax_threshold (tau in
// (0, 1]) skips a key tile whose largest logit is below every row's running maximum + log(tau_row). Tiles are
// threshold_block_q queries x threshold_block_k keys, aligned to each sequence's start; the result depends on them.
enum class GateMode { logsigmoid, product };

// The gate and threshold settings the forward and the backward share (plain data).
struct FlashGateOptions {
  TensorView alpha;  // optional, dtype of q or float32: [B, T, Hq] or packed [Nq, Hq]
  TensorView delta;  // optional (with alpha), dtype of q or float32: [B, S, Hkv] or packed [Nk, Hkv]
  GateMode gate = GateMode::logsigmoid;
  std::optional<double> gate_threshold;     // needs alpha and delta; finite
  std::optional<double> softmax_threshold;  // tau in (0, 1]
  std::int64_t threshold_block_q = 128;     // tile sizes of both thresholds, positive
  std::int64_t threshold_block_k = 128;
};

// Block-sparse masks, docs/semantics.md section 8: which (query tile, key tile) pairs exist, tiles of block_q
// queries x block_k keys aligned to each sequence's first query and key. Either a dense tile mask or
// FlexAttention's lists, not both. Batched, the batch index is b; packed, it counts sequences (B =
// len(cu_seqlens) - 1). Hb is Hq, Hkv or 1; nQ and nK are at least every sequence's tile count (packed on CUDA:
// ceil(max_seqlen / block), max_seqlen_q and max_seqlen_k then required). A key of an absent tile is hidden (AND
// with every other rule); a key of a full tile does not read the element mask. The dense tile map is bool (true =
// the tile exists) or uint8 tile states: 0 absent, 1 exists, 2 exists and full (the element mask is not read, as
// FlexAttention's full lists). CPU: either form. CUDA: the dense map only (the lists raise ErrorKind::unsupported);
// the kernels skip a kernel tile whose overlapped tiles are all absent (no loads, no MMAs) at any block sizes.
struct FlashBlockMask {
  TensorView block_mask;          // optional bool or uint8 [B|1, Hb|1, nQ, nK]: the tile map above
  TensorView kv_num_blocks;       // optional int32 [B|1, Hb|1, nQ]: query tile i lists kv_num_blocks[.., i] tiles
  TensorView kv_indices;          // int32 [B|1, Hb|1, nQ, maxK]: strictly ascending key tiles, past the count ignored
  TensorView full_kv_num_blocks;  // optional (with full_kv_indices): full tiles, disjoint from the partial ones
  TensorView full_kv_indices;
  std::int64_t block_q = 0;  // tile sizes, positive; required when any of the tensors is given
  std::int64_t block_k = 0;

  bool present() const {
    return block_mask.present() || kv_num_blocks.present() || kv_indices.present() ||
           full_kv_num_blocks.present() || full_kv_indices.present();
  }
};

// Per-head windows (CPU and CUDA, forward and backward): optional int32 [Hq] tensors on q's device (any stride)
// replacing window_left / window_right for their side (which must then stay -1); query head h keeps keys in
// [a - left[h], a + right[h]], -1 meaning unbounded. The CPU rejects entries below -1; on CUDA the entries stay on
// the device (no host synchronisation, no check of their values) and a negative entry is unbounded. On CUDA each
// kernel CTA reads its query head's bounds, so tile skipping follows every head's own window (the dK/dV kernels
// skip a head's query tiles outside its window).
struct FlashHeadWindows {
  TensorView left;
  TensorView right;

  bool present() const { return left.present() || right.present(); }
};

struct FlashAttentionParams {
  TensorView q;     // [B, T, Hq, Dqk] or packed [Nq, Hq, Dqk]
  TensorView k;     // [B, S, Hkv, Dqk] or packed [Nk, Hkv, Dqk]
  TensorView v;     // [B, S, Hkv, Dv]  or packed [Nk, Hkv, Dv]
  TensorView mask;  // optional bool [B|1, Hq|Hkv|1, T|1, S], packed [Hm|1, Nq|1, Lk] or [Hm|1, Nk]; true = keep
  TensorView bias;  // optional, dtype of q, shaped like mask
  TensorView o;     // out: [B, T, Hq, Dv] or packed [Nq, Hq, Dv]
  TensorView lse;   // out: [B, Hq, T] or packed [Hq, Nq]; float32 (float64 for float64 inputs)
  Sequences seqs_q;
  Sequences seqs_k;  // packed: cu_seqlens of the keys (both present or both absent)
  bool causal = false;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  std::optional<double> scale;
  FlashGateOptions gates;
  FlashBlockMask blocks;
  FlashHeadWindows head_windows;
  // Optional test diagnostic, int64 [1] on q's device: the CUDA kernels add the query x key elements of the kernel
  // tiles they compute (query rows x keys of each tile, clipped to the sequence; absent tiles skipped), one
  // atomicAdd per CTA; the backward adds its dQ and dK/dV kernels' counts (twice the forward's). Not written on
  // the CPU. Absent: no cost.
  TensorView work_counter;
  // Out, CUDA with gates.softmax_threshold (required there, absent otherwise): uint8 [B, Hq, nQ, nK], contiguous,
  // B counting sequences when packed, nQ and nK at least ceil(longest sequence / threshold_block) (packed:
  // max_seqlen_q / max_seqlen_k when given, else the packed rows). Every entry is written: 1 where the forward
  // kept the (query tile, key tile) pair of query head h, 0 where the threshold skipped it or no key of the pair
  // is visible. Passed to the backward as blocks.block_mask (with block_q, block_k = threshold_block), it makes
  // dQ, dK and dV follow the forward's decisions. The tile sizes the kernels take: threshold_tile_sizes below.
  TensorView threshold_tiles;
  Stream stream = nullptr;
};

// The (query tile, key tile) sizes the CUDA forward decides softmax_threshold in for these params (q, k, v and
// the optional terms as given; the kernel family that the device and build run), which threshold_block must equal;
// (0, 0) for CPU tensors, or where the head dims or dtype do not run on CUDA.
struct FlashThresholdTiles {
  std::int64_t block_q = 0, block_k = 0;
};
FlashThresholdTiles flash_attention_threshold_tiles(const FlashAttentionParams& params);

struct FlashAttentionBackwardParams {
  TensorView q, k, v, mask, bias, o, lse;  // as in the forward
  TensorView d_o;                          // like o
  TensorView dq, dk, dv;                   // out: like q, k, v
  TensorView dbias;  // optional out: the gradient of bias, reduced to bias's own (broadcast) shape
  TensorView dalpha;  // optional out (needs alpha): like gates.alpha
  TensorView ddelta;  // optional out (needs delta): like gates.delta, summed over each group's query heads
  Sequences seqs_q;
  Sequences seqs_k;
  bool causal = false;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  std::optional<double> scale;
  FlashGateOptions gates;  // as in the forward
  FlashBlockMask blocks;   // as in the forward
  FlashHeadWindows head_windows;
  TensorView work_counter;  // as in the forward
  void* workspace = nullptr;  // on q's device, 16-byte aligned, of the size the function below gives
  std::size_t workspace_bytes = 0;
  Stream stream = nullptr;
};

void flash_attention(const FlashAttentionParams& params);
// Bytes of device scratch the backward needs (0 on the CPU); depends on shapes, dtypes and device only.
std::size_t flash_attention_backward_workspace_size(const FlashAttentionBackwardParams& params);
void flash_attention_backward(const FlashAttentionBackwardParams& params);

}  // namespace sparseattn
