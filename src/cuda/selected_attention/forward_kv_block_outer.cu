// KV-block-outer forward of selected_attention (the FSA design) on tensor cores (mma.sync m16n8k16, fp32
// accumulation). For each chunk of (KV head h, token row) pairs, head-major (forward_plan.h bounds the scratch):
//  1. make_keys (inverse_index.h): each (pair, slot j) whose block b is visible (b * block <= t, before the
//     first -1) gets the key (h, global block of b) and the value e = its entry index (pair, j); other entries
//     get the sentinel key and sort last;
//  2. a stable radix sort by key: the entries of one (h, block) become a run in ascending token order (one sort
//     serves a group of chunks, the chunk index above the key bits: forward_plan.h's sort groups);
//  3. kv_forward_kernel (on sm_90a with Dv <= 128 kv_forward_wgmma_kernel instead, 64-row tiles on warpgroup
//     MMAs: forward_kv_block_outer_wgmma.cuh): CTA c takes the sorted entries [c*P, (c+1)*P), P = kKvCtaRows /
//     G (about 256 query rows). For each run of one key in that range it loads the block's K and V (<= 128
//     keys) into shared memory once; its 4 warps take the run's query rows, (token, group head) token-major,
//     16 at a time, so rows of different tokens share an mma tile and G = 1 fills tiles as well as G = 16. A
//     warp owns whole rows: scores against the block 64 keys at a time (causal per row: keys <= t), online
//     softmax in registers, P as the A operand straight from the accumulators, O = P V in registers; no
//     shared-memory reductions, no CTA barrier inside a run. Per-warp Q tiles are double buffered (cp.async).
//     It writes the partial of each (pair, group head, slot): o_j = O / l in compact form (below) and lse_j
//     (log2);
//  4. kv_merge_kernel: one warp per (pair, group head), i.e. (token, query head), merges its valid slots in
//     slot order (log-sum-exp) into o and lse; a row without a valid slot gets o = 0 and lse = -inf. Rows of
//     a packed batch outside every sequence are left untouched.
// Deterministic: each partial is computed by one warp in a fixed order (a row's mma results do not depend on
// the other rows of its tile) and merged in slot order; no atomics.
//
// The partials bound this path: written once and read once, they are the bulk of its memory traffic. Two
// measures keep them in check:
//  - compact form: o_j is stored as fp16 of o_j / max|o_j| plus that fp32 scale (and the fp32 lse_j): Dv * 2
//    + 8 bytes per slot instead of Dv * 4 + 4. Its rounding is at most 2^-12 of the slot's largest element
//    (a slot's output is of the order of the final o), against 2^-9 for the final rounding of o to bf16 and
//    2^-11 to fp16; P itself enters the P V product rounded to 16 bits. The merge runs in fp32. The per-row
//    scale makes the fp16 range safe whatever the magnitude of v (plain fp16 could overflow for bf16 inputs,
//    plain bf16 would round 8x coarser);
//  - chunks: partials cost G * n * (2 Dv + 8) bytes per (KV head, token) pair (4.2 KB at G = 1, n = 16, Dv =
//    128), too much for a long sequence at once, so the pairs go in chunks whose scratch stays near
//    kKvWorkspaceCap (256 MB) whatever T is. The chunks take the pairs head-major, so that a chunk re-reads
//    the K and V blocks of one or two heads only (forward_plan.h), not those of every head.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mma.cuh"
#include "cuda/selected_attention/common.cuh"
#include "cuda/selected_attention/kv_block_runs.cuh"
#include "cuda/selected_attention/forward_kv_block_outer_wgmma.cuh"
#include "cuda/selected_attention/forward_plan.h"
#include "cuda/selected_attention/inverse_index.h"
#include "cuda/selected_attention/launchers.h"
#include "cuda/primitives/launch.cuh"
#include "cuda/primitives/swizzled_tile.cuh"

