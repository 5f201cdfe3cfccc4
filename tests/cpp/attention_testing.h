// Helpers shared by the attention tests: an independent naive attention, error expectations, bfloat16
// rounding and views that break one rule of the API.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "sparseattn/error.h"
#include "test_util.h"

namespace sparseattn::test {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// Runs `call`, expects a sparseattn::Error of `kind` naming `argument`, and returns its message.
template <class Call>
std::string expect_error(Call&& call, ErrorKind kind, const std::string& argument) {
  try {
    call();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected an error naming '" << argument << "'";
  return {};
}

struct NaiveAttention {
  std::vector<double> o;    // [B, T, Hq, Dv]
  std::vector<double> lse;  // [B, Hq, T]
};

// Straightforward attention over batched q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv]: query head h
// reads KV head h / (Hq / Hkv); keep(b, h, t, s) says which keys a row sees; bias(b, h, t, s) is added.
inline NaiveAttention naive_attention(
    const HostF64& q, const HostF64& k, const HostF64& v, double scale,
    const std::function<bool(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>& keep,
    const std::function<double(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>& bias = nullptr) {
  const std::int64_t batch = q.shape[0], rows = q.shape[1], q_heads = q.shape[2], dim = q.shape[3];
  const std::int64_t keys = k.shape[1], kv_heads = k.shape[2], dim_v = v.shape[3];
  NaiveAttention out{std::vector<double>(batch * rows * q_heads * dim_v, 0.0),
                     std::vector<double>(batch * q_heads * rows, -kInf)};
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t t = 0; t < rows; ++t) {
      for (std::int64_t h = 0; h < q_heads; ++h) {
        const std::int64_t kv = h / (q_heads / kv_heads);
        std::vector<double> scores(keys, -kInf);
        double max = -kInf;
        for (std::int64_t s = 0; s < keys; ++s) {
          if (!keep(b, h, t, s)) continue;
          double score = 0;
          for (std::int64_t c = 0; c < dim; ++c) {
            score += q.data[((b * rows + t) * q_heads + h) * dim + c] * k.data[((b * keys + s) * kv_heads + kv) * dim + c];
          }
          scores[s] = scale * score + (bias ? bias(b, h, t, s) : 0.0);
          max = std::max(max, scores[s]);
        }
        if (max == -kInf) continue;
        double sum = 0;
        for (double s : scores) sum += std::exp(s - max);
        out.lse[(b * q_heads + h) * rows + t] = max + std::log(sum);
        for (std::int64_t s = 0; s < keys; ++s) {
          const double p = std::exp(scores[s] - max) / sum;
          for (std::int64_t c = 0; c < dim_v; ++c) {
            out.o[((b * rows + t) * q_heads + h) * dim_v + c] += p * v.data[((b * keys + s) * kv_heads + kv) * dim_v + c];
          }
        }
      }
    }
  }
  return out;
}

// Element-wise |a - b| <= tol, with equal infinities counting as equal (-inf log-sum-exps of empty rows).
inline void expect_near(const std::vector<double>& actual, const std::vector<double>& expected, double tol,
                        const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (std::isinf(expected[i])) {
      EXPECT_EQ(actual[i], expected[i]) << what << " [" << i << "]";
    } else {
      EXPECT_NEAR(actual[i], expected[i], tol) << what << " [" << i << "]";
    }
  }
}

inline Host<float> to_float32(const HostF64& x) {
  Host<float> y;
  y.shape = x.shape;
  y.data.assign(x.data.begin(), x.data.end());
  return y;
}

inline std::vector<double> to_float64(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// bfloat16 bits <-> value (round to nearest even); tests keep bfloat16 tensors as Host<uint16_t>.
inline std::uint16_t bfloat16_bits(double value) {
  const float f = static_cast<float>(value);
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

inline double bfloat16_value(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

inline Host<std::uint16_t> to_bfloat16(const HostF64& x) {
  Host<std::uint16_t> y;
  y.shape = x.shape;
  for (double value : x.data) y.data.push_back(bfloat16_bits(value));
  return y;
}

inline TensorView bfloat16_view(Host<std::uint16_t>& x) {
  TensorView view = x.view();
  view.dtype = DType::bfloat16;
  return view;
}

inline std::vector<double> from_bfloat16(const std::vector<std::uint16_t>& bits) {
  std::vector<double> values;
  for (std::uint16_t b : bits) values.push_back(bfloat16_value(b));
  return values;
}

// `x` rounded to bfloat16 and back.
inline HostF64 rounded_to_bfloat16(const HostF64& x) {
  HostF64 y = x;
  for (double& value : y.data) value = bfloat16_value(bfloat16_bits(value));
  return y;
}

inline TensorView on_cuda(TensorView view) {
  view.device = DeviceType::cuda;
  return view;
}

// A view of the first `shape[last]` elements of every other element along the last dimension of `wide`
// (a tensor whose last dimension is twice as long): a valid shape with inner stride 2.
inline TensorView inner_stride_two(HostF64& wide) {
  TensorView view = wide.view();
  view.shape[view.rank - 1] /= 2;
  view.stride[view.rank - 1] = 2;
  return view;
}

}  // namespace sparseattn::test
