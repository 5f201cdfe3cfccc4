// KV-block-outer dQ of selected_attention (see dq_kv_block_outer.h), mirroring the KV-block-outer forward
// (forward_kv_block_outer.cu). For each chunk of (KV head, token row) pairs, head-major (backward_plan.h):
//  1. make_keys with value = entry index, a stable radix sort by (KV head, block): the entries of one block
//     form a run in ascending token order (one sort serves a group of chunks: forward_plan.h's sort groups);
//  2. dq_kv_kernel (on sm_90a with Dqk <= 192 and Dv <= 128 dq_kv_wgmma_kernel instead, 64-row tiles on
//     warpgroup MMAs: dq_kv_block_outer_wgmma.cuh): CTA c takes the sorted entries [c*P, (c+1)*P), P =
//     kDqKvCtaRows / G; per run it loads the block's K and V (<= 128 keys) once, and its 4 warps take the run's
//     query rows ((token, group head) token-major, 16 per tile, double-buffered Q and dO tiles). A warp owns
//     whole rows: S = Q K^T and dP = dO V^T 64 keys at a time, P = exp2(S scale log2e - lse) (causal per row),
//     dS = P (dP - delta), dQ_j += dS K in registers; the partial of (pair, group head, slot j) is written in
//     compact form: fp16 of dQ_j / max|dQ_j| and that fp32 scale;
//  3. dq_kv_merge_kernel: one warp per (pair, group head), i.e. (token, query head), sums its valid slots in
//     slot order (fp32), scales by the softmax scale and writes dq (zeros for a row without a valid slot).
//     Rows of a packed batch outside every sequence are left untouched.
// Deterministic: each partial is computed by one warp in a fixed order and merged in slot order; no atomics.
// Compact partial rounding: at most 2^-12 of the slot's largest element (as in the forward's partials).
#include "cuda/selected_attention/dq_kv_block_outer.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mma.cuh"
#include "cuda/selected_attention/dq_kv_block_outer_wgmma.cuh"
#include "cuda/selected_attention/inverse_index.h"
#include "cuda/selected_attention/kv_block_runs.cuh"
#include "cuda/primitives/launch.cuh"
#include "cuda/primitives/swizzled_tile.cuh"

