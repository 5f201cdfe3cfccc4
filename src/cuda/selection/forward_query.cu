// Query-outer forward of selected_attention on tensor cores (mma.sync m16n8k16, fp32 accumulation).
//
// One CTA (4 warps) per (token t, KV head h, chunk of 16 query heads of the group): the chunk's heads are the
// 16 rows of the mma tile (padded with zero rows when G < 16). Keys come in tiles of 64 tokens walking the
// selected blocks of indices[t, h] (tokens <= t only; blocks starting after t are skipped; the first -1 ends
// the list). Warp w computes scores for keys [16w, 16w+16) of a tile over the full Dqk; the per-row max /
// sum of the online softmax are exchanged through shared memory, P goes through shared memory, and warp w
// accumulates output columns [w*Dv/4, (w+1)*Dv/4), which keeps accumulators at Dv/8 floats per thread even
// at Dv = 256. Needs no workspace; chosen for large groups (full tiles), see forward_plan.h.
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

constexpr int kThreads = 128;
constexpr int kWarps = 4;
constexpr int kRows = 16;  // query heads per CTA (mma M)
constexpr int kKeys = 64;  // keys per tile (16 per warp)

struct FwdConfig {
  std::int64_t heads_kv, group, chunks, num_idx, block;
  float scale_log2;
};

template <class T, int DQK, int DV>
struct FwdSmem {
  using Q = SmemTile<T, kRows, DQK>;
  using K = SmemTile<T, kKeys, DQK>;
  using V = SmemTile<T, kKeys, DV>;
  using P = SmemTile<T, kRows, kKeys>;
  static constexpr std::size_t kElements = Q::kElements + K::kElements + V::kElements + P::kElements;
  static constexpr std::size_t kBytes = kElements * sizeof(T) + 2 * kWarps * kRows * sizeof(float);
};

