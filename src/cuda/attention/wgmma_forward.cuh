// The attention forward on Hopper (sm_90a): warp-specialised, persistent, with two consumer warpgroups in
// ping-pong.
//
// A CTA of three warpgroups runs on each SM and walks the query tiles of QueryTileOrder (heaviest first). Each
// tile is kM = 128 queries of one query head against the key tiles of kN = 128 keys that hold visible keys.
//  - Warpgroup 0 (the producer, 40 registers) copies Q and the K/V tiles with cp.async into shared memory:
//    Q in one buffer, K and V in kStages stages. It signals on mbarriers (pipeline.cuh) and runs ahead across
//    tile boundaries, so the next tile's first loads overlap this tile's last MMAs and its epilogue.
//  - Warpgroups 1 and 2 (the consumers, 232 registers) own 64 query rows each. Per key tile they compute
//    S = Q K^T (both operands from shared memory, K-major). The online softmax runs in registers, in fp32, on
//    log2e-prescaled scores with exp2 and per-row visible-column bounds (softmax.cuh). Then O += P V, with P
//    as the register A operand and V as an MN-major operand. The P V of one key tile is in flight while the
//    next tile's softmax runs (wgmma::overlapped_steps). The two consumers take turns to issue their MMAs
//    (pipeline::Turns), so one's softmax overlaps the other's MMAs.
//
// With flash_attention's sparse-softmax threshold (the kThreshold instantiation, FlashTermsMask; score_terms.cuh)
// the consumers decide each key tile before its softmax: every warp's ballot of its rows' votes lands in a shared
// word, then a named barrier of the two consumers' 256 threads (not the producer's) makes the decision of the
// 128-row query tile common. A skipped tile's softmax step leaves m and l as they are and gives P = 0; the producer
// loads every tile as before.
//
// The TMA variant (attention_forward_wgmma_tma_kernel, for the plain masks: kTmaMask) has the same consumers;
// its producer is one warp, whose lane 0 copies each whole tile with TMA boxes (tma.cuh: 64 columns x 128 rows per
// box, written with the 128-byte swizzle, the layout of wgmma.cuh's swizzled tiles), so the producer takes a few
// instructions per tile instead of a copy per 16 bytes (tma_producer.cuh, shared with the dQ's TMA variant).
//
// Why the producer and the turns: with both warpgroups loading, a CTA barrier per key tile and the consumers in
// lockstep, the same loop is bound by instruction issue and leaves the tensor pipe idle about half of the time.
// The producer takes the copies and their address arithmetic off the consumers, and the turns let one
// consumer's softmax run while the other's MMAs occupy the tensor cores.
#pragma once

#include <type_traits>

#include "cuda/attention/mma_sync_kernels.cuh"
#include "cuda/attention/tma_producer.cuh"
#include "cuda/primitives/pipeline.cuh"
#include "cuda/primitives/tma.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace sparseattn::cuda::attention {

template <int Dqk, int Dv>
struct WgmmaFwdTile : pipeline::ProducerConsumers {
  // wgmma N is 64 or 128 here (O's N = Dv); tiles are whole 64-column panels.
  static constexpr bool kSupported = (Dv == 64 || Dv == 128) && Dqk % 64 == 0 && Dqk <= 192;
  static constexpr int kM = 64 * kConsumers;
  static constexpr int kN = 128;
  static constexpr int kStages = 2;
  // A second Q buffer lets the next tile's Q load while this tile's last steps run (compressed attention has
  // 16 key tiles per query tile on average at T = 64K); 192/128 has no room for it.
  static constexpr int kQBuffers = Dqk <= 128 ? 2 : 1;
  static constexpr int kQ = kM * Dqk, kK = kN * Dqk, kV = kN * Dv;  // elements (no padding)
  static constexpr int kBarriers = pipeline::Ring<kQBuffers>::kBarriers + 2 * pipeline::Ring<kStages>::kBarriers;
  // Per consumer, two buffers of a key tile's gate delta (kN floats; policies with a gate).
  static constexpr int kGateKeys = kConsumers * 2 * kN;
  // Per consumer, two buffers of a key tile's key terms (kN floats; FlashTermsMask, score_terms.cuh).
  static constexpr int kKeyTerms = kConsumers * 2 * kN;
  // The Q buffers and the K/V stages (2-byte elements, every tile a multiple of 1024 bytes), the barriers, the gate
  // and key-term buffers, plus room to align the start to a swizzle atom. 195 KB at 128/128, 211 KB at 192/128.
  static constexpr std::size_t kSmemBytes = 2 * (kQBuffers * kQ + kStages * (kK + kV)) +
                                            sizeof(std::uint64_t) * kBarriers +
                                            sizeof(float) * (kGateKeys + kKeyTerms) + wgmma::kTileAlignment;
};

