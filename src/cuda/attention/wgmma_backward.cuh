// The attention backward kernels on Hopper (sm_90a): the dQ and dK/dV mainloops of mma_sync_kernels.cuh with
// their products on warpgroup MMAs (wgmma.cuh); the forward is in wgmma_forward.cuh. On sm_90 the mma.sync loops
// are bound by shared-memory bandwidth (ldmatrix feeding the tensor cores); wgmma reads its shared-memory operands
// directly. Without warp specialisation these loops are bound by instruction issue (the tensor pipe mostly idle),
// so the per-step instruction count is kept small: descriptors are built once and advanced by compile-time
// offsets, each thread computes one global address per tile load, and masks are per-row bounds computed once (no
// divisions per element).
//
// dQ: warp-specialised and persistent like the forward (wgmma_forward.cuh): a producer warpgroup copies Q, dO
// and the K/V tiles of kN = 64 keys into mbarrier stages; two consumer warpgroups of 64 queries each take turns
// to issue S = Q K^T and dP = dO V^T (shared-memory operands), compute P and dS = P (dP - delta) in registers,
// and dQ += dS K with dS as the register A operand and K as an MN-major operand. Registers: dQ 64 + S 32 +
// dP 32 + dS 16 at 128/128 (dQ 96 at 192/128). As the forward, it has a TMA variant for the plain masks
// (attention_dq_wgmma_tma_kernel, kTmaMask; tma_producer.cuh) with the same consumers: one producer warp whose lane
// 0 copies each whole tile as 64-column boxes (64 rows for K and V, 128 for Q and dO), the two tiles of a slot
// making one arrival each on its full barrier.
//
// dK/dV: a CTA of two warpgroups owns kN = 128 keys of one KV head (64 per warpgroup) and loops over query
// tiles of kM = 64 rows of its share of the group's heads (head splits as the mma.sync kernel), with Q, dO, lse
// and delta in three buffers. Per step each warpgroup computes S^T = K Q^T and dP^T = V dO^T (shared-memory
// operands, K-major), P^T and dS^T in registers, then dV += P^T dO and dK += dS^T Q with P^T and dS^T as
// register A operands and dO, Q as MN-major B operands; the update of one step is in flight while the next
// step's P^T and dS^T are computed (wgmma::overlapped_steps). Registers: dK 64 + dV 64 + S^T 32 + dP^T 32 + the
// A fragments 32 at D = 128; at 192/128 dK 96 + dV 64 + S^T 16 + dP^T 16 + 16 with query steps of kM = 32 rows.
// 256/256 keeps the two-pass mma.sync kernel (dK and dV alone would take 256 registers). Its TMA variant for the
// plain masks (attention_dkv_wgmma_tma_kernel, kTmaMask) adds a producer warpgroup whose one TMA warp fills a ring of
// query-step slots (Q, dO, lse, delta, P factors), so that the two consumer warpgroups wait on mbarriers instead of
// loading between CTA barriers; at 128/128 their registers (setmaxnreg: 232) do not hold the update in flight beside
// the elementwise part, so there the two take turns instead (WgmmaDkvTmaTile::kOverlapsUpdate).
#pragma once

#include <type_traits>

#include "cuda/attention/wgmma_forward.cuh"
#include "cuda/attention/mma_sync_kernels.cuh"
#include "cuda/attention/tma_producer.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace sparseattn::cuda::attention {

using wgmma::load_swizzled_tile;  // shared with the select_blocks and selected-attention kernels

// Whether the dQ and dK/dV consumers of a masking policy skip the steps that none of their rows sees (rows_key_steps,
// dkv_seen_tiles): FlashMask's windows and causal diagonal leave one such step per warpgroup and tile. Not
// CompressedMask, whose bounds cost 64-bit divisions and whose warpgroups differ in so many steps that the dK/dV
// would not skip them (dkv_seen_tiles) and the dQ would skip about one in sixteen query tiles' last steps.
template <class Mask>
inline constexpr bool kSkipsUnseenSteps = std::is_same_v<Mask, FlashMask>;

// The two score products of a backward step, committed as one MMA group: s = A_s B_s^T over Dqk columns and
// dp = A_p B_p^T over Dv (every operand K-major, its descriptor at column 0; A tiles of kRowsA rows, B tiles of
// kRowsB rows; N = kN). dQ: A = Q, dO and B = K, V; dK/dV: A = K, V and B = Q, dO (the transposed products).
// s_initialized: s holds initial scores (FlashTermsMask's terms) that the product accumulates onto.
template <class T, int kN, int Dqk, int Dv, int kRowsA, int kRowsB>
__device__ __forceinline__ void issue_scores(float (&s)[kN / 8][4], float (&dp)[kN / 8][4], std::uint64_t a_s,
                                             std::uint64_t b_s, std::uint64_t a_p, std::uint64_t b_p,
                                             bool s_initialized = false) {
  wgmma::fence();
#pragma unroll
  for (int k0 = 0; k0 < Dqk; k0 += 16) {
    wgmma::mma_ss<T, kN, 0>(wgmma::flat<kN>(s), wgmma::advance(a_s, wgmma::operand_offset<kRowsA>(0, k0)),
                            wgmma::advance(b_s, wgmma::operand_offset<kRowsB>(0, k0)), k0 > 0 || s_initialized);
  }
#pragma unroll
  for (int k0 = 0; k0 < Dv; k0 += 16) {
    wgmma::mma_ss<T, kN, 0>(wgmma::flat<kN>(dp), wgmma::advance(a_p, wgmma::operand_offset<kRowsA>(0, k0)),
                            wgmma::advance(b_p, wgmma::operand_offset<kRowsB>(0, k0)), k0 > 0);
  }
  wgmma::commit();
}

// ------------------------------------------------------------------------------------------------ dK/dV

template <int Dqk, int Dv>
struct WgmmaDkvTile {
  static constexpr bool kSupported = (Dqk == Dv && (Dv == 64 || Dv == 128)) || (Dqk == 192 && Dv == 128);
  static constexpr int kWarpgroups = 2;
  static constexpr int kThreads = 128 * kWarpgroups;
  static constexpr int kN = 64 * kWarpgroups;  // keys per CTA
  // Queries per step: at 192/128 dK and dV take 160 registers per thread, so the step's S^T and dP^T (and their
  // A fragments) are half as wide as at 128/128.
  static constexpr int kM = Dqk + Dv > 256 ? 32 : 64;
  // A query step's tiles are read by its scores and by the update issued one step later, while the next step's
  // load is in flight: three buffers.
  static constexpr int kBuffers = 3;
  static constexpr int kK = kN * Dqk, kV = kN * Dv, kQ = kM * Dqk, kDO = kM * Dv;  // elements
  // K, V, the Q and dO buffers (2-byte elements; every tile a multiple of 1024 bytes), the (lse, delta, P
  // factor, gate alpha) rows of kM floats per buffer, plus room to align the start to a swizzle atom.
  static constexpr std::size_t kSmemBytes = 2 * (kK + kV + kBuffers * (kQ + kDO)) +
                                            kBuffers * 4 * kM * sizeof(float) + wgmma::kTileAlignment;
};

// The queries [first, end) (positions in the sequence, below 2^31) that see this thread's two key rows of a dK/dV
// warp whose 16 rows start at key `warp_row0` (rows lane / 4 and lane / 4 + 8).
template <class Mask>
__device__ __forceinline__ void thread_visible_queries(const Mask& mask, i64 warp_row0, int (&first)[2],
                                                       int (&end)[2]) {
  const int lane = threadIdx.x % 32;
  for (int half = 0; half < 2; ++half) {
    i64 f, e;
    visible_queries(mask, warp_row0 + lane / 4 + half * 8, f, e);
    first[half] = static_cast<int>(f);
    end[half] = static_cast<int>(e);
  }
}

// wgmma descriptors of a dK/dV warpgroup's K and V rows and of buffer 0's Q and dO tiles: Q and dO are read K-major
// by S^T = K Q^T and dP^T = V dO^T, MN-major by dK += dS^T Q and dV += P^T dO; the loops add offsets.
struct DkvDescriptors {
  std::uint64_t k, v, q, d_o, q_mn, d_o_mn;
};
template <int kN, int kM, class T>
__device__ __forceinline__ DkvDescriptors dkv_descriptors(const T* sK, const T* sV, const T* sQ, const T* sDO,
                                                          int warpgroup_row0) {
  return {wgmma::k_major_descriptor<kN>(sK, warpgroup_row0, 0), wgmma::k_major_descriptor<kN>(sV, warpgroup_row0, 0),
          wgmma::k_major_descriptor<kM>(sQ, 0, 0),              wgmma::k_major_descriptor<kM>(sDO, 0, 0),
          wgmma::mn_major_descriptor<kM>(sQ, 0, 0),             wgmma::mn_major_descriptor<kM>(sDO, 0, 0)};
}

