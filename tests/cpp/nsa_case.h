// An nsa_attention problem with owning float64 host buffers, shared by the nsa_attention tests.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <tuple>
#include <vector>

#include "sparseattn/nsa_attention.h"
#include "test_util.h"

namespace sparseattn::test {

template <class T>
Host<T> host(const std::vector<std::int64_t>& shape, T fill = T{}) {
  Host<T> t;
  t.shape = shape;
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  t.data.assign(static_cast<std::size_t>(n), fill);
  return t;
}

// A small config that still exercises every rule: 8-token compressed blocks every 4 tokens, 16-token
// selection blocks, 3 selected (1 initial, 1 local), a window of 5.
inline NsaConfig small_config() {
  NsaConfig config;
  config.cmp_block = 8;
  config.cmp_stride = 4;
  config.sel_block = 16;
  config.num_selected = 3;
  config.num_init = 1;
  config.num_local = 1;
  config.window = 5;
  return config;
}

struct NsaGrads {
  HostF64 dq, dk, dv, dk_cmp, dv_cmp;
  std::array<HostF64, kNumBranches> d_gates;
};

struct NsaCase {
  NsaConfig config = small_config();
  bool packed = false;
  std::int64_t batch = 1, rows = 0;  // rows: T, or N for the packed layout
  std::int64_t heads_q = 3, heads_kv = 1, dim = 4, dim_v = 3, cmp_rows = 0;
  HostF64 q, k, v, k_cmp, v_cmp;
  std::array<HostF64, kNumBranches> gates;
  std::array<bool, kNumBranches> use_gate{true, true, true};
  bool use_cmp = false;      // pass k_cmp, v_cmp
  bool use_indices = false;  // pass block_indices
  Host<std::int32_t> block_indices, cu, cu_cmp;
  Host<std::int32_t> cu_k;  // packed query chunks: the keys' cu_seqlens (empty: cu)
  NsaRecompute recompute = NsaRecompute::none;
  std::vector<std::byte> forward_scratch;  // of the last params() call, as large as it asks for

  // Batched [batch, tokens, ...] with random contents.
  static NsaCase batched(std::int64_t batch, std::int64_t tokens, std::int64_t heads_q, std::int64_t heads_kv,
                         std::mt19937_64& rng, NsaConfig config = small_config()) {
    NsaCase c;
    c.config = config;
    c.batch = batch;
    c.rows = tokens;
    c.heads_q = heads_q;
    c.heads_kv = heads_kv;
    c.cmp_rows = num_compressed_blocks(tokens, config.cmp_block, config.cmp_stride);
    c.allocate(rng);
    return c;
  }

  // Packed sequences of the given lengths followed by `padding` rows that belong to no sequence.
  static NsaCase varlen(const std::vector<std::int64_t>& lengths, std::int64_t padding, std::int64_t heads_q,
                        std::int64_t heads_kv, std::mt19937_64& rng, NsaConfig config = small_config()) {
    NsaCase c;
    c.config = config;
    c.packed = true;
    c.batch = static_cast<std::int64_t>(lengths.size());
    c.heads_q = heads_q;
    c.heads_kv = heads_kv;
    c.cu = host<std::int32_t>({c.batch + 1});
    c.cu_cmp = host<std::int32_t>({c.batch + 1});
    for (std::size_t b = 0; b < lengths.size(); ++b) {
      c.cu.data[b + 1] = c.cu.data[b] + static_cast<std::int32_t>(lengths[b]);
      c.cu_cmp.data[b + 1] = c.cu_cmp.data[b] + static_cast<std::int32_t>(num_compressed_blocks(
                                                     lengths[b], config.cmp_block, config.cmp_stride));
    }
    c.rows = c.cu.data.back() + padding;
    c.cmp_rows = c.cu_cmp.data.back() + 1;  // one spare compressed row
    c.allocate(rng);
    return c;
  }

  std::vector<std::int64_t> tokens(std::int64_t heads, std::int64_t d) const {
    if (packed) return {rows, heads, d};
    return {batch, rows, heads, d};
  }
  std::vector<std::int64_t> per_head() const {
    if (packed) return {rows, heads_q};
    return {batch, rows, heads_q};
  }
  std::vector<std::int64_t> compressed(std::int64_t d) const {
    if (packed) return {cmp_rows, heads_kv, d};
    return {batch, cmp_rows, heads_kv, d};
  }

