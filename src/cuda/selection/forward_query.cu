// Query-outer forward of selected_attention on tensor cores (mma.sync m16n8k16, fp32 accumulation).
//
// One warp per (token t, KV head h, chunk of 16 query heads of the group): the chunk's heads are the 16 rows
// of the mma tile (padded with zero rows when G < 16). The warp walks the key tiles of the selected blocks of
// indices[t, h] (tokens <= t only; blocks starting after t are skipped; the first -1 ends the list), kKeys keys
// per tile, and does everything of a tile itself: S = Q K^T over the full Dqk (Q in registers), the online
// softmax in registers (softmax.cuh), P as the A operand straight from the accumulators, O += P V over all Dv
// columns. Nothing is exchanged between warps, so there is no barrier; K and V have one shared-memory buffer
// each, refilled (cp.async) as soon as the warp is done with it, so loads overlap the math. CTAs hold one warp:
// shared memory alone (32 KB at D = 128, seven warps per SM) sets how many run per SM.
//
// Every (token, block) pair re-reads the block's K and V rows from L2 (98% hits), which is what this kernel
// spends its time on. H100, 64/4, T = 64K, n = 16: 26.0 ms with padded shared-memory rows, 16.0 ms with the
// swizzled tiles of tile.cuh (the padded rows made L2 serve 1.4x the sectors for the same requests; a Triton
// kernel of the same structure takes 16.5 ms).
// Needs no workspace; chosen for large groups (full tiles), see forward_plan.h.
#include <cuda_runtime.h>

#include <cmath>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"
#include "cuda/selection/common.cuh"
#include "cuda/selection/kernels.h"
#include "cuda/selection/launch.cuh"
#include "cuda/selection/tile.cuh"

namespace sparseattn::cuda::selection {

namespace {

constexpr int kThreads = 32;
constexpr int kRows = 16;  // query heads per warp (mma M)

struct FwdConfig {
  std::int64_t heads_kv, group, chunks, num_idx, block;
  float scale_log2;
};

// Keys per tile: 64, or 32 at Dqk = 192 and 256 (where Q takes 48 or 64 registers of the fragments).
template <int DQK>
inline constexpr int kKeysOf = DQK <= 128 ? 64 : 32;

// One K and one V tile per warp: 32 KB at D = 128, so seven warps fit an SM.
template <class T, int DQK, int DV>
struct FwdSmem {
  static constexpr int kKeys = kKeysOf<DQK>;
  using K = SmemTile<T, kKeys, DQK>;
  using V = SmemTile<T, kKeys, DV>;
  static constexpr std::size_t kBytes = (K::kElements + V::kElements) * sizeof(T);
};

// The key tiles of one token's selected blocks, in slot order: [s0, end) of at most kKeys keys, all <= t. The
// warp walks them together (every lane calls next()); the slots' block indices sit in registers, lane i holding
// slot chunk_base + i, so finding the next tile costs a shuffle, not a global load on the path to the next tile's
// K load.
template <int kKeys>
struct KeyTiles {
  const std::int32_t* idx;
  std::int64_t num_idx, block, t;
  std::int64_t slot = -1, s0 = 0, end = 0;  // the current tile; slot == num_idx: no more
  std::int64_t chunk_base = 0;
  std::int32_t lane_block = -1;

  __device__ __forceinline__ KeyTiles(const std::int32_t* idx_, std::int64_t num_idx_, std::int64_t block_,
                                      std::int64_t t_)
      : idx(idx_), num_idx(num_idx_), block(block_), t(t_) {
    const int lane = threadIdx.x % 32;
    if (lane < num_idx) lane_block = idx[lane];
  }

