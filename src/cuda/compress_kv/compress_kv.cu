// compress_kv (mean pooling) forward and backward. Memory-bound: one warp per output row (k and v together),
// fp32 accumulation, each lane a 16-byte piece of the row (a warp access covers 512 bytes rather than the 64 of
// 2-byte accesses per lane). The backward gathers (token t sums the blocks covering it) instead of scattering,
// so it needs no atomics and is deterministic; it adds the other gradients of k and v (nsa_attention's
// branches) in the same pass.
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/sequences.cuh"
#include "cuda/compress_kv/ops.h"

namespace sparseattn::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;

struct Config {
  std::int64_t heads, dim_k, dim_v, block, stride;
};

__device__ __forceinline__ std::int64_t blocks_of(std::int64_t length, const Config& c) {
  return length >= c.block ? (length - c.block) / c.stride + 1 : 0;
}

// Helpers over pieces of kPiece consecutive elements of a row: 16-byte vectors where every row is 16-byte
// aligned (vector_rows), single elements otherwise.
template <class T, int kPiece>
__device__ __forceinline__ void add_piece(float (&sum)[kPiece], const T* src) {
  if constexpr (kPiece == 1) {
    sum[0] += to_float(*src);
  } else {
    static_assert(kPiece * sizeof(T) == 16, "a vector piece is 16 bytes");
    T piece[kPiece];
    *reinterpret_cast<uint4*>(piece) = *reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int k = 0; k < kPiece; ++k) sum[k] += to_float(piece[k]);
  }
}

template <class T, int kPiece>
__device__ __forceinline__ void store_piece(T* dst, const float (&sum)[kPiece], float scale) {
  T piece[kPiece];
#pragma unroll
  for (int k = 0; k < kPiece; ++k) piece[k] = from_float<T>(sum[k] * scale);
  if constexpr (kPiece == 1) {
    *dst = piece[0];
  } else {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(piece);
  }
}

// Which of the two tensors of a pair (k or v) piece p of a warp's row falls in, and where: the k row's pieces
// come first, then the v row's.
struct PieceOf {
  bool second;
  std::int64_t offset;  // element offset within the row
};
template <int kPiece>
__device__ __forceinline__ PieceOf piece_of(int p, const Config& c) {
  const int pieces_k = static_cast<int>(c.dim_k / kPiece);
  return p < pieces_k ? PieceOf{false, std::int64_t{p} * kPiece} : PieceOf{true, std::int64_t{p - pieces_k} * kPiece};
}

