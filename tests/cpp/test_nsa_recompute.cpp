// NsaRecompute: the modes that keep less for the backward give the output and gradients of NsaRecompute::none bit
// for bit (the same deterministic steps in the same order), keep less workspace, and are checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <random>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "nsa_case.h"
#include "test_util.h"

namespace sparseattn::test {
namespace {

const NsaRecompute kModes[] = {NsaRecompute::none, NsaRecompute::branches, NsaRecompute::selected_and_window};

struct Result {
  HostF64 o;
  NsaGrads grads;
  std::size_t workspace_bytes = 0;
};

Result run(NsaCase c, NsaRecompute mode, HostF64& d_o) {
  c.recompute = mode;
  Result r;
  r.o = c.new_output(-7.0);  // the forward writes every element (batched); packed rows past the last stay
  std::vector<std::byte> workspace, scratch;
  const NsaParams forward = c.params(r.o, workspace);
  std::fill(c.forward_scratch.begin(), c.forward_scratch.end(), std::byte{0xFF});  // NaN in every float slot
  nsa_attention(forward);
  r.workspace_bytes = workspace.size();
  r.grads = c.new_grads(-3.0);
  NsaBackwardParams backward = c.backward_params(forward, d_o, r.grads, scratch);
  std::fill(scratch.begin(), scratch.end(), std::byte{0xFF});
  backward.forward.o = d_o.view();  // the backward reads no o: d_o stands in for it
  nsa_attention_backward(backward);
  return r;
}

void expect_modes_equal(const NsaCase& c, const std::string& label) {
  std::mt19937_64 rng(17);
  HostF64 d_o = c.new_output();
  fill_random(d_o, rng);
  const Result expected = run(c, NsaRecompute::none, d_o);
  for (NsaRecompute mode : kModes) {
    const Result got = run(c, mode, d_o);
    const std::string where = label + " mode " + std::to_string(static_cast<int>(mode));
    EXPECT_EQ(got.o.data, expected.o.data) << where;
    EXPECT_EQ(got.grads.dq.data, expected.grads.dq.data) << where;
    EXPECT_EQ(got.grads.dk.data, expected.grads.dk.data) << where;
    EXPECT_EQ(got.grads.dv.data, expected.grads.dv.data) << where;
    EXPECT_EQ(got.grads.dk_cmp.data, expected.grads.dk_cmp.data) << where;
    EXPECT_EQ(got.grads.dv_cmp.data, expected.grads.dv_cmp.data) << where;
    for (int i = 0; i < kNumBranches; ++i) {
      EXPECT_EQ(got.grads.d_gates[i].data, expected.grads.d_gates[i].data) << where;
    }
    if (mode != NsaRecompute::none && c.use_gate[1] && c.use_gate[2]) {
      EXPECT_LT(got.workspace_bytes, expected.workspace_bytes) << where;
    }
  }
}

const std::array<bool, kNumBranches> kGateSets[] = {{true, true, true},  {false, true, true}, {true, false, true},
                                                    {true, true, false}, {true, false, false}, {false, true, false},
                                                    {false, false, true}};

TEST(NsaRecompute, BatchedModesAreBitIdenticalForEveryBranchSubset) {
  for (const auto& gates : kGateSets) {
    std::mt19937_64 rng(1);
    NsaCase c = NsaCase::batched(2, 45, 4, 2, rng);
    c.use_gate = gates;
    expect_modes_equal(c, "batched gates " + std::to_string(gates[0]) + std::to_string(gates[1]) +
                              std::to_string(gates[2]));
  }
}

TEST(NsaRecompute, PackedModesAreBitIdenticalForEveryBranchSubset) {
  for (const auto& gates : kGateSets) {
    std::mt19937_64 rng(2);
    NsaCase c = NsaCase::varlen({37, 1, 20}, 3, 6, 2, rng);
    c.use_gate = gates;
    expect_modes_equal(c, "packed gates " + std::to_string(gates[0]) + std::to_string(gates[1]) +
                              std::to_string(gates[2]));
  }
}

TEST(NsaRecompute, UserCompressedKv) {
  std::mt19937_64 rng(3);
  NsaCase c = NsaCase::batched(1, 50, 3, 1, rng);
  c.use_cmp = true;
  expect_modes_equal(c, "user k_cmp");
  NsaCase packed = NsaCase::varlen({30, 17}, 2, 3, 3, rng);
  packed.use_cmp = true;
  expect_modes_equal(packed, "packed user k_cmp");
}

TEST(NsaRecompute, WorkspaceKeepsOnlyWhatTheBackwardCannotRecompute) {
  std::mt19937_64 rng(4);
  NsaCase c = NsaCase::batched(1, 64, 4, 2, rng);
  const auto sizes = [&](NsaRecompute mode) {
    c.recompute = mode;
    HostF64 o = c.new_output();
    std::vector<std::byte> workspace;
    const NsaParams p = c.params(o, workspace);
    return std::array<std::size_t, 2>{nsa_workspace_size(p), nsa_forward_scratch_size(p)};
  };
  const std::size_t output_bytes = 64 * 4 * 3 * sizeof(double);  // T x Hq x Dv
  const auto none = sizes(NsaRecompute::none), branches = sizes(NsaRecompute::branches),
             local = sizes(NsaRecompute::selected_and_window);
  EXPECT_EQ(none[1], 0u);
  EXPECT_LE(branches[0] + 3 * output_bytes, none[0]);
  EXPECT_GE(branches[1], 2 * output_bytes);  // two outputs in scratch, the window's in o
  EXPECT_LE(local[0] + 2 * output_bytes, none[0]);
  EXPECT_GE(local[0], branches[0] + output_bytes);
}

TEST(NsaRecompute, ChecksTheModeTheScratchAndO) {
  std::mt19937_64 rng(5);
  NsaCase c = NsaCase::batched(1, 40, 2, 1, rng);
  c.recompute = NsaRecompute::branches;
  HostF64 o = c.new_output();
  std::vector<std::byte> workspace;
  NsaParams p = c.params(o, workspace);
  NsaParams bad = p;
  bad.recompute = static_cast<NsaRecompute>(7);
  expect_error([&] { nsa_attention(bad); }, ErrorKind::config, "recompute");
  bad = p;
  bad.scratch_bytes -= 1;
  expect_error([&] { nsa_attention(bad); }, ErrorKind::config, "scratch");
  // o with a row stride larger than its rows: the window branch cannot write its output there.
  HostF64 wide = host<double>({1, 40, 2, 6});
  bad = p;
  bad.o = wide.view();
  bad.o.shape[3] = 3;
  expect_error([&] { nsa_attention(bad); }, ErrorKind::shape, "o");
  // A backward told another mode than its forward's finds the workspace too small.
  nsa_attention(p);
  HostF64 d_o = c.new_output(1.0);
  NsaGrads grads = c.new_grads();
  std::vector<std::byte> scratch;
  NsaParams none = p;
  none.recompute = NsaRecompute::none;
  NsaBackwardParams backward = c.backward_params(none, d_o, grads, scratch);
  expect_error([&] { nsa_attention_backward(backward); }, ErrorKind::config, "workspace");
}

}  // namespace
}  // namespace sparseattn::test
