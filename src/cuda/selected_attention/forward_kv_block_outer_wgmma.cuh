// The KV-block-outer forward of selected_attention on Hopper (sm_90a): the kernel of forward_kv_block_outer.cu
// with its products on warpgroup MMAs (wgmma.cuh) and 64-row tiles.
//
// A CTA is one warpgroup (128 threads) and takes the same slice of sorted entries as the mma.sync kernel. Per
// run (one KV head and selection block) it loads the block's K and V once into 128-byte swizzled tiles of
// KEYS = 64 or 128 rows (zero rows past the block), then walks the run's gathered query rows (token x group
// head, token-major) 64 at a time: the next tile's q rows load (cp.async, by row pointers described in shared
// memory) while the current one is computed. Per 64 keys: S = Q K^T (both operands from shared memory,
// K-major), the online softmax in registers (keys <= t per row), O += P V with P as the register A operand and
// V as an MN-major operand. Warp w owns rows 16w..16w+15 of the tile (the wgmma accumulator layout), so the
// epilogue is the mma.sync kernel's, staged in the tile's Q buffer once every product has read it.
// Registers: O Dv/2 + S 32 + P 16 per thread; shared memory at 128/128 and KEYS = 64: about 70 KB, three CTAs
// per SM. Dv = 256 keeps the mma.sync kernel (its O would need 128 registers per thread).
// Per-row work is what this kernel spends its instructions on (a row meets only the 64 keys of one block), so
// the masks run only in warps that need them, O is neither zeroed nor rescaled on the first step, and the
// epilogue and the gathers are kept cheap (store_partials, gather_swizzled_rows).
#pragma once

#include "cuda/primitives/mma.cuh"
#include "cuda/selected_attention/kv_block_runs.cuh"
#include "cuda/selected_attention/forward_plan.h"
#include "cuda/primitives/swizzled_tile.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace sparseattn::cuda::selection {

template <int DQK, int DV>
struct KvWgmmaTile {
  static constexpr bool kSupported = DQK % 64 == 0 && (DV == 64 || DV == 128) && DV <= DQK;
  static constexpr int kThreads = 128;
  static constexpr int kRows = 64;  // gathered query rows per tile (wgmma M)
  static constexpr int kSub = 64;   // keys per online-softmax step (wgmma N of S)
};

// Dynamic shared memory of the wgmma kernel: sorted keys and values of its entries, two buffers of row
// descriptors (q pointer, slot, position), two Q tiles, K and V of KEYS rows, and room to align the tiles.
inline std::size_t kv_wgmma_smem_bytes(int dim_qk, int dim_v, int keys) {
  constexpr int kRows = 64;
  const std::size_t lists = 2 * sizeof(std::int32_t) * kKvCtaRows;
  const std::size_t rows = std::size_t{2} * kRows * (8 + 8 + 4);
  const std::size_t tiles = (std::size_t{2} * kRows * dim_qk + std::size_t(keys) * (dim_qk + dim_v)) * 2;
  return lists + rows + tiles + wgmma::kTileAlignment;
}