  // Moves to the next tile (the rest of the current block, else the next visible block).
  __device__ __forceinline__ bool next() {
    if (slot >= 0 && s0 + kKeys < end) {
      s0 += kKeys;
      return true;
    }
    while (++slot < num_idx) {
      if (slot - chunk_base == 32) {
        chunk_base += 32;
        const std::int64_t mine = chunk_base + threadIdx.x % 32;
        lane_block = mine < num_idx ? idx[mine] : -1;
      }
      const std::int64_t b = __shfl_sync(0xffffffffu, lane_block, static_cast<int>(slot - chunk_base));
      if (b < 0) break;
      const std::int64_t first = b * block;
      if (first > t) continue;  // starts after t (or out of range): contributes nothing
      s0 = first;
      end = min(first + block, t + 1);
      return true;
    }
    slot = num_idx;
    return false;
  }
  __device__ __forceinline__ int keys() const { return static_cast<int>(min(end - s0, std::int64_t{kKeys})); }
};

template <class T, int DQK, int DV>
__global__ void __launch_bounds__(kThreads) selected_forward_kernel(Tokens<const T> q, Tokens<const T> k,
                                                                    Tokens<const T> v, IndexView indices,
                                                                    Tokens<T> o, LseView<float> lse, SeqTable seqs,
                                                                    FwdConfig c) {
  using S = FwdSmem<T, DQK, DV>;
  constexpr int kKeys = S::kKeys;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const typename S::K ks{reinterpret_cast<T*>(smem_raw)};
  const typename S::V vs{ks.base + S::K::kElements};

  const std::int64_t t = blockIdx.x, h = blockIdx.y / c.chunks, chunk = blockIdx.y % c.chunks;
  const auto seq = seqs[blockIdx.z];
  if (t >= seq.length) return;
  const std::int64_t row = seq.begin + t;
  const std::int64_t g0 = chunk * kRows;
  const int rows_here = static_cast<int>(min(std::int64_t{kRows}, c.group - g0));
  const int lane = threadIdx.x;

  const T* const k_head = k.row(seq.batch, seq.begin, h);  // the sequence's token 0 of KV head h
  const T* const v_head = v.row(seq.batch, seq.begin, h);
  auto load_k = [&](const KeyTiles<kKeys>& tile) {
    load_strided_rows<T, kKeys, DQK, kThreads>(ks, k_head + tile.s0 * k.row_stride, k.row_stride, tile.keys(), k_head);
  };
  auto load_v = [&](const KeyTiles<kKeys>& tile) {
    load_strided_rows<T, kKeys, DV, kThreads>(vs, v_head + tile.s0 * v.row_stride, v.row_stride, tile.keys(), v_head);
  };
  KeyTiles<kKeys> tile{indices.row(seq.batch, row, h), c.num_idx, c.block, t};
  bool has_tile = tile.next();
  // K and V have one buffer each, and every buffer is refilled as soon as the warp is done with it: the next
  // tile's K loads during this tile's softmax and P V, its V during its own scores (groups in order K0 V0 K1
  // V1 ...; with empty groups past the last tile, "wait until one group is pending" always means "the buffer
  // about to be read has landed").
  if (has_tile) load_k(tile);
  cp_async_commit();
  if (has_tile) load_v(tile);
  cp_async_commit();

  // Q stays in registers as the A fragments of the Dqk / 16 k-steps (rows past the chunk's heads: zero).
  std::uint32_t qa[DQK / 16][4];
  {
    const int r = lane / 4, col = 2 * (lane % 4);
    const T* q_lo = q.row(seq.batch, row, h * c.group + g0 + min(r, rows_here - 1));
    const T* q_hi = q.row(seq.batch, row, h * c.group + g0 + min(r + 8, rows_here - 1));
    const bool lo_ok = r < rows_here, hi_ok = r + 8 < rows_here;
#pragma unroll
    for (int kk = 0; kk < DQK / 16; ++kk) {
      const int c0 = kk * 16 + col;
      qa[kk][0] = lo_ok ? *reinterpret_cast<const std::uint32_t*>(q_lo + c0) : 0u;
      qa[kk][1] = hi_ok ? *reinterpret_cast<const std::uint32_t*>(q_hi + c0) : 0u;
      qa[kk][2] = lo_ok ? *reinterpret_cast<const std::uint32_t*>(q_lo + c0 + 8) : 0u;
      qa[kk][3] = hi_ok ? *reinterpret_cast<const std::uint32_t*>(q_hi + c0 + 8) : 0u;
    }
  }

  float acc[DV / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  while (has_tile) {
    cp_async_wait<1>();  // K of this tile
    __syncwarp();
    float s[kKeys / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < DQK / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kKeys / 16; ++np) {
        std::uint32_t bk[4];
        load_b_rows(bk, ks, np * 16, kk * 16);
        mma_pair<T>(s[2 * np], s[2 * np + 1], qa[kk], bk);
      }
    }
    const int keys = tile.keys();
    KeyTiles<kKeys> next = tile;
    const bool has_next = next.next();
    __syncwarp();  // every lane has read K
    if (has_next) load_k(next);
    cp_async_commit();

    with_mask(keys < kKeys, [&](auto masked) {
      const int col_lo[2] = {0, 0}, col_hi[2] = {keys - 1, keys - 1};
      online_softmax_step<kKeys, DV, decltype(masked)::value>(s, acc, m, l, col_lo, col_hi, c.scale_log2);
    });
    cp_async_wait<1>();  // V of this tile
    __syncwarp();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      // P's accumulator columns [16kk, 16kk + 16) are the A fragment of k-step kk.
      const std::uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                  pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int np = 0; np < DV / 16; ++np) {
        std::uint32_t bv[4];
        load_b_cols(bv, vs, kk * 16, np * 16);
        mma_pair<T>(acc[2 * np], acc[2 * np + 1], a, bv);
      }
    }
    __syncwarp();  // every lane has read V
    if (has_next) load_v(next);
    cp_async_commit();
    tile = next;
    has_tile = has_next;
  }
  cp_async_wait<0>();

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = lane / 4 + 8 * i;
    l[i] = quad_sum(l[i]);
    if (r >= rows_here) continue;
    const std::int64_t hq = h * c.group + g0 + r;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    T* dst = o.row(seq.batch, row, hq);
    const bool pairs_aligned = reinterpret_cast<std::uintptr_t>(dst) % 4 == 0;  // any stride is allowed
#pragma unroll
    for (int nt = 0; nt < DV / 8; ++nt) {
      const int col = nt * 8 + 2 * (lane % 4);
      if (pairs_aligned) {
        *reinterpret_cast<std::uint32_t*>(dst + col) = pack2<T>(acc[nt][2 * i] * inv, acc[nt][2 * i + 1] * inv);
      } else {
        dst[col] = from_float<T>(acc[nt][2 * i] * inv);
        dst[col + 1] = from_float<T>(acc[nt][2 * i + 1] * inv);
      }
    }
    if (lane % 4 == 0) lse.at(seq.batch, row, hq) = l[i] > 0.f ? (m[i] + log2f(l[i])) * kLn2 : -INFINITY;
  }
}

}  // namespace