// The named barrier of the two consumer warpgroups' threshold agreement (pipeline::Turns takes 1 and 2).
constexpr int kThresholdBarrier = 3;

// Whether some thread of the two consumer warpgroups votes: the warps with a vote write `tag` (unique per decision
// of the CTA, not 0) into words[tag % 2], then a named barrier of the consumers' 256 threads (not the producer's). A
// word is written again two decisions later, after every consumer has passed the barrier of the decision between,
// which it reaches only after reading this one.
__device__ __forceinline__ bool consumers_vote(bool vote, unsigned* words, unsigned tag) {
  if (__any_sync(~0u, vote) && threadIdx.x % 32 == 0) words[tag % 2] = tag;
  asm volatile("bar.sync %0, %1;\n" ::"n"(kThresholdBarrier), "n"(pipeline::ProducerConsumers::kConsumerThreads)
               : "memory");
  return words[tag % 2] == tag;
}

// The kernel parameter of the TMA variant: the tensor maps of q, k and v with boxes of 64 columns x 128 rows
// (tma::token_map); the cp.async kernel takes none.
struct ForwardTmaMaps {
  CUtensorMap q, k, v;
};

// The forward of both kernels below; Maps: ForwardTmaMaps (the TMA producer) or NoTmaMaps (cp.async).
// kThreshold: the variant with flash_attention's sparse-softmax threshold (FlashTermsMask with terms.threshold).
template <class T, int Dqk, int Dv, class Mask, bool kThreshold, class Maps>
__device__ __forceinline__ void attention_forward_wgmma(const AttnArgs<T>& a, const typename Mask::Config& mc,
                                                        const QueryTileOrder& order,
                                                        [[maybe_unused]] const Maps& maps) {
  static_assert(!kThreshold || kHasTerms<Mask>, "the threshold comes with FlashTermsMask");
  constexpr bool kTma = std::is_same_v<Maps, ForwardTmaMaps>;
  static_assert(!kTma || (kTmaMask<Mask> && !kThreshold), "the TMA producer serves the plain masks");
#if SPARSEATTN_WGMMA_ENABLED
  using Tile = WgmmaFwdTile<Dqk, Dv>;
  constexpr int kM = Tile::kM, kN = Tile::kN, kStages = Tile::kStages, kQBuffers = Tile::kQBuffers;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw + (-shared_address(smem_raw) & (wgmma::kTileAlignment - 1)));
  T* sK = sQ + kQBuffers * Tile::kQ;
  T* sV = sK + kStages * Tile::kK;
  auto* barriers = reinterpret_cast<std::uint64_t*>(sV + kStages * Tile::kV);
  // [consumer][2][kN]: the gate delta of a consumer's key tiles (step parity), staged by the consumer itself.
  [[maybe_unused]] float* sGateKeys = reinterpret_cast<float*>(barriers + Tile::kBarriers);
  // [consumer][2][kN]: the key terms of a consumer's key tiles (step parity), staged by the consumer itself.
  [[maybe_unused]] float* sKeyTerms = sGateKeys + Tile::kGateKeys;
  // Both roles walk the same tiles and, within each, the same key tiles: the CTA's n-th key tile is use n of the
  // K and V rings, its n-th query tile with keys to see use n of the Q ring.
  const pipeline::Ring<kQBuffers> q_ring(barriers);
  const pipeline::Ring<kStages> k_ring(barriers + q_ring.kBarriers);
  const pipeline::Ring<kStages> v_ring(barriers + q_ring.kBarriers + k_ring.kBarriers);
  // With the sparse-softmax threshold (score_terms.cuh): the consumers' agreement words, cleared before
  // init_rings' barrier.
  [[maybe_unused]] unsigned* vote_words = nullptr;
  if constexpr (kThreshold) {
    vote_words = threshold_vote_words();
    if (threadIdx.x == 0) vote_words[0] = vote_words[1] = 0;
  }
  if constexpr (kTma) {
    pipeline::init_rings_with_full_arrivals(1, q_ring, k_ring, v_ring);
  } else {
    pipeline::init_rings(q_ring, k_ring, v_ring);
  }

  if constexpr (kTma) {
    if (threadIdx.x < Tile::kProducerThreads) {
      if (!enter_tma_producer(&maps.q, &maps.k, &maps.v)) return;
      unsigned key_tiles = 0, query_tiles = 0;
      for_each_query_tile<Mask, kM, kN>(a, mc, order, [&](const auto& seq, const Mask&, const QueryWork& w) {
        // Token coordinates in 32 bits (the tensor maps' dimensions are below 2^31), so that the loop's state fits
        // the producer's registers.
        const int batch = static_cast<int>(seq.batch), k_row0 = static_cast<int>(seq.k_begin);
        const int keys = static_cast<int>(seq.S), hk = static_cast<int>(w.hk);
        KeyTileWalk<Mask> walk;
        const i64 first = walk.next(mc, seq, w, w.tile_begin, kN);
        for (i64 it = first; it < w.tile_end; it = walk.next(mc, seq, w, it + 1, kN), ++key_tiles) {
          const int j0 = static_cast<int>(it) * kN;
          produce_tma_tile<kN, Dqk>(k_ring, key_tiles, sK + k_ring.slot(key_tiles) * Tile::kK, a.k, &maps.k, batch,
                                    k_row0 + j0, keys - j0, hk);
          if (it == first) {  // Q after the first K, as the cp.async producer does
            produce_tma_tile<kM, Dqk>(q_ring, query_tiles, sQ + q_ring.slot(query_tiles) * Tile::kQ, a.q, &maps.q,
                                      batch, static_cast<int>(seq.q_begin + w.t0), static_cast<int>(w.rows),
                                      static_cast<int>(w.h));
            ++query_tiles;
          }
          produce_tma_tile<kN, Dv>(v_ring, key_tiles, sV + v_ring.slot(key_tiles) * Tile::kV, a.v, &maps.v, batch,
                                   k_row0 + j0, keys - j0, hk);
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
        k_ring.acquire(key_tiles);
        wgmma::load_swizzled_tile<kN, Dqk, kCopiers, kUnroll>(sK + k_ring.slot(key_tiles) * Tile::kK, a.k, seq.batch,
                                                              seq.k_begin + j0, seq.S - j0, w.hk);
        k_ring.commit(key_tiles);
        if (it == first) {  // Q after the first K: that K's stage frees up earlier than Q does
          q_ring.acquire(query_tiles);
          wgmma::load_swizzled_tile<kM, Dqk, kCopiers, kUnroll>(sQ + q_ring.slot(query_tiles) * Tile::kQ, a.q,
                                                                seq.batch, seq.q_begin + w.t0, w.rows, w.h);
          q_ring.commit(query_tiles++);
        }
        v_ring.acquire(key_tiles);
        wgmma::load_swizzled_tile<kN, Dv, kCopiers, kUnroll>(sV + v_ring.slot(key_tiles) * Tile::kV, a.v, seq.batch,
                                                             seq.k_begin + j0, seq.S - j0, w.hk);
        v_ring.commit(key_tiles);
      }
    });
    cp_async_wait<0>();
    return;
  }

  pipeline::claim_registers<Tile::kConsumerRegisters>();
  // The warpgroup index through a shuffle is uniform to the compiler: descriptors in uniform registers.
  const int consumer = wgmma::warpgroup_index() - 1;
  const int warp = threadIdx.x / 32 - 4;  // among the consumers' 8 warps
  const int warpgroup_row0 = consumer * 64, warp_row0 = warp * 16;
  // Descriptors of this warpgroup's Q rows in buffer 0 and of stage 0's K and V; the k-loops add compile-time
  // offsets.
  const std::uint64_t q_desc0 = wgmma::k_major_descriptor<kM>(sQ, warpgroup_row0, 0);
  const std::uint64_t k_desc0 = wgmma::k_major_descriptor<kN>(sK, 0, 0);
  const std::uint64_t v_desc0 = wgmma::mn_major_descriptor<kN>(sV, 0, 0);
  const pipeline::Turns turns(consumer);
  unsigned key_tiles = 0, query_tiles = 0;

  for_each_query_tile<Mask, kM, kN>(a, mc, order, [&](const auto& seq, const Mask& mask, const QueryWork& w) {
    const i64 t0 = w.t0, tile_begin = w.tile_begin;
    KeyTileWalk<Mask> walk;
    // The step count through a shuffle: uniform to the compiler (walk.count divides 64-bit numbers through a
    // subroutine call), so that the loop's wgmma descriptors stay in uniform registers.
    const int steps = __shfl_sync(0xffffffffu, walk.count(mc, seq, w, kN), 0);
    float acc[Dv / 8][4];
    zero(acc);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    // With a gate (kHasGate): alpha of the thread's two rows.
    [[maybe_unused]] float gate_alpha_rows[1][2];
    if constexpr (kHasGate<Mask>) {
      if (gate_of<Mask>(mc).on() && steps > 0) {
        load_gate_alpha_rows<T, 1>(gate_alpha_rows, gate_of<Mask>(mc), seq, w.h, t0 + warp_row0);
      }
    }
    // With the threshold: log2(tau_row) of the thread's two rows; the query tile of the decisions is the CTA's kM
    // rows, which both consumers hold (64 each), its key tiles the kN keys of a step.
    [[maybe_unused]] float threshold_log2_tau_rows[2];
    if constexpr (kThreshold) threshold_rows(mc.terms.threshold, mask, t0 + warp_row0, threshold_log2_tau_rows);
    if (steps > 0) {
      const unsigned q_use = query_tiles++;
      const std::uint64_t q_desc = wgmma::advance(q_desc0, q_ring.slot(q_use) * Tile::kQ * 2);
      float s[kN / 8][4];
      std::uint32_t p[kN / 16][4];
      float correction[2] = {1.f, 1.f};
      // FlashTermsMask: the key tile of the current step (absent tiles are skipped), its kind and whether the
      // softmax adds terms to its scores (init_scores).
      [[maybe_unused]] i64 key_tile = tile_begin;
      [[maybe_unused]] int terms_kind = kTileExists;
      [[maybe_unused]] bool terms_needed = false;
      // Whether the step's tile takes its terms by key (tile_uses_key_terms): each consumer thread then stages the
      // term of one key into the consumer's key-term buffer (step parity), ordered like the gate delta below.
      [[maybe_unused]] bool terms_by_key = false;
      [[maybe_unused]] float key_term_value = 0.f;
      // Step i (key tile tile_begin + i) computes the scores of its tile while O += P V of the tile before
      // (its softmax done one step earlier) is in flight; a last step adds the last tile's P V. A K stage is
      // released once its scores have landed, a V stage once its P V has, Q after the last scores.
      // With a gate, each consumer thread stages delta of one key of the step's tile into its buffer (step parity):
      // the turn taken before the softmax orders the warpgroup's writes before its reads, and a buffer is written
      // again two steps later, after every thread of the warpgroup has taken the turn that follows its reads.
      [[maybe_unused]] float gate_key_delta = 0.f;
      auto begin_step = [&](int step) {
        if constexpr (kHasTerms<Mask>) {
          if (step < steps) {
            key_tile = walk.next(mc, seq, w, step == 0 ? tile_begin : key_tile + 1, kN);
            const QueryTileTerms tt(mc.terms, walk.kind(mc, key_tile));
            terms_kind = tt.kind;
            terms_needed = tt.needs;
            terms_by_key = tt.needs && tile_uses_key_terms(mc.terms, tt.kind);
            if (terms_by_key) {
              key_term_value = key_term<T>(mc.terms, seq, w.h, key_tile * kN + threadIdx.x % 128, tt.kind);
            }
          }
        } else if constexpr (kHasKeyTerms<Mask>) {
          // The term of step 0's key here; every later step's was read one step ahead (below), so that its global
          // load's latency overlaps a step instead of stalling the consumer before its MMAs.
          terms_by_key = true;
          if (step == 0) {
            key_term_value = key_term<T>(mc.terms, seq, w.h, tile_begin * kN + threadIdx.x % 128, kTileExists);
          }
        }
        if constexpr (kHasGate<Mask>) {
          if (gate_of<Mask>(mc).on() && step < steps) {
            const i64 j0 = (kHasTerms<Mask> ? key_tile : tile_begin + step) * kN;
            gate_key_delta = gate_delta<T>(gate_of<Mask>(mc), seq, w.hk, j0 + threadIdx.x % 128);
          }
        }
        if (step == 0) q_ring.wait_full(q_use);
        if (step < steps) k_ring.wait_full(key_tiles + step);
        if (step > 0) v_ring.wait_full(key_tiles + step - 1);
        if constexpr (kHasAnyTerms<Mask>) {
          if (terms_by_key && step < steps) {
            sKeyTerms[(consumer * 2 + (step & 1)) * kN + threadIdx.x % 128] = key_term_value;
          }
        }
        if constexpr (kHasKeyTerms<Mask>) {
          if (step + 1 < steps) {
            key_term_value =
                key_term<T>(mc.terms, seq, w.h, (tile_begin + step + 1) * kN + threadIdx.x % 128, kTileExists);
          }
        }
        if constexpr (kHasGate<Mask>) {
          if (gate_of<Mask>(mc).on() && step < steps) {
            sGateKeys[(consumer * 2 + (step & 1)) * kN + threadIdx.x % 128] = gate_key_delta;
          }
        }
        wgmma::fence_shared_for_async();
        wgmma::fence();
      };
      auto issue_scores = [&](int step) {
        const std::uint64_t k_desc = wgmma::advance(k_desc0, k_ring.slot(key_tiles + step) * Tile::kK * 2);
#pragma unroll
        for (int k0 = 0; k0 < Dqk; k0 += 16) {
          wgmma::mma_ss<T, kN, 0>(wgmma::flat<kN>(s), wgmma::advance(q_desc, wgmma::operand_offset<kM>(0, k0)),
                                  wgmma::advance(k_desc, wgmma::operand_offset<kN>(0, k0)),
                                  k0 > 0);
        }
        wgmma::commit();
      };
      auto issue_pv = [&](int step) {  // P V of the tile of step - 1
        const std::uint64_t v_desc = wgmma::advance(v_desc0, v_ring.slot(key_tiles + step - 1) * Tile::kV * 2);
#pragma unroll
        for (int kk = 0; kk < kN / 16; ++kk) {
          wgmma::mma_rs<T, Dv, 1>(wgmma::flat<Dv>(acc), p[kk],
                                  wgmma::advance(v_desc, wgmma::operand_offset<kN>(16 * kk, 0)), 1);
        }
        wgmma::commit();
      };
      auto softmax = [&](int step) {
        wgmma::fence_operand(wgmma::flat<kN>(s));
        k_ring.release(key_tiles + step);
        if (step == steps - 1) q_ring.release(q_use);
        const i64 j0 = (kHasTerms<Mask> ? key_tile : tile_begin + step) * kN;
        if constexpr (kHasKeyTerms<Mask>) {
          add_key_terms<kN, true>(s, sKeyTerms + (consumer * 2 + (step & 1)) * kN);
        } else if constexpr (kHasTerms<Mask>) {
          if (terms_by_key) {
            add_key_terms<kN, true>(s, sKeyTerms + (consumer * 2 + (step & 1)) * kN);
          } else if (terms_needed) {
            init_scores<T, kN, true, true>(s, mc.terms, seq, w.sequence, w.h, t0 + warp_row0, j0, terms_kind);
          }
        }
        with_gate_of<Mask>(mc, [&](auto gate) {
          if constexpr (decltype(gate)::value != kNoGate) {
            add_query_gate<kN, decltype(gate)::value>(s, gate_alpha_rows[0],
                                                      sGateKeys + (consumer * 2 + (step & 1)) * kN);
          }
        });
        if constexpr (kThreshold) {
          // The threshold's decision on this key tile from the 128 rows of both consumers, on the scores masked to
          // the visible columns. A skipped tile leaves m and l as they are and its P (to_a_fragments of s in land)
          // is 0, so its P V adds nothing (threshold_softmax_probabilities).
          int col_lo[2] = {0, 0}, col_hi[2] = {kN - 1, kN - 1};
          if (!tile_full(mask, t0, kM, j0, kN)) {
            visible_columns<kN>(mask, t0 + warp_row0, j0, col_lo, col_hi);
            mask_columns<kN>(s, col_lo, col_hi);
          }
          float row_max[2];
          tile_row_maxima<kN>(s, row_max);
          const bool keep = consumers_vote(rows_reach_bar(row_max, m, threshold_log2_tau_rows, a.scale_log2),
                                           vote_words, key_tiles + static_cast<unsigned>(step) + 1);
          if (keep && threadIdx.x == Tile::kProducerThreads) {
            record_kept_tile(mc.terms.threshold, w.sequence, w.h, t0 / kM, j0 / kN);
          }
          threshold_softmax_probabilities<kN>(s, m, l, row_max, keep, a.scale_log2, correction);
        } else {
          with_mask(!tile_full(mask, t0, kM, j0, kN), [&](auto masked) {
            int col_lo[2] = {0, 0}, col_hi[2] = {kN - 1, kN - 1};
            if constexpr (decltype(masked)::value) visible_columns<kN>(mask, t0 + warp_row0, j0, col_lo, col_hi);
            softmax_probabilities<kN, decltype(masked)::value>(s, m, l, col_lo, col_hi, a.scale_log2, correction);
          });
        }
      };
      auto land = [&](int step) {
        wgmma::wait<0>();
        wgmma::fence_operand(wgmma::flat<Dv>(acc));
        wgmma::fence_operand(p);
        if (step > 0) v_ring.release(key_tiles + step - 1);
        if (step < steps) {
          rescale_rows<Dv>(acc, correction);
          wgmma::to_a_fragments<T, kN>(s, p);
        }
      };
      wgmma::overlapped_steps(steps, begin_step, issue_scores, issue_pv, softmax, land, turns);
      key_tiles += steps;
    }
    store_forward_rows<Dv>(acc, m, l, a, seq, t0 + warp_row0, w.h);
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

template <class T, int Dqk, int Dv, class Mask, bool kThreshold = false>
__global__ void __launch_bounds__(WgmmaFwdTile<Dqk, Dv>::kThreads, 1)
    attention_forward_wgmma_kernel(AttnArgs<T> a, typename Mask::Config mc, QueryTileOrder order) {
  attention_forward_wgmma<T, Dqk, Dv, Mask, kThreshold>(a, mc, order, NoTmaMaps{});
}

// The TMA variant (kTmaMask policies); the host launches it where the device runs its sm_90a code and every
// tensor has a map (launch_forward_wgmma_tma).
template <class T, int Dqk, int Dv, class Mask>
__global__ void __launch_bounds__(WgmmaFwdTile<Dqk, Dv>::kThreads, 1)
    attention_forward_wgmma_tma_kernel(AttnArgs<T> a, typename Mask::Config mc, QueryTileOrder order,
                                       const __grid_constant__ ForwardTmaMaps maps) {
  attention_forward_wgmma<T, Dqk, Dv, Mask, false>(a, mc, order, maps);
}

}  // namespace sparseattn::cuda::attention
