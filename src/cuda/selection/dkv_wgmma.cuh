// The KV-block-outer dK/dV of selected_attention on Hopper (sm_90a): the mma.sync kernel of backward.cu with
// its four products on warpgroup MMAs (wgmma.cuh), the dense dK/dV wgmma kernel's step applied to gathered
// query rows.
//
// A CTA is one warpgroup (128 threads) and takes the same task as the mma.sync kernel (dkv_task: 64 keys of a
// block and a chunk of the tokens that selected it). K and V are loaded once into 128-byte swizzled tiles; the
// chunk's (token, group head) pairs are walked 64 rows at a time, double-buffered: while step i's S^T and dP^T
// run, the threads gather step i + 1's Q and dO rows (cp.async, each thread its own rows, no barrier) and its
// row statistics. Per step, with warp w owning keys 16w..16w+15 (the accumulator layout):
//   S^T = K Q^T, dP^T = V dO^T (both operands K-major in shared memory, N = 64 rows);
//   P^T = exp2(S^T scale log2e - lse log2e) where key <= the row's position, dS^T = P^T (dP^T - delta);
//   dV += P^T dO, dK += dS^T Q (P^T, dS^T as register A operands; dO, Q MN-major).
// Keys past the block's end need no mask: their dK/dV rows are never stored. Padding rows (past the chunk) are
// zero in Q and dO and masked (position -1), so they add nothing.
// Registers: dK Dqk/2 + dV Dv/2 + S^T 32 + dP^T 32 fp32 per thread (192 at 128/128); the statistics are read
// from shared memory inside the elementwise loop rather than held. Shared memory at 128/128: about 99 KB, two
// CTAs (8 warps) per SM, like the dense kernel's one CTA of two warpgroups.
#pragma once

#include "cuda/mma.cuh"
#include "cuda/selection/dkv.cuh"
#include "cuda/selection/launch.cuh"
#include "cuda/wgmma.cuh"

namespace sparseattn::cuda::selection {

template <int DQK, int DV>
struct DkvWgmmaTile {
  // Q and dO rows share their gather addresses (same head dim); dK and dV accumulate with N = Dqk = Dv.
  static constexpr bool kSupported = DQK == DV && (DV == 64 || DV == 128);
  static constexpr int kThreads = 128;
  static constexpr int kKeys = 64;  // wgmma M: the CTA's keys
  static constexpr int kRows = 64;  // gathered (token, head) rows per step: N of S^T, K of dK/dV
  static constexpr int kK = kKeys * DQK, kV = kKeys * DV, kQ = kRows * DQK, kDO = kRows * DV;  // elements
  // K, V, 2 x Q, 2 x dO (2-byte elements, each a multiple of 1024 bytes), 2 x (lse, delta, position) per row,
  // plus room to align the start to a swizzle atom.
  static constexpr std::size_t kSmemBytes =
      2 * (kK + kV + 2 * kQ + 2 * kDO) + 2 * 3 * kRows * sizeof(float) + wgmma::kTileAlignment;
};

template <class T, int DQK, int DV>
__global__ void __launch_bounds__(128, 2) selected_dkv_wgmma_kernel(
    Tokens<const T> q, Tokens<const T> k, Tokens<const T> v, LseView<const float> lse, Tokens<const T> d_o,
    LseView<const float> delta, const std::int32_t* offsets, const std::int32_t* seg_begin,
    const std::int32_t* seg_end, const std::int32_t* tokens, const std::uint64_t* chunk_scan, float* partials,
    Tokens<T> dk, Tokens<T> dv, SeqTable seqs, DkvConfig c) {
#if SPARSEATTN_WGMMA_ENABLED
  using Tile = DkvWgmmaTile<DQK, DV>;
  constexpr int kThreads = Tile::kThreads, kKeys = Tile::kKeys, kRows = Tile::kRows;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw + (-shared_address(smem_raw) & (wgmma::kTileAlignment - 1)));
  T* sV = sK + Tile::kK;
  T* sQ = sV + Tile::kV;        // [2]
  T* sDO = sQ + 2 * Tile::kQ;   // [2]
  float* sLse = reinterpret_cast<float*>(sDO + 2 * Tile::kDO);  // [2][kRows], log2 domain, +inf: no gradient
  float* sDelta = sLse + 2 * kRows;                             // [2][kRows]
  int* sPos = reinterpret_cast<int*>(sDelta + 2 * kRows);       // [2][kRows], position in the sequence, -1: padding