void forward_query_outer(const SelectedAttentionParams& p) {
  const HostShape s = host_shape(p.q, p.seqs);
  const std::int64_t heads_q = p.q.shape[p.q.rank - 2], dqk = p.q.shape[p.q.rank - 1];
  const std::int64_t heads_kv = p.k.shape[p.k.rank - 2], dv = p.v.shape[p.v.rank - 1];
  if (s.batch <= 0 || s.max_len <= 0 || heads_q <= 0) return;
  const std::int64_t group = heads_q / heads_kv, chunks = (group + kRows - 1) / kRows;
  const double scale = softmax_scale(p.scale, dqk);
  const FwdConfig c{heads_kv, group, chunks, p.indices.shape[p.indices.rank - 1], p.block,
                    static_cast<float>(scale * 1.4426950408889634)};
  const dim3 grid(static_cast<unsigned>(s.max_len), static_cast<unsigned>(heads_kv * chunks),
                  static_cast<unsigned>(s.batch));
  const auto stream = static_cast<cudaStream_t>(p.stream);
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_dims(dqk, dv, [&](auto dqk_c, auto dv_c) {
      constexpr int DQK = decltype(dqk_c)::value, DV = decltype(dv_c)::value;
      auto kernel = selected_forward_kernel<T, DQK, DV>;
      const std::size_t smem = FwdSmem<T, DQK, DV>::kBytes;
      set_smem(kernel, smem);
      kernel<<<grid, kThreads, smem, stream>>>(tokens_of<const T>(p.q), tokens_of<const T>(p.k),
                                               tokens_of<const T>(p.v), index_of(p.indices), tokens_of<T>(p.o),
                                               lse_of<float>(p.lse), seq_table(s, p.seqs), c);
      check_launch("selected_forward_kernel");
    });
  });
}

}  // namespace sparseattn::cuda::selection
