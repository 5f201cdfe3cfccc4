// The KV-block-outer dK/dV of selected_attention on Hopper (sm_90a): the mma.sync kernel of dkdv.cu with
// its four products on warpgroup MMAs (wgmma.cuh), the dense dK/dV wgmma kernel's step applied to gathered
// query rows.
//
// A CTA is one warpgroup (128 threads) and takes the same task as the mma.sync kernel (dkv_task: 64 keys of a
// block and a chunk of the tokens that selected it). K and V are loaded once into 128-byte swizzled tiles; the
// chunk's (token, group head) pairs are walked 64 rows at a time, double-buffered: while step i's S^T and dP^T
// run, the threads gather step i + 1's Q and dO rows and its row statistics (cp.async, no barrier). Each of
// those copies takes its address from shared memory: the steps' token positions are copied two steps ahead of
// their use (a ring of three), so no thread waits on a global load before it can issue a copy. (Loading the
// positions inside the gather would leave eight dependent L2 round trips per step in the warp's path, as ptxas
// keeps the loads in order with the copies.) Per step, with warp w owning keys 16w..16w+15 (the accumulator
// layout):
//   S^T = K Q^T, dP^T = V dO^T (both operands K-major in shared memory, N = 64 rows);
//   P^T = exp2(S^T scale log2e - lse log2e) where key <= the row's position, dS^T = P^T (dP^T - delta);
//   dV += P^T dO, dK += dS^T Q (P^T, dS^T as register A operands; dO, Q MN-major).
// Keys past the block's end need no mask: their dK/dV rows are never stored. Padding rows (past the chunk) are
// zero in Q and dO and masked (position -1), so they add nothing.
// Registers: dK Dqk/2 + dV Dv/2 + S^T 32 + dP^T 32 fp32 per thread (192 at 128/128; at 192/128, 160 + 16 + 16 with
// 32-row steps); the statistics are read from shared memory inside the elementwise loop rather than held. Shared
// memory at 128/128: about 100 KB, two CTAs (8 warps) per SM, like the dense kernel's one CTA of two warpgroups.
#pragma once

#include "cuda/primitives/mma.cuh"
#include "cuda/selected_attention/dkdv_common.cuh"
#include "cuda/primitives/launch.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace sparseattn::cuda::selection {

template <int DQK, int DV>
struct DkvWgmmaTile {
  static constexpr bool kSupported = (DQK == DV && (DV == 64 || DV == 128)) || (DQK == 192 && DV == 128);
  static constexpr int kThreads = 128;
  static constexpr int kKeys = 64;  // wgmma M: the CTA's keys
  // Gathered (token, head) rows per step: N of S^T, K of dK/dV. At 192/128 dK and dV take 160 registers per
  // thread, so S^T and dP^T are half as wide.
  static constexpr int kRows = DQK + DV > 256 ? 32 : 64;
  static constexpr int kK = kKeys * DQK, kV = kKeys * DV, kQ = kRows * DQK, kDO = kRows * DV;  // elements
  // K, V, 2 x Q, 2 x dO (2-byte elements, each a multiple of 1024 bytes), per row 3 x (position, group head)
  // and 2 x (lse, delta, P factor), plus room to align the start to a swizzle atom.
  static constexpr std::size_t kSmemBytes = 2 * (kK + kV + 2 * kQ + 2 * kDO) +
                                            kRows * (3 * sizeof(int2) + 2 * 3 * sizeof(float)) +
                                            wgmma::kTileAlignment;
};

