// The reference backend's working form: float64, row-major copies of the caller's strided tensors, plus
// the sequence spans and the thread pool every reference operation uses.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/token_layout.h"
#include "sparseattn/sequences.h"
#include "sparseattn/tensor.h"

namespace sparseattn::reference {

// A dense float64 array of rank 1 to 4. Packed token tensors are loaded with a leading batch dimension
// of 1 (see with_batch_dim) so that one indexing scheme serves both layouts.
struct Dense {
  std::vector<std::int64_t> shape;
  std::vector<double> values;

  static Dense zeros(std::vector<std::int64_t> shape);
  std::int64_t dim(int i) const { return shape[i]; }
  std::int64_t numel() const { return static_cast<std::int64_t>(values.size()); }

  double& operator()(std::int64_t i, std::int64_t j) { return values[i * shape[1] + j]; }
  double operator()(std::int64_t i, std::int64_t j) const { return values[i * shape[1] + j]; }
  double& operator()(std::int64_t i, std::int64_t j, std::int64_t k) {
    return values[(i * shape[1] + j) * shape[2] + k];
  }
  double operator()(std::int64_t i, std::int64_t j, std::int64_t k) const {
    return values[(i * shape[1] + j) * shape[2] + k];
  }
  double& operator()(std::int64_t i, std::int64_t j, std::int64_t k, std::int64_t l) {
    return values[((i * shape[1] + j) * shape[2] + k) * shape[3] + l];
  }
  double operator()(std::int64_t i, std::int64_t j, std::int64_t k, std::int64_t l) const {
    return values[((i * shape[1] + j) * shape[2] + k) * shape[3] + l];
  }
  // Pointer to the innermost row at the given leading indices (rank 4 / rank 3).
  const double* row(std::int64_t i, std::int64_t j, std::int64_t k) const {
    return values.data() + ((i * shape[1] + j) * shape[2] + k) * shape[3];
  }
  double* row(std::int64_t i, std::int64_t j, std::int64_t k) {
    return values.data() + ((i * shape[1] + j) * shape[2] + k) * shape[3];
  }
};

// Float tensors of any supported dtype to float64 (same shape; rank 1 to 4).
Dense load(const TensorView& t);
// Rounds to t's dtype and writes through t's strides; `values` must have t's element count.
void store(const Dense& values, const TensorView& t);
// Prepends a dimension of 1 when `packed` (a packed [N, H, D] becomes [1, N, H, D]).
Dense with_batch_dim(Dense dense, bool packed);

std::vector<std::int32_t> load_int32(const TensorView& t);   // row-major
void store_int32(const std::vector<std::int32_t>& values, const TensorView& t);
std::vector<std::uint8_t> load_bool(const TensorView& t);    // row-major, 0 or 1

// One sequence: its batch index in the (batch-dim) Dense arrays, first row and length.
struct Span {
  std::int64_t batch = 0;
  std::int64_t begin = 0;
  std::int64_t length = 0;
};
// Batched: {b, 0, rows}. Packed: {0, cu[b], cu[b+1] - cu[b]}. cu_seqlens must be on the CPU.
std::vector<Span> spans(const detail::TokenLayout& layout, const TensorView& cu_seqlens);

// Runs body(i) for i in [0, n) on all cores. Each i must touch disjoint outputs, so the result does not
// depend on scheduling. The first exception thrown by a body is rethrown.
template <class Body>
void parallel_for(std::int64_t n, Body&& body) {
  const std::int64_t workers =
      std::min<std::int64_t>(n, std::max<std::int64_t>(1, std::thread::hardware_concurrency()));
  if (workers <= 1) {
    for (std::int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::atomic<std::int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  std::vector<std::thread> threads;
  threads.reserve(workers);
  for (std::int64_t w = 0; w < workers; ++w) {
    threads.emplace_back([&] {
      for (std::int64_t i = next++; i < n; i = next++) {
        try {
          body(i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!error) error = std::current_exception();
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace sparseattn::reference