template <class T, int Dqk, int Dv, class Mask>
__global__ void __launch_bounds__(WgmmaDkvTile<Dqk, Dv>::kThreads, 1)
    attention_dkv_wgmma_kernel(AttnArgs<T> a, typename Mask::Config mc) {
#if SPARSEATTN_WGMMA_ENABLED
  using Tile = WgmmaDkvTile<Dqk, Dv>;
  constexpr int kM = Tile::kM, kN = Tile::kN, kThreadCount = Tile::kThreads, kBuffers = Tile::kBuffers;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw + (-shared_address(smem_raw) & (wgmma::kTileAlignment - 1)));
  T* sV = sK + Tile::kK;
  T* sQ = sV + Tile::kV;
  T* sDO = sQ + kBuffers * Tile::kQ;
  float* sLse = reinterpret_cast<float*>(sDO + kBuffers * Tile::kDO);  // [kBuffers][kM]
  float* sDelta = sLse + kBuffers * kM;                                // [kBuffers][kM]
  float* sScale = sDelta + kBuffers * kM;  // [kBuffers][kM]: P factor (AttnArgs::d_o_scale)
  [[maybe_unused]] float* sGateAlpha = sScale + kBuffers * kM;  // [kBuffers][kM]: gate alpha (kHasGate)

  const auto seq = a.seqs[blockIdx.z];
  const Mask mask = bind_mask<Mask>(mc, seq, blockIdx.z);
  const DkvWork w(a, mask, seq, kN, kM);
  if (w.keys <= 0) return;
  const i64 j0 = w.j0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warpgroup_row0 = (warp / 4) * 64;
  // With a gate (kHasGate): delta of the thread's two key rows and their ddelta sums.
  [[maybe_unused]] float gate_delta_rows[2] = {0.f, 0.f}, ddelta_sums[2] = {0.f, 0.f};
  if constexpr (kHasGate<Mask>) {
    if (gate_of<Mask>(mc).on()) load_gate_delta_rows<T>(gate_delta_rows, gate_of<Mask>(mc), seq, w.hk, j0 + warp * 16);
  }
  // Queries [q_first, q_end) see this thread's two key rows.
  int q_first[2], q_end[2];
  thread_visible_queries(mask, j0 + warp * 16, q_first, q_end);
  const DkvDescriptors desc = dkv_descriptors<kN, kM>(sK, sV, sQ, sDO, warpgroup_row0);

  float dk[Dqk / 8][4], dv[Dv / 8][4];
  zero(dk);
  zero(dv);

  auto load_step = [&](i64 step, int buf) {
    const i64 h = w.head(step), t0 = w.tile(step) * kM;
    load_swizzled_tile<kM, Dqk, kThreadCount>(sQ + buf * Tile::kQ, a.q, seq.batch, seq.q_begin + t0, seq.T - t0, h);
    load_swizzled_tile<kM, Dv, kThreadCount>(sDO + buf * Tile::kDO, a.d_o, seq.batch, seq.q_begin + t0, seq.T - t0,
                                             h);
    load_row_stats<kM, kThreadCount>(sLse + buf * kM, sDelta + buf * kM, sScale + buf * kM, a, seq, t0, h);
    if constexpr (kHasGate<Mask>) {
      const GateTerms& gate = gate_of<Mask>(mc);
      if (gate.on()) load_gate_rows<kM, kThreadCount>(sGateAlpha + buf * kM, gate, seq, t0, h);
    }
  };

  // With a tile map (FlashTermsMask) the CTA computes the present steps only: logical step i is step_now, the
  // (head, query tile) step of the CTA's i-th present one (DkvStepWalk), and step_next the one after.
  DkvStepWalk<Mask> walk;
  const int steps = walk.count(mc, seq, w, kM);
  if (steps > 0) {
    [[maybe_unused]] i64 step_now = walk.next(mc, seq, w, 0, kM), step_next = step_now;
    [[maybe_unused]] float key_sums[2] = {0.f, 0.f};
    load_swizzled_tile<kN, Dqk, kThreadCount>(sK, a.k, seq.batch, seq.k_begin + j0, w.keys, w.hk);
    load_swizzled_tile<kN, Dv, kThreadCount>(sV, a.v, seq.batch, seq.k_begin + j0, w.keys, w.hk);
    load_step(kHasTerms<Mask> ? step_now : 0, 0);
    cp_async_commit();
    float s[kM / 8][4], dp[kM / 8][4];
    std::uint32_t p_a[kM / 16][4], ds_a[kM / 16][4];
    // FlashTermsMask: the step's scores start from its terms (init_scores) instead of 0. FlashKeyTermsMask: the
    // step's P^T and dS^T add the key terms of the thread's two key rows, read once per step.
    [[maybe_unused]] bool scores_initialized = false;
    [[maybe_unused]] float key_term_rows[2] = {0.f, 0.f};
    // Step i computes S^T and dP^T of query step i while dV += P^T dO and dK += dS^T Q of step i - 1 (its
    // elementwise part done one step earlier) are in flight, and loads step i + 1 into buffer (i + 1) % 3,
    // whose last reader (the update of step i - 2) every thread waited for before this step's barrier.
    auto begin_step = [&](int step) {
      cp_async_wait<0>();
      wgmma::fence_shared_for_async();
      __syncthreads();
      if constexpr (kHasTerms<Mask>) {
        if (step > 0) step_now = step_next;
        const int kind = step < steps ? walk.kind(mc, step_now) : kTileAbsent;  // before next() moves the window
        if (step + 1 < steps) step_next = walk.next(mc, seq, w, step_now + 1, kM);
        if (step < steps) {
          const i64 h = w.head(step_now), t0 = w.tile(step_now) * kM;
          // The step's terms into s (free since the last step's P^T went into p_a), which S^T accumulates onto.
          scores_initialized = tile_needs_terms(mc.terms, kind);
          if (scores_initialized) init_scores<T, kM, false>(s, mc.terms, seq, blockIdx.z, h, j0 + warp * 16, t0, kind);
        }
      } else if constexpr (kHasKeyTerms<Mask>) {
        if (step < steps) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            key_term_rows[half] =
                key_term<T>(mc.terms, seq, w.head(step), j0 + warp * 16 + lane / 4 + 8 * half, kTileExists);
          }
        }
      }
      if (step + 1 < steps) load_step(kHasTerms<Mask> ? step_next : step + 1, (step + 1) % kBuffers);
      cp_async_commit();
      wgmma::fence();
    };
    auto issue_step_scores = [&](int step) {  // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys
      const int buf = step % kBuffers;
      issue_scores<T, kM, Dqk, Dv, kN, kM>(s, dp, desc.k, wgmma::advance(desc.q, buf * Tile::kQ * 2), desc.v,
                                           wgmma::advance(desc.d_o, buf * Tile::kDO * 2),
                                           kHasTerms<Mask> && scores_initialized);
    };
    auto issue_update = [&](int step) {  // dV += P^T dO and dK += dS^T Q of step - 1
      const int buf = (step - 1) % kBuffers;
      wgmma::issue_dkv_update<T, kM, Dqk, Dv>(dk, dv, p_a, ds_a, wgmma::advance(desc.q_mn, buf * Tile::kQ * 2),
                                              wgmma::advance(desc.d_o_mn, buf * Tile::kDO * 2));
    };
    // P^T and dS^T (without the scale) in place of S^T and dP^T; column n * 8 + 2 (lane % 4) + {0, 1} is a query
    // row, its statistics read from shared memory here rather than held (registers: the update's A fragments
    // are live across this part).
    auto make_ds = [&](int step) {
      wgmma::fence_operand(wgmma::flat<kM>(s));
      wgmma::fence_operand(wgmma::flat<kM>(dp));
      const float* lse = sLse + (step % kBuffers) * kM;
      const float* delta = sDelta + (step % kBuffers) * kM;
      const float* p_scale = sScale + (step % kBuffers) * kM;
      // This thread's visible columns [col_first, col_end) of the step, per key row; the mask is needed only
      // where they do not cover the step (a per-thread choice: the elementwise part has no collectives).
      const i64 step_id = kHasTerms<Mask> ? step_now : step;
      const int t0 = static_cast<int>(w.tile(step_id) * kM);
      [[maybe_unused]] const i64 h = w.head(step_id);
      // Per-head windows (kPerHeadWindows only, so that the other policies hold no per-head values in the step
      // loop) replace the CTA's bounds by those of the step's head.
      int col_first[2] = {q_first[0] - t0, q_first[1] - t0}, col_end[2] = {q_end[0] - t0, q_end[1] - t0};
      if constexpr (kPerHeadWindows<Mask>) {
        if (has_head_windows(mask)) {  // per-head windows: the queries of the step's head that see the key rows
          const Mask head_mask = for_head(mask, h);
          for (int half = 0; half < 2; ++half) {
            i64 first, end;
            visible_queries(head_mask, j0 + warp * 16 + lane / 4 + half * 8, first, end);
            col_first[half] = static_cast<int>(first) - t0;
            col_end[half] = static_cast<int>(end) - t0;
          }
        }
      }
      const bool full = max(col_first[0], col_first[1]) <= 0 && min(col_end[0], col_end[1]) >= kM;
      [[maybe_unused]] const float* gate_alpha = sGateAlpha + (step % kBuffers) * kM;
      with_gate_of<Mask>(mc, [&](auto gate) {
        constexpr int kGate = decltype(gate)::value;
        with_mask(!full, [&](auto masked) {
#pragma unroll
          for (int n = 0; n < kM / 8; ++n) {
            float2 l2 = *reinterpret_cast<const float2*>(lse + n * 8 + 2 * (lane % 4));
            if constexpr (kHasAnyTerms<Mask>) l2 = make_float2(finite_lse(l2.x), finite_lse(l2.y));
            const float2 d2 = *reinterpret_cast<const float2*>(delta + n * 8 + 2 * (lane % 4));
            const float2 g2 = *reinterpret_cast<const float2*>(p_scale + n * 8 + 2 * (lane % 4));
            [[maybe_unused]] float2 a2 = make_float2(0.f, 0.f);
            if constexpr (kGate != kNoGate) a2 = *reinterpret_cast<const float2*>(gate_alpha + n * 8 + 2 * (lane % 4));
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int col = n * 8 + 2 * (lane % 4) + (i % 2);
              float score = s[n][i];
              if constexpr (kHasKeyTerms<Mask>) score += key_term_rows[i / 2];
              [[maybe_unused]] float slope = 0.f;
              if constexpr (kGate != kNoGate) {
                score += gate_value_slope<kGate>((i % 2 ? a2.y : a2.x) * gate_delta_rows[i / 2], slope);
              }
              float p = fast_exp2(fmaf(score, a.scale_log2, -kLog2e * (i % 2 ? l2.y : l2.x))) * (i % 2 ? g2.y : g2.x);
              if constexpr (decltype(masked)::value) {
                if (col < col_first[i / 2] || col >= col_end[i / 2]) p = 0.f;
              }
              s[n][i] = p;
              dp[n][i] = p * (dp[n][i] - (i % 2 ? d2.y : d2.x));
              if constexpr (kGate != kNoGate) ddelta_sums[i / 2] += dp[n][i] * slope * (i % 2 ? a2.y : a2.x);
            }
          }
        });
      });
      if constexpr (kHasAnyTerms<Mask>) {
        const BiasGradientSink& sink = mc.terms.dbias;
        if (sink.data != nullptr) {
          if constexpr (kHasKeyTerms<Mask>) {  // a key sum (dispatch.cu)
            add_key_sums<kM>(dp, key_sums);
          } else {
            add_bias_gradient<kM>(sink, dp, key_sums, seq, h, j0 + warp * 16, t0);
          }
          const i64 following = kHasTerms<Mask> ? step_next : step + 1;
          if (sink.key_sums && (step + 1 >= steps || w.head(following) != h)) {
            flush_key_sums(sink, key_sums, seq, h, j0 + warp * 16);
          }
        }
      }
    };
    wgmma::overlapped_steps(steps, begin_step, issue_step_scores, issue_update, make_ds, [&](int step) {
      wgmma::wait<0>();
      wgmma::fence_operand(wgmma::flat<Dv>(dv));
      wgmma::fence_operand(wgmma::flat<Dqk>(dk));
      wgmma::fence_operand(p_a);
      wgmma::fence_operand(ds_a);
      if (step < steps) {
        wgmma::to_a_fragments<T, kM>(s, p_a);
        wgmma::to_a_fragments<T, kM>(dp, ds_a);
      }
    });
  }
  store_dkv_rows<true, true>(dk, dv, a, seq, w.split, j0 + warp * 16, w.hk);
  if constexpr (kHasGate<Mask>) {
    const GateTerms& gate = gate_of<Mask>(mc);
    if (gate.on()) store_ddelta_partial(gate, ddelta_sums, a.scale, seq, w.split, w.hk, j0 + warp * 16);
  }
  if constexpr (kHasTerms<Mask>) {
    if (threadIdx.x < 32 && mc.terms.work_counter != nullptr) {
      const unsigned long long work = dkv_work<Mask>(mc, seq, w, kM);
      if (threadIdx.x == 0) add_work(mc.terms, work);
    }
  }
