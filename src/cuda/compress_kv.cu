// compress_kv (mean pooling) forward and backward. Memory-bound and small next to attention: one warp per
// output row, fp32 accumulation, lanes striding over the head dim (coalesced). The backward gathers
// (token t sums the blocks covering it) instead of scattering, so it needs no atomics and is deterministic.
#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace sparseattn::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;

// Where sequence b lives: batched sequences are batch rows with fixed lengths; packed ones are read from
// cu_seqlens / cu_seqlens_cmp on the device (no host sync).
struct SequenceTable {
  const std::int32_t* cu_seqlens;      // null for batched
  const std::int32_t* cu_seqlens_cmp;  // null for batched
  std::int64_t batched_length;         // T for batched

  struct Sequence {
    std::int64_t batch, begin, length, cmp_begin;
  };
  __device__ Sequence operator[](std::int64_t b) const {
    if (cu_seqlens == nullptr) return {b, 0, batched_length, 0};
    return {0, cu_seqlens[b], std::int64_t{cu_seqlens[b + 1]} - cu_seqlens[b], cu_seqlens_cmp[b]};
  }
};

struct Config {
  std::int64_t heads, dim_k, dim_v, block, stride;
};

__device__ __forceinline__ std::int64_t blocks_of(std::int64_t length, const Config& c) {
  return length >= c.block ? (length - c.block) / c.stride + 1 : 0;
}

template <class T>
__device__ void mean_rows(const Tokens<T>& in, Tokens<T> out, std::int64_t b, std::int64_t first,
                          std::int64_t out_b, std::int64_t out_row, std::int64_t h, std::int64_t dim,
                          std::int64_t block) {
  T* dst = out.row(out_b, out_row, h);
  for (std::int64_t d = threadIdx.x % 32; d < dim; d += 32) {
    float sum = 0.f;
    for (std::int64_t i = 0; i < block; ++i) sum += to_float(in.row(b, first + i, h)[d]);
    dst[d] = from_float<T>(sum / static_cast<float>(block));
  }
}

template <class T>
__global__ void compress_kernel(Tokens<T> k, Tokens<T> v, Tokens<T> k_cmp, Tokens<T> v_cmp, SequenceTable seqs,
                                Config c, std::int64_t max_blocks) {
  const std::int64_t item = std::int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (item >= max_blocks * c.heads) return;
  const std::int64_t h = item % c.heads, j = item / c.heads;
  const auto seq = seqs[blockIdx.y];
  if (j >= blocks_of(seq.length, c)) return;
  const std::int64_t first = seq.begin + j * c.stride;
  mean_rows(k, k_cmp, seq.batch, first, seq.batch, seq.cmp_begin + j, h, c.dim_k, c.block);
  mean_rows(v, v_cmp, seq.batch, first, seq.batch, seq.cmp_begin + j, h, c.dim_v, c.block);
}

// Packed outputs: rows past cu_seqlens_cmp[B] belong to no sequence and are zeroed.
template <class T>
__global__ void zero_tail_kernel(Tokens<T> k_cmp, Tokens<T> v_cmp, const std::int32_t* used_rows, std::int64_t rows,
                                 Config c) {
  const std::int64_t item = std::int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (item >= rows * c.heads) return;
  const std::int64_t h = item % c.heads, row = item / c.heads;
  if (row < *used_rows) return;
  for (std::int64_t d = threadIdx.x % 32; d < c.dim_k; d += 32) k_cmp.row(0, row, h)[d] = from_float<T>(0.f);
  for (std::int64_t d = threadIdx.x % 32; d < c.dim_v; d += 32) v_cmp.row(0, row, h)[d] = from_float<T>(0.f);
}

template <class T>
__device__ void gather_rows(const Tokens<T>& d_cmp, Tokens<T> d_in, std::int64_t b, std::int64_t cmp_begin,
                            std::int64_t j_first, std::int64_t j_last, std::int64_t row, std::int64_t h,
                            std::int64_t dim, std::int64_t block) {
  T* dst = d_in.row(b, row, h);
  for (std::int64_t d = threadIdx.x % 32; d < dim; d += 32) {
    float sum = 0.f;
    for (std::int64_t j = j_first; j <= j_last; ++j) sum += to_float(d_cmp.row(b, cmp_begin + j, h)[d]);
    dst[d] = from_float<T>(sum / static_cast<float>(block));
  }
}

