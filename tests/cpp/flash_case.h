// The flash_attention tests' call: owning float64 tensors of one batched call on the CPU reference and its
// forward and backward params. The optional inputs (mask, bias, alpha and delta) and gradients (dbias, dalpha,
// ddelta) are passed where their tensors hold data.
#pragma once

#include <cstdint>
#include <optional>

#include "sparseattn/flash_attention.h"
#include "test_util.h"

namespace sparseattn::test {

struct FlashSizes {
  std::int64_t batch = 1, q_len = 1, k_len = 1, q_heads = 1, kv_heads = 1, dim = 1, dim_v = 1;
};

struct FlashCase {
  FlashSizes n;
  HostF64 q, k, v, o, lse, d_o, dq, dk, dv;
  HostF64 bias, dbias, alpha, delta, dalpha, ddelta;  // empty unless a test fills them
  Host<std::uint8_t> mask;
  bool causal = false;
  std::int64_t left = -1, right = -1;
  std::optional<double> scale;
  FlashGateOptions gates;  // its alpha and delta views come from the tensors above
  FlashBlockMask blocks;
  FlashHeadWindows windows;

  explicit FlashCase(const FlashSizes& sizes)
      : n(sizes),
        q({n.batch, n.q_len, n.q_heads, n.dim}),
        k({n.batch, n.k_len, n.kv_heads, n.dim}),
        v({n.batch, n.k_len, n.kv_heads, n.dim_v}),
        o({n.batch, n.q_len, n.q_heads, n.dim_v}),
        lse({n.batch, n.q_heads, n.q_len}),
        d_o({n.batch, n.q_len, n.q_heads, n.dim_v}),
        dq({n.batch, n.q_len, n.q_heads, n.dim}),
        dk({n.batch, n.k_len, n.kv_heads, n.dim}),
        dv({n.batch, n.k_len, n.kv_heads, n.dim_v}) {}

  // alpha [B, T, Hq] and delta [B, S, Hkv], zero, with their gradients.
  void add_gates() {
    alpha = dalpha = HostF64({n.batch, n.q_len, n.q_heads});
    delta = ddelta = HostF64({n.batch, n.k_len, n.kv_heads});
  }

  FlashAttentionParams forward_params() {
    FlashAttentionParams p;
    p.q = q.view(), p.k = k.view(), p.v = v.view(), p.o = o.view(), p.lse = lse.view();
    if (!mask.data.empty()) p.mask = mask.view();
    if (!bias.data.empty()) p.bias = bias.view();
    p.causal = causal, p.window_left = left, p.window_right = right, p.scale = scale;
    p.gates = gates;
    if (!alpha.data.empty()) p.gates.alpha = alpha.view(), p.gates.delta = delta.view();
    p.blocks = blocks;
    p.head_windows = windows;
    return p;
  }
  FlashAttentionBackwardParams backward_params() {
    const FlashAttentionParams f = forward_params();
    FlashAttentionBackwardParams p;
    p.q = f.q, p.k = f.k, p.v = f.v, p.mask = f.mask, p.bias = f.bias, p.o = f.o, p.lse = f.lse;
    p.d_o = d_o.view(), p.dq = dq.view(), p.dk = dk.view(), p.dv = dv.view();
    if (!dbias.data.empty()) p.dbias = dbias.view();
    if (!dalpha.data.empty()) p.dalpha = dalpha.view(), p.ddelta = ddelta.view();
    p.causal = f.causal, p.window_left = f.window_left, p.window_right = f.window_right, p.scale = f.scale;
    p.gates = f.gates, p.blocks = f.blocks, p.head_windows = f.head_windows;
    return p;
  }
  void forward() { flash_attention(forward_params()); }
  void backward() { flash_attention_backward(backward_params()); }
};

}  // namespace sparseattn::test
