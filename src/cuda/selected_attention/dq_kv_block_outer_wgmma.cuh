// The KV-block-outer dQ of selected_attention on Hopper (sm_90a): the kernel of dq_kv_block_outer.cu with its
// products on warpgroup MMAs (wgmma.cuh) and 64-row tiles, built like the KV-block-outer wgmma forward
// (forward_kv_block_outer_wgmma.cuh).
//
// A CTA is one warpgroup (128 threads) and takes the same slice of sorted entries as the mma.sync kernel. Per
// run (one KV head and selection block) it loads the block's K and V once into 128-byte swizzled tiles of
// KEYS = 64 or 128 rows (zero rows past the block), then walks the run's gathered query rows (token x group
// head, token-major) 64 at a time: the next tile's Q and dO rows load (cp.async, by row pointers described in
// shared memory) while the current one is computed. Per 64 keys: S = Q K^T and dP = dO V^T (operands K-major
// in shared memory), P = exp2(S scale log2e - lse log2e) for keys <= the row's position, dS = P (dP - delta),
// dQ += dS K with dS as the register A operand and K as an MN-major operand. Warp w owns rows 16w..16w+15, so
// the epilogue is the mma.sync kernel's (store_scaled_rows), staged in the tile's Q buffer once every product
// has read it. Registers: dQ Dqk/2 + S 32 + dP 32 per thread; shared memory at 128/128 and KEYS = 64: about
// 106 KB, two CTAs per SM (at 192/128, 130 KB: one). As in the forward, the masks run only in warps with a row
// that needs them, and the gathers are kept cheap (gather_swizzled_rows).
#pragma once

#include "cuda/primitives/mma.cuh"
#include "cuda/selected_attention/dq_kv_block_outer.h"
#include "cuda/selected_attention/kv_block_runs.cuh"
#include "cuda/primitives/launch.cuh"
#include "cuda/primitives/swizzled_tile.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace sparseattn::cuda::selection {

template <int DQK, int DV>
struct DqKvWgmmaTile {
  // dQ accumulates with wgmma N = Dqk (64, 128 or 192); dO V^T reads Dv in whole 64-column panels.
  static constexpr bool kSupported = (DQK == 64 || DQK == 128 || DQK == 192) && (DV == 64 || DV == 128);
  static constexpr int kThreads = 128;
  static constexpr int kRows = 64;  // gathered query rows per tile (wgmma M)
  static constexpr int kSub = 64;   // keys per step (wgmma N of S and dP)
};

// Dynamic shared memory of the wgmma kernel: the sorted keys and values of its entries, two buffers of row
// descriptors (q and dO pointers, slot, position, lse, delta, P factor), two Q and dO tiles, K and V of KEYS
// rows, and room to align the tiles.
inline std::size_t dq_kv_wgmma_smem_bytes(int dim_qk, int dim_v, int keys) {
  constexpr int kRows = 64;
  const std::size_t lists = 2 * sizeof(std::int32_t) * kDqKvCtaRows;
  const std::size_t rows = std::size_t{2} * kRows * (8 + 8 + 8 + 4 + 4 + 4 + 4);
  const std::size_t tiles = (std::size_t{2} * kRows * (dim_qk + dim_v) + std::size_t(keys) * (dim_qk + dim_v)) * 2;
  return lists + rows + tiles + wgmma::kTileAlignment;
}