template <class T, int DQK, int DV, int KEYS>
__global__ void __launch_bounds__(128) kv_forward_wgmma_kernel(Tokens<const T> q, Tokens<const T> k,
                                                               Tokens<const T> v, const std::uint32_t* keys,
                                                               const std::int32_t* values,
                                                               const std::int32_t* cu_seqlens,
                                                               const std::int32_t* offsets, __half* o_part,
                                                               float* scale_part, float* lse_part, KvConfig c) {
#if SPARSEATTN_WGMMA_ENABLED
  using Tile = KvWgmmaTile<DQK, DV>;
  constexpr int kThreads = Tile::kThreads, kRows = Tile::kRows, kSub = Tile::kSub;
  constexpr int kQ = kRows * DQK, kK = KEYS * DQK;  // elements
  // Carved as kv_wgmma_smem_bytes counts it: the tiles first (1024-byte aligned), then the lists.
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw + (-shared_address(smem_raw) & (wgmma::kTileAlignment - 1)));  // [2]
  T* sK = sQ + 2 * kQ;
  T* sV = sK + kK;
  auto* keys_s = reinterpret_cast<std::uint32_t*>(sV + KEYS * DV);
  auto* vals_s = reinterpret_cast<std::int32_t*>(keys_s + kKvCtaRows);
  auto* qptr_s = reinterpret_cast<const T**>(vals_s + kKvCtaRows);  // [buffer][row]: q row or null
  auto* slot_s = reinterpret_cast<std::int64_t*>(qptr_s + 2 * kRows);  // partial slot, -1: padding row
  auto* t_s = reinterpret_cast<std::int32_t*>(slot_s + 2 * kRows);     // position in the sequence, -1: padding

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int count = load_cta_entries<kThreads>(keys, values, c, keys_s, vals_s);

  // Descriptors of Q buffer 0, K and V; the loops add offsets (compile-time ones in the k-loops).
  const std::uint64_t q_desc0 = wgmma::k_major_descriptor<kRows>(sQ, 0, 0);
  const std::uint64_t k_desc = wgmma::k_major_descriptor<KEYS>(sK, 0, 0);
  const std::uint64_t v_desc = wgmma::mn_major_descriptor<KEYS>(sV, 0, 0);
  int cur = 0;
  while (cur < count && keys_s[cur] < c.sentinel) {
    const std::uint32_t key = keys_s[cur];
    const int stop = run_end(keys_s, cur, count);
    const KvRun run = decode_run(key, vals_s[cur], c, cu_seqlens, offsets);
    const std::int64_t run_rows = std::int64_t{stop - cur} * c.group;
    const int tiles = static_cast<int>((run_rows + kRows - 1) / kRows);

    // Describes the rows of `tile` in buffer `buf` (threads < kRows, one row each), then, after a barrier,
    // gathers their q rows into the swizzled Q tile (8 threads per 128-byte row piece; zero rows for padding).
    auto stage = [&](int tile, int buf) {
      if (threadIdx.x < kRows) {
        const KvRow<T> r = describe_row(q, std::int64_t{tile} * kRows + threadIdx.x, run_rows, vals_s + cur, run, c);
        qptr_s[buf * kRows + threadIdx.x] = r.q;
        slot_s[buf * kRows + threadIdx.x] = r.slot;
        t_s[buf * kRows + threadIdx.x] = r.t;
      }
      __syncthreads();
      // Row 0 of a tile always exists: its q row is the padding rows' fallback address.
      wgmma::gather_swizzled_rows<kRows, DQK, kThreads>(
          sQ + buf * kQ, [&](int r) { return qptr_s[buf * kRows + r]; }, qptr_s[buf * kRows]);
      cp_async_commit();
    };

    __syncthreads();  // the previous run is done with K, V and both Q buffers
    wgmma::load_swizzled_tile<KEYS, DQK, kThreads>(sK, k, run.batch, run.begin + run.first, run.keys, run.h);
    wgmma::load_swizzled_tile<KEYS, DV, kThreads>(sV, v, run.batch, run.begin + run.first, run.keys, run.h);
    cp_async_commit();
    stage(0, 0);

    for (int tile = 0; tile < tiles; ++tile) {
      const int buf = tile & 1;
      __syncthreads();  // the previous tile's epilogue is done with buffer buf ^ 1
      if (tile + 1 < tiles) {
        stage(tile + 1, buf ^ 1);
        cp_async_wait<1>();  // K, V and this tile's q rows have landed
      } else {
        cp_async_wait<0>();
      }
      wgmma::fence_shared_for_async();
      __syncthreads();
      const T* q_tile = sQ + buf * kQ;
      const std::uint64_t q_desc = wgmma::advance(q_desc0, buf * kQ * 2);
      const int* t_tile = t_s + buf * kRows;
      const int t_row[2] = {t_tile[warp * 16 + lane / 4], t_tile[warp * 16 + lane / 4 + 8]};
      // Keys past the tile's last token are invisible to all its rows (every real row sees key 0 of the block).
      int t_max = max(t_tile[lane], t_tile[lane + 32]);
#pragma unroll
      for (int off = 16; off > 0; off /= 2) t_max = max(t_max, __shfl_xor_sync(0xffffffffu, t_max, off));
      // Through a shuffle: the butterfly's result is warp-uniform but not known to be so by the compiler, and
      // the key loop's wgmma descriptors stay in uniform registers only with a uniform bound.
      const int keys_vis = __shfl_sync(0xffffffffu, visible_keys(run.keys, run.first, t_max), 0);
      const int row_keys[2] = {visible_keys(run.keys, run.first, t_row[0]),
                               visible_keys(run.keys, run.first, t_row[1])};

      // No zeroing of O: the first P V product overwrites it, and the first step has nothing to rescale (at
      // block <= 64, the common case, the only step: a plain softmax).
      float acc[DV / 8][4];
      float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
      for (int s0 = 0; s0 < keys_vis; s0 += kSub) {
        float s[kSub / 8][4];
        wgmma::fence();
#pragma unroll
        for (int k0 = 0; k0 < DQK; k0 += 16) {
          wgmma::mma_ss<T, kSub, 0>(wgmma::flat<kSub>(s), wgmma::advance(q_desc, wgmma::operand_offset<kRows>(0, k0)),
                                    wgmma::advance(k_desc, wgmma::operand_offset<KEYS>(s0, k0)), k0 > 0);
        }
        wgmma::commit();
        wgmma::wait<0>();
        const int col_lo[2] = {0, 0}, col_hi[2] = {row_keys[0] - 1 - s0, row_keys[1] - 1 - s0};
        // The masks only where a row of this warp sees fewer than all kSub keys of the step: rows near the
        // block's start and padding rows (most tiles of a long run need none).
        float correction[2];
        with_mask(__any_sync(0xffffffffu, min(col_hi[0], col_hi[1]) < kSub - 1), [&](auto masked) {
          softmax_probabilities<kSub, decltype(masked)::value>(s, m, l, col_lo, col_hi, c.scale_log2, correction);
        });
        if (s0 > 0) rescale_rows<DV>(acc, correction);
        std::uint32_t p[kSub / 16][4];
        wgmma::to_a_fragments<T, kSub>(s, p);
        wgmma::fence();
#pragma unroll
        for (int kk = 0; kk < kSub / 16; ++kk) {
          wgmma::mma_rs<T, DV, 1>(wgmma::flat<DV>(acc), p[kk],
                                  wgmma::advance(v_desc, wgmma::operand_offset<KEYS>(s0 + 16 * kk, 0)),
                                  s0 > 0 || kk > 0);
        }
        wgmma::commit();
        wgmma::wait<0>();
      }
      // Every product of the warpgroup has read this Q tile: it becomes the warps' staging areas (warp w:
      // 16 x DV halves in the swizzled layout of swizzled_tile.cuh, against bank conflicts; DV <= DQK).
      __syncthreads();
      __half* staged = reinterpret_cast<__half*>(const_cast<T*>(q_tile)) + warp * 16 * DV;
      store_partials<DV>(acc, m, l, slot_s + buf * kRows + warp * 16, staged,
                         [](int r, int col) { return SmemTile<__half, 16, DV>::offset(r, col); }, o_part,
                         scale_part, lse_part);
    }
    cur = stop;
  }
#endif
}

}  // namespace sparseattn::cuda::selection