#endif
}

// The dK/dV's TMA variant for the plain masks (kTmaMask: no terms, gates or per-head windows, so step i is query
// tile w.tile(i) of head w.head(i)): the CTA of the kernel above, whose two warpgroups become consumers, plus a
// producer warpgroup of which one warp copies (tma_producer.cuh). The producer loads K and V once (their own
// one-use ring) and each step's Q and dO tiles (64-column boxes of kM rows) and its lse, delta and P-factor rows
// into a ring of kBuffers slots, running ahead of the consumers by the slots they have released, instead of every
// thread loading the next step between two CTA barriers. The consumers issue the kernel above's MMAs in its order
// and compute its elementwise part, so dK and dV are the same bit for bit; at 128/128 the order of a consumer's
// update and its next step's elementwise part differs (kOverlapsUpdate), not the values.
template <int Dqk, int Dv>
struct WgmmaDkvTmaTile {
  using Consumers = WgmmaDkvTile<Dqk, Dv>;
  static constexpr bool kSupported = Consumers::kSupported;
  static constexpr int kM = Consumers::kM, kN = Consumers::kN;
  // Whether a consumer runs its elementwise part while its previous update is in flight (wgmma::overlapped_steps),
  // as the kernel above does. Not at 128/128: there the operands of the MMAs in flight take 224 registers (dK 64 +
  // dV 64 + S^T 32 + dP^T 32 + the A fragments 32) and the elementwise part's values do not fit beside them in the
  // 240 that setmaxnreg can give at most (ptxas serialises the MMAs), so a consumer lands its update before it
  // issues its scores, and lands those before its elementwise part, which runs while the other consumer's MMAs
  // occupy the tensor cores (the two take turns to issue, pipeline::Turns); at most 192 operand registers are live.
  static constexpr bool kOverlapsUpdate = !(Dqk == 128 && Dv == 128);
  // Whether a consumer skips the query steps that do not see its keys (attention_dkv_wgmma_tma_kernel). Not at
  // 192/128, whose consumers have no registers left for the walk's state (ptxas spills 276 bytes instead of 60).
  static constexpr bool kSkipsUnseen = Dqk + Dv <= 256;
  static constexpr int kProducerThreads = pipeline::ProducerConsumers::kProducerThreads;
  static constexpr int kConsumerThreads = Consumers::kThreads;
  static_assert(kConsumerThreads == pipeline::ProducerConsumers::kConsumerThreads, "the rings count 256 consumers");
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  // The consumers hold what the kernel above holds (dK, dV, S^T, dP^T, the update's A fragments) without its
  // per-thread load addresses: 160 operand registers at 64/64 and 208 at 192/128 with the update in flight during the
  // elementwise part, at 128/128 192 (kOverlapsUpdate). At 192/128, 232 leave ptxas too few to keep the MMAs
  // asynchronous, so the producer gets the minimum, 24, there (its loop then keeps a few values in local memory).
  // The launch gives 168 per thread (__launch_bounds__(384, 1)), which setmaxnreg moves between the warpgroups.
  static constexpr int kConsumerRegisters = Dqk + Dv > 256 ? 240 : 232;
  static constexpr int kProducerRegisters = Dqk + Dv > 256 ? 24 : 40;
  static_assert(kProducerRegisters * kProducerThreads + kConsumerRegisters * kConsumerThreads <= 168 * kThreads,
                "setmaxnreg: the warpgroups' registers within the CTA's");
  // A step's slot is read by its scores and by the update issued one step later; four slots let the producer
  // fill the next two steps meanwhile.
  static constexpr int kBuffers = 4;
  static constexpr int kK = Consumers::kK, kV = Consumers::kV, kQ = Consumers::kQ, kDO = Consumers::kDO;
  static constexpr int kBarriers = pipeline::Ring<1>::kBarriers + pipeline::Ring<kBuffers>::kBarriers;
  // K, V, the Q and dO slots (2-byte elements; every tile a multiple of 1024 bytes), the (lse, delta, P factor)
  // rows of kM floats per slot, the barriers, plus room to align the start to a swizzle atom: 100 KB at 64/64,
  // 196 KB at 128/128, 163 KB at 192/128.
  static constexpr std::size_t kSmemBytes = 2 * (kK + kV + kBuffers * (kQ + kDO)) +
                                            kBuffers * 3 * kM * sizeof(float) + sizeof(std::uint64_t) * kBarriers +
                                            wgmma::kTileAlignment;
};

