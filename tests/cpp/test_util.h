// Helpers for the C++ tests: owning host tensors, random fills and a finite-difference gradient check.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <random>
#include <vector>

#include "sparseattn/tensor.h"

namespace sparseattn::test {

// Shared memory a CTA may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin), for the CUDA plans' tests.
inline constexpr std::size_t kH100 = 227 * 1024;
inline constexpr std::size_t kA100 = 163 * 1024;

// A float64 (or int32/bool) host tensor that owns its memory; view() hands it to the API.
template <class T>
struct Host {
  std::vector<std::int64_t> shape;
  std::vector<T> data;

  Host() = default;
  Host(std::initializer_list<std::int64_t> dims, T fill = T{}) : shape(dims) {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    data.assign(static_cast<std::size_t>(n), fill);
  }
  TensorView view() {
    TensorView t;
    t.data = data.data();
    t.dtype = dtype();
    t.rank = static_cast<int>(shape.size());
    std::int64_t stride = 1;
    for (int i = t.rank - 1; i >= 0; --i) {
      t.shape[i] = shape[i];
      t.stride[i] = stride;
      stride *= shape[i];
    }
    return t;
  }
  static DType dtype() {
    if constexpr (std::is_same_v<T, double>) return DType::float64;
    else if constexpr (std::is_same_v<T, float>) return DType::float32;
    else if constexpr (std::is_same_v<T, std::int32_t>) return DType::int32;
    else return DType::boolean;
  }
  std::int64_t numel() const { return static_cast<std::int64_t>(data.size()); }
};

using HostF64 = Host<double>;

inline void fill_random(HostF64& t, std::mt19937_64& rng, double scale = 1.0) {
  std::normal_distribution<double> normal(0.0, scale);
  for (double& x : t.data) x = normal(rng);
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

// Central-difference estimate of d(loss)/d(x[i]) for every i, where loss() reads x.
inline std::vector<double> numeric_gradient(HostF64& x, const std::function<double()>& loss, double eps = 1e-6) {
  std::vector<double> grad(x.data.size());
  for (std::size_t i = 0; i < x.data.size(); ++i) {
    const double saved = x.data[i];
    x.data[i] = saved + eps;
    const double plus = loss();
    x.data[i] = saved - eps;
    const double minus = loss();
    x.data[i] = saved;
    grad[i] = (plus - minus) / (2 * eps);
  }
  return grad;
}

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

}  // namespace sparseattn::test
