// create_mask: hand-computed top-k masks (ties, causal, window, padding, keep above the visible count, empty
// rows, NaN) and validation that names the argument and writes nothing.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "sparseattn/create_mask.h"

namespace sparseattn::test {
namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();
using Rows = std::vector<std::vector<int>>;

struct Options {
  std::int64_t keep = 1;
  bool causal = false;
  const std::vector<std::uint8_t>* padding = nullptr;  // [B, S]
  std::int64_t left = -1, right = -1;
};

// Runs create_mask on a float64 bias [B, H, T, S] and returns its rows (b, h, t) as 0/1 vectors.
Rows run(HostF64& bias, const Options& o) {
  const std::int64_t batch = bias.shape[0], keys = bias.shape[3];
  Host<std::uint8_t> mask({bias.shape[0], bias.shape[1], bias.shape[2], keys}, 7);
  Host<std::uint8_t> padding({batch, keys});
  CreateMaskParams p;
  p.bias = bias.view();
  p.mask = mask.view();
  if (o.padding) {
    padding.data = *o.padding;
    p.key_padding_mask = padding.view();
  }
  p.keep = o.keep;
  p.causal = o.causal;
  p.window_left = o.left;
  p.window_right = o.right;
  create_mask(p);
  Rows rows;
  for (std::int64_t i = 0; i < mask.numel(); i += keys) {
    rows.emplace_back(mask.data.begin() + i, mask.data.begin() + i + keys);
  }
  return rows;
}

// The worked example of docs/semantics.md ("### create_mask").
HostF64 example_bias() {
  HostF64 bias({1, 1, 3, 5});
  bias.data = {0.5, 2.0, 1.0, 3.0, -1.0,  //
               2.0, 9.0, 1.0, 1.0, 5.0,   //
               kNaN, 4.0, 0.3, -0.5, 0.7};
  return bias;
}
const std::vector<std::uint8_t> kExamplePadding = {1, 0, 1, 1, 1};

TEST(CreateMask, SemanticsExample) {
  HostF64 bias = example_bias();
  EXPECT_EQ(run(bias, {.keep = 2, .causal = true, .padding = &kExamplePadding}),
            (Rows{{1, 0, 1, 0, 0}, {1, 0, 1, 0, 0}, {0, 0, 1, 0, 1}}));
  EXPECT_EQ(run(bias, {.keep = 2, .padding = &kExamplePadding}),
            (Rows{{0, 0, 1, 1, 0}, {1, 0, 0, 0, 1}, {0, 0, 1, 0, 1}}));
  EXPECT_EQ(run(bias, {.keep = 2, .causal = true}), (Rows{{0, 1, 1, 0, 0}, {1, 1, 0, 0, 0}, {0, 1, 0, 0, 1}}));
  EXPECT_EQ(run(bias, {.keep = 2}), (Rows{{0, 1, 0, 1, 0}, {0, 1, 0, 0, 1}, {0, 1, 0, 0, 1}}));
  // keep larger than the visible count: every visible (non-NaN) key.
  EXPECT_EQ(run(bias, {.keep = 9, .causal = true, .padding = &kExamplePadding}),
            (Rows{{1, 0, 1, 0, 0}, {1, 0, 1, 1, 0}, {0, 0, 1, 1, 1}}));
  EXPECT_EQ(run(bias, {.keep = 5}), (Rows{{1, 1, 1, 1, 1}, {1, 1, 1, 1, 1}, {0, 1, 1, 1, 1}}));
}

TEST(CreateMask, TiesGoToTheLowerIndex) {
  HostF64 bias({1, 1, 2, 6});
  bias.data = {1, 1, 1, 1, 1, 1,  //
               0, 2, 5, 2, 5, 2};
  EXPECT_EQ(run(bias, {.keep = 2}), (Rows{{1, 1, 0, 0, 0, 0}, {0, 0, 1, 0, 1, 0}}));
  EXPECT_EQ(run(bias, {.keep = 3}), (Rows{{1, 1, 1, 0, 0, 0}, {0, 1, 1, 0, 1, 0}}));
  EXPECT_EQ(run(bias, {.keep = 4}), (Rows{{1, 1, 1, 1, 0, 0}, {0, 1, 1, 1, 1, 0}}));
  // Padding the first tied key moves the choice to the next one.
  const std::vector<std::uint8_t> padding = {1, 0, 1, 1, 1, 1};
  EXPECT_EQ(run(bias, {.keep = 3, .padding = &padding}), (Rows{{1, 0, 1, 1, 0, 0}, {0, 0, 1, 1, 1, 0}}));
}

TEST(CreateMask, InfinitiesAreValuesAndNaNIsNeverKept) {
  const double inf = std::numeric_limits<double>::infinity();
  HostF64 bias({1, 1, 3, 4});
  bias.data = {-inf, kNaN, 0.0, inf,  //
               kNaN, kNaN, kNaN, kNaN,  //
               kNaN, -inf, -inf, kNaN};
  EXPECT_EQ(run(bias, {.keep = 1}), (Rows{{0, 0, 0, 1}, {0, 0, 0, 0}, {0, 1, 0, 0}}));
  EXPECT_EQ(run(bias, {.keep = 3}), (Rows{{1, 0, 1, 1}, {0, 0, 0, 0}, {0, 1, 1, 0}}));
}

TEST(CreateMask, CausalIsBottomRightAlignedAndEmptyRowsAreFalse) {
  // T = 4 queries, S = 2 keys: rows 0 and 1 are aligned before key 0 and see nothing.
  HostF64 bias({1, 1, 4, 2}, 1.0);
  EXPECT_EQ(run(bias, {.keep = 1, .causal = true}), (Rows{{0, 0}, {0, 0}, {1, 0}, {1, 0}}));
  EXPECT_EQ(run(bias, {.keep = 2, .causal = true}), (Rows{{0, 0}, {0, 0}, {1, 0}, {1, 1}}));
  // A fully padded sequence is empty in every row; the other sequence is unaffected.
  HostF64 two({2, 1, 1, 3}, 0.0);
  const std::vector<std::uint8_t> padding = {0, 0, 0, 1, 1, 0};
  EXPECT_EQ(run(two, {.keep = 2, .padding = &padding}), (Rows{{0, 0, 0}, {1, 1, 0}}));
}

TEST(CreateMask, WindowAsFlashAttention) {
  // T = S = 5, window (1, 0): query t sees keys t-1 .. t; with (1, 1) keys t-1 .. t+1 (no causal).
  HostF64 bias({1, 1, 5, 5});
  for (std::int64_t t = 0; t < 5; ++t)
    for (std::int64_t s = 0; s < 5; ++s) bias.data[t * 5 + s] = static_cast<double>(s);  // larger keys win
  EXPECT_EQ(run(bias, {.keep = 1, .left = 1, .right = 0}),
            (Rows{{1, 0, 0, 0, 0}, {0, 1, 0, 0, 0}, {0, 0, 1, 0, 0}, {0, 0, 0, 1, 0}, {0, 0, 0, 0, 1}}));
  EXPECT_EQ(run(bias, {.keep = 5, .left = 1, .right = 1}),
            (Rows{{1, 1, 0, 0, 0}, {1, 1, 1, 0, 0}, {0, 1, 1, 1, 0}, {0, 0, 1, 1, 1}, {0, 0, 0, 1, 1}}));
  // More queries than keys (T = 4, S = 2): row t is aligned to t - 2, so (0, 3) sees keys t - 2 .. t + 1.
  HostF64 tall({1, 1, 4, 2}, 0.0);
  EXPECT_EQ(run(tall, {.keep = 2, .left = 0, .right = 3}), (Rows{{1, 1}, {1, 1}, {1, 1}, {0, 1}}));
  EXPECT_EQ(run(tall, {.keep = 2, .left = 0, .right = 2}), (Rows{{1, 0}, {1, 1}, {1, 1}, {0, 1}}));
  // Huge bounds are unbounded in effect (no overflow).
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(run(bias, {.keep = 1, .causal = true, .left = huge, .right = huge}),
            (Rows{{1, 0, 0, 0, 0}, {0, 1, 0, 0, 0}, {0, 0, 1, 0, 0}, {0, 0, 0, 1, 0}, {0, 0, 0, 0, 1}}));
}

TEST(CreateMask, Float32AndStridedViews) {
  // A float32 key bias [1, 2, 1, 4] expanded over T = 3 rows with a zero stride; the mask written into every
  // other row of a larger buffer.
  Host<float> key_bias({1, 2, 1, 4});
  key_bias.data = {0.25f, 3.f, -1.f, 3.f, 7.f, 6.f, 5.f, 4.f};
  TensorView bias = key_bias.view();
  bias.shape[2] = 3;
  bias.stride[2] = 0;
  Host<std::uint8_t> buffer({1, 2, 6, 4}, 9);
  TensorView mask = buffer.view();
  mask.shape[2] = 3;
  mask.stride[2] = 8;
  create_mask({.bias = bias, .mask = mask, .keep = 2, .causal = true});
  // causal with T = 3, S = 4: row t sees keys 0 .. t + 1.
  const std::vector<std::uint8_t> expected = {
      1, 1, 0, 0, 9, 9, 9, 9, 1, 1, 0, 0, 9, 9, 9, 9, 0, 1, 0, 1, 9, 9, 9, 9,   // head 0
      1, 1, 0, 0, 9, 9, 9, 9, 1, 1, 0, 0, 9, 9, 9, 9, 1, 1, 0, 0, 9, 9, 9, 9};  // head 1
  EXPECT_EQ(buffer.data, expected);
}

TEST(CreateMask, EmptyShapes) {
  for (auto shape : {std::vector<std::int64_t>{0, 2, 3, 4}, {1, 2, 0, 4}, {1, 2, 3, 0}}) {
    HostF64 bias({shape[0], shape[1], shape[2], shape[3]});
    Host<std::uint8_t> mask({shape[0], shape[1], shape[2], shape[3]});
    create_mask({.bias = bias.view(), .mask = mask.view(), .keep = 3, .causal = true});
  }
}

TEST(CreateMask, ValidationNamesTheArgumentAndWritesNothing) {
  HostF64 bias({2, 3, 4, 5}), bias3({2, 3, 20}), wide({2, 3, 4, 10});
  Host<std::int32_t> bias_int({2, 3, 4, 5});
  Host<std::uint8_t> mask({2, 3, 4, 5}, 7), mask_short({2, 3, 4, 4}), padding({2, 5}, 1), padding_bad({1, 5}, 1);
  HostF64 mask_float({2, 3, 4, 5}), padding_float({2, 5});
  using Edit = std::function<void(CreateMaskParams&)>;
  struct Case { const char* what; Edit edit; ErrorKind kind; const char* arg; };
  const std::vector<Case> cases = {
      {"no bias", [](auto& p) { p.bias = {}; }, ErrorKind::shape, "bias"},
      {"bias int32", [&](auto& p) { p.bias = bias_int.view(); }, ErrorKind::dtype, "bias"},
      {"bias rank 3", [&](auto& p) { p.bias = bias3.view(); }, ErrorKind::shape, "bias"},
      {"bias inner stride", [&](auto& p) { p.bias = inner_stride_two(wide); }, ErrorKind::layout, "bias"},
      {"no mask", [](auto& p) { p.mask = {}; }, ErrorKind::shape, "mask"},
      {"mask float64", [&](auto& p) { p.mask = mask_float.view(); }, ErrorKind::dtype, "mask"},
      {"mask shape", [&](auto& p) { p.mask = mask_short.view(); }, ErrorKind::shape, "mask"},
      {"mask on cuda", [](auto& p) { p.mask = on_cuda(p.mask); }, ErrorKind::device, "mask"},
      {"padding float", [&](auto& p) { p.key_padding_mask = padding_float.view(); }, ErrorKind::dtype, "key_padding_mask"},
      {"padding batch", [&](auto& p) { p.key_padding_mask = padding_bad.view(); }, ErrorKind::shape, "key_padding_mask"},
      {"padding on cuda", [&](auto& p) { p.key_padding_mask = on_cuda(padding.view()); }, ErrorKind::device,
       "key_padding_mask"},
      {"keep 0", [](auto& p) { p.keep = 0; }, ErrorKind::config, "keep"},
      {"keep -3", [](auto& p) { p.keep = -3; }, ErrorKind::config, "keep"},
      {"cuda", [&](auto& p) { p.bias = on_cuda(p.bias), p.mask = on_cuda(p.mask), p.key_padding_mask = on_cuda(p.key_padding_mask); },
       ErrorKind::unsupported, "bias"},
  };
  for (const Case& c : cases) {
    CreateMaskParams p{.bias = bias.view(), .key_padding_mask = padding.view(), .mask = mask.view(), .keep = 2};
    c.edit(p);
    SCOPED_TRACE(c.what);
    const std::string message = expect_error([&] { create_mask(p); }, c.kind, c.arg);
    EXPECT_EQ(message.rfind("sparseattn.create_mask: argument '" + std::string(c.arg) + "': ", 0), 0u) << message;
    if (c.kind == ErrorKind::unsupported) EXPECT_NE(message.find("use CPU tensors"), std::string::npos) << message;
  }
  for (std::uint8_t x : mask.data) EXPECT_EQ(x, 7);
}

}  // namespace
}  // namespace sparseattn::test