// The lse, delta and P-factor rows t0 + r (r < kRows) of query head `head` of the sequence that starts at query row
// q_row0 and has `queries` rows (0 past them, as load_row_stats) into a slot, by the TMA producer's warp with
// cp.async (P factors only where the call has them; the slots' factors stay 1 otherwise). It makes one of the
// arrivals that the use's full barrier expects, which the copies' landing completes (as produce_tma_tile's
// zero-filled tiles), so the warp does not wait.
template <int kRows, class Ring, class T>
__device__ __forceinline__ void produce_row_stats(const Ring& ring, unsigned use, float* lse, float* delta,
                                                  float* p_scale, const AttnArgs<T>& a, int batch, int q_row0,
                                                  int queries, int t0, int head) {
  static_assert(kRows % 32 == 0, "whole rows per lane");
  const int lane = static_cast<int>(threadIdx.x % 32);
  // The rows' addresses from values the compiler sees as made here, so that it computes them here instead of holding
  // their 64-bit parts across the producer's loop (as warp_copy_tile_rows).
  asm volatile("" : "+r"(batch), "+r"(q_row0), "+r"(head));
#pragma unroll
  for (int i = 0; i < kRows / 32; ++i) {
    const int r = lane + 32 * i;
    const bool ok = t0 + r < queries;
    const int row = q_row0 + (ok ? t0 + r : 0);
    cp_async_4(lse + r, &a.lse.at(batch, row, head), ok ? 4 : 0);
    cp_async_4(delta + r, &a.delta.at(batch, row, head), ok ? 4 : 0);
    if (a.d_o_scale.data != nullptr) cp_async_4(p_scale + r, &a.d_o_scale.at(batch, row, head), ok ? 4 : 0);
  }
  pipeline::arrive_on_copies_extra(ring.full_barrier(use));
  __syncwarp();
  if (lane == 0) pipeline::arrive(ring.full_barrier(use));
  __syncwarp();
}

// The query tiles of kM rows, relative to tile_begin, that see some of a dK/dV warpgroup's 64 keys from j0 under a
// monotone mask: [first, last] of the `tiles` each head walks, the same for every head (the plain masks have no
// per-head windows). A consumer skips the others, so at the boundary between two heads it passes (tiles - 1 - last)
// + first slots of the step ring on without using them, which it waits for while its previous step's update still
// holds a slot: only up to kMaxSkipped such slots (fewer than the ring's free ones) keep the producer ahead of every
// wait; with more, every tile counts as seen.
template <int kM, int kMaxSkipped, class Mask>
__device__ __forceinline__ void dkv_seen_tiles(const Mask& mask, i64 j0, int tile_begin, int tiles, int& first,
                                               int& last) {
  i64 q_first, q_end;
  keys_visible_queries<64>(mask, j0, q_first, q_end);
  first = 0;
  last = tiles - 1;
  if (q_end <= q_first) return;
  const int lo = max(0, static_cast<int>(q_first / kM) - tile_begin);
  const int hi = min(tiles - 1, static_cast<int>((q_end - 1) / kM) - tile_begin);
  if (lo <= hi && tiles - 1 - hi + lo <= kMaxSkipped) {
    first = lo;
    last = hi;
  }
}