namespace sparseattn::cuda::selection {

namespace {

constexpr int kThreads = kDqKvWarps * 32;
constexpr int kTile = kDqKvTile;
constexpr int kSub = 64;
constexpr int kRowSlots = kDqKvBuffers * kDqKvWarps * kTile;
constexpr int kMergeWarps = 8;


template <class T, int DQK, int DV>
__global__ void __launch_bounds__(kThreads) dq_kv_kernel(Tokens<const T> q, Tokens<const T> k, Tokens<const T> v,
                                                         Tokens<const T> d_o, LseView<const float> lse,
                                                         LseView<const float> delta,
                                                         LseView<const float> p_scale, const std::uint32_t* keys,
                                                         const std::int32_t* values, const std::int32_t* cu_seqlens,
                                                         const std::int32_t* offsets, __half* dq_part,
                                                         float* scale_part, KvConfig c) {
  using QTile = SmemTile<T, kTile, DQK>;
  using OTile = SmemTile<T, kTile, DV>;
  using KTile = SmemTile<T, kDqKvMaxBlock, DQK>;
  using VTile = SmemTile<T, kDqKvMaxBlock, DV>;
  extern __shared__ __align__(128) unsigned char smem_raw[];  // as the wgmma kernels of this unit declare it
  auto* keys_s = reinterpret_cast<std::uint32_t*>(smem_raw);
  auto* vals_s = reinterpret_cast<std::int32_t*>(keys_s + kDqKvCtaRows);
  auto* qptr_s = reinterpret_cast<const T**>(vals_s + kDqKvCtaRows);
  auto* optr_s = qptr_s + kRowSlots;
  auto* slot_s = reinterpret_cast<std::int64_t*>(optr_s + kRowSlots);
  auto* t_s = reinterpret_cast<std::int32_t*>(slot_s + kRowSlots);
  auto* lse_s = reinterpret_cast<float*>(t_s + kRowSlots);
  auto* delta_s = lse_s + kRowSlots;
  auto* scale_s = delta_s + kRowSlots;  // the P factor (p_scale_at), applied to the row's partial
  T* q_base = reinterpret_cast<T*>(scale_s + kRowSlots);
  T* o_base = q_base + kRowSlots * QTile::kPitch;
  const KTile ks{o_base + kRowSlots * OTile::kPitch};
  const VTile vs{ks.base + c.key_rows * KTile::kPitch};

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int count = load_cta_entries<kThreads>(keys, values, c, keys_s, vals_s);

  int cur = 0;
  while (cur < count && keys_s[cur] < c.sentinel) {
    const std::uint32_t key = keys_s[cur];
    const int stop = run_end(keys_s, cur, count);
    const KvRun run = decode_run(key, vals_s[cur], c, cu_seqlens, offsets);
    const std::int64_t h = run.h, batch = run.batch, begin = run.begin, first = run.first;
    const int keys_here = run.keys;
    for (int i = threadIdx.x; i < c.key_rows * (DQK / 8); i += kThreads) {
      const int r = i / (DQK / 8), cc = i % (DQK / 8);
      const bool in = r < keys_here;
      cp_async_16(ks.at(r, cc * 8), k.row(batch, begin + first + (in ? r : 0), h) + cc * 8, in ? 16 : 0);
    }
    for (int i = threadIdx.x; i < c.key_rows * (DV / 8); i += kThreads) {
      const int r = i / (DV / 8), cc = i % (DV / 8);
      const bool in = r < keys_here;
      cp_async_16(vs.at(r, cc * 8), v.row(batch, begin + first + (in ? r : 0), h) + cc * 8, in ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    const std::int64_t run_rows = std::int64_t{stop - cur} * c.group;
    const int tiles = static_cast<int>((run_rows + kTile - 1) / kTile);
    auto stage = [&](int tile, int buf) {
      const int base = (buf * kDqKvWarps + warp) * kTile;
      if (lane < kTile) {
        const KvRow<T> r = describe_row(q, std::int64_t{tile} * kTile + lane, run_rows, vals_s + cur, run, c);
        const T* qp = r.q;
        const T* op = qp != nullptr ? d_o.row(r.batch, r.row, r.hq) : nullptr;
        const std::int64_t slot = r.slot;
        const int t = r.t;
        float lv = INFINITY, dl = 0.f, g = 0.f;
        if (qp != nullptr) {
          const float x = lse.at(r.batch, r.row, r.hq);
          if (x != -INFINITY) lv = x * kLog2e;
          dl = delta.at(r.batch, r.row, r.hq);
          g = p_scale_at(p_scale, r.batch, r.row, r.hq);
        }
        qptr_s[base + lane] = qp;
        optr_s[base + lane] = op;
        slot_s[base + lane] = slot;
        t_s[base + lane] = t;
        lse_s[base + lane] = lv;
        delta_s[base + lane] = dl;
        scale_s[base + lane] = g;
      }
      __syncwarp();
      const QTile qt{q_base + base * QTile::kPitch};
      const OTile ot{o_base + base * OTile::kPitch};
      const T* qf = qptr_s[base];
      const T* of = optr_s[base];
      for (int i = lane; i < kTile * (DQK / 8); i += 32) {
        const int r = i / (DQK / 8), cc = i % (DQK / 8);
        const T* src = qptr_s[base + r];
        cp_async_16(qt.at(r, cc * 8), (src != nullptr ? src : qf) + cc * 8, src != nullptr ? 16 : 0);
      }
      for (int i = lane; i < kTile * (DV / 8); i += 32) {
        const int r = i / (DV / 8), cc = i % (DV / 8);
        const T* src = optr_s[base + r];
        cp_async_16(ot.at(r, cc * 8), (src != nullptr ? src : of) + cc * 8, src != nullptr ? 16 : 0);
      }
      cp_async_commit();
    };

    int buf = 0;
    if (warp < tiles) stage(warp, 0);
    for (int tile = warp; tile < tiles; tile += kDqKvWarps) {
      if (tile + kDqKvWarps < tiles) {
        stage(tile + kDqKvWarps, buf ^ 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncwarp();
      const int base = (buf * kDqKvWarps + warp) * kTile;
      const QTile qt{q_base + base * QTile::kPitch};
      const OTile ot{o_base + base * OTile::kPitch};
      const int r_lo = lane / 4, r_hi = lane / 4 + 8;
      const std::int64_t t_row[2] = {t_s[base + r_lo], t_s[base + r_hi]};
      const float lse_r[2] = {lse_s[base + r_lo], lse_s[base + r_hi]};
      const float delta_r[2] = {delta_s[base + r_lo], delta_s[base + r_hi]};
      int t_max = t_s[base + lane % kTile];
#pragma unroll
      for (int off = 8; off > 0; off /= 2) t_max = max(t_max, __shfl_xor_sync(0xffffffffu, t_max, off));
      const int keys_vis = static_cast<int>(min(std::int64_t{keys_here}, std::int64_t{t_max} - first + 1));

      float acc[DQK / 8][4] = {};
      for (int s0 = 0; s0 < keys_vis; s0 += kSub) {
        float s[kSub / 8][4] = {}, dp[kSub / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < DQK / 16; ++kk) {
          std::uint32_t a[4];
          load_a(a, qt, 0, kk * 16);
#pragma unroll
          for (int np = 0; np < kSub / 16; ++np) {
            if (s0 + np * 16 < keys_vis) {
              std::uint32_t bk[4];
              load_b_rows(bk, ks, s0 + np * 16, kk * 16);
              mma_pair<T>(s[2 * np], s[2 * np + 1], a, bk);
            }
          }
        }
#pragma unroll
        for (int kk = 0; kk < DV / 16; ++kk) {
          std::uint32_t a[4];
          load_a(a, ot, 0, kk * 16);
#pragma unroll
          for (int np = 0; np < kSub / 16; ++np) {
            if (s0 + np * 16 < keys_vis) {
              std::uint32_t bv[4];
              load_b_rows(bv, vs, s0 + np * 16, kk * 16);
              mma_pair<T>(dp[2 * np], dp[2 * np + 1], a, bv);
            }
          }
        }
#pragma unroll
        for (int nt = 0; nt < kSub / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int kc = s0 + nt * 8 + 2 * (lane % 4) + (e & 1);
            const bool visible = kc < keys_here && first + kc <= t_row[e / 2];
            const float p = visible ? fast_exp2(fmaf(s[nt][e], c.scale_log2, -lse_r[e / 2])) : 0.f;
            s[nt][e] = p * (dp[nt][e] - delta_r[e / 2]);
          }
        }
#pragma unroll
        for (int kk = 0; kk < kSub / 16; ++kk) {
          if (s0 + kk * 16 < keys_vis) {
            std::uint32_t a[4];
            a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int np = 0; np < DQK / 16; ++np) {
              std::uint32_t bk[4];
              load_b_cols(bk, ks, s0 + kk * 16, np * 16);
              mma_pair<T>(acc[2 * np], acc[2 * np + 1], a, bk);
            }
          }
        }
      }
      __syncwarp();  // every lane is done reading the Q tile: it stages the fp16 rows
      store_scaled_rows<DQK>(acc, {scale_s[base + r_lo], scale_s[base + r_hi]}, slot_s + base,
                             reinterpret_cast<__half*>(qt.base),
                             [](int r, int col) { return QTile::offset(r, col); }, dq_part, scale_part);
      buf ^= 1;
    }
    cur = stop;
    __syncthreads();
  }
}

struct DqMergeConfig {
  std::int64_t group, num_idx, block, rows, batch, total_rows, pair0, pair_count;
  bool packed, accumulate_dq;
  float scale;
};

// One warp per (pair, group head) of the chunk: dq = scale * sum_j scale_j * (fp16 row j), valid slots in order.
template <class T, int DQK>
__global__ void __launch_bounds__(kMergeWarps * 32) dq_kv_merge_kernel(const __half* dq_part, const float* scale_part,
                                                                       IndexView indices,
                                                                       const std::int32_t* cu_seqlens, Tokens<T> dq,
                                                                       DqMergeConfig c) {
  constexpr int kPairs = (DQK + 63) / 64;  // half2 pairs per lane (DQK = 64: 1, 128: 2, 192: 3, 256: 4)
  const std::int64_t item = std::int64_t{blockIdx.x} * kMergeWarps + threadIdx.x / 32;
  if (item >= c.pair_count * c.group) return;
  const int lane = threadIdx.x % 32;
  const std::int64_t pair = c.pair0 + item / c.group, h = pair / c.total_rows, hq = h * c.group + item % c.group;
  const std::int64_t row_g = pair % c.total_rows;
  std::int64_t batch = 0, row = row_g, t = 0;
  if (c.packed) {
    if (c.batch <= 0 || row < cu_seqlens[0] || row >= cu_seqlens[c.batch]) return;
    t = row - cu_seqlens[last_at_most(cu_seqlens, c.batch, row)];
  } else {
    batch = row_g / c.rows;
    row = t = row_g % c.rows;
  }
  const std::int32_t* idx = indices.row(batch, row, h);
  const std::int64_t base = item * c.num_idx;
  // 32 slots at a time: lane i finds whether slot j0 + i holds a partial (make_keys' rule: before the first -1,
  // block starting <= t) and its scale; then the warp adds the valid slots' rows in slot order with kAhead rows'
  // loads in flight, waiting on nothing but the mask of valid slots (the merge streams the partials from DRAM).
  constexpr int kAhead = 8;
  float acc[kPairs][2] = {};
  std::int64_t end = c.num_idx;
  for (std::int64_t j0 = 0; j0 < end; j0 += 32) {
    const std::int64_t j = j0 + lane;
    const std::int64_t b = j < end ? idx[j] : 0;
    const unsigned negative = __ballot_sync(0xffffffffu, b < 0);
    if (negative != 0) end = j0 + __ffs(static_cast<int>(negative)) - 1;
    const float w_lane = j < end && b * c.block <= t ? scale_part[base + j] : 0.f;
    const unsigned valid = __ballot_sync(0xffffffffu, w_lane != 0.f);  // a zero scale adds nothing
    const __half* rows = dq_part + (base + j0) * DQK;
#pragma unroll 1
    for (int u0 = 0; u0 < 32 && j0 + u0 < end; u0 += kAhead) {
      float w[kAhead];
      __half2 raw[kAhead][kPairs];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        w[u] = __shfl_sync(0xffffffffu, w_lane, u0 + u);
        const bool ok = (valid >> (u0 + u)) & 1u;
#pragma unroll
        for (int x = 0; x < kPairs; ++x) {
          const int col = 2 * (lane + 32 * x);
          raw[u][x] = ok && col < DQK ? *reinterpret_cast<const __half2*>(rows + (u0 + u) * DQK + col)
                                      : __half2{};
        }
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
#pragma unroll
        for (int x = 0; x < kPairs; ++x) {
          const float2 f = __half22float2(raw[u][x]);
          acc[x][0] += w[u] * f.x;
          acc[x][1] += w[u] * f.y;
        }
      }
    }
  }
  T* dst = dq.row(batch, row, hq);
#pragma unroll
  for (int x = 0; x < kPairs; ++x) {
    const int col = 2 * (lane + 32 * x);
    if (col >= DQK) continue;
    auto* pair = reinterpret_cast<std::uint32_t*>(dst + col);
    float lo = acc[x][0] * c.scale, hi = acc[x][1] * c.scale;
    if (c.accumulate_dq) add_unpacked<T>(*pair, lo, hi);
    *pair = pack2<T>(lo, hi);
  }
}

}  // namespace

void dq_kv_outer(const SelectedAttentionBackwardParams& p, const DqKvArgs& a) {
  if (a.total_rows <= 0 || a.heads_q <= 0 || a.batch <= 0) return;
  const std::int64_t dqk = p.q.shape[p.q.rank - 1], dv = p.v.shape[p.v.rank - 1];
  const auto stream = static_cast<cudaStream_t>(p.stream);
  const std::int64_t per_cta = std::max<std::int64_t>(1, kDqKvCtaRows / std::max<std::int64_t>(1, a.group));
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_head_dims(dqk, dv, [&](auto dqk_c, auto dv_c) {
      constexpr int DQK = decltype(dqk_c)::value, DV = decltype(dv_c)::value;
      // The wgmma kernel where it runs (sm_90a; Dqk <= 192, Dv <= 128), else the mma.sync one; same arguments.
      auto kernel = dq_kv_kernel<T, DQK, DV>;
      std::size_t smem = dq_kv_smem_bytes(DQK, DV, a.block);
      if constexpr (DqKvWgmmaTile<DQK, DV>::kSupported) {
        const int keys = a.block <= 64 ? 64 : 128;
        auto wgmma_kernel = keys == 64 ? dq_kv_wgmma_kernel<T, DQK, DV, 64> : dq_kv_wgmma_kernel<T, DQK, DV, 128>;
        if (wgmma::kernel_runs(wgmma_kernel)) {
          kernel = wgmma_kernel;
          smem = dq_kv_wgmma_smem_bytes(DQK, DV, keys);
        }
      }
      set_dynamic_smem(kernel, smem);
      const KeyConfig kc{a.num_idx, a.block, a.rows, a.batch, a.blocks_per_seq, a.total_rows, 0, 0, a.chunk_pairs,
                         a.end_bit, a.blocks_bound, a.sentinel, a.packed, /*value_is_entry=*/true};
      const IndexBuffers buffers{a.keys_in, a.keys_out, a.values_in, a.values_out, a.temp, a.temp_bytes};
      for_each_sorted_chunk(index_of(p.indices), a.cu_seqlens, a.offsets, kc, a.total_rows * a.heads_kv, a.sort,
                            buffers, stream,
                            [&](std::int64_t pair0, std::int64_t pairs, const std::uint32_t* keys,
                                const std::int32_t* values) {
        const std::int64_t entries = pairs * a.num_idx;
        if (entries > 0) {
          const KvConfig c{a.group, a.num_idx, a.block, a.rows, a.batch, a.blocks_per_seq, a.total_rows, pair0,
                           entries, per_cta, a.blocks_bound, a.sentinel, key_mask(a.end_bit),
                           static_cast<int>((std::min<std::int64_t>(a.block, kDqKvMaxBlock) + 15) / 16 * 16),
                           a.packed, a.scale_log2};
          kernel<<<static_cast<unsigned>(ceil_div(entries, per_cta)), kThreads, smem, stream>>>(
              tokens_of<const T>(p.q), tokens_of<const T>(p.k), tokens_of<const T>(p.v), tokens_of<const T>(p.d_o),
              lse_of<const float>(p.lse), a.delta, a.p_scale, keys, values, a.cu_seqlens, a.offsets,
              static_cast<__half*>(a.dq_half), a.dq_scale, c);
          check_launch("dq_kv_kernel");
        }
        const DqMergeConfig mc{a.group, a.num_idx, a.block, a.rows, a.batch, a.total_rows, pair0, pairs, a.packed,
                               a.accumulate_dq, a.scale};
        dq_kv_merge_kernel<T, DQK><<<static_cast<unsigned>(ceil_div(pairs * a.group, kMergeWarps)), kMergeWarps * 32,
                                     0, stream>>>(static_cast<const __half*>(a.dq_half), a.dq_scale,
                                                  index_of(p.indices), a.cu_seqlens, tokens_of<T>(p.dq), mc);
        check_launch("dq_kv_merge_kernel");
      });
    });
  });
}

}  // namespace sparseattn::cuda::selection