template <class T, int DQK, int DV>
__global__ void __launch_bounds__(128, 2) selected_dkv_wgmma_kernel(
    Tokens<const T> q, Tokens<const T> k, Tokens<const T> v, LseView<const float> lse, Tokens<const T> d_o,
    LseView<const float> delta, LseView<const float> p_scale, const std::int32_t* offsets,
    const std::int32_t* seg_begin, const std::int32_t* seg_end, const std::int32_t* tokens,
    const std::uint64_t* chunk_scan, float* partials, Tokens<T> dk, Tokens<T> dv, SeqPairTable seqs, DkvConfig c) {
#if SPARSEATTN_WGMMA_ENABLED
  using Tile = DkvWgmmaTile<DQK, DV>;
  constexpr int kThreads = Tile::kThreads, kKeys = Tile::kKeys, kRows = Tile::kRows;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw + (-shared_address(smem_raw) & (wgmma::kTileAlignment - 1)));
  T* sV = sK + Tile::kK;
  T* sQ = sV + Tile::kV;        // [2]
  T* sDO = sQ + 2 * Tile::kQ;   // [2]
  // [3][kRows]: (position in the sequence, -1: padding; group head) of a step's rows, a ring two steps deep.
  int2* sRows = reinterpret_cast<int2*>(sDO + 2 * Tile::kDO);
  float* sLse = reinterpret_cast<float*>(sRows + 3 * kRows);  // [2][kRows], log2 domain (once landed)
  float* sDelta = sLse + 2 * kRows;                           // [2][kRows]
  float* sScale = sDelta + 2 * kRows;                         // [2][kRows]: the P factor (p_scale_at)

  const DkvTask task = dkv_task(chunk_scan, offsets, seg_begin, seg_end, seqs, c, blockIdx.y, kKeys);
  if (task.first >= task.end) return;
  const auto& seq = task.seq;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  // Pair p of the chunk: token tokens[list_begin + p / G] and group head p % G (32-bit division: pairs < 2^31).
  const std::uint32_t group32 = static_cast<std::uint32_t>(c.group);
  const std::int32_t* chunk_tokens = tokens + task.list_begin;
  // Rows of step `step` into ring slot `slot` (threads < kRows, one row each): the position by cp.async, the
  // group head by a plain store (both visible after the barrier that follows the position's wait).
  auto stage_rows = [&](std::int64_t step, int slot) {
    if (threadIdx.x >= kRows) return;
    const std::int64_t pidx = step * kRows + threadIdx.x;
    int2* row = sRows + slot * kRows + threadIdx.x;
    if (pidx < task.pairs) {
      const std::uint32_t token = static_cast<std::uint32_t>(pidx) / group32;
      row->y = static_cast<int>(static_cast<std::uint32_t>(pidx) - token * group32);
      cp_async_4(&row->x, chunk_tokens + token);
    } else {
      *row = make_int2(-1, 0);
    }
  };
  const T* const q_head = q.row(seq.batch, task.q_begin, task.h * c.group);
  const T* const do_head = d_o.row(seq.batch, task.q_begin, task.h * c.group);
  // Gathers the Q and dO rows of ring slot `slot` into buffer `buf`: a pass of 128 threads covers
  // kThreads / (kSpan / 8) rows of kSpan columns (the whole row, or 64-column panels at 192/128), 16 bytes per
  // thread; padding rows are zero.
  auto gather = [&](int slot, int buf) {
    constexpr int kSpan = DQK % 128 == 0 && DV % 128 == 0 ? 128 : 64;
    constexpr int kChunks = kSpan / 8, kRowsPerPass = kThreads / kChunks, kPasses = kRows / kRowsPerPass;
    const int r0 = threadIdx.x / kChunks, cc = threadIdx.x % kChunks;
    int2 rows[kPasses];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) rows[pass] = sRows[slot * kRows + r0 + pass * kRowsPerPass];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const bool in = rows[pass].x >= 0;
      const std::int64_t pos = in ? rows[pass].x : 0, head = rows[pass].y;
      const int r = r0 + pass * kRowsPerPass;
      const T* q_src = q_head + pos * q.row_stride + head * q.head_stride + cc * 8;
      const T* do_src = do_head + pos * d_o.row_stride + head * d_o.head_stride + cc * 8;
#pragma unroll
      for (int c0 = 0; c0 < DQK; c0 += kSpan) {
        cp_async_16(sQ + buf * Tile::kQ + wgmma::swizzled_offset<kRows>(r, c0 + cc * 8), q_src + c0, in ? 16 : 0);
      }
#pragma unroll
      for (int c0 = 0; c0 < DV; c0 += kSpan) {
        cp_async_16(sDO + buf * Tile::kDO + wgmma::swizzled_offset<kRows>(r, c0 + cc * 8), do_src + c0,
                    in ? 16 : 0);
      }
    }
  };
  // lse, delta and P factor of ring slot `slot` into buffer `buf` (threads < kRows, one row each; zero for padding,
  // which the position -1 masks).
  auto stage_stats = [&](int slot, int buf) {
    if (threadIdx.x >= kRows) return;
    const int2 row = sRows[slot * kRows + threadIdx.x];
    const bool in = row.x >= 0;
    const std::int64_t pos = task.q_begin + (in ? row.x : 0), hq = task.h * c.group + row.y;
    cp_async_4(sLse + buf * kRows + threadIdx.x, &lse.at(seq.batch, pos, hq), in ? 4 : 0);
    cp_async_4(sDelta + buf * kRows + threadIdx.x, &delta.at(seq.batch, pos, hq), in ? 4 : 0);
    if (p_scale.data != nullptr) {
      cp_async_4(sScale + buf * kRows + threadIdx.x, &p_scale.at(seq.batch, pos, hq), in ? 4 : 0);
    } else {
      sScale[buf * kRows + threadIdx.x] = 1.f;  // ordered by the barrier after the wait, as the copies
    }
  };
  // After the wait for buffer `buf`, the thread that copied a row's lse takes it to the log2 domain
  // (+inf where it is -inf: a row that saw no key gets no gradient).
  auto finish_stats = [&](int buf) {
    if (threadIdx.x >= kRows) return;
    float& x = sLse[buf * kRows + threadIdx.x];
    x = x == -INFINITY ? INFINITY : x * kLog2e;
  };

  const std::uint64_t k_desc = wgmma::k_major_descriptor<kKeys>(sK, 0, 0);
  const std::uint64_t v_desc = wgmma::k_major_descriptor<kKeys>(sV, 0, 0);
  // Q and dO are read K-major by S^T = K Q^T and dP^T = V dO^T, MN-major by dK += dS^T Q and dV += P^T dO.
  const std::uint64_t q_desc0 = wgmma::k_major_descriptor<kRows>(sQ, 0, 0);
  const std::uint64_t do_desc0 = wgmma::k_major_descriptor<kRows>(sDO, 0, 0);
  const std::uint64_t q_mn_desc0 = wgmma::mn_major_descriptor<kRows>(sQ, 0, 0);
  const std::uint64_t do_mn_desc0 = wgmma::mn_major_descriptor<kRows>(sDO, 0, 0);
  // This thread's key rows, relative to the sequence, less the key position offset of the queries (a query chunk's,
  // common.cuh), so that they compare with the rows' query positions.
  const std::int64_t key_row[2] = {task.first + warp * 16 + lane / 4 - task.offset,
                                   task.first + warp * 16 + lane / 4 + 8 - task.offset};

  float dk_acc[DQK / 8][4], dv_acc[DV / 8][4];