  const DkvTask task = dkv_task(chunk_scan, offsets, seg_begin, seg_end, seqs, c, blockIdx.y, kKeys);
  if (task.first >= task.end) return;
  const auto& seq = task.seq;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  // K and V rows [first, end), zero rows after.
  wgmma::load_swizzled_tile<kKeys, DQK, kThreads>(sK, k, seq.batch, seq.begin + task.first, task.end - task.first,
                                                  task.h);
  wgmma::load_swizzled_tile<kKeys, DV, kThreads>(sV, v, seq.batch, seq.begin + task.first, task.end - task.first,
                                                 task.h);

  // Pair p of the chunk: token tokens[list_begin + p / G] and group head p % G (32-bit division: pairs < 2^31).
  const std::uint32_t group32 = static_cast<std::uint32_t>(c.group);
  const std::int32_t* chunk_tokens = tokens + task.list_begin;
  const T* const q_head = q.row(seq.batch, seq.begin, task.h * c.group);
  const T* const do_head = d_o.row(seq.batch, seq.begin, task.h * c.group);
  // Gathers the Q and dO rows of step `step` into buffer `buf`: a pass of 128 threads covers kThreads / (D / 8)
  // rows, 16 bytes per thread; rows past the chunk are zero.
  auto gather = [&](std::int64_t step, int buf) {
    constexpr int kChunks = DQK / 8, kRowsPerPass = kThreads / kChunks;
    const int r0 = threadIdx.x / kChunks, cc = threadIdx.x % kChunks;
#pragma unroll
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
      const int r = r0 + pass * kRowsPerPass;
      const std::int64_t pidx = step * kRows + r;
      const bool in = pidx < task.pairs;
      std::int64_t q_off = 0, do_off = 0;
      if (in) {
        const std::uint32_t token = static_cast<std::uint32_t>(pidx) / group32;
        const std::int64_t pos = chunk_tokens[token];
        const std::int64_t head = static_cast<std::uint32_t>(pidx) - token * group32;
        q_off = pos * q.row_stride + head * q.head_stride;
        do_off = pos * d_o.row_stride + head * d_o.head_stride;
      }
      const int at = wgmma::swizzled_offset<kRows>(r, cc * 8);
      cp_async_16(sQ + buf * Tile::kQ + at, q_head + q_off + cc * 8, in ? 16 : 0);
      cp_async_16(sDO + buf * Tile::kDO + at, do_head + do_off + cc * 8, in ? 16 : 0);
    }
  };
  // Row statistics of step `step` (threads < kRows, one row each): plain stores, visible after the next barrier.
  auto row_stats = [&](std::int64_t step, int buf) {
    if (threadIdx.x >= kRows) return;
    const std::int64_t pidx = step * kRows + threadIdx.x;
    float lv = INFINITY, dl = 0.f;
    int pos = -1;
    if (pidx < task.pairs) {
      const std::uint32_t token = static_cast<std::uint32_t>(pidx) / group32;
      pos = chunk_tokens[token];
      const std::int64_t hq = task.h * c.group + (static_cast<std::uint32_t>(pidx) - token * group32);
      const float x = lse.at(seq.batch, seq.begin + pos, hq);
      if (x != -INFINITY) lv = x * kLog2e;
      dl = delta.at(seq.batch, seq.begin + pos, hq);
    }
    sLse[buf * kRows + threadIdx.x] = lv;
    sDelta[buf * kRows + threadIdx.x] = dl;
    sPos[buf * kRows + threadIdx.x] = pos;
  };

  const std::uint64_t k_desc = wgmma::k_major_descriptor<kKeys>(sK, 0, 0);
  const std::uint64_t v_desc = wgmma::k_major_descriptor<kKeys>(sV, 0, 0);
  // Q and dO are read K-major by S^T = K Q^T and dP^T = V dO^T, MN-major by dK += dS^T Q and dV += P^T dO.
  const std::uint64_t q_desc0 = wgmma::k_major_descriptor<kRows>(sQ, 0, 0);
  const std::uint64_t do_desc0 = wgmma::k_major_descriptor<kRows>(sDO, 0, 0);
  const std::uint64_t q_mn_desc0 = wgmma::mn_major_descriptor<kRows>(sQ, 0, 0);
  const std::uint64_t do_mn_desc0 = wgmma::mn_major_descriptor<kRows>(sDO, 0, 0);
  // This thread's key rows, relative to the sequence.
  const std::int64_t key_row[2] = {task.first + warp * 16 + lane / 4, task.first + warp * 16 + lane / 4 + 8};

  float dk_acc[DQK / 8][4], dv_acc[DV / 8][4];