template <class T, int DQK, int DV, int KEYS>
__global__ void __launch_bounds__(128) dq_kv_wgmma_kernel(Tokens<const T> q, Tokens<const T> k, Tokens<const T> v,
                                                          Tokens<const T> d_o, LseView<const float> lse,
                                                          LseView<const float> delta,
                                                          LseView<const float> p_scale, const std::uint32_t* keys,
                                                          const std::int32_t* values, const std::int32_t* cu_seqlens,
                                                          const std::int32_t* offsets, __half* dq_part,
                                                          float* scale_part, KvConfig c) {
#if SPARSEATTN_WGMMA_ENABLED
  using Tile = DqKvWgmmaTile<DQK, DV>;
  constexpr int kThreads = Tile::kThreads, kRows = Tile::kRows, kSub = Tile::kSub;
  constexpr int kQ = kRows * DQK, kDO = kRows * DV, kK = KEYS * DQK;  // elements
  // Carved as dq_kv_wgmma_smem_bytes counts it: the tiles first (1024-byte aligned), then the lists and rows.
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw + (-shared_address(smem_raw) & (wgmma::kTileAlignment - 1)));  // [2]
  T* sDO = sQ + 2 * kQ;                                                                                 // [2]
  T* sK = sDO + 2 * kDO;
  T* sV = sK + kK;
  auto* keys_s = reinterpret_cast<std::uint32_t*>(sV + KEYS * DV);
  auto* vals_s = reinterpret_cast<std::int32_t*>(keys_s + kDqKvCtaRows);
  auto* qptr_s = reinterpret_cast<const T**>(vals_s + kDqKvCtaRows);   // [buffer][row]: q row or null
  auto* optr_s = qptr_s + 2 * kRows;                                   // [buffer][row]: dO row or null
  auto* slot_s = reinterpret_cast<std::int64_t*>(optr_s + 2 * kRows);  // partial slot, -1: padding row
  auto* t_s = reinterpret_cast<std::int32_t*>(slot_s + 2 * kRows);     // position in the sequence, -1: padding
  auto* lse_s = reinterpret_cast<float*>(t_s + 2 * kRows);             // log2 domain, +inf: no gradient
  auto* delta_s = lse_s + 2 * kRows;
  auto* scale_s = delta_s + 2 * kRows;  // the P factor (p_scale_at), applied to the row's partial

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int count = load_cta_entries<kThreads>(keys, values, c, keys_s, vals_s);

  const std::uint64_t q_desc0 = wgmma::k_major_descriptor<kRows>(sQ, 0, 0);
  const std::uint64_t do_desc0 = wgmma::k_major_descriptor<kRows>(sDO, 0, 0);
  const std::uint64_t k_desc = wgmma::k_major_descriptor<KEYS>(sK, 0, 0);      // S = Q K^T
  const std::uint64_t k_mn_desc = wgmma::mn_major_descriptor<KEYS>(sK, 0, 0);  // dQ += dS K
  const std::uint64_t v_desc = wgmma::k_major_descriptor<KEYS>(sV, 0, 0);      // dP = dO V^T
  int cur = 0;
  while (cur < count && keys_s[cur] < c.sentinel) {
    const std::uint32_t key = keys_s[cur];
    const int stop = run_end(keys_s, cur, count);
    const KvRun run = decode_run(key, vals_s[cur], c, cu_seqlens, offsets);
    const std::int64_t run_rows = std::int64_t{stop - cur} * c.group;
    const int tiles = static_cast<int>((run_rows + kRows - 1) / kRows);

    // Describes the rows of `tile` in buffer `buf` (threads < kRows, one row each), then, after a barrier,
    // gathers their Q and dO rows into the swizzled tiles (zero rows for padding).
    auto stage = [&](int tile, int buf) {
      if (threadIdx.x < kRows) {
        const KvRow<T> r = describe_row(q, std::int64_t{tile} * kRows + threadIdx.x, run_rows, vals_s + cur, run, c);
        float lv = INFINITY, dl = 0.f, g = 0.f;
        if (r.q != nullptr) {
          const float x = lse.at(r.batch, r.row, r.hq);
          if (x != -INFINITY) lv = x * kLog2e;
          dl = delta.at(r.batch, r.row, r.hq);
          g = p_scale_at(p_scale, r.batch, r.row, r.hq);
        }
        const int at = buf * kRows + threadIdx.x;
        qptr_s[at] = r.q;
        optr_s[at] = r.q != nullptr ? d_o.row(r.batch, r.row, r.hq) : nullptr;
        slot_s[at] = r.slot;
        t_s[at] = r.t;
        lse_s[at] = lv;
        delta_s[at] = dl;
        scale_s[at] = g;
      }
      __syncthreads();
      // Row 0 of a tile always exists: its rows are the padding rows' fallback addresses.
      wgmma::gather_swizzled_rows<kRows, DQK, kThreads>(
          sQ + buf * kQ, [&](int r) { return qptr_s[buf * kRows + r]; }, qptr_s[buf * kRows]);
      wgmma::gather_swizzled_rows<kRows, DV, kThreads>(
          sDO + buf * kDO, [&](int r) { return optr_s[buf * kRows + r]; }, optr_s[buf * kRows]);
      cp_async_commit();
    };

    __syncthreads();  // the previous run is done with K, V and both tile buffers
    wgmma::load_swizzled_tile<KEYS, DQK, kThreads>(sK, k, run.batch, run.begin + run.first, run.keys, run.h);
    wgmma::load_swizzled_tile<KEYS, DV, kThreads>(sV, v, run.batch, run.begin + run.first, run.keys, run.h);
    cp_async_commit();
    stage(0, 0);

    for (int tile = 0; tile < tiles; ++tile) {
      const int buf = tile & 1;
      __syncthreads();  // the previous tile's epilogue is done with buffer buf ^ 1
      if (tile + 1 < tiles) {
        stage(tile + 1, buf ^ 1);
        cp_async_wait<1>();  // K, V and this tile's rows have landed
      } else {
        cp_async_wait<0>();
      }
      wgmma::fence_shared_for_async();
      __syncthreads();
      const std::uint64_t q_desc = wgmma::advance(q_desc0, buf * kQ * 2);
      const std::uint64_t do_desc = wgmma::advance(do_desc0, buf * kDO * 2);
      const int row_lo = buf * kRows + warp * 16 + lane / 4;
      const int t_row[2] = {t_s[row_lo], t_s[row_lo + 8]};
      const float lse_r[2] = {lse_s[row_lo], lse_s[row_lo + 8]};
      const float delta_r[2] = {delta_s[row_lo], delta_s[row_lo + 8]};
      // Keys past the tile's last token are invisible to all its rows (every real row sees key 0 of the block).
      int t_max = max(t_s[buf * kRows + lane], t_s[buf * kRows + lane + 32]);
#pragma unroll
      for (int off = 16; off > 0; off /= 2) t_max = max(t_max, __shfl_xor_sync(0xffffffffu, t_max, off));
      // Through a shuffle: the butterfly's result is warp-uniform but not known to be so by the compiler, and
      // the key loop's wgmma descriptors stay in uniform registers only with a uniform bound.
      const int keys_vis = __shfl_sync(0xffffffffu, visible_keys(run.keys, run.first, t_max), 0);
      const int row_keys[2] = {visible_keys(run.keys, run.first, t_row[0]),
                               visible_keys(run.keys, run.first, t_row[1])};

      float acc[DQK / 8][4];
#pragma unroll
      for (int n = 0; n < DQK / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
      for (int s0 = 0; s0 < keys_vis; s0 += kSub) {
        float s[kSub / 8][4], dp[kSub / 8][4];
        wgmma::fence();
#pragma unroll
        for (int k0 = 0; k0 < DQK; k0 += 16) {
          wgmma::mma_ss<T, kSub, 0>(wgmma::flat<kSub>(s), wgmma::advance(q_desc, wgmma::operand_offset<kRows>(0, k0)),
                                    wgmma::advance(k_desc, wgmma::operand_offset<KEYS>(s0, k0)), k0 > 0);
        }
#pragma unroll
        for (int k0 = 0; k0 < DV; k0 += 16) {
          wgmma::mma_ss<T, kSub, 0>(wgmma::flat<kSub>(dp),
                                    wgmma::advance(do_desc, wgmma::operand_offset<kRows>(0, k0)),
                                    wgmma::advance(v_desc, wgmma::operand_offset<KEYS>(s0, k0)), k0 > 0);
        }
        wgmma::commit();
        wgmma::wait<0>();
        wgmma::fence_operand(wgmma::flat<kSub>(s));
        wgmma::fence_operand(wgmma::flat<kSub>(dp));
        // Columns [0, col_end) of this step are visible to a row; the masks only where a row of this warp sees
        // fewer than all kSub of them (rows near the block's start, padding rows).
        const int col_end[2] = {row_keys[0] - s0, row_keys[1] - s0};
        with_mask(__any_sync(0xffffffffu, min(col_end[0], col_end[1]) < kSub), [&](auto masked) {
#pragma unroll
          for (int n = 0; n < kSub / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float p = fast_exp2(fmaf(s[n][e], c.scale_log2, -lse_r[e / 2]));
              const bool visible = !decltype(masked)::value || n * 8 + 2 * (lane % 4) + (e & 1) < col_end[e / 2];
              s[n][e] = visible ? p * (dp[n][e] - delta_r[e / 2]) : 0.f;  // dS (without the scale)
            }
          }
        });
        std::uint32_t ds[kSub / 16][4];
        wgmma::to_a_fragments<T, kSub>(s, ds);
        wgmma::fence();
#pragma unroll
        for (int kk = 0; kk < kSub / 16; ++kk) {
          wgmma::mma_rs_mn<T, DQK, KEYS>(wgmma::flat<DQK>(acc), ds[kk],
                                         wgmma::advance(k_mn_desc, wgmma::operand_offset<KEYS>(s0 + 16 * kk, 0)), 1);
        }
        wgmma::commit();
        wgmma::wait<0>();
        wgmma::fence_operand(wgmma::flat<DQK>(acc));
        wgmma::fence_operand(ds);
      }
      // Every product of the warpgroup has read this Q tile: it becomes the warps' staging areas (warp w:
      // 16 x DQK halves in the swizzled layout of swizzled_tile.cuh, against bank conflicts).
      __syncthreads();
      __half* staged = reinterpret_cast<__half*>(sQ + buf * kQ) + warp * 16 * DQK;
      store_scaled_rows<DQK>(acc, {scale_s[row_lo], scale_s[row_lo + 8]}, slot_s + buf * kRows + warp * 16, staged,
                             [](int r, int col) { return SmemTile<__half, 16, DQK>::offset(r, col); }, dq_part,
                             scale_part);
    }
    cur = stop;
  }
#endif
}

}  // namespace sparseattn::cuda::selection