template <class T, int Dqk, int Dv, class Mask>
__global__ void __launch_bounds__(WgmmaDkvTmaTile<Dqk, Dv>::kThreads, 1)
    attention_dkv_wgmma_tma_kernel(AttnArgs<T> a, typename Mask::Config mc, const __grid_constant__ BackwardTmaMaps maps) {
  static_assert(kTmaMask<Mask>, "the TMA producer serves the plain masks");
#if SPARSEATTN_WGMMA_ENABLED
  using Tile = WgmmaDkvTmaTile<Dqk, Dv>;
  constexpr int kM = Tile::kM, kN = Tile::kN, kBuffers = Tile::kBuffers;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw + (-shared_address(smem_raw) & (wgmma::kTileAlignment - 1)));
  T* sV = sK + Tile::kK;
  T* sQ = sV + Tile::kV;
  T* sDO = sQ + kBuffers * Tile::kQ;
  float* sLse = reinterpret_cast<float*>(sDO + kBuffers * Tile::kDO);  // [kBuffers][kM]
  float* sDelta = sLse + kBuffers * kM;                                // [kBuffers][kM]
  float* sScale = sDelta + kBuffers * kM;  // [kBuffers][kM]: P factor (AttnArgs::d_o_scale)
  auto* barriers = reinterpret_cast<std::uint64_t*>(sScale + kBuffers * kM);

  if (a.seqs[blockIdx.z].S <= i64{blockIdx.y} * kN) return;  // no keys (DkvWork::keys)
  // K and V: one use, whose two tiles make one arrival each; step i: use i of the slots, its Q and dO tiles and its
  // row statistics making one arrival each (produce_tma_tile, produce_row_stats). A slot is released by every
  // consumer thread once the update that reads it (issued one step after its scores) has landed.
  const pipeline::Ring<1> kv_ring(barriers);
  const pipeline::Ring<kBuffers> step_ring(barriers + kv_ring.kBarriers);
  if (a.d_o_scale.data == nullptr) {  // without P factors the slots' factors are 1 throughout
    for (int i = threadIdx.x; i < kBuffers * kM; i += Tile::kThreads) sScale[i] = 1.f;
  }
  if (threadIdx.x == 0) {
    kv_ring.init(2, Tile::kConsumerThreads);
    step_ring.init(3, Tile::kConsumerThreads);
    pipeline::fence_init();
  }
  __syncthreads();
  // The CTA's work, found by each role after its setmaxnreg: values held across it would have to fit the
  // producer's few registers.
  auto find_work = [&](auto&& body) {
    const auto seq = a.seqs[blockIdx.z];
    const Mask mask = bind_mask<Mask>(mc, seq, blockIdx.z);
    body(seq, mask, DkvWork(a, mask, seq, kN, kM));
  };

  if (threadIdx.x < Tile::kProducerThreads) {
    if (!enter_tma_producer<Tile::kProducerRegisters>(&maps.q, &maps.d_o, &maps.k, &maps.v)) return;
    find_work([&](const auto& seq, const Mask&, const DkvWork& w) {
      const int steps = static_cast<int>(w.steps);
      if (steps <= 0) return;
      // Token coordinates in 32 bits (the tensor maps' dimensions are below 2^31), so that the loop's state fits
      // the producer's registers.
      const int batch = static_cast<int>(seq.batch), hk = static_cast<int>(w.hk);
      const int k_row0 = static_cast<int>(seq.k_begin + w.j0), keys = static_cast<int>(w.keys);
      produce_tma_tile<kN, Dqk>(kv_ring, 0, sK, a.k, &maps.k, batch, k_row0, keys, hk);
      produce_tma_tile<kN, Dv>(kv_ring, 0, sV, a.v, &maps.v, batch, k_row0, keys, hk);
      const int q_row0 = static_cast<int>(seq.q_begin), queries = static_cast<int>(seq.T);
      const int tile_begin = static_cast<int>(w.tile_begin), tile_end = tile_begin + static_cast<int>(w.tiles);
      // Step i's head and query tile as DkvWork::head(i) and tile(i), walked without divisions.
      int head = static_cast<int>(w.first_head), tile = tile_begin;
      for (int step = 0; step < steps; ++step) {
        const int t0 = tile * kM, slot = step_ring.slot(step);
        step_ring.acquire(step);  // by every lane: each writes the slot's row statistics
        produce_tma_tile<kM, Dqk>(step_ring, step, sQ + slot * Tile::kQ, a.q, &maps.q, batch, q_row0 + t0,
                                  queries - t0, head);
        produce_tma_tile<kM, Dv>(step_ring, step, sDO + slot * Tile::kDO, a.d_o, &maps.d_o, batch, q_row0 + t0,
                                 queries - t0, head);
        produce_row_stats<kM>(step_ring, step, sLse + slot * kM, sDelta + slot * kM, sScale + slot * kM, a, batch,
                              q_row0, queries, t0, head);
        if (++tile == tile_end) {
          tile = tile_begin;
          ++head;
        }
      }
      cp_async_wait<0>();
    });
    return;
  }

  pipeline::claim_registers<Tile::kConsumerRegisters>();
  const int warp = threadIdx.x / 32 - Tile::kProducerThreads / 32, lane = threadIdx.x % 32;  // among the 8 consumers'
  const int warpgroup_row0 = (warp / 4) * 64;
  // What the step loop needs of the CTA's work, in 32 bits (the rest is found again for the stores): steps, step i's
  // query tile tile_begin + i % tiles (DkvWork::tile), and the queries [q_first, q_end) (positions in the sequence,
  // below 2^31) that see this thread's two key rows.
  // A warpgroup computes only the steps whose query tile sees its keys, tiles [seen_first, seen_last] of each head
  // (dkv_seen_tiles: with a window each warpgroup has one tile fewer per head than the CTA, with a causal mask the
  // second warpgroup one); its pipeline step i is the i-th of those, and the ring's other steps it passes on unused.
  // Where the two take turns (at 128/128), only if both have as many tiles per head: their turns then pair up, and
  // neither runs ahead of the other's releases by more than the ring holds.
  constexpr bool kSkips = Tile::kSkipsUnseen && kSkipsUnseenSteps<Mask>;
  int steps = 0, tile_begin = 0, q_first[2], q_end[2], seen_first = 0, seen_last = 0, seen_steps = 0;
  unsigned tiles = 1;
  find_work([&](const auto&, const Mask& mask, const DkvWork& w) {
    steps = static_cast<int>(w.steps);
    tile_begin = static_cast<int>(w.tile_begin);
    tiles = static_cast<unsigned>(w.tiles);
    thread_visible_queries(mask, w.j0 + warp * 16, q_first, q_end);
    seen_steps = steps;
    if (kSkips && steps > 0) {
      constexpr int kMaxSkipped = Tile::kBuffers - 2;
      int other_first, other_last;
      dkv_seen_tiles<kM, kMaxSkipped>(mask, w.j0 + warpgroup_row0, tile_begin, static_cast<int>(tiles), seen_first,
                                      seen_last);
      dkv_seen_tiles<kM, kMaxSkipped>(mask, w.j0 + 64 - warpgroup_row0, tile_begin, static_cast<int>(tiles),
                                      other_first, other_last);
      if (!Tile::kOverlapsUpdate && seen_last - seen_first != other_last - other_first) {
        seen_first = 0;
        seen_last = static_cast<int>(tiles) - 1;
      }
      seen_steps = steps / static_cast<int>(tiles) * (seen_last - seen_first + 1);
    }
  });
  if constexpr (kSkips) {
    // Through shuffles: uniform to the compiler, so that the ring slots' wgmma descriptors stay in uniform registers.
    seen_first = __shfl_sync(0xffffffffu, seen_first, 0);
    seen_last = __shfl_sync(0xffffffffu, seen_last, 0);
    seen_steps = __shfl_sync(0xffffffffu, seen_steps, 0);
  }
  const DkvDescriptors desc = dkv_descriptors<kN, kM>(sK, sV, sQ, sDO, warpgroup_row0);  // slot 0's Q and dO

  float dk[Dqk / 8][4], dv[Dv / 8][4];
  zero(dk);
  zero(dv);
  if (steps > 0) {
    float s[kM / 8][4], dp[kM / 8][4];
    std::uint32_t p_a[kM / 16][4], ds_a[kM / 16][4];
    // With kSkips: the ring's use (the walk's step) of the current pipeline step and of the one before, and the
    // current step's query tile relative to tile_begin; begin_step moves them on, passing the unseen uses on (wait,
    // release: Ring::pass_on). Without, pipeline step i is use i, and make_ds walks the query tiles.
    [[maybe_unused]] int use = 0, previous_use = 0, tile = seen_first;
    [[maybe_unused]] int ds_tile = tile_begin;  // without kSkips: the query tile of make_ds's next step
    // With kOverlapsUpdate, step i computes S^T and dP^T of query step i while dV += P^T dO and dK += dS^T Q of
    // step i - 1 (its elementwise part done one step earlier) are in flight; its slot was filled by the producer
    // meanwhile.
    auto begin_step = [&](int step) {
      if (step == 0) kv_ring.wait_full(0);
      if constexpr (kSkips) {
        previous_use = use;
        if (step == 0) {
          step_ring.pass_on(0, seen_first);
          use = seen_first;
        } else if (step < seen_steps) {
          if (tile == seen_last) {  // the next head's first seen tile
            const int skipped = static_cast<int>(tiles) - 1 - seen_last + seen_first;
            step_ring.pass_on(use + 1, use + 1 + skipped);
            use += skipped + 1;
            tile = seen_first;
          } else {
            ++use;
            ++tile;
          }
        }
      }
      if (step < seen_steps) step_ring.wait_full(kSkips ? use : step);
      wgmma::fence_shared_for_async();  // the producer's zero-filled tiles (cp.async) before the MMAs read them
      wgmma::fence();
    };
    auto issue_step_scores = [&](int step) {  // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys
      const int buf = step_ring.slot(kSkips ? use : step);
      // The K and V descriptors made opaque here, so that the compiler advances them per MMA (an add each) instead
      // of holding every advanced copy across the step loop, in registers that the consumers do not have.
      std::uint64_t k_rows = desc.k, v_rows = desc.v;
      asm volatile("" : "+l"(k_rows), "+l"(v_rows));
      issue_scores<T, kM, Dqk, Dv, kN, kM>(s, dp, k_rows, wgmma::advance(desc.q, buf * Tile::kQ * 2), v_rows,
                                           wgmma::advance(desc.d_o, buf * Tile::kDO * 2));
    };
    auto issue_update = [&](int step) {  // dV += P^T dO and dK += dS^T Q of the previous step
      const int buf = step_ring.slot(kSkips ? previous_use : step - 1);
      wgmma::issue_dkv_update<T, kM, Dqk, Dv>(dk, dv, p_a, ds_a, wgmma::advance(desc.q_mn, buf * Tile::kQ * 2),
                                              wgmma::advance(desc.d_o_mn, buf * Tile::kDO * 2));
    };
    // P^T and dS^T (without the scale) in place of S^T and dP^T, as the kernel above computes them for the plain
    // masks; column n * 8 + 2 (lane % 4) + {0, 1} is a query row, its statistics read from the step's slot.
    auto make_ds = [&](int step) {
      wgmma::fence_operand(wgmma::flat<kM>(s));
      wgmma::fence_operand(wgmma::flat<kM>(dp));
      const int buf = step_ring.slot(kSkips ? use : step);
      const float* lse = sLse + buf * kM;
      const float* delta = sDelta + buf * kM;
      const float* p_scale = sScale + buf * kM;
      int t0 = (tile_begin + tile) * kM;
      if constexpr (!kSkips) {
        // Step i's query tile tile_begin + i % tiles, walked without a division (make_ds runs once per step, in
        // order).
        t0 = ds_tile * kM;
        if (++ds_tile == tile_begin + static_cast<int>(tiles)) ds_tile = tile_begin;
      }
      const int col_first[2] = {q_first[0] - t0, q_first[1] - t0}, col_end[2] = {q_end[0] - t0, q_end[1] - t0};
      const bool full = max(col_first[0], col_first[1]) <= 0 && min(col_end[0], col_end[1]) >= kM;
      with_mask(!full, [&](auto masked) {
#pragma unroll
        for (int n = 0; n < kM / 8; ++n) {
          const float2 l2 = *reinterpret_cast<const float2*>(lse + n * 8 + 2 * (lane % 4));
          const float2 d2 = *reinterpret_cast<const float2*>(delta + n * 8 + 2 * (lane % 4));
          const float2 g2 = *reinterpret_cast<const float2*>(p_scale + n * 8 + 2 * (lane % 4));
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int col = n * 8 + 2 * (lane % 4) + (i % 2);
            float p = fast_exp2(fmaf(s[n][i], a.scale_log2, -kLog2e * (i % 2 ? l2.y : l2.x))) * (i % 2 ? g2.y : g2.x);
            if constexpr (decltype(masked)::value) {
              if (col < col_first[i / 2] || col >= col_end[i / 2]) p = 0.f;
            }
            s[n][i] = p;
            dp[n][i] = p * (dp[n][i] - (i % 2 ? d2.y : d2.x));
          }
        }
      });
    };
    auto land = [&](int step) {
      wgmma::wait<0>();
      wgmma::fence_operand(wgmma::flat<Dv>(dv));
      wgmma::fence_operand(wgmma::flat<Dqk>(dk));
      wgmma::fence_operand(p_a);
      wgmma::fence_operand(ds_a);
      if (step > 0) step_ring.release(kSkips ? previous_use : step - 1);  // its update has landed: the slot is free
      if (Tile::kOverlapsUpdate && step < seen_steps) {
        wgmma::to_a_fragments<T, kM>(s, p_a);
        wgmma::to_a_fragments<T, kM>(dp, ds_a);
      }
    };
    if constexpr (Tile::kOverlapsUpdate) {
      wgmma::overlapped_steps(seen_steps, begin_step, issue_step_scores, issue_update, make_ds, land);
    } else {
      // Step i, in the consumer's turn, issues the update of step i - 1, lands it (its A fragments are then free),
      // issues the scores of step i; then it lands those and runs step i's elementwise part while the other
      // consumer issues. The first and last steps are peeled, as in overlapped_steps, so that every MMA is issued on
      // a path without branches.
      const pipeline::Turns turns(warp / 4);
      auto finish_step = [&](int step) {
        land(step);
        wgmma::fence_operand(wgmma::flat<kM>(s));
        wgmma::fence_operand(wgmma::flat<kM>(dp));
        if (step < seen_steps) {
          make_ds(step);
          wgmma::to_a_fragments<T, kM>(s, p_a);
          wgmma::to_a_fragments<T, kM>(dp, ds_a);
        }
      };
      begin_step(0);
      turns.take();
      issue_step_scores(0);
      turns.pass();
      finish_step(0);
      for (int step = 1; step < seen_steps; ++step) {
        begin_step(step);
        turns.take();
        issue_update(step);
        wgmma::wait<0>();
        wgmma::fence_operand(p_a);
        wgmma::fence_operand(ds_a);
        issue_step_scores(step);
        turns.pass();
        finish_step(step);
      }
      begin_step(seen_steps);
      turns.take();
      issue_update(seen_steps);
      turns.pass();
      finish_step(seen_steps);
      turns.finish();
    }
    if constexpr (kSkips) step_ring.pass_on(use + 1, steps);
  }
  find_work([&](const auto& seq, const Mask&, const DkvWork& w) {
    store_dkv_rows<true, true>(dk, dv, a, seq, w.split, w.j0 + warp * 16, w.hk);
  });