#pragma unroll
  for (int n = 0; n < DQK / 8; ++n) dk_acc[n][0] = dk_acc[n][1] = dk_acc[n][2] = dk_acc[n][3] = 0.f;
#pragma unroll
  for (int n = 0; n < DV / 8; ++n) dv_acc[n][0] = dv_acc[n][1] = dv_acc[n][2] = dv_acc[n][3] = 0.f;

  const std::int64_t steps = (task.pairs + kRows - 1) / kRows;
  gather(0, 0);
  row_stats(0, 0);
  cp_async_commit();
  for (std::int64_t step = 0; step < steps; ++step) {
    const int buf = static_cast<int>(step & 1);
    // Step's rows (and K, V) landed for every thread; every thread is done with step - 1, so buffer buf ^ 1
    // is free for step + 1.
    cp_async_wait<0>();
    wgmma::fence_shared_for_async();
    __syncthreads();
    float st[kRows / 8][4], dpt[kRows / 8][4];
    wgmma::fence();
    const std::uint64_t q_desc = wgmma::advance(q_desc0, buf * Tile::kQ * 2);
    const std::uint64_t do_desc = wgmma::advance(do_desc0, buf * Tile::kDO * 2);
#pragma unroll
    for (int k0 = 0; k0 < DQK; k0 += 16) {
      wgmma::mma_ss<T, kRows, 0>(wgmma::flat<kRows>(st), wgmma::advance(k_desc, wgmma::operand_offset<kKeys>(0, k0)),
                                 wgmma::advance(q_desc, wgmma::operand_offset<kRows>(0, k0)), k0 > 0);
    }
#pragma unroll
    for (int k0 = 0; k0 < DV; k0 += 16) {
      wgmma::mma_ss<T, kRows, 0>(wgmma::flat<kRows>(dpt), wgmma::advance(v_desc, wgmma::operand_offset<kKeys>(0, k0)),
                                 wgmma::advance(do_desc, wgmma::operand_offset<kRows>(0, k0)), k0 > 0);
    }
    wgmma::commit();
    if (step + 1 < steps) {
      gather(step + 1, buf ^ 1);
      row_stats(step + 1, buf ^ 1);
    }
    cp_async_commit();
    wgmma::wait<0>();
    wgmma::fence_operand(wgmma::flat<kRows>(st));
    wgmma::fence_operand(wgmma::flat<kRows>(dpt));

    // P^T and dS^T (without the scale) in place; column n * 8 + 2 (lane % 4) + {0, 1} is a gathered row.
    const float* lse_b = sLse + buf * kRows;
    const float* delta_b = sDelta + buf * kRows;
    const int* pos_b = sPos + buf * kRows;
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) {
      const int col = n * 8 + 2 * (lane % 4);
      const float2 l2 = *reinterpret_cast<const float2*>(lse_b + col);
      const float2 d2 = *reinterpret_cast<const float2*>(delta_b + col);
      const int2 p2 = *reinterpret_cast<const int2*>(pos_b + col);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool odd = (e & 1) != 0;
        const bool visible = key_row[e / 2] <= (odd ? p2.y : p2.x);
        const float p = visible ? fast_exp2(fmaf(st[n][e], c.scale_log2, -(odd ? l2.y : l2.x))) : 0.f;
        st[n][e] = p;
        dpt[n][e] = p * (dpt[n][e] - (odd ? d2.y : d2.x));
      }
    }
    std::uint32_t p_a[kRows / 16][4], ds_a[kRows / 16][4];
    wgmma::to_a_fragments<T, kRows>(st, p_a);
    wgmma::to_a_fragments<T, kRows>(dpt, ds_a);
    wgmma::fence();
    wgmma::issue_dkv_update<T, kRows, DQK, DV>(dk_acc, dv_acc, p_a, ds_a,
                                               wgmma::advance(q_mn_desc0, buf * Tile::kQ * 2),
                                               wgmma::advance(do_mn_desc0, buf * Tile::kDO * 2));
    wgmma::wait<0>();
    wgmma::fence_operand(wgmma::flat<DV>(dv_acc));
    wgmma::fence_operand(wgmma::flat<DQK>(dk_acc));
    wgmma::fence_operand(p_a);
    wgmma::fence_operand(ds_a);
  }
  cp_async_wait<0>();
  store_dkv<T, DQK, DV, DQK, DV>(dk_acc, dv_acc, task, c, warp * 16, 0, 0, partials, dk, dv);
#endif
}

}  // namespace sparseattn::cuda::selection
