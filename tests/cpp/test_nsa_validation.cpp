#include <gtest/gtest.h>

#include <functional>

#include "nsa_case.h"
#include "sparseattn/error.h"

namespace sparseattn::test {
namespace {

void expect_error(const std::function<void()>& call, ErrorKind kind, const std::string& argument,
                  const std::string& op) {
  try {
    call();
    ADD_FAILURE() << "expected an error naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_EQ(e.op(), op) << e.what();
  }
}

// A valid batched forward call (T = 40, Hq 3, Hkv 1) whose output starts as -99.
struct ForwardCall {
  std::mt19937_64 rng{21};
  NsaCase c = NsaCase::batched(1, 40, 3, 1, rng);
  HostF64 o = c.new_output(-99);
  std::vector<std::byte> workspace;
  NsaParams good = c.params(o, workspace);

  // Runs nsa_attention on `bad` expecting the error, and checks that o was not written.
  void expect_rejected(const NsaParams& bad, ErrorKind kind, const std::string& argument) {
    expect_error([&] { nsa_attention(bad); }, kind, argument, "nsa_attention");
    EXPECT_EQ(o.data, std::vector<double>(o.data.size(), -99.0)) << "o written despite the error on " << argument;
  }
};

TEST(NsaValidation, ConfigErrorsNameTheField) {
  ForwardCall call;
  const std::vector<std::pair<std::function<void(NsaConfig&)>, std::string>> cases = {
      {[](NsaConfig& c) { c.cmp_block = 0; }, "cmp_block"},
      {[](NsaConfig& c) { c.cmp_stride = 3; }, "cmp_stride"},
      {[](NsaConfig& c) { c.sel_block = 4; }, "sel_block"},
      {[](NsaConfig& c) { c.num_selected = 0; }, "num_selected"},
      {[](NsaConfig& c) { c.num_init = -1; }, "num_init"},
      {[](NsaConfig& c) { c.num_local = -1; }, "num_local"},
      {[](NsaConfig& c) { c.num_local = 3; }, "num_selected"},
      {[](NsaConfig& c) { c.window = 0; }, "window"},
      {[](NsaConfig& c) { c.scale = -1.0; }, "scale"},
  };
  for (const auto& [apply, argument] : cases) {
    NsaParams bad = call.good;
    apply(bad.config);
    call.expect_rejected(bad, ErrorKind::config, argument);
  }
}

TEST(NsaValidation, TensorErrorsNameTheArgument) {
  ForwardCall call;
  HostF64& k_cmp = call.c.k_cmp;
  Host<std::int32_t> indices = host<std::int32_t>({1, 40, 1, 3}, -1);
  struct Case {
    std::function<void(NsaParams&)> apply;
    ErrorKind kind;
    std::string argument;
  };
  const std::vector<Case> cases = {
      {[](NsaParams& p) { p.q.dtype = DType::int32; }, ErrorKind::dtype, "q"},
      {[](NsaParams& p) { p.q.rank = 3; }, ErrorKind::shape, "q"},
      {[](NsaParams& p) { p.q.data = nullptr; }, ErrorKind::value, "q"},
      {[](NsaParams& p) { p.k.shape[2] = 2; }, ErrorKind::shape, "k"},  // 2 KV heads for 3 query heads
      {[](NsaParams& p) { p.k.stride[3] = 2; }, ErrorKind::layout, "k"},
      {[](NsaParams& p) { p.k.device = DeviceType::cuda; }, ErrorKind::device, "k"},
      {[](NsaParams& p) { p.v.dtype = DType::float32; }, ErrorKind::dtype, "v"},
      {[](NsaParams& p) { p.v.shape[1] = 39; }, ErrorKind::shape, "v"},
      {[](NsaParams& p) { p.o.shape[3] = 4; }, ErrorKind::shape, "o"},
      {[](NsaParams& p) { p.o = {}; }, ErrorKind::shape, "o"},
      {[](NsaParams& p) { p.gates[1].shape[1] = 39; }, ErrorKind::shape, "g_slc"},
      {[](NsaParams& p) { p.gates = {}; }, ErrorKind::config, "gates"},
      {[&](NsaParams& p) { p.k_cmp = k_cmp.view(); }, ErrorKind::config, "v_cmp"},
      {[&](NsaParams& p) { p.v_cmp = k_cmp.view(); }, ErrorKind::config, "k_cmp"},
      {[&](NsaParams& p) {
         p.k_cmp = k_cmp.view();
         p.v_cmp = k_cmp.view();  // Dqk = 4 but Dv = 3
       },
       ErrorKind::shape, "v_cmp"},
      {[&](NsaParams& p) {
         p.k_cmp = k_cmp.view();
         p.k_cmp.shape[1] = 8;  // 40 tokens make 9 compressed blocks
         p.v_cmp = p.k_cmp;
       },
       ErrorKind::shape, "k_cmp"},
      {[&](NsaParams& p) {
         p.block_indices = indices.view();
         p.gates[1] = {};
       },
       ErrorKind::config, "block_indices"},
      {[&](NsaParams& p) {
         p.block_indices = indices.view();
         p.block_indices.dtype = DType::float32;
       },
       ErrorKind::dtype, "block_indices"},
      {[&](NsaParams& p) {
         p.block_indices = indices.view();
         p.block_indices.shape[1] = 39;
       },
       ErrorKind::shape, "block_indices"},
      {[&](NsaParams& p) { p.cu_seqlens_cmp = indices.view(); }, ErrorKind::config, "cu_seqlens_cmp"},
      {[](NsaParams& p) { p.workspace_bytes -= 1; }, ErrorKind::config, "workspace"},
      {[](NsaParams& p) { p.workspace = nullptr; }, ErrorKind::value, "workspace"},
  };
  for (const Case& c : cases) {
    NsaParams bad = call.good;
    c.apply(bad);
    call.expect_rejected(bad, c.kind, c.argument);
  }
}

TEST(NsaValidation, BlockIndexContents) {
  ForwardCall call;
  Host<std::int32_t> indices = host<std::int32_t>({1, 40, 1, 3}, -1);
  NsaParams p = call.good;
  p.block_indices = indices.view();
  for (std::int64_t t = 0; t < 40; ++t) indices.data[t * 3] = 0;
  nsa_attention(p);  // block 0 alone everywhere is valid
  call.o.data.assign(call.o.data.size(), -99.0);
  const std::int64_t row = 35 * 3;  // token 35 has selection blocks 0, 1, 2
  const std::vector<std::vector<std::int32_t>> bad_rows = {
      {1, 0, -1},   // descending
      {0, 0, -1},   // repeated
      {0, -1, 2},   // -1 before the tail
      {0, 3, -1},   // past the last selection block of the 40 tokens
      {-2, -1, -1}, // negative
  };
  for (const auto& bad : bad_rows) {
    std::copy(bad.begin(), bad.end(), indices.data.begin() + row);
    call.expect_rejected(p, ErrorKind::value, "block_indices");
  }
  // Blocks after the query (but inside the sequence) are valid: their keys are simply not visible.
  indices.data[row + 1] = 2;
  indices.data[row + 2] = -1;
  indices.data[row] = 0;
  indices.data[0 * 3 + 1] = 2;
  nsa_attention(p);
}

TEST(NsaValidation, PackedLayoutErrors) {
  std::mt19937_64 rng(22);
  NsaCase c = NsaCase::varlen({9, 30}, 2, 2, 1, rng);
  HostF64 o = c.new_output(-99);
  std::vector<std::byte> workspace;
  const NsaParams good = c.params(o, workspace);
  const auto rejected = [&](const NsaParams& bad, ErrorKind kind, const std::string& argument) {
    expect_error([&] { nsa_attention(bad); }, kind, argument, "nsa_attention");
    EXPECT_EQ(o.data, std::vector<double>(o.data.size(), -99.0));
  };
  NsaParams bad = good;
  bad.cu_seqlens_cmp = {};
  rejected(bad, ErrorKind::shape, "cu_seqlens_cmp");
  c.cu_cmp.data[1] += 1;
  rejected(good, ErrorKind::value, "cu_seqlens_cmp");
  c.cu_cmp.data[1] -= 1;
  c.cu.data[1] = 35;  // 35, then 39 - 35 = 4 tokens: cu_seqlens_cmp no longer matches
  rejected(good, ErrorKind::value, "cu_seqlens_cmp");
  c.cu.data[1] = 45;  // decreasing
  rejected(good, ErrorKind::value, "cu_seqlens");
  c.cu.data[1] = 9;

  // Without the compressed branch and without selection, cu_seqlens_cmp is not needed.
  bad = good;
  bad.cu_seqlens_cmp = {};
  bad.gates[0] = bad.gates[1] = {};
  std::vector<std::byte> smaller(nsa_workspace_size(bad));
  bad.workspace = smaller.data();
  bad.workspace_bytes = smaller.size();
  nsa_attention(bad);
}

TEST(NsaValidation, CudaTensorsAreUnsupported) {
  ForwardCall call;
  NsaParams p = call.good;
  for (TensorView* t : {&p.q, &p.k, &p.v, &p.o, &p.gates[0], &p.gates[1], &p.gates[2]}) {
    t->device = DeviceType::cuda;
    t->dtype = DType::float32;
  }
  call.expect_rejected(p, ErrorKind::unsupported, "q");
}

// A forward call that ran, and valid backward params for it whose gradients start as -99.
struct BackwardCall {
  std::mt19937_64 rng{23};
  NsaCase c;
  HostF64 o, d_o;
  std::vector<std::byte> workspace, scratch;
  NsaGrads grads;
  NsaBackwardParams good;