namespace sparseattn::cuda::selection {

namespace {

constexpr int kThreads = kKvWarps * 32;
constexpr int kTile = kKvTileRows;
constexpr int kSub = 64;  // keys per online-softmax step
constexpr int kRowSlots = kKvQBuffers * kKvWarps * kTile;
constexpr int kMergeWarps = 8;

template <class T, int DQK, int DV>
__global__ void __launch_bounds__(kThreads) kv_forward_kernel(Tokens<const T> q, Tokens<const T> k, Tokens<const T> v,
                                                              const std::uint32_t* keys, const std::int32_t* values,
                                                              const std::int32_t* cu_seqlens,
                                                              const std::int32_t* offsets, __half* o_part,
                                                              float* scale_part, float* lse_part, KvConfig c) {
  using QTile = SmemTile<T, kTile, DQK>;
  using KTile = SmemTile<T, kKvMaxBlock, DQK>;
  using VTile = SmemTile<T, kKvMaxBlock, DV>;
  static_assert(DV <= DQK, "the epilogue stages a 16 x Dv fp16 tile in a Q tile");
  // Carved as kv_forward_smem_bytes counts it.
  extern __shared__ __align__(128) unsigned char smem_raw[];  // as the wgmma kernels of this unit declare it
  auto* keys_s = reinterpret_cast<std::uint32_t*>(smem_raw);
  auto* vals_s = reinterpret_cast<std::int32_t*>(keys_s + kKvCtaRows);
  auto* qptr_s = reinterpret_cast<const T**>(vals_s + kKvCtaRows);  // [buffer][warp][row]: q row or null
  auto* slot_s = reinterpret_cast<std::int64_t*>(qptr_s + kRowSlots);  // partial slot, -1: padding row
  auto* t_s = reinterpret_cast<std::int32_t*>(slot_s + kRowSlots);     // position in the sequence, -1: padding
  T* q_base = reinterpret_cast<T*>(t_s + kRowSlots);
  const KTile ks{q_base + kRowSlots * QTile::kPitch};
  const VTile vs{ks.base + c.key_rows * KTile::kPitch};

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int count = load_cta_entries<kThreads>(keys, values, c, keys_s, vals_s);

  int cur = 0;
  while (cur < count && keys_s[cur] < c.sentinel) {
    // The run [cur, stop) of one (KV head, block).
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
    // Describes the 16 rows of `tile` in row buffer `buf` and starts loading their q rows.
    auto stage = [&](int tile, int buf) {
      const int base = (buf * kKvWarps + warp) * kTile;
      if (lane < kTile) {
        const KvRow<T> r = describe_row(q, std::int64_t{tile} * kTile + lane, run_rows, vals_s + cur, run, c);
        qptr_s[base + lane] = r.q;
        slot_s[base + lane] = r.slot;
        t_s[base + lane] = r.t;
      }
      __syncwarp();
      const QTile qt{q_base + base * QTile::kPitch};
      const T* fallback = qptr_s[base];  // row 0 of a tile always exists
      for (int i = lane; i < kTile * (DQK / 8); i += 32) {
        const int r = i / (DQK / 8), cc = i % (DQK / 8);
        const T* src = qptr_s[base + r];
        cp_async_16(qt.at(r, cc * 8), (src != nullptr ? src : fallback) + cc * 8, src != nullptr ? 16 : 0);
      }
      cp_async_commit();
    };

    int buf = 0;
    if (warp < tiles) stage(warp, 0);
    for (int tile = warp; tile < tiles; tile += kKvWarps) {
      if (tile + kKvWarps < tiles) {
        stage(tile + kKvWarps, buf ^ 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncwarp();
      const int base = (buf * kKvWarps + warp) * kTile;
      const QTile qt{q_base + base * QTile::kPitch};
      const int t_row[2] = {t_s[base + lane / 4], t_s[base + lane / 4 + 8]};
      int t_max = t_s[base + lane % kTile];
#pragma unroll
      for (int off = 8; off > 0; off /= 2) t_max = max(t_max, __shfl_xor_sync(0xffffffffu, t_max, off));
      // Keys past the tile's last token are invisible to all its rows (every real row sees key 0 of the block).
      const int keys_vis = visible_keys(keys_here, first, t_max);

      float acc[DV / 8][4] = {};
      float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
      for (int s0 = 0; s0 < keys_vis; s0 += kSub) {
        float s[kSub / 8][4] = {};
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
        int col_lo[2] = {0, 0}, col_hi[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) col_hi[i] = visible_keys(keys_here, first, t_row[i]) - 1 - s0;
        online_softmax_step<kSub, DV, true>(s, acc, m, l, col_lo, col_hi, c.scale_log2);
#pragma unroll
        for (int kk = 0; kk < kSub / 16; ++kk) {
          if (s0 + kk * 16 < keys_vis) {
            std::uint32_t a[4];
            a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int np = 0; np < DV / 16; ++np) {
              std::uint32_t bv[4];
              load_b_cols(bv, vs, s0 + kk * 16, np * 16);
              mma_pair<T>(acc[2 * np], acc[2 * np + 1], a, bv);
            }
          }
        }
      }
      // Epilogue, staged in this (now free) Q tile: 16 x DV halves in the tile's layout (DV <= DQK).
      __syncwarp();  // every lane is done reading the Q tile
      store_partials<DV>(acc, m, l, slot_s + base, reinterpret_cast<__half*>(qt.base),
                         [](int r, int col) { return QTile::offset(r, col); }, o_part, scale_part, lse_part);
      buf ^= 1;
    }
    cur = stop;
    __syncthreads();  // all warps are done with ks and vs before the next run loads them
  }
}

// N (2, 4 or 8) consecutive halves in one vector load.
template <int N>
__device__ __forceinline__ void load_halves(std::uint32_t (&raw)[N / 2], const __half* src) {
  if constexpr (N == 2) {
    raw[0] = *reinterpret_cast<const std::uint32_t*>(src);
  } else if constexpr (N == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(src);
    raw[0] = u.x, raw[1] = u.y;
  } else {
    static_assert(N == 8, "Dv / 32 halves per lane");
    const uint4 u = *reinterpret_cast<const uint4*>(src);
    raw[0] = u.x, raw[1] = u.y, raw[2] = u.z, raw[3] = u.w;
  }
}

struct MergeConfig {
  std::int64_t group, num_idx, block, rows, batch, total_rows, pair0, pair_count;
  bool packed;
};

// One warp per (pair, group head) of the chunk: o = sum_j w_j o_j / sum_j w_j, w_j = 2^(lse_j - max),
// o_j = scale_j * (its fp16 row). Four CTAs per SM: without the bound ptxas gives it 32 registers and spills.
template <class T, int DV>
__global__ void __launch_bounds__(kMergeWarps * 32, 4)
    kv_merge_kernel(const __half* o_part, const float* scale_part, const float* lse_part, IndexView indices,
                    const std::int32_t* cu_seqlens, Tokens<T> o, LseView<float> lse, MergeConfig c) {
  constexpr int kVec = DV / 32;  // output columns per lane
  const std::int64_t item = std::int64_t{blockIdx.x} * kMergeWarps + threadIdx.x / 32;
  if (item >= c.pair_count * c.group) return;
  const int lane = threadIdx.x % 32;
  const std::int64_t pair = c.pair0 + item / c.group, h = pair / c.total_rows, hq = h * c.group + item % c.group;
  const std::int64_t row_g = pair % c.total_rows;
  std::int64_t batch = 0, row = row_g, t = 0;
  if (c.packed) {
    if (c.batch <= 0 || row < cu_seqlens[0] || row >= cu_seqlens[c.batch]) return;  // outside every sequence
    t = row - cu_seqlens[last_at_most(cu_seqlens, c.batch, row)];
  } else {
    batch = row_g / c.rows;
    row = t = row_g % c.rows;
  }
  const std::int32_t* idx = indices.row(batch, row, h);
  const std::int64_t base = item * c.num_idx;
  // The slots that hold a partial follow the rule of make_keys: before the first -1, block starting <= t.
  // Pass 1, a lane per slot: where the list ends and the largest lse of a valid slot.
  std::int64_t end = c.num_idx;
  float mx = -INFINITY;
  for (std::int64_t j0 = 0; j0 < end; j0 += 32) {
    const std::int64_t j = j0 + lane;
    const std::int64_t b = j < end ? idx[j] : 0;
    const unsigned negative = __ballot_sync(0xffffffffu, b < 0);
    if (negative != 0) end = j0 + __ffs(static_cast<int>(negative)) - 1;
    if (j < end && b * c.block <= t) mx = fmaxf(mx, lse_part[base + j]);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  // Pass 2, 32 slots at a time: lane i weighs slot j0 + i (any valid slot makes mx finite), then the warp adds
  // the valid slots' rows in slot order, each lane its kVec columns, with kAhead rows' loads in flight: the
  // loads wait on nothing but the mask of valid slots (the merge streams the partials from DRAM; finding the
  // weights and validity per slot inside the loop would queue its loads behind index loads).
  constexpr int kAhead = 8;
  float acc[kVec] = {};
  float sum = 0.f;
  for (std::int64_t j0 = 0; j0 < end; j0 += 32) {
    const std::int64_t j = j0 + lane;
    float w = 0.f, ws_lane = 0.f;
    if (j < end && std::int64_t{idx[j]} * c.block <= t) {
      w = fast_exp2(lse_part[base + j] - mx);
      ws_lane = w * scale_part[base + j];
    }
    sum += w;
    const unsigned valid = __ballot_sync(0xffffffffu, ws_lane != 0.f);  // a zero weight adds nothing
    const __half* rows = o_part + (base + j0) * DV + lane * kVec;
#pragma unroll 1
    for (int u0 = 0; u0 < 32 && j0 + u0 < end; u0 += kAhead) {
      float ws[kAhead];
      std::uint32_t raw[kAhead][kVec / 2];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        ws[u] = __shfl_sync(0xffffffffu, ws_lane, u0 + u);
#pragma unroll
        for (int x = 0; x < kVec / 2; ++x) raw[u][x] = 0u;
        if ((valid >> (u0 + u)) & 1u) load_halves<kVec>(raw[u], rows + (u0 + u) * DV);
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
#pragma unroll
        for (int x = 0; x < kVec / 2; ++x) {
          __half2 pair;
          memcpy(&pair, &raw[u][x], sizeof(pair));
          const float2 f = __half22float2(pair);
          acc[2 * x] += ws[u] * f.x;
          acc[2 * x + 1] += ws[u] * f.y;
        }
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  T* dst = o.row(batch, row, hq) + lane * kVec;
#pragma unroll
  for (int x = 0; x < kVec; x += 2) *reinterpret_cast<std::uint32_t*>(dst + x) = pack2<T>(acc[x] * inv, acc[x + 1] * inv);
  if (lane == 0) lse.at(batch, row, hq) = sum > 0.f ? (mx + log2f(sum)) * kLn2 : -INFINITY;
}

}  // namespace

KvForwardPlan kv_forward_plan(const SelectedAttentionParams& p) {
  KvForwardPlan plan;
  plan.shape = host_shape(p.q, p.seqs);
  const HostShape& s = plan.shape;
  plan.heads_q = p.q.shape[p.q.rank - 2];
  plan.heads_kv = p.k.shape[p.k.rank - 2];
  plan.group = plan.heads_kv > 0 ? plan.heads_q / plan.heads_kv : 0;
  plan.num_idx = p.indices.shape[p.indices.rank - 1];
  plan.block = p.block;
  plan.dim_v = p.v.shape[p.v.rank - 1];
  plan.total_rows = s.packed ? s.rows : s.batch * s.rows;
  plan.blocks_per_seq = (s.rows + p.block - 1) / p.block;
  plan.blocks_bound = s.packed ? s.rows / p.block + s.batch : s.batch * plan.blocks_per_seq;
  const std::int64_t keys = plan.heads_kv * plan.blocks_bound;
  if (keys >= (std::int64_t{1} << 31) - 1) {
    throw std::length_error("sparseattn: selected_attention: KV heads x selection blocks exceeds 2^31");
  }
  plan.sentinel = static_cast<std::uint32_t>(keys);
  plan.end_bit = key_end_bit(plan.sentinel);
  plan.total_pairs = plan.total_rows * plan.heads_kv;
  plan.chunk_pairs = kv_chunk_pairs(plan.total_pairs, plan.group, plan.num_idx, plan.dim_v);
  plan.chunk_entries = plan.chunk_pairs * plan.num_idx;
  plan.sort = sort_group(ceil_div(plan.total_pairs, std::max<std::int64_t>(1, plan.chunk_pairs)), plan.chunk_entries,
                         plan.end_bit, kKvIndexCap);
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t offset = at;
    at = align_up(at + bytes);
    return offset;
  };
  const std::size_t entries = static_cast<std::size_t>(plan.chunk_entries * plan.sort.chunks);
  const std::size_t partials = static_cast<std::size_t>(plan.chunk_entries * plan.group);
  plan.offsets = take(sizeof(std::int32_t) * (s.batch + 1));
  plan.keys_in = take(sizeof(std::uint32_t) * entries);
  plan.keys_out = take(sizeof(std::uint32_t) * entries);
  plan.values_in = take(sizeof(std::int32_t) * entries);
  plan.values_out = take(sizeof(std::int32_t) * entries);
  plan.o_part = take(sizeof(std::uint16_t) * partials * plan.dim_v);
  plan.scale_part = take(sizeof(float) * partials);
  plan.lse_part = take(sizeof(float) * partials);
  {
    const DeviceGuard device(p.q.device_index);
    plan.temp_bytes = radix_sort_temp_bytes(static_cast<std::int64_t>(entries), plan.sort.end_bit);
  }
  plan.temp = take(plan.temp_bytes);
  plan.total = at + 256;  // slack: the base is only promised 16-byte aligned
  return plan;
}

void forward_kv_outer(const SelectedAttentionParams& p, const KvForwardPlan& plan) {
  const HostShape& s = plan.shape;
  if (s.batch <= 0 || s.max_len <= 0 || plan.heads_q <= 0 || plan.total_rows <= 0) return;
  const std::int64_t dqk = p.q.shape[p.q.rank - 1], dv = plan.dim_v;
  const auto stream = static_cast<cudaStream_t>(p.stream);
  unsigned char* ws = aligned_workspace(p.workspace);
  auto* offsets = reinterpret_cast<std::int32_t*>(ws + plan.offsets);
  auto* keys_in = reinterpret_cast<std::uint32_t*>(ws + plan.keys_in);
  auto* keys_out = reinterpret_cast<std::uint32_t*>(ws + plan.keys_out);
  auto* values_in = reinterpret_cast<std::int32_t*>(ws + plan.values_in);
  auto* values_out = reinterpret_cast<std::int32_t*>(ws + plan.values_out);
  auto* o_part = reinterpret_cast<__half*>(ws + plan.o_part);
  auto* scale_part = reinterpret_cast<float*>(ws + plan.scale_part);
  auto* lse_part = reinterpret_cast<float*>(ws + plan.lse_part);
  const auto* cu = s.packed ? static_cast<const std::int32_t*>(p.seqs.cu_seqlens.data) : nullptr;
  const float scale_log2 = static_cast<float>(softmax_scale(p.scale, dqk) * kLog2eDouble);
  const std::int64_t per_cta = kv_entries_per_cta(plan.group);
  if (s.packed) launch_block_offsets(cu, s.batch, plan.block, offsets, stream);

  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_head_dims(dqk, dv, [&](auto dqk_c, auto dv_c) {
      constexpr int DQK = decltype(dqk_c)::value, DV = decltype(dv_c)::value;
      // The wgmma kernel where it runs (sm_90a; Dv <= 128), else the mma.sync one; both take the same arguments.
      auto kernel = kv_forward_kernel<T, DQK, DV>;
      std::size_t smem = kv_forward_smem_bytes(DQK, DV, plan.block);
      if constexpr (KvWgmmaTile<DQK, DV>::kSupported) {
        const int keys = plan.block <= 64 ? 64 : 128;
        auto wgmma_kernel = keys == 64 ? kv_forward_wgmma_kernel<T, DQK, DV, 64> : kv_forward_wgmma_kernel<T, DQK, DV, 128>;
        if (wgmma::kernel_runs(wgmma_kernel)) {
          kernel = wgmma_kernel;
          smem = kv_wgmma_smem_bytes(DQK, DV, keys);
        }
      }
      set_dynamic_smem(kernel, smem);
      const KeyConfig kc{plan.num_idx, plan.block, s.rows, s.batch, plan.blocks_per_seq, plan.total_rows, 0, 0,
                         plan.chunk_pairs, plan.end_bit, static_cast<std::uint32_t>(plan.blocks_bound), plan.sentinel,
                         s.packed, /*value_is_entry=*/true};
      const IndexBuffers buffers{keys_in, keys_out, values_in, values_out, ws + plan.temp, plan.temp_bytes};
      for_each_sorted_chunk(index_of(p.indices), cu, offsets, kc, plan.total_pairs, plan.sort, buffers, stream,
                            [&](std::int64_t pair0, std::int64_t pairs, const std::uint32_t* keys,
                                const std::int32_t* values) {
        const std::int64_t entries = pairs * plan.num_idx;
        const KvConfig c{plan.group, plan.num_idx, plan.block, s.rows, s.batch, plan.blocks_per_seq, plan.total_rows,
                         pair0, entries, per_cta, static_cast<std::uint32_t>(plan.blocks_bound), plan.sentinel,
                         key_mask(plan.end_bit), static_cast<int>(round_up16(plan.block)), s.packed, scale_log2};
        kernel<<<static_cast<unsigned>(ceil_div(entries, per_cta)), kThreads, smem, stream>>>(
            tokens_of<const T>(p.q), tokens_of<const T>(p.k), tokens_of<const T>(p.v), keys, values, cu, offsets,
            o_part, scale_part, lse_part, c);
        check_launch("kv_forward_kernel (KV-block-outer selected attention)");
        const MergeConfig mc{plan.group, plan.num_idx, plan.block, s.rows, s.batch, plan.total_rows, pair0, pairs,
                             s.packed};
        kv_merge_kernel<T, DV><<<static_cast<unsigned>(ceil_div(pairs * plan.group, kMergeWarps)), kMergeWarps * 32,
                                 0, stream>>>(o_part, scale_part, lse_part, index_of(p.indices), cu, tokens_of<T>(p.o),
                                              lse_of<float>(p.lse), mc);
        check_launch("kv_merge_kernel");
      });
    });
  });
}

}  // namespace sparseattn::cuda::selection
