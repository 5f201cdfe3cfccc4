#include "sparseattn/flash_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <string>
#include <vector>

#include "api/branch_backward.h"
#include "api/check.h"
#include "api/cuda_limits.h"
#include "reference/reference.h"
#include "sparseattn/head_dims.h"
#ifdef SPARSEATTN_WITH_CUDA
#include "cuda/attention/ops.h"
#endif

namespace sparseattn {

namespace {

using detail::int32_at;

struct FlashShapes {
  detail::TokenLayout layout_q, layout_k;
  std::int64_t q_heads = 0, kv_heads = 0, dim_qk = 0, dim_v = 0;

  // The shape of a key-side token tensor: batched key tensors share q's batch size.
  std::vector<std::int64_t> key_tokens(std::int64_t heads, std::int64_t dim) const {
    std::vector<std::int64_t> shape = layout_k.tokens(heads, dim);
    if (!layout_k.packed) shape[0] = layout_q.batch;
    return shape;
  }
};

// mask and bias: batched, 4-D broadcast as [B|1, Hq|Hkv|1, T|1, S]; packed, the row form [Hm|1, Nq|1, Lk]
// (Lk at least every sequence's key count: from cu_seqlens on the CPU, max_seqlen_k on CUDA) or the key form
// [Hm|1, Nk], told apart by rank (docs/semantics.md section 8).
void check_broadcast(const detail::Check& check, const TensorView& t, const std::string& arg, DType dtype,
                     const TensorView& q, const FlashShapes& shapes, std::int64_t longest_keys,
                     std::int64_t max_seqlen_k) {
  if (!t.present()) return;
  check.tensor(t, arg, dtype, q, "q");
  const std::int64_t batch = shapes.layout_q.batch, rows = shapes.layout_q.rows, keys = shapes.layout_k.rows;
  const std::string heads = std::to_string(shapes.q_heads) + "|" + std::to_string(shapes.kv_heads) + "|1";
  if (shapes.layout_q.packed) {
    const bool heads_ok = t.rank >= 2 && t.rank <= 3 &&
                          (t.shape[0] == shapes.q_heads || t.shape[0] == shapes.kv_heads || t.shape[0] == 1);
    const std::string expected = "expected the row form [Hm|1, Nq|1, Lk] = [" + heads + ", " + std::to_string(rows) +
                                 "|1, Lk] or the key form [Hm|1, Nk] = [" + heads + ", " + std::to_string(keys) +
                                 "] with the packed layout, got " + t.shape_string();
    check.require(heads_ok, ErrorKind::shape, arg, expected);
    if (t.rank == 2) {
      check.require(t.shape[1] == keys, ErrorKind::shape, arg, expected);
      return;
    }
    check.require(t.shape[1] == rows || t.shape[1] == 1, ErrorKind::shape, arg, expected);
    const std::int64_t width = t.shape[2];
    if (q.device == DeviceType::cpu) {
      check.require(width >= longest_keys, ErrorKind::shape, arg,
                    "(row form) has Lk = " + std::to_string(width) + " columns, fewer than the " +
                        std::to_string(longest_keys) + " keys of the longest sequence (cu_seqlens_k)");
    } else {
      check.require(max_seqlen_k > 0, ErrorKind::config, "max_seqlen_k",
                    "must be given with a row-form " + arg + " on CUDA (cu_seqlens is not read on the host)");
      check.require(max_seqlen_k <= width, ErrorKind::shape, arg,
                    "(row form) has Lk = " + std::to_string(width) + " columns, fewer than max_seqlen_k = " +
                        std::to_string(max_seqlen_k));
    }
    return;
  }
  const bool ok = t.rank == 4 && (t.shape[0] == batch || t.shape[0] == 1) &&
                  (t.shape[1] == shapes.q_heads || t.shape[1] == shapes.kv_heads || t.shape[1] == 1) &&
                  (t.shape[2] == rows || t.shape[2] == 1) && t.shape[3] == keys;
  check.require(ok, ErrorKind::shape, arg,
                "expected a shape broadcastable as [B|1, Hq|Hkv|1, T|1, S] = [" + std::to_string(batch) + "|1, " +
                    heads + ", " + std::to_string(rows) + "|1, " + std::to_string(keys) + "], got " +
                    t.shape_string());
}

// A gate tensor: [B, rows, heads] (batched) or [rows, heads] (packed), dtype of q or float32.
void check_gate_tensor(const detail::Check& check, const TensorView& t, const std::string& arg,
                       const TensorView& q, const detail::TokenLayout& layout, std::int64_t batch,
                       std::int64_t heads) {
  check.tensor(t, arg, t.dtype == DType::float32 ? DType::float32 : q.dtype, q, "q");
  std::vector<std::int64_t> expected{layout.rows, heads};
  if (!layout.packed) expected.insert(expected.begin(), batch);
  check.shape(t, arg, expected);
}

// alpha and delta (both or neither), the gate mode and the two thresholds with their tile sizes.
void check_gates(const detail::Check& check, const FlashGateOptions& gates, const TensorView& q,
                 const FlashShapes& shapes) {
  const bool has_alpha = gates.alpha.present(), has_delta = gates.delta.present();
  check.require(has_alpha == has_delta, ErrorKind::config, has_alpha ? "delta" : "alpha",
                "alpha and delta must be given together (gated attention) or not at all");
  if (has_alpha) {
    check_gate_tensor(check, gates.alpha, "alpha", q, shapes.layout_q, shapes.layout_q.batch, shapes.q_heads);
    check_gate_tensor(check, gates.delta, "delta", q, shapes.layout_k, shapes.layout_q.batch, shapes.kv_heads);
  }
  check.require(gates.gate == GateMode::logsigmoid || gates.gate == GateMode::product, ErrorKind::config, "gate",
                "must be GateMode::logsigmoid or GateMode::product");
  if (gates.gate_threshold) {
    check.require(has_alpha, ErrorKind::config, "gate_threshold", "needs alpha and delta (gated attention)");
    check.require(std::isfinite(*gates.gate_threshold), ErrorKind::config, "gate_threshold",
                  "must be finite, got " + std::to_string(*gates.gate_threshold));
  }
  if (gates.softmax_threshold) {
    const double tau = *gates.softmax_threshold;
    check.require(tau > 0 && tau <= 1, ErrorKind::config, "softmax_threshold",
                  "must lie in (0, 1], got " + std::to_string(tau));
  }
  check.require(gates.threshold_block_q > 0, ErrorKind::config, "threshold_block_q",
                "must be positive, got " + std::to_string(gates.threshold_block_q));
  check.require(gates.threshold_block_k > 0, ErrorKind::config, "threshold_block_k",
                "must be positive, got " + std::to_string(gates.threshold_block_k));
}

// Each sequence's (query count, key count): from the batched shapes, or from cu_seqlens (CPU only; empty on
// CUDA, where cu_seqlens is not read on the host).
std::vector<std::pair<std::int64_t, std::int64_t>> sequence_lengths(const FlashShapes& shapes, const Sequences& seqs_q,
                                                                    const Sequences& seqs_k) {
  std::vector<std::pair<std::int64_t, std::int64_t>> lengths;
  if (!shapes.layout_q.packed) {
    lengths.assign(static_cast<std::size_t>(shapes.layout_q.batch), {shapes.layout_q.rows, shapes.layout_k.rows});
    return lengths;
  }
  if (seqs_q.cu_seqlens.device != DeviceType::cpu) return lengths;
  for (std::int64_t b = 0; b < shapes.layout_q.batch; ++b) {
    lengths.emplace_back(std::int64_t{int32_at(seqs_q.cu_seqlens, {b + 1})} - int32_at(seqs_q.cu_seqlens, {b}),
                         std::int64_t{int32_at(seqs_k.cu_seqlens, {b + 1})} - int32_at(seqs_k.cu_seqlens, {b}));
  }
  return lengths;
}

// ceil(length / block) for length >= 0 and block > 0, without the overflow of length + block - 1 for huge blocks.
std::int64_t tile_count(std::int64_t length, std::int64_t block) { return length > 0 ? (length - 1) / block + 1 : 0; }

// The batch and head dimensions of a block-sparse tensor: [B|1, Hb|1, ...] with Hb = Hq or Hkv.
bool block_leading_ok(const TensorView& t, const FlashShapes& shapes) {
  return (t.shape[0] == shapes.layout_q.batch || t.shape[0] == 1) &&
         (t.shape[1] == shapes.q_heads || t.shape[1] == shapes.kv_heads || t.shape[1] == 1);
}

// A list pair (kv_num_blocks [B|1, Hb|1, nQ] and kv_indices [B|1, Hb|1, nQ, maxK]): dtypes and shapes, and on
// the CPU the contents: counts in [0, maxK], indices strictly ascending in [0, nK of the sequences reading them).
void check_block_lists(const detail::Check& check, const TensorView& counts, const TensorView& indices,
                       const std::string& counts_arg, const std::string& indices_arg, const TensorView& q,
                       const FlashShapes& shapes, std::int64_t needed_q_tiles,
                       const std::vector<std::int64_t>& key_tiles) {
  check.tensor(counts, counts_arg, DType::int32, q, "q");
  check.tensor(indices, indices_arg, DType::int32, q, "q");
  const std::string expected = "[" + std::to_string(shapes.layout_q.batch) + "|1, " + std::to_string(shapes.q_heads) +
                               "|" + std::to_string(shapes.kv_heads) + "|1, nQ]";
  check.require(counts.rank == 3 && block_leading_ok(counts, shapes), ErrorKind::shape, counts_arg,
                "expected a shape " + expected + ", got " + counts.shape_string());
  check.require(counts.shape[2] >= needed_q_tiles, ErrorKind::shape, counts_arg,
                "has " + std::to_string(counts.shape[2]) + " query tiles, fewer than the " +
                    std::to_string(needed_q_tiles) + " of the longest sequence");
  check.require(indices.rank == 4 && indices.shape[0] == counts.shape[0] && indices.shape[1] == counts.shape[1] &&
                    indices.shape[2] == counts.shape[2] && indices.shape[3] >= 1,
                ErrorKind::shape, indices_arg,
                "expected [" + std::to_string(counts.shape[0]) + ", " + std::to_string(counts.shape[1]) + ", " +
                    std::to_string(counts.shape[2]) + ", maxK >= 1] (the leading dimensions of " + counts_arg +
                    "), got " + indices.shape_string());
  if (q.device != DeviceType::cpu || key_tiles.empty()) return;
  const std::int64_t width = indices.shape[3];
  std::int64_t widest = 0;
  for (std::int64_t n : key_tiles) widest = std::max(widest, n);
  for (std::int64_t b = 0; b < counts.shape[0]; ++b) {
    // A list shared by every sequence (batch dimension 1) may name tiles up to the longest sequence's count.
    const std::int64_t limit = counts.shape[0] == 1 ? widest : key_tiles[static_cast<std::size_t>(b)];
    for (std::int64_t h = 0; h < counts.shape[1]; ++h) {
      for (std::int64_t i = 0; i < counts.shape[2]; ++i) {
        const auto at = [&](std::int64_t j = -1) {
          std::string text("[");
          for (std::int64_t part : {b, h, i, j}) {
            if (part < 0) break;
            if (text.size() > 1) text += ", ";
            text += std::to_string(part);
          }
          return text + "]";
        };
        const std::int64_t count = int32_at(counts, {b, h, i});
        if (count < 0 || count > width) {
          check.fail(ErrorKind::config, counts_arg,
                     "entry " + at() + " is " + std::to_string(count) + ", outside [0, " + std::to_string(width) +
                         "] (the width of " + indices_arg + ")");
        }
        std::int64_t previous = -1;
        for (std::int64_t j = 0; j < count; ++j) {
          const std::int64_t tile = int32_at(indices, {b, h, i, j});
          if (tile < 0 || tile >= limit) {
            check.fail(ErrorKind::config, indices_arg,
                       "entry " + at(j) + " is " +
                           std::to_string(tile) + ", outside the key tiles [0, " + std::to_string(limit) + ")");
          }
          if (tile <= previous) {
            check.fail(ErrorKind::config, indices_arg,
                       "row " + at() + " is not strictly ascending (" + std::to_string(previous) + " then " +
                           std::to_string(tile) + ")");
          }
          previous = tile;
        }
      }
    }
  }
}

// Block-sparse masks: one form, tile sizes, shapes against every sequence's tile counts, list contents (CPU).
void check_blocks(const detail::Check& check, const FlashBlockMask& blocks, const TensorView& q,
                  const FlashShapes& shapes, const Sequences& seqs_q, const Sequences& seqs_k) {
  if (!blocks.present()) return;
  const bool dense = blocks.block_mask.present();
  const bool lists = blocks.kv_num_blocks.present() || blocks.kv_indices.present();
  const bool full = blocks.full_kv_num_blocks.present() || blocks.full_kv_indices.present();
  check.require(!(dense && (lists || full)), ErrorKind::config, "block_mask",
                "give either a dense tile mask (block_mask) or the lists (kv_num_blocks, kv_indices), not both");
  check.require(blocks.kv_num_blocks.present() == blocks.kv_indices.present(), ErrorKind::config,
                blocks.kv_num_blocks.present() ? "kv_indices" : "kv_num_blocks",
                "kv_num_blocks and kv_indices must be given together");
  check.require(blocks.full_kv_num_blocks.present() == blocks.full_kv_indices.present(), ErrorKind::config,
                blocks.full_kv_num_blocks.present() ? "full_kv_indices" : "full_kv_num_blocks",
                "full_kv_num_blocks and full_kv_indices must be given together");
  check.require(blocks.block_q > 0, ErrorKind::config, "block_q",
                "(the block-sparse mask's query tile size) must be positive, got " + std::to_string(blocks.block_q));
  check.require(blocks.block_k > 0, ErrorKind::config, "block_k",
                "(the block-sparse mask's key tile size) must be positive, got " + std::to_string(blocks.block_k));
  const auto lengths = sequence_lengths(shapes, seqs_q, seqs_k);
  std::int64_t needed_q = 0, needed_k = 0;
  std::vector<std::int64_t> key_tiles;
  for (const auto& [rows, keys] : lengths) {
    needed_q = std::max(needed_q, tile_count(rows, blocks.block_q));
    needed_k = std::max(needed_k, tile_count(keys, blocks.block_k));
    key_tiles.push_back(tile_count(keys, blocks.block_k));
  }
  if (dense && shapes.layout_q.packed && q.device != DeviceType::cpu) {
    // cu_seqlens is not read on the host: max_seqlen_q and max_seqlen_k bound every sequence's tile counts.
    for (const auto& [seqs, arg] : {std::pair{&seqs_q, "max_seqlen_q"}, std::pair{&seqs_k, "max_seqlen_k"}}) {
      check.require(seqs->max_seqlen > 0, ErrorKind::config, arg,
                    "must be given with a block-sparse mask on CUDA (cu_seqlens is not read on the host)");
    }
    needed_q = tile_count(std::min(seqs_q.max_seqlen, shapes.layout_q.rows), blocks.block_q);
    needed_k = tile_count(std::min(seqs_k.max_seqlen, shapes.layout_k.rows), blocks.block_k);
  }
  if (dense) {
    const TensorView& m = blocks.block_mask;
    // bool: true = the tile exists; uint8: 0 absent, 1 exists, 2 exists and full (the element mask is not read).
    check.tensor(m, "block_mask", m.dtype == DType::uint8 ? DType::uint8 : DType::boolean, q, "q");
    check.require(m.rank == 4 && block_leading_ok(m, shapes), ErrorKind::shape, "block_mask",
                  "expected a shape [" + std::to_string(shapes.layout_q.batch) + "|1, " +
                      std::to_string(shapes.q_heads) + "|" + std::to_string(shapes.kv_heads) +
                      "|1, nQ, nK], got " + m.shape_string());
    check.require(m.shape[2] >= needed_q && m.shape[3] >= needed_k, ErrorKind::shape, "block_mask",
                  "has " + std::to_string(m.shape[2]) + " x " + std::to_string(m.shape[3]) +
                      " tiles, fewer than the " + std::to_string(needed_q) + " x " + std::to_string(needed_k) +
                      " of the longest sequence (block_size " + std::to_string(blocks.block_q) + " x " +
                      std::to_string(blocks.block_k) + ")");
    if (m.dtype == DType::uint8 && q.device == DeviceType::cpu) {
      const auto* states = static_cast<const std::uint8_t*>(m.data);
      for (std::int64_t b = 0; b < m.shape[0]; ++b) {
        for (std::int64_t h = 0; h < m.shape[1]; ++h) {
          for (std::int64_t i = 0; i < m.shape[2]; ++i) {
            for (std::int64_t j = 0; j < m.shape[3]; ++j) {
              const int state = states[b * m.stride[0] + h * m.stride[1] + i * m.stride[2] + j * m.stride[3]];
              check.require(state <= 2, ErrorKind::config, "block_mask",
                            "(uint8 tile states) entry [" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                                std::to_string(i) + ", " + std::to_string(j) + "] is " + std::to_string(state) +
                                "; expected 0 (absent), 1 (exists) or 2 (full)");
            }
          }
        }
      }
    }
    return;
  }
  if (lists) {
    check_block_lists(check, blocks.kv_num_blocks, blocks.kv_indices, "kv_num_blocks", "kv_indices", q, shapes,
                      needed_q, key_tiles);
  }
  if (!full) return;
  check_block_lists(check, blocks.full_kv_num_blocks, blocks.full_kv_indices, "full_kv_num_blocks",
                    "full_kv_indices", q, shapes, needed_q, key_tiles);
  if (!lists) return;
  check.shape(blocks.full_kv_num_blocks, "full_kv_num_blocks", detail::shape_of(blocks.kv_num_blocks));
  if (q.device != DeviceType::cpu) return;
  const TensorView &counts = blocks.kv_num_blocks, &full_counts = blocks.full_kv_num_blocks;
  for (std::int64_t b = 0; b < counts.shape[0]; ++b) {
    for (std::int64_t h = 0; h < counts.shape[1]; ++h) {
      for (std::int64_t i = 0; i < counts.shape[2]; ++i) {
        const std::int64_t n = int32_at(counts, {b, h, i}), nf = int32_at(full_counts, {b, h, i});
        for (std::int64_t j = 0, jf = 0; j < n && jf < nf;) {  // both strictly ascending: a merge walk
          const std::int32_t a = int32_at(blocks.kv_indices, {b, h, i, j});
          const std::int32_t f = int32_at(blocks.full_kv_indices, {b, h, i, jf});
          check.require(a != f, ErrorKind::config, "full_kv_indices",
                        "key tile " + std::to_string(a) + " of row [" + std::to_string(b) + ", " + std::to_string(h) +
                            ", " + std::to_string(i) + "] is in both kv_indices and full_kv_indices");
          if (a < f) ++j; else ++jf;
        }
      }
    }
  }
}

// Per-head windows: int32 [Hq] on q's device (any stride), replacing that side's int (which stays -1). The entries
// are checked (>= -1) on the CPU only: on CUDA reading them would synchronise with the device, and the kernels read
// any negative entry as unbounded.
void check_head_windows(const detail::Check& check, const FlashHeadWindows& windows, const TensorView& q,
                        const FlashShapes& shapes, std::int64_t window_left, std::int64_t window_right) {
  const std::pair<const TensorView*, std::int64_t> sides[2] = {{&windows.left, window_left},
                                                               {&windows.right, window_right}};
  for (int side = 0; side < 2; ++side) {
    const TensorView& t = *sides[side].first;
    if (!t.present()) continue;
    const std::string arg = side == 0 ? "window_left" : "window_right";
    check.tensor(t, arg, DType::int32, q, "q");
    check.shape(t, arg, {shapes.q_heads});
    check.require(sides[side].second == -1, ErrorKind::config, arg,
                  "is given both as a per-head tensor and as an int (" + std::to_string(sides[side].second) +
                      "); leave the int at -1");
    if (q.device != DeviceType::cpu) continue;
    for (std::int64_t h = 0; h < shapes.q_heads; ++h) {
      const std::int64_t w = int32_at(t, {h});
      check.require(w >= -1, ErrorKind::config, arg,
                    "entry " + std::to_string(h) + " is " + std::to_string(w) + "; expected -1 (unbounded) or >= 0");
    }
  }
}

// The optional work counter: int64 [1] on q's device (read by the CUDA kernels only).
void check_work_counter(const detail::Check& check, const TensorView& counter, const TensorView& q) {
  if (!counter.present()) return;
  check.tensor(counter, "work_counter", DType::int64, q, "q");
  check.shape(counter, "work_counter", {1});
}

// Checks what the forward and the backward share (for the backward, o and lse are inputs).
template <class Params>
FlashShapes check_common(const detail::Check& check, const Params& params) {
  const TensorView& q = params.q;
  check.present(q, "q");
  check.floating(q, "q");
  const DType dtype = q.dtype;
  const bool packed = params.seqs_q.cu_seqlens.present();
  check.require(packed == params.seqs_k.cu_seqlens.present(), ErrorKind::config,
                packed ? "cu_seqlens_k" : "cu_seqlens_q",
                "cu_seqlens_q and cu_seqlens_k must be given together (packed layout) or not at all (batched)");
  FlashShapes shapes;
  check.tensor(q, "q", dtype, q, "q");
  shapes.layout_q = check.layout(q, "q", params.seqs_q, "cu_seqlens_q");
  check.tensor(params.k, "k", dtype, q, "q");
  shapes.layout_k = check.layout(params.k, "k", params.seqs_k, "cu_seqlens_k");
  if (packed) check.shape(params.seqs_k.cu_seqlens, "cu_seqlens_k", {shapes.layout_q.batch + 1});

  shapes.q_heads = q.shape[q.rank - 2];
  shapes.dim_qk = q.shape[q.rank - 1];
  shapes.kv_heads = params.k.shape[params.k.rank - 2];
  check.require(shapes.dim_qk > 0, ErrorKind::shape, "q", "needs a positive head dim, got " + q.shape_string());
  check.require(shapes.kv_heads > 0, ErrorKind::shape, "k", "needs at least one head, got " + params.k.shape_string());
  check.require(shapes.q_heads % shapes.kv_heads == 0, ErrorKind::shape, "k",
                "has " + std::to_string(shapes.kv_heads) + " heads, which must divide the " +
                    std::to_string(shapes.q_heads) + " query heads of q (group size Hq / Hkv)");
  check.shape(params.k, "k", shapes.key_tokens(shapes.kv_heads, shapes.dim_qk));
  check.tensor(params.v, "v", dtype, q, "q");
  shapes.dim_v = params.v.shape[params.v.rank - 1];
  check.shape(params.v, "v", shapes.key_tokens(shapes.kv_heads, shapes.dim_v));
  check.tensor(params.o, "o", dtype, q, "q");
  check.shape(params.o, "o", shapes.layout_q.tokens(shapes.q_heads, shapes.dim_v));
  check.tensor(params.lse, "lse", detail::lse_dtype(dtype), q, "q");
  check.shape(params.lse, "lse", shapes.layout_q.lse(shapes.q_heads));
  if (params.mask.present() || params.bias.present()) {
    std::int64_t longest_keys = 0;
    for (const auto& lengths : sequence_lengths(shapes, params.seqs_q, params.seqs_k)) {
      longest_keys = std::max(longest_keys, lengths.second);
    }
    const std::int64_t max_seqlen_k = params.seqs_k.max_seqlen;
    check_broadcast(check, params.mask, "mask", DType::boolean, q, shapes, longest_keys, max_seqlen_k);
    check_broadcast(check, params.bias, "bias", dtype, q, shapes, longest_keys, max_seqlen_k);
  }
  check_gates(check, params.gates, q, shapes);
  check_blocks(check, params.blocks, q, shapes, params.seqs_q, params.seqs_k);
  check_head_windows(check, params.head_windows, q, shapes, params.window_left, params.window_right);
  check_work_counter(check, params.work_counter, q);
  detail::resolve_scale(check, params.scale, shapes.dim_qk);
  return shapes;
}

// Whether the CUDA kernels take q's dtype and (Dqk, Dv).
bool cuda_runs(const TensorView& q, std::int64_t dim_qk, std::int64_t dim_v) {
  return (q.dtype == DType::float16 || q.dtype == DType::bfloat16) && cuda_head_dims_supported(dim_qk, dim_v);
}

// The decisions of softmax_threshold on CUDA (FlashAttentionParams::threshold_tiles): uint8 [B, Hq, nQ, nK],
// contiguous (the forward clears it before the kernel writes the kept pairs), nQ x nK at least the tiles of the
// longest sequence in threshold_block's tiles. The kernels decide in their own tiles, which threshold_block must be.
void check_threshold_tiles(const detail::Check& check, const FlashAttentionParams& params, const FlashShapes& shapes) {
  const TensorView& t = params.threshold_tiles;
  const FlashGateOptions& gates = params.gates;
  check.require(t.present(), ErrorKind::config, "threshold_tiles",
                "is required on CUDA with softmax_threshold (the forward records its decisions there)");
  check.tensor(t, "threshold_tiles", DType::uint8, params.q, "q");
  if (shapes.layout_q.packed) {
    // cu_seqlens is not read on the host: max_seqlen_q and max_seqlen_k bound the tile counts, as the backward's
    // tile map needs them too.
    for (const auto& [seqs, arg] :
         {std::pair{&params.seqs_q, "max_seqlen_q"}, std::pair{&params.seqs_k, "max_seqlen_k"}}) {
      check.require(seqs->max_seqlen > 0, ErrorKind::config, arg,
                    "must be given with softmax_threshold on CUDA (cu_seqlens is not read on the host)");
    }
  }
  const auto longest = [](const detail::TokenLayout& layout, const Sequences& seqs) {
    if (!layout.packed) return layout.rows;
    return seqs.max_seqlen > 0 ? std::min(seqs.max_seqlen, layout.rows) : layout.rows;
  };
  const std::int64_t needed_q = tile_count(longest(shapes.layout_q, params.seqs_q), gates.threshold_block_q);
  const std::int64_t needed_k = tile_count(longest(shapes.layout_k, params.seqs_k), gates.threshold_block_k);
  const std::string expected = "[" + std::to_string(shapes.layout_q.batch) + ", " + std::to_string(shapes.q_heads) +
                               ", >= " + std::to_string(needed_q) + ", >= " + std::to_string(needed_k) + "]";
  check.require(t.rank == 4 && t.shape[0] == shapes.layout_q.batch && t.shape[1] == shapes.q_heads &&
                    t.shape[2] >= needed_q && t.shape[3] >= needed_k,
                ErrorKind::shape, "threshold_tiles",
                "expected a shape " + expected + " (threshold_block " + std::to_string(gates.threshold_block_q) +
                    " x " + std::to_string(gates.threshold_block_k) + "), got " + t.shape_string());
  check.require(t.stride[3] == 1 && t.stride[2] == t.shape[3] && t.stride[1] == t.shape[2] * t.shape[3] &&
                    t.stride[0] == t.shape[1] * t.stride[1],
                ErrorKind::layout, "threshold_tiles", "must be contiguous");
}

template <class Params>
void check_cuda_flash(const detail::Check& check, const Params& params, const FlashShapes& shapes) {
  const FlashGateOptions& gates = params.gates;
  // alpha and delta run on CUDA as check_gates validated them (shapes, q's dtype or float32, q's device, any
  // strides). The gate threshold does not: the Python layer passes its decisions as a tile map (block_mask),
  // which this API leaves to its caller since it allocates nothing.
  check.require(!gates.gate_threshold, ErrorKind::unsupported, "gate_threshold",
                "is not supported on CUDA yet; use CPU tensors");
  if constexpr (std::is_same_v<Params, FlashAttentionParams>) {
    if (gates.softmax_threshold && cuda_runs(params.q, shapes.dim_qk, shapes.dim_v)) {
      // The forward decides per kernel tile, agreed by the threads that hold the rows of a query tile.
      const FlashThresholdTiles tiles = flash_attention_threshold_tiles(params);
      check.require(gates.threshold_block_q == tiles.block_q && gates.threshold_block_k == tiles.block_k,
                    ErrorKind::unsupported, "threshold_block",
                    "is " + std::to_string(gates.threshold_block_q) + " x " +
                        std::to_string(gates.threshold_block_k) + ", but softmax_threshold on CUDA needs the "
                        "forward kernel's tiles here, " + std::to_string(tiles.block_q) + " x " +
                        std::to_string(tiles.block_k) + " (queries x keys; they depend on the head dims and on "
                        "whether the sm_90a kernels run); use CPU tensors for other tile sizes");
      check_threshold_tiles(check, params, shapes);
      // The backward's tile map is this one with the decisions' skipped pairs made absent: the same tiles.
      const FlashBlockMask& blocks = params.blocks;
      check.require(!blocks.block_mask.present() || (blocks.block_q == gates.threshold_block_q &&
                                                      blocks.block_k == gates.threshold_block_k),
                    ErrorKind::unsupported, "threshold_block",
                    "is " + std::to_string(gates.threshold_block_q) + " x " + std::to_string(gates.threshold_block_k) +
                        " but the tile map block_mask has tiles of " + std::to_string(blocks.block_q) + " x " +
                        std::to_string(blocks.block_k) + ": on CUDA softmax_threshold needs the same tiles");
    } else {
      check.require(!params.threshold_tiles.present(), ErrorKind::config, "threshold_tiles",
                    "is given without softmax_threshold");
    }
  } else {
    check.require(!gates.softmax_threshold, ErrorKind::unsupported, "softmax_threshold",
                  "is not taken by the CUDA backward: pass the forward's decisions (threshold_tiles) as the tile "
                  "map block_mask with block_q, block_k = threshold_block instead");
  }
  const FlashBlockMask& blocks = params.blocks;
  check.require(!blocks.kv_num_blocks.present() && !blocks.kv_indices.present(), ErrorKind::unsupported,
                "kv_num_blocks",
                "(FlexAttention's block lists) is not supported on CUDA: pass the dense tile map block_mask "
                "[B|1, Hb|1, nQ, nK] instead (bool, or uint8 with 2 for the full tiles)");
  check.require(!blocks.full_kv_num_blocks.present() && !blocks.full_kv_indices.present(), ErrorKind::unsupported,
                "full_kv_num_blocks",
                "(FlexAttention's block lists) is not supported on CUDA: pass the dense tile map block_mask "
                "[B|1, Hb|1, nQ, nK] instead (uint8: 2 marks a full tile)");
  detail::check_cuda_half(check, params.q);
  detail::check_cuda_head_dims(check, shapes.dim_qk, shapes.dim_v);
  detail::check_cuda_rows(check, params.q, "q");
  detail::check_cuda_rows(check, params.k, "k");
  detail::check_cuda_rows(check, params.v, "v");
  detail::check_cuda_rows(check, params.o, "o");
  detail::check_cuda_length(check, params.q, params.seqs_q, "q");
  detail::check_cuda_length(check, params.k, params.seqs_k, "k");
}

}  // namespace

FlashThresholdTiles flash_attention_threshold_tiles(const FlashAttentionParams& params) {
  const TensorView& q = params.q;
  const TensorView& v = params.v;
  if (!q.present() || !v.present() || q.device != DeviceType::cuda || q.rank < 3 || v.rank < 3 ||
      !cuda_runs(q, q.shape[q.rank - 1], v.shape[v.rank - 1])) {
    return {};
  }
#ifdef SPARSEATTN_WITH_CUDA
  return cuda::flash_attention_threshold_tiles(params);
#else
  return {};
#endif
}

void flash_attention(const FlashAttentionParams& params) {
  const detail::Check check("flash_attention");
  const FlashShapes shapes = check_common(check, params);
  switch (detail::backend(check, params.q, "q", detail::kCudaBuilt)) {
    case detail::Backend::cpu:
      check.require(!params.threshold_tiles.present(), ErrorKind::config, "threshold_tiles",
                    "is CUDA's record of softmax_threshold's decisions; the CPU takes none");
      reference::flash_attention(params);
      break;
    case detail::Backend::cuda:
      check_cuda_flash(check, params, shapes);
#ifdef SPARSEATTN_WITH_CUDA
      cuda::flash_attention(params);
#endif
      break;
  }
}

std::size_t flash_attention_backward_workspace_size(const FlashAttentionBackwardParams& params) {
  // The CPU reference keeps its scratch on the host; CUDA needs delta = rowsum(dO * O) (fp32, one per row),
  // when the dK/dV kernel splits the group's heads over CTAs their fp32 partials, and with dbias the fp32
  // contributions that a reduction sums into it.
#ifdef SPARSEATTN_WITH_CUDA
  if (params.q.present() && params.q.device == DeviceType::cuda) return cuda::flash_attention_backward_workspace_size(params);
#endif
  (void)params;
  return 0;
}

void flash_attention_backward(const FlashAttentionBackwardParams& params) {
  detail::flash_attention_backward(params, {});
}

void detail::flash_attention_backward(const FlashAttentionBackwardParams& params,
                                      const BranchBackwardOptions& options) {
  const detail::Check check("flash_attention_backward");
  const FlashShapes shapes = check_common(check, params);
  const DType dtype = params.q.dtype;
  check.tensor(params.d_o, "d_o", dtype, params.q, "q");
  check.shape(params.d_o, "d_o", shapes.layout_q.tokens(shapes.q_heads, shapes.dim_v));
  check.tensor(params.dq, "dq", dtype, params.q, "q");
  check.shape(params.dq, "dq", shapes.layout_q.tokens(shapes.q_heads, shapes.dim_qk));
  check.tensor(params.dk, "dk", dtype, params.q, "q");
  check.shape(params.dk, "dk", shapes.key_tokens(shapes.kv_heads, shapes.dim_qk));
  check.tensor(params.dv, "dv", dtype, params.q, "q");
  check.shape(params.dv, "dv", shapes.key_tokens(shapes.kv_heads, shapes.dim_v));
  if (params.dbias.present()) {
    check.require(params.bias.present(), ErrorKind::config, "dbias", "is given but bias is not");
    check.tensor(params.dbias, "dbias", dtype, params.q, "q");
    const TensorView& bias = params.bias;
    check.shape(params.dbias, "dbias", std::vector<std::int64_t>(bias.shape.begin(), bias.shape.begin() + bias.rank));
  }
  if (params.dalpha.present()) {
    check.require(params.gates.alpha.present(), ErrorKind::config, "dalpha", "is given but alpha is not");
    check.tensor(params.dalpha, "dalpha", params.gates.alpha.dtype, params.gates.alpha, "alpha");
    check.shape(params.dalpha, "dalpha", detail::shape_of(params.gates.alpha));
  }
  if (params.ddelta.present()) {
    check.require(params.gates.delta.present(), ErrorKind::config, "ddelta", "is given but delta is not");
    check.tensor(params.ddelta, "ddelta", params.gates.delta.dtype, params.gates.delta, "delta");
    check.shape(params.ddelta, "ddelta", detail::shape_of(params.gates.delta));
  }
  check.buffer(params.workspace, params.workspace_bytes, flash_attention_backward_workspace_size(params), "workspace",
               "flash_attention_backward_workspace_size");
  detail::check_options(check, options, shapes.layout_q.lse(shapes.q_heads), params.q);
  switch (detail::backend(check, params.q, "q", detail::kCudaBuilt)) {
    case detail::Backend::cpu: reference::flash_attention_backward(params); break;
    case detail::Backend::cuda:
      check_cuda_flash(check, params, shapes);
      detail::check_cuda_rows(check, params.d_o, "d_o");
      detail::check_cuda_rows(check, params.dq, "dq");
      detail::check_cuda_rows(check, params.dk, "dk");
      detail::check_cuda_rows(check, params.dv, "dv");
#ifdef SPARSEATTN_WITH_CUDA
      cuda::flash_attention_backward(params, options);
#endif
      break;
  }
}

}  // namespace sparseattn