  void allocate(std::mt19937_64& rng) {
    q = host<double>(tokens(heads_q, dim));
    k = host<double>(tokens(heads_kv, dim));
    v = host<double>(tokens(heads_kv, dim_v));
    k_cmp = host<double>(compressed(dim));
    v_cmp = host<double>(compressed(dim_v));
    for (HostF64* t : {&q, &k, &v, &k_cmp, &v_cmp}) fill_random(*t, rng);
    std::uniform_real_distribution<double> gate(0.2, 1.0);
    for (HostF64& g : gates) {
      g = host<double>(per_head());
      for (double& x : g.data) x = gate(rng);
    }
    block_indices = host<std::int32_t>(tokens(heads_kv, config.num_selected), -1);
  }

  // The params of a forward call writing `o`, with a workspace of exactly the size it asks for.
  NsaParams params(HostF64& o, std::vector<std::byte>& workspace) {
    NsaParams p;
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    if (use_cmp) {
      p.k_cmp = k_cmp.view();
      p.v_cmp = v_cmp.view();
    }
    if (use_indices) p.block_indices = block_indices.view();
    for (int i = 0; i < kNumBranches; ++i) {
      if (use_gate[i]) p.gates[i] = gates[i].view();
    }
    p.o = o.view();
    if (packed) {
      p.seqs.cu_seqlens = cu.view();
      if (!cu_k.data.empty()) p.seqs_k.cu_seqlens = cu_k.view();
      p.cu_seqlens_cmp = cu_cmp.view();
    }
    p.config = config;
    p.recompute = recompute;
    workspace.resize(nsa_workspace_size(p));
    p.workspace = workspace.data();
    p.workspace_bytes = workspace.size();
    forward_scratch.resize(nsa_forward_scratch_size(p));
    p.scratch = forward_scratch.empty() ? nullptr : forward_scratch.data();
    p.scratch_bytes = forward_scratch.size();
    return p;
  }

  HostF64 new_output(double fill = 0) const { return host<double>(tokens(heads_q, dim_v), fill); }

  HostF64 forward() {
    HostF64 o = new_output();
    std::vector<std::byte> workspace;
    nsa_attention(params(o, workspace));
    return o;
  }

  // Gradient buffers for a backward call, filled with `fill` (to see what the call writes).
  NsaGrads new_grads(double fill = 0) const {
    NsaGrads g;
    g.dq = host<double>(q.shape, fill);
    g.dk = host<double>(k.shape, fill);
    g.dv = host<double>(v.shape, fill);
    if (use_cmp) {
      g.dk_cmp = host<double>(k_cmp.shape, fill);
      g.dv_cmp = host<double>(v_cmp.shape, fill);
    }
    for (int i = 0; i < kNumBranches; ++i) {
      if (use_gate[i]) g.d_gates[i] = host<double>(gates[i].shape, fill);
    }
    return g;
  }

  NsaBackwardParams backward_params(const NsaParams& forward, HostF64& d_o, NsaGrads& g,
                                    std::vector<std::byte>& scratch) const {
    NsaBackwardParams b;
    b.forward = forward;
    b.d_o = d_o.view();
    b.dq = g.dq.view();
    b.dk = g.dk.view();
    b.dv = g.dv.view();
    if (use_cmp) {
      b.dk_cmp = g.dk_cmp.view();
      b.dv_cmp = g.dv_cmp.view();
    }
    for (int i = 0; i < kNumBranches; ++i) {
      if (use_gate[i]) b.d_gates[i] = g.d_gates[i].view();
    }
    scratch.resize(nsa_backward_scratch_size(forward));
    b.scratch = scratch.data();
    b.scratch_bytes = scratch.size();
    return b;
  }

  NsaGrads backward(HostF64& d_o, double fill = 0) {
    HostF64 o = new_output();
    std::vector<std::byte> workspace, scratch;
    const NsaParams forward = params(o, workspace);
    nsa_attention(forward);
    NsaGrads g = new_grads(fill);
    nsa_attention_backward(backward_params(forward, d_o, g, scratch));
    return g;
  }

  // Every float input a gradient flows to, with its name and its gradient in `g`.
  std::vector<std::tuple<const char*, HostF64*, const HostF64*>> differentiable(const NsaGrads& g) {
    std::vector<std::tuple<const char*, HostF64*, const HostF64*>> inputs = {
        {"q", &q, &g.dq}, {"k", &k, &g.dk}, {"v", &v, &g.dv}};
    if (use_cmp) {
      inputs.emplace_back("k_cmp", &k_cmp, &g.dk_cmp);
      inputs.emplace_back("v_cmp", &v_cmp, &g.dv_cmp);
    }
    const char* const names[kNumBranches] = {"g_cmp", "g_slc", "g_swa"};
    for (int i = 0; i < kNumBranches; ++i) {
      if (use_gate[i]) inputs.emplace_back(names[i], &gates[i], &g.d_gates[i]);
    }
    return inputs;
  }
};

}  // namespace sparseattn::test
