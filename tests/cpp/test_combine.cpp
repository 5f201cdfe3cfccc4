#include <gtest/gtest.h>

#include "sparseattn/combine.h"
#include "sparseattn/error.h"
#include "test_util.h"

namespace sparseattn::test {
namespace {

TEST(Combine, HandComputedTwoBranches) {
  // One token, one head, Dv = 2: o = 0.5*[1, 2] + 2*[3, -1] = [6.5, -1].
  HostF64 o_cmp({1, 1, 1, 2}), o_swa({1, 1, 1, 2}), g_cmp({1, 1, 1}, 0.5), g_swa({1, 1, 1}, 2.0);
  o_cmp.data = {1, 2};
  o_swa.data = {3, -1};
  HostF64 o({1, 1, 1, 2}, -99);
  CombineParams params;
  params.outputs = {o_cmp.view(), TensorView{}, o_swa.view()};
  params.gates = {g_cmp.view(), TensorView{}, g_swa.view()};
  params.o = o.view();
  combine(params);
  EXPECT_DOUBLE_EQ(o.data[0], 6.5);
  EXPECT_DOUBLE_EQ(o.data[1], -1.0);
}

TEST(Combine, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(7);
  const std::int64_t rows = 5, heads = 3, dim = 4;
  std::array<HostF64, 3> outs, gates;
  for (int i = 0; i < 3; ++i) {
    outs[i] = HostF64({rows, heads, dim});
    gates[i] = HostF64({rows, heads});
    fill_random(outs[i], rng);
    fill_random(gates[i], rng);
  }
  HostF64 weight({rows, heads, dim});
  fill_random(weight, rng);
  auto forward = [&] {
    HostF64 o({rows, heads, dim});
    CombineParams params;
    for (int i = 0; i < 3; ++i) {
      params.outputs[i] = outs[i].view();
      params.gates[i] = gates[i].view();
    }
    params.o = o.view();
    combine(params);
    return dot(o.data, weight.data);
  };
  std::array<HostF64, 3> d_outs, d_gates;
  CombineBackwardParams back;
  for (int i = 0; i < 3; ++i) {
    d_outs[i] = HostF64({rows, heads, dim});
    d_gates[i] = HostF64({rows, heads});
    back.outputs[i] = outs[i].view();
    back.gates[i] = gates[i].view();
    back.d_outputs[i] = d_outs[i].view();
    back.d_gates[i] = d_gates[i].view();
  }
  back.d_o = weight.view();
  combine_backward(back);
  for (int i = 0; i < 3; ++i) {
    EXPECT_LT(max_abs_diff(d_outs[i].data, numeric_gradient(outs[i], forward)), 1e-7);
    EXPECT_LT(max_abs_diff(d_gates[i].data, numeric_gradient(gates[i], forward)), 1e-7);
  }
}

TEST(Combine, ValidationNamesTheArgument) {
  HostF64 o_cmp({1, 4, 2, 8}), g_bad({1, 4, 3}), o({1, 4, 2, 8});
  CombineParams params;
  params.outputs[0] = o_cmp.view();
  params.gates[0] = g_bad.view();
  params.o = o.view();
  try {
    combine(params);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::shape);
    EXPECT_EQ(e.argument(), "g_cmp");
    EXPECT_NE(std::string(e.what()).find("[1, 4, 2]"), std::string::npos) << e.what();
  }
  params.gates[0] = TensorView{};
  EXPECT_THROW(combine(params), Error);  // no branch at all
}

}  // namespace
}  // namespace sparseattn::test
