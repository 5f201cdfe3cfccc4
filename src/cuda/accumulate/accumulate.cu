// accumulate (internal): out = sum of up to kMaxAccumulateTerms same-shaped tensors, any strides with a contiguous
// last dimension. Memory-bound: one grid-stride kernel serves every rank; packed outputs skip rows past
// cu_seqlens[B] (read on the device, no host sync).
#include "core/accumulate_params.h"
#include "cuda/primitives/common.cuh"
#include "cuda/accumulate/ops.h"

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

// One thread per piece of up to kPiece consecutive elements of the last dimension: the index arithmetic
// (64-bit divisions) is paid once per piece, and with kVector (16-byte aligned rows, last dimension a
// multiple of kPiece, the row limit not on the last dimension) the piece moves as one 16-byte access.
template <class T, bool kVector>
__global__ void accumulate_kernel(Strided4<T> out, Terms<T> terms, Shape4 shape, const std::int32_t* rows_used) {
  constexpr int kPiece = 16 / sizeof(T);
  const std::int64_t inner = shape.extent[kMaxRank - 1];
  const std::int64_t pieces_per_row = (inner + kPiece - 1) / kPiece;
  const std::int64_t total = shape.extent[0] * shape.extent[1] * shape.extent[2] * pieces_per_row;
  const std::int64_t row_limit = rows_used == nullptr ? shape.extent[shape.row_dim] : *rows_used;
  for (std::int64_t e = std::int64_t{blockIdx.x} * kThreads + threadIdx.x; e < total;
       e += std::int64_t{gridDim.x} * kThreads) {
    std::int64_t index[kMaxRank];
    index[kMaxRank - 1] = (e % pieces_per_row) * kPiece;
    std::int64_t rest = e / pieces_per_row;
    for (int d = kMaxRank - 2; d >= 0; --d) {
      index[d] = rest % shape.extent[d];
      rest /= shape.extent[d];
    }
    if (shape.row_dim < kMaxRank - 1 && index[shape.row_dim] >= row_limit) continue;
    const auto offset_of = [&](const std::int64_t(&stride)[kMaxRank]) {
      std::int64_t offset = 0;
      for (int d = 0; d < kMaxRank; ++d) offset += index[d] * stride[d];
      return offset;
    };
    float sum[kPiece] = {};
    for (int i = 0; i < terms.count; ++i) {
      const T* src = terms.term[i].data + offset_of(terms.term[i].stride);
      if constexpr (kVector) {
        T piece[kPiece];
        *reinterpret_cast<uint4*>(piece) = *reinterpret_cast<const uint4*>(src);
#pragma unroll
        for (int k = 0; k < kPiece; ++k) sum[k] += to_float(piece[k]);
      } else {
        for (int k = 0; k < kPiece && index[kMaxRank - 1] + k < inner; ++k) sum[k] += to_float(src[k]);
      }
    }
    T* dst = out.data + offset_of(out.stride);
    if constexpr (kVector) {
      T piece[kPiece];
#pragma unroll
      for (int k = 0; k < kPiece; ++k) piece[k] = from_float<T>(sum[k]);
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(piece);
    } else {
      for (int k = 0; k < kPiece && index[kMaxRank - 1] + k < inner; ++k) {
        const bool kept = shape.row_dim == kMaxRank - 1 && index[kMaxRank - 1] + k >= row_limit;
        if (!kept) dst[k] = from_float<T>(sum[k]);
      }
    }
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
  bool vector = out.rank >= 2 && vector_rows(out);
  for (const TensorView& term : params.terms) vector = vector && vector_rows(term);
  const std::int64_t piece = 16 / static_cast<std::int64_t>(element_size(out.dtype));
  const std::int64_t pieces = total / out.shape[out.rank - 1] * ceil_div(out.shape[out.rank - 1], piece);
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>(ceil_div(pieces, kThreads), 65535));
  dispatch_float(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    Terms<T> terms{};
    terms.count = static_cast<int>(params.terms.size());
    for (int i = 0; i < terms.count; ++i) {
      const Strided4<T> term = strided4<T>(params.terms[i]);
      terms.term[i].data = term.data;
      for (int d = 0; d < kMaxRank; ++d) terms.term[i].stride[d] = term.stride[d];
    }
    const auto stream = static_cast<cudaStream_t>(params.stream);
    if (vector) {
      accumulate_kernel<T, true><<<blocks, kThreads, 0, stream>>>(strided4<T>(out), terms, shape, rows_used);
    } else {
      accumulate_kernel<T, false><<<blocks, kThreads, 0, stream>>>(strided4<T>(out), terms, shape, rows_used);
    }
    check_launch("accumulate_kernel");
  });
}

}  // namespace sparseattn::cuda