  explicit BackwardCall(bool user_cmp, std::array<bool, kNumBranches> gates = {true, true, true})
      : c(NsaCase::batched(1, 40, 3, 1, rng)) {
    c.use_cmp = user_cmp;
    c.use_gate = gates;
    o = c.new_output();
    d_o = c.new_output(1.0);
    const NsaParams forward = c.params(o, workspace);
    nsa_attention(forward);
    grads = c.new_grads(-99);
    good = c.backward_params(forward, d_o, grads, scratch);
  }

  void expect_rejected(const NsaBackwardParams& bad, ErrorKind kind, const std::string& argument) {
    expect_error([&] { nsa_attention_backward(bad); }, kind, argument, "nsa_attention_backward");
    const NsaGrads& g = grads;
    for (const HostF64* t : {&g.dq, &g.dk, &g.dv, &g.dk_cmp, &g.dv_cmp, &g.d_gates[0], &g.d_gates[1], &g.d_gates[2]}) {
      EXPECT_EQ(t->data, std::vector<double>(t->data.size(), -99.0)) << "written despite the error on " << argument;
    }
  }
};

TEST(NsaValidation, BackwardErrorsNameTheArgument) {
  BackwardCall call(/*user_cmp=*/false, {false, true, true});
  HostF64 spare = call.c.k_cmp;
  HostF64 gate = call.c.gates[0];
  struct Case {
    std::function<void(NsaBackwardParams&)> apply;
    ErrorKind kind;
    std::string argument;
  };
  const std::vector<Case> cases = {
      {[](NsaBackwardParams& p) { p.d_o.shape[1] = 39; }, ErrorKind::shape, "d_o"},
      {[](NsaBackwardParams& p) { p.dq.dtype = DType::float32; }, ErrorKind::dtype, "dq"},
      {[](NsaBackwardParams& p) { p.dk.shape[3] = 3; }, ErrorKind::shape, "dk"},
      {[](NsaBackwardParams& p) { p.dv = {}; }, ErrorKind::shape, "dv"},
      {[&](NsaBackwardParams& p) { p.dk_cmp = spare.view(); }, ErrorKind::config, "dk_cmp"},
      {[&](NsaBackwardParams& p) { p.d_gates[0] = gate.view(); }, ErrorKind::config, "d_g_cmp"},
      {[](NsaBackwardParams& p) { p.d_gates[2].shape[2] = 2; }, ErrorKind::shape, "d_g_swa"},
      {[](NsaBackwardParams& p) { p.scratch_bytes -= 1; }, ErrorKind::config, "scratch"},
      {[](NsaBackwardParams& p) { p.scratch = nullptr; }, ErrorKind::value, "scratch"},
      {[](NsaBackwardParams& p) { p.forward.workspace_bytes = 256; }, ErrorKind::config, "workspace"},
      {[](NsaBackwardParams& p) { p.forward.config.window = 0; }, ErrorKind::config, "window"},
  };
  for (const Case& c : cases) {
    NsaBackwardParams bad = call.good;
    c.apply(bad);
    call.expect_rejected(bad, c.kind, c.argument);
  }
  // Gate gradients are optional.
  NsaBackwardParams without_gate_grads = call.good;
  without_gate_grads.d_gates = {};
  nsa_attention_backward(without_gate_grads);
}

TEST(NsaValidation, UserCompressedKvNeedsItsGradients) {
  BackwardCall call(/*user_cmp=*/true);
  NsaBackwardParams bad = call.good;
  bad.dk_cmp = {};
  call.expect_rejected(bad, ErrorKind::shape, "dk_cmp");
  bad = call.good;
  bad.dv_cmp.shape[3] = 4;
  call.expect_rejected(bad, ErrorKind::shape, "dv_cmp");
  nsa_attention_backward(call.good);
}

// Replaces every data pointer by null: what the Python fake (meta) implementation passes.
NsaParams shapes_only(NsaParams p) {
  for (TensorView* t : {&p.q, &p.k, &p.v, &p.k_cmp, &p.v_cmp, &p.block_indices, &p.o, &p.gates[0], &p.gates[1],
                        &p.gates[2], &p.seqs.cu_seqlens, &p.cu_seqlens_cmp}) {
    t->data = nullptr;
  }
  p.workspace = nullptr;
  return p;
}

TEST(NsaValidation, SizeQueriesNeedNoData) {
  std::mt19937_64 rng(24);
  for (NsaCase c : {NsaCase::batched(2, 40, 3, 1, rng), NsaCase::varlen({1, 37, 70}, 3, 4, 2, rng)}) {
    HostF64 o = c.new_output();
    std::vector<std::byte> workspace;
    const NsaParams p = c.params(o, workspace);
    EXPECT_EQ(nsa_workspace_size(shapes_only(p)), nsa_workspace_size(p));
    EXPECT_EQ(nsa_backward_scratch_size(shapes_only(p)), nsa_backward_scratch_size(p));
    EXPECT_EQ(nsa_forward_scratch_size(p), 0u);  // the CPU steps keep their working memory on the host
    NsaParams bad = shapes_only(p);
    bad.v.shape[1] += 1;
    expect_error([&] { nsa_workspace_size(bad); }, ErrorKind::shape, "v", "nsa_workspace_size");
    expect_error([&] { nsa_backward_scratch_size(bad); }, ErrorKind::shape, "v", "nsa_backward_scratch_size");
    expect_error([&] { nsa_forward_scratch_size(bad); }, ErrorKind::shape, "v", "nsa_forward_scratch_size");
  }
}

TEST(NsaValidation, WorkspaceHoldsOnlyWhatRuns) {
  std::mt19937_64 rng(25);
  NsaCase c = NsaCase::batched(1, 64, 4, 2, rng);
  HostF64 o = c.new_output();
  std::vector<std::byte> unused;
  const auto sizes = [&] {
    const NsaParams p = c.params(o, unused);
    return std::pair{nsa_workspace_size(p), nsa_backward_scratch_size(p)};
  };
  const auto all = sizes();
  c.use_gate = {false, false, true};  // the window branch alone: no compression, no selection
  const auto window_only = sizes();
  EXPECT_LT(window_only.first, all.first);
  EXPECT_LT(window_only.second, all.second);
  c.use_gate = {true, true, true};
  c.use_cmp = true;  // no pooled K/V, no dk_cmp/dv_cmp scratch
  EXPECT_LT(sizes().first, all.first);
  EXPECT_LT(sizes().second, all.second);
  c.use_cmp = false;
  c.use_indices = true;  // no indices
  EXPECT_LT(sizes().first, all.first);
  c.use_gate = {false, true, false};  // user indices and the selected branch alone: no compressed attention
  EXPECT_EQ(sizes().first, window_only.first);
}

TEST(NsaValidation, WorkspaceNeedsSixteenByteAlignment) {
  std::mt19937_64 rng(26);
  NsaCase c = NsaCase::batched(1, 40, 3, 1, rng);
  const HostF64 expected = c.forward();
  HostF64 o = c.new_output();
  std::vector<std::byte> unused;
  NsaParams p = c.params(o, unused);
  std::vector<std::byte> buffer(p.workspace_bytes + 16);
  p.workspace = buffer.data() + 16;
  nsa_attention(p);
  EXPECT_EQ(o.data, expected.data);
  p.workspace = buffer.data() + 8;
  try {
    nsa_attention(p);
    FAIL() << "expected an alignment error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::layout);
    EXPECT_EQ(e.argument(), "workspace");
  }
}

}  // namespace
}  // namespace sparseattn::test