#pragma unroll
  for (int n = 0; n < DQK / 8; ++n) dk_acc[n][0] = dk_acc[n][1] = dk_acc[n][2] = dk_acc[n][3] = 0.f;
#pragma unroll
  for (int n = 0; n < DV / 8; ++n) dv_acc[n][0] = dv_acc[n][1] = dv_acc[n][2] = dv_acc[n][3] = 0.f;

  const std::int64_t steps = (task.pairs + kRows - 1) / kRows;
  // Prologue: the rows of steps 0 and 1, then K and V (rows [first, end), zero rows after), then step 0's Q,
  // dO and statistics once its rows are known.
  stage_rows(0, 0);
  if (steps > 1) stage_rows(1, 1);
  cp_async_commit();
  wgmma::load_swizzled_tile<kKeys, DQK, kThreads>(sK, k, seq.batch, seq.begin + task.first, task.end - task.first,
                                                  task.h);
  wgmma::load_swizzled_tile<kKeys, DV, kThreads>(sV, v, seq.batch, seq.begin + task.first, task.end - task.first,
                                                 task.h);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  gather(0, 0);
  stage_stats(0, 0);
  cp_async_commit();
  int slot = 0;
  for (std::int64_t step = 0; step < steps; ++step) {
    const int buf = static_cast<int>(step & 1);
    const int next_slot = slot == 2 ? 0 : slot + 1, after_slot = next_slot == 2 ? 0 : next_slot + 1;
    // Step's rows, statistics (and K, V) and step + 1's positions landed for every thread; every thread is
    // done with step - 1, so buffer buf ^ 1 is free for step + 1 and ring slot after_slot for step + 2.
    cp_async_wait<0>();
    finish_stats(buf);
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
      gather(next_slot, buf ^ 1);
      stage_stats(next_slot, buf ^ 1);
    }
    if (step + 2 < steps) stage_rows(step + 2, after_slot);
    cp_async_commit();
    wgmma::wait<0>();
    wgmma::fence_operand(wgmma::flat<kRows>(st));
    wgmma::fence_operand(wgmma::flat<kRows>(dpt));

    // P^T and dS^T (without the scale) in place; column n * 8 + 2 (lane % 4) + {0, 1} is a gathered row.
    const float* lse_b = sLse + buf * kRows;
    const float* delta_b = sDelta + buf * kRows;
    const float* scale_b = sScale + buf * kRows;
    const int2* rows_b = sRows + slot * kRows;
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) {
      const int col = n * 8 + 2 * (lane % 4);
      const float2 l2 = *reinterpret_cast<const float2*>(lse_b + col);
      const float2 d2 = *reinterpret_cast<const float2*>(delta_b + col);
      const float2 g2 = *reinterpret_cast<const float2*>(scale_b + col);
      const int4 p2 = *reinterpret_cast<const int4*>(rows_b + col);  // (position, head) of col, col + 1
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool odd = (e & 1) != 0;
        const int position = odd ? p2.z : p2.x;  // -1: a padding row
        const bool visible = position >= 0 && key_row[e / 2] <= position;
        const float p = visible ? fast_exp2(fmaf(st[n][e], c.scale_log2, -(odd ? l2.y : l2.x))) * (odd ? g2.y : g2.x)
                                : 0.f;
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
    slot = next_slot;
  }
  cp_async_wait<0>();
  store_dkv<T, DQK, DV, DQK, DV>(dk_acc, dv_acc, task, c, warp * 16, 0, 0, partials, dk, dv);
#endif
}

}  // namespace sparseattn::cuda::selection
