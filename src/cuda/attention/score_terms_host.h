// Host side of FlashTermsMask (score_terms.cuh): the device views of a call's mask, bias, block-sparse tile map and
// gate tensors (validated by the API). Broadcast dimensions get stride 0.
#pragma once

#include <cstdint>

#include "cuda/attention/score_terms.cuh"
#include "sparseattn/flash_attention.h"

namespace sparseattn::cuda::attention {

// The head of a [.., Hm, ..] tensor that query head h reads: Hm = Hq (h), Hkv (h / group) or 1 (stride 0).
inline void set_heads(i64 heads, i64 stride, i64 q_heads, i64 group, i64& head_stride, int& head_div) {
  head_stride = heads == 1 ? 0 : stride;
  head_div = heads == q_heads || heads == 1 ? 1 : static_cast<int>(group);
}

// A mask or bias: batched [B|1, H, T|1, S], packed row form [Hm, Nq|1, Lk] or key form [Hm, Nk].
inline BroadcastView broadcast_view(const TensorView& t, i64 q_heads, i64 group) {
  BroadcastView b{};
  b.head_div = 1;
  if (!t.present()) return b;
  b.data = t.data;
  const int head_dim = t.rank == 4 ? 1 : 0;
  set_heads(t.shape[head_dim], t.stride[head_dim], q_heads, group, b.head_stride, b.head_div);
  if (t.rank == 4) {
    b.batch_stride = t.shape[0] == 1 ? 0 : t.stride[0];
    b.row_stride = t.shape[2] == 1 ? 0 : t.stride[2];
  } else if (t.rank == 3) {
    b.row_stride = t.shape[1] == 1 ? 0 : t.stride[1];
  } else {
    b.packed_keys = true;
  }
  return b;
}

// The dense tile map [B|1, Hb|1, nQ, nK] (bool or uint8 states), or none.
inline TileMap tile_map(const FlashBlockMask& blocks, i64 q_heads, i64 group) {
  TileMap m{};
  m.head_div = 1;
  const TensorView& map = blocks.block_mask;
  if (!map.present()) return m;
  m.states = static_cast<const std::uint8_t*>(map.data);
  m.batch_stride = map.shape[0] == 1 ? 0 : map.stride[0];
  set_heads(map.shape[1], map.stride[1], q_heads, group, m.head_stride, m.head_div);
  m.row_stride = map.stride[2];
  m.query_tiles = map.shape[2];
  m.key_tiles = map.shape[3];
  m.block_q = blocks.block_q;
  m.block_k = blocks.block_k;
  return m;
}

// alpha [B, T, Hq] / packed [Nq, Hq] or delta [B, S, Hkv] / packed [Nk, Hkv] as the caller gave it (q's dtype or
// float32), or none.
inline GateView gate_view(const TensorView& t) {
  GateView g{};
  if (!t.present()) return g;
  g.data = t.data;
  const bool packed = t.rank == 2;
  g.batch_stride = packed ? 0 : t.stride[0];
  g.row_stride = t.stride[packed ? 0 : 1];
  g.head_stride = t.stride[packed ? 1 : 2];
  g.fp32 = t.dtype == DType::float32;
  return g;
}

// The gate of a forward call: the caller's alpha and delta.
inline GateTerms gate_terms(const FlashGateOptions& gates) {
  GateTerms g{};
  g.alpha = gate_view(gates.alpha);
  g.delta = gate_view(gates.delta);
  g.product = gates.gate == GateMode::product;
  return g;
}

}  // namespace sparseattn::cuda::attention