template <class T>
__global__ void compress_backward_kernel(Tokens<T> dk_cmp, Tokens<T> dv_cmp, Tokens<T> dk, Tokens<T> dv,
                                         SequenceTable seqs, Config c, std::int64_t max_length) {
  const std::int64_t item = std::int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (item >= max_length * c.heads) return;
  const std::int64_t h = item % c.heads, t = item / c.heads;
  const auto seq = seqs[blockIdx.y];
  if (t >= seq.length) return;
  // Blocks j with j*stride <= t < j*stride + block, clipped to the sequence's blocks (empty range -> 0).
  const std::int64_t j_first = t >= c.block ? (t - c.block) / c.stride + 1 : 0;
  const std::int64_t j_last = min(t / c.stride, blocks_of(seq.length, c) - 1);
  gather_rows(dk_cmp, dk, seq.batch, seq.cmp_begin, j_first, j_last, seq.begin + t, h, c.dim_k, c.block);
  gather_rows(dv_cmp, dv, seq.batch, seq.cmp_begin, j_first, j_last, seq.begin + t, h, c.dim_v, c.block);
}

struct Shape {
  std::int64_t batch, length, heads, dim_k, dim_v, packed_rows;
};

Shape shape_of(const TensorView& k, const TensorView& v, const Sequences& seqs) {
  const bool packed = k.rank == 3;
  const std::int64_t rows = k.shape[packed ? 0 : 1];
  return {packed ? seqs.cu_seqlens.shape[0] - 1 : k.shape[0],
          packed ? (seqs.max_seqlen > 0 ? seqs.max_seqlen : rows) : rows, k.shape[packed ? 1 : 2],
          k.shape[k.rank - 1], v.shape[v.rank - 1], rows};
}

SequenceTable table_of(const Sequences& seqs, const TensorView& cu_seqlens_cmp, std::int64_t length) {
  return {static_cast<const std::int32_t*>(seqs.cu_seqlens.data),
          static_cast<const std::int32_t*>(cu_seqlens_cmp.data), length};
}

dim3 grid_of(std::int64_t items, std::int64_t batch) {
  return dim3(static_cast<unsigned>(ceil_div(items, kWarpsPerBlock)), static_cast<unsigned>(batch));
}

}  // namespace

void compress_kv(const CompressKvParams& p) {
  const DeviceGuard device(p.k.device_index);
  const Shape s = shape_of(p.k, p.v, p.seqs);
  const Config c{s.heads, s.dim_k, s.dim_v, p.block, p.stride};
  const std::int64_t max_blocks = (s.length >= p.block) ? (s.length - p.block) / p.stride + 1 : 0;
  const auto stream = static_cast<cudaStream_t>(p.stream);
  dispatch_float(p.k.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (max_blocks > 0 && s.batch > 0) {
      compress_kernel<T><<<grid_of(max_blocks * s.heads, s.batch), kWarpsPerBlock * 32, 0, stream>>>(
          tokens_of<T>(p.k), tokens_of<T>(p.v), tokens_of<T>(p.k_cmp), tokens_of<T>(p.v_cmp),
          table_of(p.seqs, p.cu_seqlens_cmp, s.length), c, max_blocks);
      check_launch("compress_kernel");
    }
    const std::int64_t cmp_rows = p.k_cmp.shape[0];
    if (p.k_cmp.rank == 3 && cmp_rows > 0) {
      zero_tail_kernel<T><<<grid_of(cmp_rows * s.heads, 1), kWarpsPerBlock * 32, 0, stream>>>(
          tokens_of<T>(p.k_cmp), tokens_of<T>(p.v_cmp),
          static_cast<const std::int32_t*>(p.cu_seqlens_cmp.data) + s.batch, cmp_rows, c);
      check_launch("zero_tail_kernel");
    }
  });
}

void compress_kv_backward(const CompressKvBackwardParams& p) {
  const DeviceGuard device(p.dk.device_index);
  const Shape s = shape_of(p.dk, p.dv, p.seqs);
  const Config c{s.heads, s.dim_k, s.dim_v, p.block, p.stride};
  if (s.length == 0 || s.batch == 0) return;
  dispatch_float(p.dk.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    compress_backward_kernel<T><<<grid_of(s.length * s.heads, s.batch), kWarpsPerBlock * 32, 0,
                                  static_cast<cudaStream_t>(p.stream)>>>(
        tokens_of<T>(p.dk_cmp), tokens_of<T>(p.dv_cmp), tokens_of<T>(p.dk), tokens_of<T>(p.dv),
        table_of(p.seqs, p.cu_seqlens_cmp, s.length), c, s.length);
    check_launch("compress_backward_kernel");
  });
}

}  // namespace sparseattn::cuda