// CTAs per SM that shared memory allows on H100 (42 KB each at D = 128, 52 KB at 192/128); registers are
// capped to match.
template <class T, int DQK, int DV>
__global__ void __launch_bounds__(kThreads, DQK <= 128 ? 5 : DQK + DV <= 320 ? 4 : 2) selected_forward_kernel(Tokens<const T> q, Tokens<const T> k,
                                                                    Tokens<const T> v, IndexView indices,
                                                                    Tokens<T> o, LseView<float> lse, SeqTable seqs,
                                                                    FwdConfig c) {
  using S = FwdSmem<T, DQK, DV>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* base = reinterpret_cast<T*>(smem_raw);
  const typename S::Q qs{base};
  const typename S::K ks{qs.base + S::Q::kElements};
  const typename S::V vs{ks.base + S::K::kElements};
  const typename S::P ps{vs.base + S::V::kElements};
  float* red_max = reinterpret_cast<float*>(ps.base + S::P::kElements);  // [warp][row]
  float* red_sum = red_max + kWarps * kRows;

  const std::int64_t t = blockIdx.x, h = blockIdx.y / c.chunks, chunk = blockIdx.y % c.chunks;
  const auto seq = seqs[blockIdx.z];
  if (t >= seq.length) return;
  const std::int64_t row = seq.begin + t;
  const std::int64_t g0 = chunk * kRows;
  const int rows_here = static_cast<int>(min(std::int64_t{kRows}, c.group - g0));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const T* q_fallback = q.row(seq.batch, row, h * c.group + g0);
  load_rows<T, kRows, DQK, kThreads>(
      qs, [&](int r) { return r < rows_here ? q.row(seq.batch, row, h * c.group + g0 + r) : nullptr; }, q_fallback);
  cp_async_commit();

  constexpr int kOutCols = DV / kWarps;  // output columns of this warp
  float acc[kOutCols / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int r_lo = lane / 4, r_hi = lane / 4 + 8;
  const std::int32_t* idx = indices.row(seq.batch, row, h);
  const T* const k_head = k.row(seq.batch, seq.begin, h);  // the sequence's token 0 of KV head h
  const T* const v_head = v.row(seq.batch, seq.begin, h);
  for (std::int64_t j = 0; j < c.num_idx; ++j) {
    const std::int64_t b = idx[j];
    if (b < 0) break;
    const std::int64_t first = b * c.block;
    if (first > t) continue;  // starts after t (or out of range): contributes nothing
    const std::int64_t end = min(first + c.block, t + 1);
    for (std::int64_t s0 = first; s0 < end; s0 += kKeys) {
      __syncthreads();  // the previous tile is done with ks, vs, ps, red_*
      const int valid = static_cast<int>(end - s0);
      load_strided_rows<T, kKeys, DQK, kThreads>(ks, k_head + s0 * k.row_stride, k.row_stride, valid, k_head);
      cp_async_commit();
      load_strided_rows<T, kKeys, DV, kThreads>(vs, v_head + s0 * v.row_stride, v.row_stride, valid, v_head);
      cp_async_commit();
      cp_async_wait<1>();  // q and k have landed
      __syncthreads();

      float s[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < DQK / 16; ++kk) {
        std::uint32_t a[4], bk[4];
        load_a(a, qs, 0, kk * 16);
        load_b_rows(bk, ks, warp * 16, kk * 16);
        mma_pair<T>(s[0], s[1], a, bk);
      }
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = warp * 16 + nt * 8 + 2 * (lane % 4) + (e & 1);
          s[nt][e] = s0 + col < end ? s[nt][e] * c.scale_log2 : -INFINITY;
          tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nt][e]);
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
      }
      if (lane % 4 == 0) {
        red_max[warp * kRows + r_lo] = tile_max[0];
        red_max[warp * kRows + r_hi] = tile_max[1];
      }
      __syncthreads();
      float m_use[2], alpha[2], part[2] = {0.f, 0.f};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = i == 0 ? r_lo : r_hi;
        float mx = m[i];
#pragma unroll
        for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, red_max[w * kRows + r]);
        m_use[i] = mx == -INFINITY ? 0.f : mx;
        alpha[i] = fast_exp2(m[i] - m_use[i]);
        m[i] = mx;
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nt][e] = fast_exp2(s[nt][e] - m_use[e / 2]);
          part[e / 2] += s[nt][e];
        }
        const int col = warp * 16 + nt * 8 + 2 * (lane % 4);
        *reinterpret_cast<std::uint32_t*>(ps.at(r_lo, col)) = pack2<T>(s[nt][0], s[nt][1]);
        *reinterpret_cast<std::uint32_t*>(ps.at(r_hi, col)) = pack2<T>(s[nt][2], s[nt][3]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        part[i] += __shfl_xor_sync(0xffffffffu, part[i], 1);
        part[i] += __shfl_xor_sync(0xffffffffu, part[i], 2);
      }
      if (lane % 4 == 0) {
        red_sum[warp * kRows + r_lo] = part[0];
        red_sum[warp * kRows + r_hi] = part[1];
      }
      cp_async_wait<0>();  // v has landed
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = i == 0 ? r_lo : r_hi;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += red_sum[w * kRows + r];
        l[i] = l[i] * alpha[i] + sum;
      }
#pragma unroll
      for (int nt = 0; nt < kOutCols / 8; ++nt) {
        acc[nt][0] *= alpha[0];
        acc[nt][1] *= alpha[0];
        acc[nt][2] *= alpha[1];
        acc[nt][3] *= alpha[1];
      }
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        std::uint32_t a[4];
        load_a(a, ps, 0, kk * 16);
#pragma unroll
        for (int np = 0; np < kOutCols / 16; ++np) {
          std::uint32_t bv[4];
          load_b_cols(bv, vs, kk * 16, warp * kOutCols + np * 16);
          mma_pair<T>(acc[2 * np], acc[2 * np + 1], a, bv);
        }
      }
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = i == 0 ? r_lo : r_hi;
    if (r >= rows_here) continue;
    const std::int64_t hq = h * c.group + g0 + r;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    T* dst = o.row(seq.batch, row, hq);
#pragma unroll
    for (int nt = 0; nt < kOutCols / 8; ++nt) {
      const int col = warp * kOutCols + nt * 8 + 2 * (lane % 4);
      dst[col] = from_float<T>(acc[nt][2 * i] * inv);
      dst[col + 1] = from_float<T>(acc[nt][2 * i + 1] * inv);
    }
    if (warp == 0 && lane % 4 == 0) lse.at(seq.batch, row, hq) = l[i] > 0.f ? (m[i] + log2f(l[i])) * kLn2 : -INFINITY;
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