template <class T, int kPiece>
__global__ void compress_kernel(Tokens<const T> k, Tokens<const T> v, Tokens<T> k_cmp, Tokens<T> v_cmp,
                                SeqPairTable seqs, Config c, std::int64_t max_blocks) {
  const std::int64_t item = std::int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (item >= max_blocks * c.heads) return;
  const std::int64_t h = item % c.heads, j = item / c.heads;
  const auto seq = seqs[blockIdx.y];
  if (j >= blocks_of(seq.T, c)) return;
  const std::int64_t first = seq.q_begin + j * c.stride;
  const int pieces = static_cast<int>((c.dim_k + c.dim_v) / kPiece);
  for (int p = threadIdx.x % 32; p < pieces; p += 32) {
    const PieceOf at = piece_of<kPiece>(p, c);
    const Tokens<const T> in = at.second ? v : k;
    float sum[kPiece] = {};
#pragma unroll 8
    for (std::int64_t i = 0; i < c.block; ++i) add_piece<T, kPiece>(sum, in.row(seq.batch, first + i, h) + at.offset);
    const Tokens<T> out = at.second ? v_cmp : k_cmp;
    T* dst = out.row(seq.batch, seq.k_begin + j, h) + at.offset;
    store_piece<T, kPiece>(dst, sum, 1.f / static_cast<float>(c.block));
  }
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

// Gradients of k and v added to the pooling's (at most kMaxCompressTerms of each, like dk and dv).
template <class T>
struct Terms {
  Tokens<const T> k[detail::kMaxCompressTerms], v[detail::kMaxCompressTerms];
  int count;
};

// One warp per token and run of up to kHeadsPerWarp heads of dk and dv: dk[t] = sum of the terms' rows +
// (sum of dk_cmp over the blocks covering t) / block, in fp32, rounded once. The index arithmetic (64-bit
// divisions) is paid once per run of heads rather than once per row.
constexpr int kHeadsPerWarp = 8;

template <class T, int kPiece>
__global__ void compress_backward_kernel(Tokens<const T> dk_cmp, Tokens<const T> dv_cmp, Tokens<T> dk, Tokens<T> dv,
                                         Terms<T> terms, SeqPairTable seqs, Config c, std::int64_t max_length) {
  const std::int64_t runs = ceil_div(c.heads, kHeadsPerWarp);
  const std::int64_t item = std::int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (item >= max_length * runs) return;
  const std::int64_t t = item / runs, h_first = item % runs * kHeadsPerWarp;
  const std::int64_t h_end = min(c.heads, h_first + kHeadsPerWarp);
  const auto seq = seqs[blockIdx.y];
  if (t >= seq.T) return;
  // Blocks j with j*stride <= t < j*stride + block, clipped to the sequence's blocks (empty range -> 0).
  const std::int64_t j_first = t >= c.block ? (t - c.block) / c.stride + 1 : 0;
  const std::int64_t j_last = min(t / c.stride, blocks_of(seq.T, c) - 1);
  const int pieces = static_cast<int>((c.dim_k + c.dim_v) / kPiece);
  const float inv_block = 1.f / static_cast<float>(c.block);
  for (std::int64_t h = h_first; h < h_end; ++h) {
    for (int p = threadIdx.x % 32; p < pieces; p += 32) {
      const PieceOf at = piece_of<kPiece>(p, c);
      const Tokens<const T> d_cmp = at.second ? dv_cmp : dk_cmp;
      float pooled[kPiece] = {}, sum[kPiece] = {};
      for (std::int64_t j = j_first; j <= j_last; ++j) {
        add_piece<T, kPiece>(pooled, d_cmp.row(seq.batch, seq.k_begin + j, h) + at.offset);
      }
#pragma unroll
      for (int i = 0; i < detail::kMaxCompressTerms; ++i) {  // unrolled: the terms stay in parameter space
        if (i < terms.count) {
          const Tokens<const T> term = at.second ? terms.v[i] : terms.k[i];
          add_piece<T, kPiece>(sum, term.row(seq.batch, seq.q_begin + t, h) + at.offset);
        }
      }
#pragma unroll
      for (int e = 0; e < kPiece; ++e) sum[e] = fmaf(pooled[e], inv_block, sum[e]);
      const Tokens<T> out = at.second ? dv : dk;
      store_piece<T, kPiece>(out.row(seq.batch, seq.q_begin + t, h) + at.offset, sum, 1.f);
    }
  }
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

// The tokens' sequences (q side) and their compressed rows' (k side; only their starts are read).
SeqPairTable table_of(const Sequences& seqs, const TensorView& cu_seqlens_cmp, std::int64_t length) {
  const auto* cu = static_cast<const std::int32_t*>(seqs.cu_seqlens.data);
  const std::int64_t batch = cu == nullptr ? 0 : seqs.cu_seqlens.shape[0] - 1;
  return {{cu, length, batch}, {static_cast<const std::int32_t*>(cu_seqlens_cmp.data), 0, batch}};
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
  const bool vector = vector_rows(p.k) && vector_rows(p.v) && vector_rows(p.k_cmp) && vector_rows(p.v_cmp);
  dispatch_float(p.k.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (max_blocks > 0 && s.batch > 0) {
      auto kernel = vector ? compress_kernel<T, 16 / sizeof(T)> : compress_kernel<T, 1>;
      kernel<<<grid_of(max_blocks * s.heads, s.batch), kWarpsPerBlock * 32, 0, stream>>>(
          tokens_of<const T>(p.k), tokens_of<const T>(p.v), tokens_of<T>(p.k_cmp), tokens_of<T>(p.v_cmp),
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

void compress_kv_backward(const CompressKvBackwardParams& p, const detail::CompressBackwardTerms& terms) {
  const DeviceGuard device(p.dk.device_index);
  const Shape s = shape_of(p.dk, p.dv, p.seqs);
  const Config c{s.heads, s.dim_k, s.dim_v, p.block, p.stride};
  if (s.length == 0 || s.batch == 0) return;
  bool vector = vector_rows(p.dk) && vector_rows(p.dv) && vector_rows(p.dk_cmp) && vector_rows(p.dv_cmp);
  for (const TensorView& term : terms.dk) vector = vector && (!term.present() || vector_rows(term));
  for (const TensorView& term : terms.dv) vector = vector && (!term.present() || vector_rows(term));
  dispatch_float(p.dk.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    Terms<T> added{};
    for (int i = 0; i < detail::kMaxCompressTerms; ++i) {
      if (!terms.dk[i].present()) continue;
      added.k[added.count] = tokens_of<const T>(terms.dk[i]);
      added.v[added.count] = tokens_of<const T>(terms.dv[i]);
      ++added.count;
    }
    auto kernel = vector ? compress_backward_kernel<T, 16 / sizeof(T)> : compress_backward_kernel<T, 1>;
    const std::int64_t runs = ceil_div(s.heads, kHeadsPerWarp);
    kernel<<<grid_of(s.length * runs, s.batch), kWarpsPerBlock * 32, 0, static_cast<cudaStream_t>(p.stream)>>>(
        tokens_of<const T>(p.dk_cmp), tokens_of<const T>(p.dv_cmp), tokens_of<T>(p.dk), tokens_of<T>(p.dv), added,
        table_of(p.seqs, p.cu_seqlens_cmp, s.length), c, s.length);
    check_launch("compress_backward_kernel");
  });
}

}  // namespace sparseattn::cuda
