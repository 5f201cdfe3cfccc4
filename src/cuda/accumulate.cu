// accumulate (internal): out = sum of up to kMaxTerms same-shaped tensors, any strides with a contiguous
// last dimension. Memory-bound and off the hot path of attention, so one grid-stride kernel serves every
// rank; packed outputs skip rows past cu_seqlens[B] (read on the device, no host sync).
#include "api/accumulate.h"
#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace sparseattn::cuda {

namespace {

constexpr int kThreads = 256;

template <class T>
struct Strided4 {
  T* data;
  std::int64_t stride[kMaxRank];
};

// Passed by value (a plain array parameter would decay to a host pointer).
template <class T>
struct Terms {
  Strided4<const T> term[detail::kMaxAccumulateTerms];
  int count;
};

struct Shape4 {
  std::int64_t extent[kMaxRank];  // leading dimensions padded with 1; extent[pad] is the row dimension
  int row_dim;
};

template <class T>
Strided4<T> strided4(const TensorView& t) {
  Strided4<T> s{static_cast<T*>(t.data), {0, 0, 0, 0}};
  const int pad = kMaxRank - t.rank;
  for (int i = 0; i < t.rank; ++i) s.stride[pad + i] = t.stride[i];
  return s;
}

template <class T>
__global__ void accumulate_kernel(Strided4<T> out, Terms<T> terms, Shape4 shape, const std::int32_t* rows_used) {
  const std::int64_t total = shape.extent[0] * shape.extent[1] * shape.extent[2] * shape.extent[3];
  const std::int64_t row_limit = rows_used == nullptr ? shape.extent[shape.row_dim] : *rows_used;
  for (std::int64_t e = std::int64_t{blockIdx.x} * kThreads + threadIdx.x; e < total;
       e += std::int64_t{gridDim.x} * kThreads) {
    std::int64_t index[kMaxRank];
    std::int64_t rest = e;
    for (int d = kMaxRank - 1; d >= 0; --d) {
      index[d] = rest % shape.extent[d];
      rest /= shape.extent[d];
    }
    if (index[shape.row_dim] >= row_limit) continue;
    float sum = 0.f;
    for (int i = 0; i < terms.count; ++i) {
      std::int64_t offset = 0;
      for (int d = 0; d < kMaxRank; ++d) offset += index[d] * terms.term[i].stride[d];
      sum += to_float(terms.term[i].data[offset]);
    }
    std::int64_t offset = 0;
    for (int d = 0; d < kMaxRank; ++d) offset += index[d] * out.stride[d];
    out.data[offset] = from_float<T>(sum);
  }
}

}  // namespace

void accumulate(const detail::AccumulateParams& params) {
  const DeviceGuard device(params.out.device_index);
  const TensorView& out = params.out;
  Shape4 shape{{1, 1, 1, 1}, kMaxRank - out.rank};
  for (int i = 0; i < out.rank; ++i) shape.extent[shape.row_dim + i] = out.shape[i];
  const std::int64_t total = out.numel();
  if (total == 0) return;
  const auto* rows_used = params.cu_seqlens.present()
                              ? static_cast<const std::int32_t*>(params.cu_seqlens.data) + params.cu_seqlens.shape[0] - 1
                              : nullptr;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>(ceil_div(total, kThreads), 65535));
  dispatch_float(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    Terms<T> terms{};
    terms.count = static_cast<int>(params.terms.size());
    for (int i = 0; i < terms.count; ++i) {
      const Strided4<T> term = strided4<T>(params.terms[i]);
      terms.term[i].data = term.data;
      for (int d = 0; d < kMaxRank; ++d) terms.term[i].stride[d] = term.stride[d];
    }
    accumulate_kernel<T><<<blocks, kThreads, 0, static_cast<cudaStream_t>(params.stream)>>>(
        strided4<T>(out), terms, shape, rows_used);
    check_launch("accumulate_kernel");
  });
}

}  // namespace sparseattn::cuda