#endif
}

// -------------------------------------------------------------------------------------------------- dQ

template <int Dqk, int Dv>
struct WgmmaDqTile : pipeline::ProducerConsumers {
  // dQ accumulates with wgmma N = Dqk (64, 128 or 192); dO V^T reads Dv in whole 64-column panels.
  static constexpr bool kSupported = (Dqk == 64 || Dqk == 128 || Dqk == 192) && (Dv == 64 || Dv == 128);
  static constexpr int kM = 64 * kConsumers;  // queries per tile
  static constexpr int kN = 64;               // keys per step
  // A stage holds K and V of one key tile. It is released when dQ += dS K of that tile, issued one step after
  // its scores, has landed: four stages keep the producer two tiles ahead (three, one tile, at Dqk = 192, where
  // four do not fit in shared memory).
  static constexpr int kStages = Dqk > 128 ? 3 : 4;
  static constexpr int kQ = kM * Dqk, kDO = kM * Dv, kK = kN * Dqk, kV = kN * Dv;  // elements
  static constexpr int kBarriers = pipeline::Ring<1>::kBarriers + pipeline::Ring<kStages>::kBarriers;
  // Per consumer, two buffers of a key tile's gate delta (kN floats; policies with a gate).
  static constexpr int kGateKeys = kConsumers * 2 * kN;
  // Per consumer, two buffers of a key tile's key terms (kN floats; FlashTermsMask, score_terms.cuh).
  static constexpr int kKeyTerms = kConsumers * 2 * kN;
  // Q, dO, the K/V stages (2-byte elements, every tile a multiple of 1024 bytes), the barriers, the gate and
  // key-term buffers, plus room to align the start to a swizzle atom: 194 KB at 128/128, 202 KB at 192/128.
  static constexpr std::size_t kSmemBytes = 2 * (kQ + kDO + kStages * (kK + kV)) +
                                            sizeof(std::uint64_t) * kBarriers +
                                            sizeof(float) * (kGateKeys + kKeyTerms) + wgmma::kTileAlignment;
};

