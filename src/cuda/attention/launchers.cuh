// Host launchers of the attention kernels: grid shapes, shared-memory opt-in, and the choice between the
// mma.sync kernels (mma_sync_kernels.cuh; sm_80 and later) and the wgmma kernels (wgmma_forward.cuh,
// wgmma_backward.cuh; sm_90a, where wgmma::kernel_runs says the device runs them).
#pragma once

#include <algorithm>

#include "cuda/attention/wgmma_backward.cuh"
#include "cuda/attention/mma_sync_kernels.cuh"
#include "cuda/primitives/delta.cuh"
#include "cuda/primitives/launch.cuh"

namespace sparseattn::cuda::attention {

struct Launch {
  i64 batch;       // sequences (grid z)
  i64 max_q;       // longest query sequence
  i64 max_k;       // longest key sequence
  i64 q_heads, kv_heads;
  i64 rows_q;      // rows of the q tensor's token dim per batch (T, or N packed), for the delta kernel
  i64 batch_rows;  // leading batch dim of the q tensor (B, or 1 packed)
  bool delta_given;  // backward: AttnArgs::delta holds the caller's rowsum(dO * O), no delta kernel
  int multiprocessors;  // of the device: the grid of the persistent kernels
  cudaStream_t stream;
  // The q, k and v tensors (and the backward's d_o), which the TMA variants of the wgmma forward and dQ describe
  // with tensor maps; null where the caller leaves them out (then the cp.async kernels run).
  const TensorView* q_view = nullptr;
  const TensorView* k_view = nullptr;
  const TensorView* v_view = nullptr;
  const TensorView* d_o_view = nullptr;
};

// Query-tile grids: (query heads, query tiles, sequences); key-block grids: (KV heads x head splits, key blocks,
// sequences). mma_sync_kernels.cuh's query_tile() and DkvWork read them in heaviest-first order.
inline dim3 query_grid(const Launch& l, int rows_per_cta) {
  return dim3(static_cast<unsigned>(l.q_heads), static_cast<unsigned>(ceil_div(l.max_q, rows_per_cta)),
              static_cast<unsigned>(l.batch));
}

inline dim3 key_grid(const Launch& l, int keys_per_cta, int head_splits) {
  return dim3(static_cast<unsigned>(l.kv_heads * head_splits), static_cast<unsigned>(ceil_div(l.max_k, keys_per_cta)),
              static_cast<unsigned>(l.batch));
}

// The query tiles of the persistent kernels, and their grid: one CTA per SM (fewer when the tiles are fewer).
inline QueryTileOrder query_tile_order(const Launch& l, int rows_per_cta) {
  const i64 tiles = ceil_div(l.max_q, rows_per_cta);
  return {l.q_heads, tiles, l.q_heads * tiles * l.batch};
}
inline unsigned persistent_ctas(const Launch& l, const QueryTileOrder& order) {
  return static_cast<unsigned>(std::min<i64>(order.count, l.multiprocessors));
}

// The sizes from which the wgmma forward and dQ take their TMA producers by default: the longest key sequence and
// the longest query sequence (a whole query tile). Below them the cp.async producer is as fast or faster: the work
// items hold few key tiles, or their query tiles end early and take the producer warp's zero-filled copy
// (docs/perf/2026-11-28-attention-tma.md). The dK/dV kernel's TMA variant is faster at every size measured (from
// 511 keys on) and is the default at every size.
inline constexpr i64 kAttentionTmaMinKeys = 1536;
inline constexpr i64 kAttentionTmaMinQueries = 128;

// Whether the wgmma forward and dQ (kDkv: the dK/dV) take their TMA producers: SPARSEATTN_ATTENTION_TMA=1 wherever
// they may run, =0 never (the cp.async producers), otherwise by the rule above; read at every call.
template <bool kDkv>
bool attention_tma_requested(const Launch& l) {
  const bool by_size = kDkv || (l.max_k >= kAttentionTmaMinKeys && l.max_q >= kAttentionTmaMinQueries);
  return tma::switch_on("SPARSEATTN_ATTENTION_TMA", by_size);
}

// Whether a TMA variant may run: the switch or rule (attention_tma_requested), the token views it maps (q, k, v, and
// d_o where kNeedsDo), TMA on the device (sm_90 or later, the driver's encoder found), and the kernel running there
// from its sm_90a code (wgmma::kernel_runs: compiled for sm_90a, so its TMA instructions are there too, and not forced
// off by SPARSEATTN_ATTENTION_MMA).
template <bool kDkv, bool kNeedsDo, class Kernel>
bool attention_tma_may_run(const Launch& l, Kernel kernel) {
  if (l.q_view == nullptr || l.k_view == nullptr || l.v_view == nullptr) return false;
  if (kNeedsDo && l.d_o_view == nullptr) return false;
  if (!attention_tma_requested<kDkv>(l) || !tma::device_supports(l.q_view->device_index)) return false;
  return wgmma::kernel_runs(kernel);
}

// Launches the TMA variant of the wgmma forward where it may run (attention_tma_may_run) and q, k and v each have a
// tensor map with boxes of 64 columns x 128 rows (tma::token_map: 16-byte aligned base, strides multiples of 16
// bytes, innermost stride 1, dimensions below 2^31); false otherwise. The maps are encoded on the host into
// the kernel's parameter: no allocation, no synchronisation.
template <class T, int Dqk, int Dv, class Mask>
bool launch_forward_wgmma_tma(const AttnArgs<T>& args, const typename Mask::Config& mc, const Launch& l) {
  using Tile = WgmmaFwdTile<Dqk, Dv>;
  static_assert(Tile::kM == 128 && Tile::kN == 128, "the tensor maps' boxes are 128 rows");
  auto kernel = attention_forward_wgmma_tma_kernel<T, Dqk, Dv, Mask>;
  if (!attention_tma_may_run<false, false>(l, kernel)) return false;
  ForwardTmaMaps maps;
  if (!tma::token_map(&maps.q, *l.q_view, Tile::kM) || !tma::token_map(&maps.k, *l.k_view, Tile::kN) ||
      !tma::token_map(&maps.v, *l.v_view, Tile::kN)) {
    return false;
  }
  set_dynamic_smem(kernel, Tile::kSmemBytes);
  const QueryTileOrder order = query_tile_order(l, Tile::kM);
  kernel<<<persistent_ctas(l, order), Tile::kThreads, Tile::kSmemBytes, l.stream>>>(args, mc, order, maps);
  check_launch("attention_forward_wgmma_tma_kernel");
  return true;
}

// Launches the wgmma forward (kThreshold: its variant with the sparse-softmax threshold) where it runs; false
// otherwise. The plain masks (kTmaMask) take the TMA variant where launch_forward_wgmma_tma allows it.
template <class T, int Dqk, int Dv, class Mask, bool kThreshold>
bool launch_forward_wgmma(const AttnArgs<T>& args, const typename Mask::Config& mc, const Launch& l) {
  if constexpr (WgmmaFwdTile<Dqk, Dv>::kSupported) {
    using Tile = WgmmaFwdTile<Dqk, Dv>;
    if constexpr (kTmaMask<Mask> && !kThreshold) {
      if (launch_forward_wgmma_tma<T, Dqk, Dv, Mask>(args, mc, l)) return true;
    }
    auto kernel = attention_forward_wgmma_kernel<T, Dqk, Dv, Mask, kThreshold>;
    if (!wgmma::kernel_runs(kernel)) return false;
    set_dynamic_smem(kernel, Tile::kSmemBytes);
    const QueryTileOrder order = query_tile_order(l, Tile::kM);
    kernel<<<persistent_ctas(l, order), Tile::kThreads, Tile::kSmemBytes, l.stream>>>(args, mc, order);
    check_launch("attention_forward_wgmma_kernel");
    return true;
  }
  return false;
}

// The tensor maps of a backward TMA variant (attention_tma_may_run<..., true> has checked that the views exist): q
// and d_o with boxes of `query_rows` rows, k and v of `key_rows`; false where one cannot be made (tma::token_map).
inline bool backward_tma_maps(BackwardTmaMaps* maps, const Launch& l, int query_rows, int key_rows) {
  return tma::token_map(&maps->q, *l.q_view, query_rows) && tma::token_map(&maps->d_o, *l.d_o_view, query_rows) &&
         tma::token_map(&maps->k, *l.k_view, key_rows) && tma::token_map(&maps->v, *l.v_view, key_rows);
}

// Launches the TMA variant of the wgmma dQ where it may run; false otherwise: as launch_forward_wgmma_tma, with
// tensor maps of q and d_o (boxes of 64 columns x 128 rows, the query tile) and of k and v (64 columns x 64 rows,
// the key tile).
template <class T, int Dqk, int Dv, class Mask>
bool launch_dq_wgmma_tma(const AttnArgs<T>& args, const typename Mask::Config& mc, const Launch& l) {
  using Tile = WgmmaDqTile<Dqk, Dv>;
  static_assert(Tile::kM == 128 && Tile::kN == 64, "the tensor maps' boxes are 128 query rows and 64 key rows");
  auto kernel = attention_dq_wgmma_tma_kernel<T, Dqk, Dv, Mask>;
  if (!attention_tma_may_run<false, true>(l, kernel)) return false;
  BackwardTmaMaps maps;
  if (!backward_tma_maps(&maps, l, Tile::kM, Tile::kN)) return false;
  set_dynamic_smem(kernel, Tile::kSmemBytes);
  const QueryTileOrder order = query_tile_order(l, Tile::kM);
  kernel<<<persistent_ctas(l, order), Tile::kThreads, Tile::kSmemBytes, l.stream>>>(args, mc, order, maps);
  check_launch("attention_dq_wgmma_tma_kernel");
  return true;
}

// Launches the wgmma dQ kernel where it runs; false otherwise. The plain masks (kTmaMask) take the TMA variant where
// launch_dq_wgmma_tma allows it.
template <class T, int Dqk, int Dv, class Mask>
bool launch_dq_wgmma(const AttnArgs<T>& args, const typename Mask::Config& mc, const Launch& l) {
  if constexpr (WgmmaDqTile<Dqk, Dv>::kSupported) {
    using Tile = WgmmaDqTile<Dqk, Dv>;
    if constexpr (kTmaMask<Mask>) {
      if (launch_dq_wgmma_tma<T, Dqk, Dv, Mask>(args, mc, l)) return true;
    }
    auto kernel = attention_dq_wgmma_kernel<T, Dqk, Dv, Mask>;
    if (!wgmma::kernel_runs(kernel)) return false;
    set_dynamic_smem(kernel, Tile::kSmemBytes);
    const QueryTileOrder order = query_tile_order(l, Tile::kM);
    kernel<<<persistent_ctas(l, order), Tile::kThreads, Tile::kSmemBytes, l.stream>>>(args, mc, order);
    check_launch("attention_dq_wgmma_kernel");
    return true;
  }
  return false;
}

// The (query tile, key tile) sizes of the forward kernel that run_forward launches on the current device.
struct ForwardTiles {
  int rows, keys;
};
template <class T, int Dqk, int Dv, class Mask>
ForwardTiles forward_tiles() {
  if constexpr (WgmmaFwdTile<Dqk, Dv>::kSupported) {
    if (wgmma::kernel_runs(attention_forward_wgmma_kernel<T, Dqk, Dv, Mask>)) {
      return {WgmmaFwdTile<Dqk, Dv>::kM, WgmmaFwdTile<Dqk, Dv>::kN};
    }
  }
  return {FwdTile<Dqk, Dv>::kM, FwdTile<Dqk, Dv>::kN};
}

// The forward of either family; kThreshold: the kernels' variant with the sparse-softmax threshold (FlashTermsMask),
// separate so that the others keep their registers.
template <class T, int Dqk, int Dv, class Mask, bool kThreshold>
void launch_forward(const AttnArgs<T>& args, const typename Mask::Config& mc, const Launch& l) {
  using Tile = FwdTile<Dqk, Dv>;
  if (launch_forward_wgmma<T, Dqk, Dv, Mask, kThreshold>(args, mc, l)) return;
  auto kernel = attention_forward_kernel<T, Dqk, Dv, Mask, kThreshold>;
  set_dynamic_smem(kernel, Tile::kSmemBytes);
  const dim3 grid = query_grid(l, Tile::kM);
  kernel<<<grid, kThreads, Tile::kSmemBytes, l.stream>>>(args, mc);
  check_launch("attention_forward_kernel");
}

template <class T, int Dqk, int Dv, class Mask>
void run_forward(const AttnArgs<T>& args, const typename Mask::Config& mc, const Launch& l) {
  if (l.batch == 0 || l.max_q == 0) return;
  if constexpr (kHasTerms<Mask>) {
    if (mc.terms.threshold.decisions != nullptr) {
      launch_forward<T, Dqk, Dv, Mask, true>(args, mc, l);
      return;
    }
  }
  launch_forward<T, Dqk, Dv, Mask, false>(args, mc, l);
}

template <class T, int Dqk, int Dv, class Mask>
void launch_dkv_sync(const AttnArgs<T>& args, const typename Mask::Config& mc, const Launch& l) {
  using Tile = DkvTile<Dqk, Dv>;
  const dim3 grid = key_grid(l, Tile::kN, args.head_splits);
  if constexpr (Tile::kSplit) {
    auto dv_kernel = attention_dkv_kernel<T, Dqk, Dv, Mask, 1>;
    auto dk_kernel = attention_dkv_kernel<T, Dqk, Dv, Mask, 2>;
    set_dynamic_smem(dv_kernel, Tile::kSmemBytes);
    set_dynamic_smem(dk_kernel, Tile::kSmemBytes);
    dv_kernel<<<grid, kThreads, Tile::kSmemBytes, l.stream>>>(args, mc);
    check_launch("attention_dkv_kernel (dV)");
    dk_kernel<<<grid, kThreads, Tile::kSmemBytes, l.stream>>>(args, mc);
    check_launch("attention_dkv_kernel (dK)");
  } else {
    auto kernel = attention_dkv_kernel<T, Dqk, Dv, Mask, 0>;
    set_dynamic_smem(kernel, Tile::kSmemBytes);
    kernel<<<grid, kThreads, Tile::kSmemBytes, l.stream>>>(args, mc);
    check_launch("attention_dkv_kernel");
  }
}

// Launches the TMA variant of the wgmma dK/dV where it may run (its rule: every size); false otherwise: as
// launch_dq_wgmma_tma, with tensor maps of q and d_o (boxes of 64 columns x kM rows, the query step) and of k and v
// (64 columns x 128 rows, the CTA's keys). The grid is the dK/dV kernel's.
template <class T, int Dqk, int Dv, class Mask>
bool launch_dkv_wgmma_tma(const AttnArgs<T>& args, const typename Mask::Config& mc, const Launch& l) {
  using Tile = WgmmaDkvTmaTile<Dqk, Dv>;
  auto kernel = attention_dkv_wgmma_tma_kernel<T, Dqk, Dv, Mask>;
  if (!attention_tma_may_run<true, true>(l, kernel)) return false;
  BackwardTmaMaps maps;
  if (!backward_tma_maps(&maps, l, Tile::kM, Tile::kN)) return false;
  set_dynamic_smem(kernel, Tile::kSmemBytes);
  const dim3 grid = key_grid(l, Tile::kN, args.head_splits);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, l.stream>>>(args, mc, maps);
  check_launch("attention_dkv_wgmma_tma_kernel");
  return true;
}

// Launches the wgmma dK/dV kernel where it runs; false otherwise. The plain masks (kTmaMask) take the TMA variant
// where launch_dkv_wgmma_tma allows it.
template <class T, int Dqk, int Dv, class Mask>
bool launch_dkv_wgmma(const AttnArgs<T>& args, const typename Mask::Config& mc, const Launch& l) {
  if constexpr (WgmmaDkvTile<Dqk, Dv>::kSupported) {
    using Tile = WgmmaDkvTile<Dqk, Dv>;
    if constexpr (kTmaMask<Mask>) {
      if (launch_dkv_wgmma_tma<T, Dqk, Dv, Mask>(args, mc, l)) return true;
    }
    auto kernel = attention_dkv_wgmma_kernel<T, Dqk, Dv, Mask>;
    if (!wgmma::kernel_runs(kernel)) return false;
    set_dynamic_smem(kernel, Tile::kSmemBytes);
    const dim3 grid = key_grid(l, Tile::kN, args.head_splits);
    kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, l.stream>>>(args, mc);
    check_launch("attention_dkv_wgmma_kernel");
    return true;
  }
  return false;
}

template <class T, int Dqk, int Dv, class Mask>
void run_backward(const AttnArgs<T>& args, const typename Mask::Config& mc, const Launch& l) {
  if (l.batch == 0) return;
  if (!l.delta_given) {
    launch_delta<T>({args.o.data, args.o.batch_stride, args.o.row_stride, args.o.head_stride},
                    {args.d_o.data, args.d_o.batch_stride, args.d_o.row_stride, args.d_o.head_stride}, args.delta,
                    l.batch_rows, l.rows_q, l.q_heads, Dv, l.stream);
  }
  if (l.max_q > 0 && !launch_dq_wgmma<T, Dqk, Dv, Mask>(args, mc, l)) {
    using Tile = DqTile<Dqk, Dv>;
    auto kernel = attention_dq_kernel<T, Dqk, Dv, Mask>;
    set_dynamic_smem(kernel, Tile::kSmemBytes);
    const dim3 grid = query_grid(l, Tile::kM);
    kernel<<<grid, kThreads, Tile::kSmemBytes, l.stream>>>(args, mc);
    check_launch("attention_dq_kernel");
  }
  if (l.max_k > 0) {
    if (!launch_dkv_wgmma<T, Dqk, Dv, Mask>(args, mc, l)) launch_dkv_sync<T, Dqk, Dv, Mask>(args, mc, l);
    if (args.head_splits > 1) {
      // Few key rows per CTA: the compressed keys are few (T / 16) and the reduction is latency-bound, so it
      // needs many CTAs in flight (compressed keys at T = 8K, 4 KV heads: 256 CTAs instead of 16).
      constexpr int kReduceRows = 8;
      const dim3 reduce_grid = key_grid(l, kReduceRows, 1);
      attention_dkv_reduce_kernel<T, Dqk><<<reduce_grid, kThreads, 0, l.stream>>>(args.dk, args.dk_partial, args.seqs,
                                                                                   args.head_splits, kReduceRows);
      attention_dkv_reduce_kernel<T, Dv><<<reduce_grid, kThreads, 0, l.stream>>>(args.dv, args.dv_partial, args.seqs,
                                                                                  args.head_splits, kReduceRows);
      check_launch("attention_dkv_reduce_kernel");
    }
  }
}

}  // namespace sparseattn::cuda::attention