// The dQ of both kernels below; Maps: BackwardTmaMaps (the TMA producer, tma_producer.cuh) or NoTmaMaps (cp.async).
template <class T, int Dqk, int Dv, class Mask, class Maps>
__device__ __forceinline__ void attention_dq_wgmma(const AttnArgs<T>& a, const typename Mask::Config& mc,
                                                   const QueryTileOrder& order, [[maybe_unused]] const Maps& maps) {
  constexpr bool kTma = std::is_same_v<Maps, BackwardTmaMaps>;
  static_assert(!kTma || kTmaMask<Mask>, "the TMA producer serves the plain masks");
#if SPARSEATTN_WGMMA_ENABLED
  using Tile = WgmmaDqTile<Dqk, Dv>;
  constexpr int kM = Tile::kM, kN = Tile::kN, kStages = Tile::kStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw + (-shared_address(smem_raw) & (wgmma::kTileAlignment - 1)));
  T* sDO = sQ + Tile::kQ;
  T* sK = sDO + Tile::kDO;
  T* sV = sK + kStages * Tile::kK;
  auto* barriers = reinterpret_cast<std::uint64_t*>(sV + kStages * Tile::kV);
  // [consumer][2][kN]: the gate delta of a consumer's key tiles (step parity), staged by the consumer itself.
  [[maybe_unused]] float* sGateKeys = reinterpret_cast<float*>(barriers + Tile::kBarriers);
  // [consumer][2][kN]: the key terms of a consumer's key tiles (step parity), staged by the consumer itself.
  [[maybe_unused]] float* sKeyTerms = sGateKeys + Tile::kGateKeys;
  // Both roles walk the same tiles and, within each, the same key tiles: the CTA's n-th key tile is use n of the
  // K/V ring, its n-th query tile with keys to see use n of the Q/dO ring.
  const pipeline::Ring<1> q_ring(barriers);
  const pipeline::Ring<kStages> kv_ring(barriers + q_ring.kBarriers);
  if constexpr (kTma) {
    // A slot holds two tiles (K and V; Q and dO), each of which makes one arrival (produce_tma_tile).
    pipeline::init_rings_with_full_arrivals(2, q_ring, kv_ring);
  } else {
    pipeline::init_rings(q_ring, kv_ring);
  }

  if constexpr (kTma) {
    if (threadIdx.x < Tile::kProducerThreads) {
      if (!enter_tma_producer(&maps.q, &maps.d_o, &maps.k, &maps.v)) return;
      unsigned key_tiles = 0, query_tiles = 0;
      for_each_query_tile<Mask, kM, kN>(a, mc, order, [&](const auto& seq, const Mask&, const QueryWork& w) {
        // Token coordinates in 32 bits (the tensor maps' dimensions are below 2^31), so that the loop's state fits
        // the producer's registers.
        const int batch = static_cast<int>(seq.batch), k_row0 = static_cast<int>(seq.k_begin);
        const int keys = static_cast<int>(seq.S), hk = static_cast<int>(w.hk);
        const int q_row0 = static_cast<int>(seq.q_begin + w.t0), rows = static_cast<int>(w.rows),
                  h = static_cast<int>(w.h);
        KeyTileWalk<Mask> walk;
        const int first = static_cast<int>(walk.next(mc, seq, w, w.tile_begin, kN)),
                  tile_end = static_cast<int>(w.tile_end);
        for (int it = first; it < tile_end; it = static_cast<int>(walk.next(mc, seq, w, it + 1, kN)), ++key_tiles) {
          const int j0 = it * kN, stage = kv_ring.slot(key_tiles);
          produce_tma_tile<kN, Dqk>(kv_ring, key_tiles, sK + stage * Tile::kK, a.k, &maps.k, batch, k_row0 + j0,
                                    keys - j0, hk);
          produce_tma_tile<kN, Dv>(kv_ring, key_tiles, sV + stage * Tile::kV, a.v, &maps.v, batch, k_row0 + j0,
                                   keys - j0, hk);
          if (it == first) {  // Q and dO after the first K/V, as the cp.async producer does
            produce_tma_tile<kM, Dqk>(q_ring, query_tiles, sQ, a.q, &maps.q, batch, q_row0, rows, h);
            produce_tma_tile<kM, Dv>(q_ring, query_tiles, sDO, a.d_o, &maps.d_o, batch, q_row0, rows, h);
            ++query_tiles;
          }
        }
      });
      return;
    }
  } else if (threadIdx.x < Tile::kProducerThreads) {
    pipeline::release_registers<Tile::kProducerRegisters>();
    constexpr int kCopiers = Tile::kProducerThreads, kUnroll = Tile::kProducerUnroll;
    unsigned key_tiles = 0, query_tiles = 0;
    for_each_query_tile<Mask, kM, kN>(a, mc, order, [&](const auto& seq, const Mask&, const QueryWork& w) {
      KeyTileWalk<Mask> walk;
      const i64 first = walk.next(mc, seq, w, w.tile_begin, kN);
      for (i64 it = first; it < w.tile_end; it = walk.next(mc, seq, w, it + 1, kN), ++key_tiles) {
        const i64 j0 = it * kN;
        const int stage = kv_ring.slot(key_tiles);
        kv_ring.acquire(key_tiles);
        wgmma::load_swizzled_tile<kN, Dqk, kCopiers, kUnroll>(sK + stage * Tile::kK, a.k, seq.batch,
                                                              seq.k_begin + j0, seq.S - j0, w.hk);
        wgmma::load_swizzled_tile<kN, Dv, kCopiers, kUnroll>(sV + stage * Tile::kV, a.v, seq.batch,
                                                             seq.k_begin + j0, seq.S - j0, w.hk);
        kv_ring.commit(key_tiles);
        if (it == first) {  // Q and dO after the first K/V: that stage frees up earlier than Q does
          q_ring.acquire(query_tiles);
          wgmma::load_swizzled_tile<kM, Dqk, kCopiers, kUnroll>(sQ, a.q, seq.batch, seq.q_begin + w.t0, w.rows, w.h);
          wgmma::load_swizzled_tile<kM, Dv, kCopiers, kUnroll>(sDO, a.d_o, seq.batch, seq.q_begin + w.t0, w.rows,
                                                               w.h);
          q_ring.commit(query_tiles++);
        }
      }
    });
    cp_async_wait<0>();
    return;
  }

  pipeline::claim_registers<Tile::kConsumerRegisters>();
  // The warpgroup index through a shuffle is uniform to the compiler: descriptors in uniform registers.
  const int consumer = wgmma::warpgroup_index() - 1;
  const int warp = threadIdx.x / 32 - 4, lane = threadIdx.x % 32;  // warp among the consumers' 8
  const int warpgroup_row0 = consumer * 64, warp_row0 = warp * 16;
  // Descriptors of this warpgroup's Q and dO rows and of stage 0's K (read K-major by S = Q K^T, MN-major by
  // dQ += dS K) and V; the loops add compile-time offsets.
  const std::uint64_t q_desc = wgmma::k_major_descriptor<kM>(sQ, warpgroup_row0, 0);
  const std::uint64_t do_desc = wgmma::k_major_descriptor<kM>(sDO, warpgroup_row0, 0);
  const std::uint64_t k_desc0 = wgmma::k_major_descriptor<kN>(sK, 0, 0);
  const std::uint64_t k_mn_desc0 = wgmma::mn_major_descriptor<kN>(sK, 0, 0);
  const std::uint64_t v_desc0 = wgmma::k_major_descriptor<kN>(sV, 0, 0);
  const pipeline::Turns turns(consumer);
  unsigned key_tiles = 0, query_tiles = 0;

  for_each_query_tile<Mask, kM, kN>(a, mc, order, [&](const auto& seq, const Mask& mask, const QueryWork& w) {
    const i64 t0 = w.t0, tile_begin = w.tile_begin;
    KeyTileWalk<Mask> walk;
    // The step count through a shuffle: uniform to the compiler (walk.count divides 64-bit numbers through a
    // subroutine call), so that the loop's wgmma descriptors stay in uniform registers.
    const int steps = __shfl_sync(0xffffffffu, walk.count(mc, seq, w, kN), 0);
    float acc[Dqk / 8][4];
    zero(acc);
    // With a gate (kHasGate): alpha of the thread's two rows and their dalpha sums.
    [[maybe_unused]] float gate_alpha_rows[1][2], dalpha_sums[2] = {0.f, 0.f};
    if constexpr (kHasGate<Mask>) {
      if (gate_of<Mask>(mc).on() && steps > 0) {
        load_gate_alpha_rows<T, 1>(gate_alpha_rows, gate_of<Mask>(mc), seq, w.h, t0 + warp_row0);
      }
    }
    if (steps > 0) {
      const unsigned q_use = query_tiles++;
      // dS = g P (dP - delta) as P (g dP - g delta): g (the P factor) costs no instruction per element.
      float lse2[2], g_delta[2], p_scale[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        row_stats(a, seq, w.h, t0 + warp_row0 + lane / 4 + half * 8, lse2[half], g_delta[half], p_scale[half]);
        g_delta[half] *= p_scale[half];
        if constexpr (kHasAnyTerms<Mask>) lse2[half] = finite_lse(lse2[half]);
      }
      // FlashTermsMask: the key tile of the current step (absent tiles are skipped), its kind and whether the
      // elementwise part adds terms to its scores (init_scores).
      [[maybe_unused]] i64 key_tile = tile_begin;
      [[maybe_unused]] int terms_kind = kTileExists;
      [[maybe_unused]] bool terms_needed = false;
      // Whether the step's tile takes its terms by key (tile_uses_key_terms): the first kN threads of each consumer
      // then stage the term of one key each into the consumer's key-term buffer, ordered like the gate delta.
      [[maybe_unused]] bool terms_by_key = false;
      [[maybe_unused]] float key_term_value = 0.f;
      // With kSkipsUnseenSteps (FlashMask): this warpgroup's 64 rows see the key tiles of steps [first_seen,
      // first_seen + seen) only (a monotone mask's rows see one interval together), so its pipeline runs over those
      // steps (step i below is step first_seen + i of the walk) and the others only pass their K/V stage on; with a
      // window each warpgroup has one step fewer than the query tile. Both warpgroups take as many turns: the one
      // with fewer steps takes empty turns after its last.
      [[maybe_unused]] int first_seen = 0, seen = steps, turns_left = 0;
      if constexpr (kSkipsUnseenSteps<Mask>) {
        int last = 0, other_first = 0, other_last = 0;
        rows_key_steps<kN, 64>(mask, t0 + warpgroup_row0, tile_begin, steps, first_seen, last);
        rows_key_steps<kN, 64>(mask, t0 + 64 - warpgroup_row0, tile_begin, steps, other_first, other_last);
        // Through shuffles: uniform to the compiler, so that the loop's wgmma descriptors stay in uniform registers.
        first_seen = __shfl_sync(0xffffffffu, first_seen, 0);
        seen = __shfl_sync(0xffffffffu, max(0, last - first_seen + 1), 0);
        const int other_seen = max(0, other_last - other_first + 1);
        // overlapped_steps takes seen + 1 turns
        const int turns_taken = seen > 0 ? seen + 1 : 0, other_turns = other_seen > 0 ? other_seen + 1 : 0;
        turns_left = __shfl_sync(0xffffffffu, max(0, other_turns - turns_taken), 0);
        kv_ring.pass_on(key_tiles, key_tiles + first_seen);
      }
      const unsigned first_use = key_tiles + first_seen;  // the K/V ring's use of step 0
      float s[kN / 8][4], dp[kN / 8][4];
      std::uint32_t ds[kN / 16][4];
      // Step i (key tile tile_begin + i) computes S and dP of its tile while dQ += dS K of the tile before (dS
      // done one step earlier) is in flight, so the dS arithmetic overlaps an MMA; a last step adds the last
      // tile's dS K. A K/V stage is released once that dS K has landed, Q and dO after the last scores.
      // With a gate, the first kN threads of each consumer stage delta of the step's keys into its buffer (step
      // parity), ordered before the reads by the turn taken before the elementwise part (as in the forward).
      [[maybe_unused]] float gate_key_delta = 0.f;
      auto begin_step = [&](int step) {
        if constexpr (kHasTerms<Mask>) {
          if (step < seen) {
            key_tile = walk.next(mc, seq, w, step == 0 ? tile_begin : key_tile + 1, kN);
            const QueryTileTerms tt(mc.terms, walk.kind(mc, key_tile));
            terms_kind = tt.kind;
            terms_needed = tt.needs;
            terms_by_key = tt.needs && tile_uses_key_terms(mc.terms, tt.kind);
            if (terms_by_key && threadIdx.x % 128 < kN) {
              key_term_value = key_term<T>(mc.terms, seq, w.h, key_tile * kN + threadIdx.x % 128, tt.kind);
            }
          }
        } else if constexpr (kHasKeyTerms<Mask>) {
          // The term of step 0's key here; every later step's was read one step ahead (below), as in the forward.
          terms_by_key = true;
          if (step == 0 && threadIdx.x % 128 < kN) {
            key_term_value =
                key_term<T>(mc.terms, seq, w.h, (tile_begin + first_seen) * kN + threadIdx.x % 128, kTileExists);
          }
        }
        if constexpr (kHasGate<Mask>) {
          if (gate_of<Mask>(mc).on() && step < seen && threadIdx.x % 128 < kN) {
            const i64 j0 = (kHasTerms<Mask> ? key_tile : tile_begin + first_seen + step) * kN;
            gate_key_delta = gate_delta<T>(gate_of<Mask>(mc), seq, w.hk, j0 + threadIdx.x % 128);
          }
        }
        if (step == 0) q_ring.wait_full(q_use);
        if (step < seen) kv_ring.wait_full(first_use + step);
        if constexpr (kHasAnyTerms<Mask>) {
          if (terms_by_key && step < seen && threadIdx.x % 128 < kN) {
            sKeyTerms[(consumer * 2 + (step & 1)) * kN + threadIdx.x % 128] = key_term_value;
          }
        }
        if constexpr (kHasKeyTerms<Mask>) {
          if (step + 1 < seen && threadIdx.x % 128 < kN) {
            const i64 j = (tile_begin + first_seen + step + 1) * kN + threadIdx.x % 128;
            key_term_value = key_term<T>(mc.terms, seq, w.h, j, kTileExists);
          }
        }
        if constexpr (kHasGate<Mask>) {
          if (gate_of<Mask>(mc).on() && step < seen && threadIdx.x % 128 < kN) {
            sGateKeys[(consumer * 2 + (step & 1)) * kN + threadIdx.x % 128] = gate_key_delta;
          }
        }
        wgmma::fence_shared_for_async();
        wgmma::fence();
      };
      auto issue_step_scores = [&](int step) {
        const int stage = kv_ring.slot(first_use + step);
        issue_scores<T, kN, Dqk, Dv, kM, kN>(s, dp, q_desc, wgmma::advance(k_desc0, stage * Tile::kK * 2), do_desc,
                                             wgmma::advance(v_desc0, stage * Tile::kV * 2));
      };
      auto issue_dq = [&](int step) {  // dQ += dS K of the tile of step - 1
        const std::uint64_t k_mn_desc = wgmma::advance(k_mn_desc0, kv_ring.slot(first_use + step - 1) * Tile::kK * 2);
#pragma unroll
        for (int kk = 0; kk < kN / 16; ++kk) {
          wgmma::mma_rs_mn<T, Dqk, kN>(wgmma::flat<Dqk>(acc), ds[kk],
                                       wgmma::advance(k_mn_desc, wgmma::operand_offset<kN>(16 * kk, 0)), 1);
        }
        wgmma::commit();
      };
      auto make_ds = [&](int step) {  // dS (without the scale) into s
        wgmma::fence_operand(wgmma::flat<kN>(s));
        wgmma::fence_operand(wgmma::flat<kN>(dp));
        if (step == seen - 1) q_ring.release(q_use);
        const i64 j0 = (kHasTerms<Mask> ? key_tile : tile_begin + first_seen + step) * kN;
        if constexpr (kHasKeyTerms<Mask>) {
          add_key_terms<kN, true>(s, sKeyTerms + (consumer * 2 + (step & 1)) * kN);
        } else if constexpr (kHasTerms<Mask>) {
          if (terms_by_key) {
            add_key_terms<kN, true>(s, sKeyTerms + (consumer * 2 + (step & 1)) * kN);
          } else if (terms_needed) {
            init_scores<T, kN, true, true>(s, mc.terms, seq, w.sequence, w.h, t0 + warp_row0, j0, terms_kind);
          }
        }
        [[maybe_unused]] const float* gate_keys = sGateKeys + (consumer * 2 + (step & 1)) * kN;
        with_gate_of<Mask>(mc, [&](auto gate) {
          constexpr int kGate = decltype(gate)::value;
          with_mask(!tile_full(mask, t0, kM, j0, kN), [&](auto masked) {
            int col_lo[2] = {0, 0}, col_hi[2] = {kN - 1, kN - 1};
            if constexpr (decltype(masked)::value) visible_columns<kN>(mask, t0 + warp_row0, j0, col_lo, col_hi);
#pragma unroll
            for (int n = 0; n < kN / 8; ++n) {
              [[maybe_unused]] float2 d2 = make_float2(0.f, 0.f);
              if constexpr (kGate != kNoGate) d2 = *reinterpret_cast<const float2*>(gate_keys + n * 8 + 2 * (lane % 4));
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const int col = n * 8 + 2 * (lane % 4) + (i % 2);
                float score = s[n][i];
                [[maybe_unused]] float slope = 0.f;
                if constexpr (kGate != kNoGate) {
                  score += gate_value_slope<kGate>(gate_alpha_rows[0][i / 2] * (i % 2 ? d2.y : d2.x), slope);
                }
                float p = fast_exp2(fmaf(score, a.scale_log2, -lse2[i / 2]));
                if constexpr (decltype(masked)::value) {
                  if (col < col_lo[i / 2] || col > col_hi[i / 2]) p = 0.f;
                }
                s[n][i] = p * fmaf(p_scale[i / 2], dp[n][i], -g_delta[i / 2]);
                if constexpr (kGate != kNoGate) dalpha_sums[i / 2] += s[n][i] * slope * (i % 2 ? d2.y : d2.x);
              }
            }
          });
        });
      };
      auto land = [&](int step) {
        wgmma::wait<0>();
        wgmma::fence_operand(wgmma::flat<Dqk>(acc));
        wgmma::fence_operand(ds);
        if (step > 0) kv_ring.release(first_use + step - 1);
        if (step < seen) wgmma::to_a_fragments<T, kN>(s, ds);
      };
      if (seen > 0) {
        wgmma::overlapped_steps(seen, begin_step, issue_step_scores, issue_dq, make_ds, land, turns);
      } else {
        q_ring.pass_on(q_use, q_use + 1);
      }
      if constexpr (kSkipsUnseenSteps<Mask>) {
        kv_ring.pass_on(key_tiles + first_seen + seen, key_tiles + steps);
        for (; turns_left > 0; --turns_left) {
          turns.take();
          turns.pass();
        }
      }
      key_tiles += steps;
    }
    store_rows<Dqk>(acc, a.scale, a.scale, a.dq, seq.batch, seq.q_begin + t0 + warp_row0, seq.T - (t0 + warp_row0),
                    w.h, a.accumulate_dq);
    if constexpr (kHasGate<Mask>) {
      if (gate_of<Mask>(mc).on()) store_dalpha<T>(gate_of<Mask>(mc), dalpha_sums, a.scale, seq, w.h, t0 + warp_row0);
    }
  });
  turns.finish();
  if constexpr (kHasTerms<Mask>) {
    if (threadIdx.x / 32 == Tile::kProducerThreads / 32 && mc.terms.work_counter != nullptr) {  // one warp
      unsigned long long work = 0;
      for_each_query_tile<Mask, kM, kN>(a, mc, order, [&](const auto& seq, const Mask&, const QueryWork& w) {
        work += query_tile_work<Mask>(mc, seq, w, kN);
      });
      if (threadIdx.x == Tile::kProducerThreads) add_work(mc.terms, work);
    }
  }
#endif
}

template <class T, int Dqk, int Dv, class Mask>
__global__ void __launch_bounds__(WgmmaDqTile<Dqk, Dv>::kThreads, 1)
    attention_dq_wgmma_kernel(AttnArgs<T> a, typename Mask::Config mc, QueryTileOrder order) {
  attention_dq_wgmma<T, Dqk, Dv, Mask>(a, mc, order, NoTmaMaps{});
}

// The TMA variant (kTmaMask policies); the host launches it where the device runs its sm_90a code and every tensor
// has a map (launch_dq_wgmma_tma).
template <class T, int Dqk, int Dv, class Mask>
__global__ void __launch_bounds__(WgmmaDqTile<Dqk, Dv>::kThreads, 1)
    attention_dq_wgmma_tma_kernel(AttnArgs<T> a, typename Mask::Config mc, QueryTileOrder order,
                                  const __grid_constant__ BackwardTmaMaps maps) {
  attention_dq_wgmma<T, Dqk, Dv, Mask>(a, mc, order, maps);
}

}  // namespace sparseattn::cuda::attention
