// select_blocks on tensor cores: for each (token t, KV head h) the group-summed compressed-attention
// probabilities, pooled to selection blocks, and top-n with forced blocks (semantics.md sections 3-4).
//
// A persistent grid of CTAs (8 warps) walks over tiles of (kRows / G consecutive tokens, KV head h); the
// tile's query rows are (token, group head) pairs, kRows = 128 MMA rows, so any group size 1..128 fills
// them without padding to 16 per token. Per column tile of kCols compressed blocks: S = Q K_cmp^T on
// mma.sync (fp32 accumulate), P = exp2(S * scale * log2e - lse * log2e) with the visibility rule
// (j*stride + block - 1 <= t), summed over the group heads in shared memory, then pooled into the
// selection blocks whose compressed blocks the column tile holds (tiles overlap by the border blocks,
// cmp_block/stride - 1 columns, so every pooled score comes from one tile: fixed summation order, no
// atomics, deterministic). Pooled scores go to the CTA's slot of the workspace ([tokens][blocks] fp32:
// O(T) per CTA, a fixed number of CTAs), then each warp picks the top-n of one token's row: forced blocks
// first, then argmax rounds (ties to the lower index, as the reference's stable sort). Chosen blocks are
// marked -inf in the slot (real scores are >= 0 or NaN) and collected in ascending order.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/selection/common.cuh"
#include "cuda/selection/ops.h"
#include "cuda/selection/tile.cuh"

namespace sparseattn::cuda {

namespace {

using i64 = std::int64_t;
using selection::LseView;
using selection::SeqTable;
using selection::SmemTile;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16 * kWarps;          // MMA rows per tile: (token, group head) pairs
static_assert(kRows == kSelectMaxGroup, "a tile holds at least one token of the largest group");
constexpr int kCols = kSelectColumns;       // compressed blocks per column tile
constexpr int kProbPitch = kCols + 8;       // fp32 pitch: 64-bit stores of a half warp hit distinct banks
constexpr float kLog2e = 1.4426950408889634f;
constexpr std::size_t kWorkspaceCap = std::size_t{256} << 20;  // pooled-score slots of all CTAs

template <int D>
struct Layout {
  static constexpr int kStages = D <= 192 ? 2 : 1;  // 256: one K buffer keeps the CTA within sm_80's 163 KB
  static constexpr std::size_t kQ = std::size_t{2} * kRows * (D + 8);
  static constexpr std::size_t kK = std::size_t{2} * kCols * (D + 8);
  static constexpr std::size_t kProbs = sizeof(float) * kRows * kProbPitch;
  static constexpr std::size_t kBytes = kQ + kStages * kK + kProbs + (sizeof(float) + sizeof(int)) * kRows;
};

// Positions within a sequence (and block numbers) fit int32 (cu_seqlens is int32); the per-element and
// pooling arithmetic uses int32 without divisions, which matters at small groups (128 tokens per tile).
struct Config {
  i64 heads_kv, group, tokens_per_tile;
  i64 cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local;
  int cols_per_block;   // sel_block / cmp_stride
  int border;           // cmp_block / cmp_stride - 1: compressed blocks reaching into the previous selection block
  float inv_stride;     // 1 / cmp_stride
  i64 blocks_per_tile;  // selection blocks pooled per column tile
  i64 slot_blocks;      // row length of a slot: selection blocks of the longest sequence
  i64 position_tiles;   // token tiles of the longest sequence
  i64 batch;
  float scale_log2;
};

// First compressed block overlapping selection block b: (b*sel_block - cmp_block) / stride + 1 for b >= 1
// (cmp_block <= sel_block, both multiples of the stride), 0 for b = 0.
__device__ __forceinline__ int first_cmp_block(const Config& c, int b) {
  return b == 0 ? 0 : b * c.cols_per_block - c.border;
}

template <class T, int D>
__device__ __forceinline__ void load_k_tile(const SmemTile<T, kCols, D>& tile, const Tokens<const T>& k_cmp, i64 batch,
                                            i64 cmp_begin, i64 j0, i64 cmp_count, i64 h) {
  selection::load_rows<T, kCols, D, kThreads>(
      tile, [&](int r) -> const T* { return j0 + r < cmp_count ? k_cmp.row(batch, cmp_begin + j0 + r, h) : nullptr; },
      k_cmp.data);
  cp_async_commit();
}

// A candidate's rank value: chosen blocks are -inf (skipped); NaN (garbage input) ranks last but still fills
// a slot.
__device__ __forceinline__ float rank_value(float v) { return v != v ? -3.0e38f : v; }

// The larger of (v, i) and the lanes' (ties to the lower index), across the warp.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
}

// Top-n of one token's pooled row (`row`, `candidates` blocks) by one warp; writes `out[0..n)`. Lane l keeps
// the best of blocks l, l + 32, ...; a round takes the warp's best, marks it, and only its lane's subset is
// scanned again (by the whole warp), so a round costs a few loads rather than a scan of the row.
__device__ void choose_blocks(float* row, i64 candidates, const Config& c, std::int32_t* out) {
  constexpr int kNone = 0x7fffffff;
  const int lane = threadIdx.x % 32;
  const i64 init = min(c.num_init, candidates);
  const i64 local_lo = max(init, candidates - c.num_local);
  const i64 forced = init + (candidates - local_lo);
  for (i64 b = lane; b < candidates; b += 32) {
    if (b < init || b >= local_lo) row[b] = -INFINITY;
  }
  __syncwarp();
  float mine = -INFINITY;
  int mine_i = kNone;
  for (i64 b = lane; b < candidates; b += 32) {
    const float v = row[b];
    if (v != -INFINITY && rank_value(v) > mine) {
      mine = rank_value(v);
      mine_i = static_cast<int>(b);
    }
  }
  const i64 count = min(c.num_selected, candidates);
  for (i64 round = forced; round < count; ++round) {
    float best = mine;
    int best_i = mine_i;
    warp_argmax(best, best_i);
    if (best_i == kNone) break;  // cannot happen while round < count <= candidates
    const int owner = best_i % 32;
    if (lane == owner) row[best_i] = -INFINITY;
    __syncwarp();
    float next = -INFINITY;
    int next_i = kNone;
    for (i64 b = owner + 32 * i64{lane}; b < candidates; b += 32 * 32) {
      const float v = row[b];
      if (v != -INFINITY && rank_value(v) > next) {
        next = rank_value(v);
        next_i = static_cast<int>(b);
      }
    }
    warp_argmax(next, next_i);
    if (lane == owner) {
      mine = next;
      mine_i = next_i;
    }
  }
  // Collect the marked blocks in ascending order, then pad with -1.
  i64 written = 0;
  for (i64 base = 0; base < candidates && written < count; base += 32) {
    const i64 b = base + lane;
    const bool marked = b < candidates && row[b] == -INFINITY;
    const unsigned ballot = __ballot_sync(0xffffffffu, marked);
    const i64 slot = written + __popc(ballot & ((1u << lane) - 1u));
    if (marked && slot < c.num_selected) out[slot] = static_cast<std::int32_t>(b);
    written += __popc(ballot);
  }
  for (i64 i = written + lane; i < c.num_selected; i += 32) out[i] = -1;
}

// Two CTAs per SM fit in shared memory up to D = 128 (107 KB each at 128); registers are capped to match.
template <class T, int D>
__global__ void __launch_bounds__(kThreads, D <= 128 ? 2 : 1)
    select_blocks_kernel(Tokens<const T> q, Tokens<const T> k_cmp, LseView<const float> lse, Tokens<std::int32_t> out,
                         SeqTable seqs, const std::int32_t* cu_seqlens_cmp, Config c, float* slots) {
  using L = Layout<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  const SmemTile<T, kRows, D> q_tile{reinterpret_cast<T*>(smem)};
  T* const k_base = reinterpret_cast<T*>(smem + L::kQ);
  float* const probs = reinterpret_cast<float*>(smem + L::kQ + L::kStages * L::kK);  // [kRows][kProbPitch]
  float* const row_lse = probs + kRows * kProbPitch;                                 // lse * log2e per row
  int* const row_visible_end = reinterpret_cast<int*>(row_lse + kRows);  // compressed blocks a row's token sees
  float* const slot = slots + static_cast<i64>(blockIdx.x) * c.tokens_per_tile * c.slot_blocks;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const i64 G = c.group, M = c.tokens_per_tile;
  const i64 tiles = c.position_tiles * c.batch * c.heads_kv;
  // Longest tokens first (position tiles descending), so the round-robin ends with the cheap tiles.
  for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const i64 h = tile % c.heads_kv, rest = tile / c.heads_kv;
    const i64 sq = rest % c.batch, position_tile = c.position_tiles - 1 - rest / c.batch;
    const auto seq = seqs[sq];
    const i64 t0 = position_tile * M;
    if (t0 >= seq.length) continue;
    const i64 tokens = min(M, seq.length - t0);
    const i64 cmp_begin = cu_seqlens_cmp != nullptr ? cu_seqlens_cmp[sq] : 0;
    const i64 cmp_count = seq.length >= c.cmp_block ? (seq.length - c.cmp_block) / c.cmp_stride + 1 : 0;

    __syncthreads();  // the previous tile is done with shared memory
    selection::load_rows<T, kRows, D, kThreads>(
        q_tile,
        [&](int r) -> const T* {
          const i64 m = r / G;
          return m < tokens ? q.row(seq.batch, seq.begin + t0 + m, h * G + r % G) : nullptr;
        },
        q.data);
    for (int r = tid; r < kRows; r += kThreads) {
      const i64 m = r / G, t = t0 + m;
      row_lse[r] = m < tokens ? lse.at(seq.batch, seq.begin + t, h * G + r % G) * kLog2e : -INFINITY;
      const bool sees = m < tokens && t >= c.cmp_block - 1;  // compressed block j is visible iff j*d + l - 1 <= t
      row_visible_end[r] = sees ? static_cast<int>(min((t - c.cmp_block + 1) / c.cmp_stride + 1, cmp_count)) : 0;
    }
    const i64 col_tiles = ceil_div((t0 + tokens - 1) / c.sel_block + 1, c.blocks_per_tile);
    const auto k_stage = [&](i64 k) {
      return SmemTile<T, kCols, D>{k_base + (k % L::kStages) * SmemTile<T, kCols, D>::kElements};
    };
    load_k_tile<T, D>(k_stage(0), k_cmp, seq.batch, cmp_begin, first_cmp_block(c, 0), cmp_count, h);

    // This warp's rows hold tokens (the first row's is the earliest), or none past the tile's last token.
    const int rows_used = static_cast<int>(tokens * G);
    const bool warp_has_rows = 16 * warp < rows_used;
    const int warp_last_row = min(16 * warp + 15, rows_used - 1);
    for (i64 k = 0; k < col_tiles; ++k) {
      if (L::kStages == 2 && k + 1 < col_tiles) {
        load_k_tile<T, D>(k_stage(k + 1), k_cmp, seq.batch, cmp_begin,
                          first_cmp_block(c, static_cast<int>((k + 1) * c.blocks_per_tile)), cmp_count, h);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const int j0 = first_cmp_block(c, static_cast<int>(k * c.blocks_per_tile));
      float acc[kCols / 8][4] = {};
      const bool any_visible = warp_has_rows && row_visible_end[warp_last_row] > j0;
      if (any_visible) {
        const SmemTile<T, kCols, D> k_tile = k_stage(k);
#pragma unroll
        for (int k0 = 0; k0 < D; k0 += 16) {
          std::uint32_t a[4];
          selection::load_a(a, q_tile, 16 * warp, k0);
#pragma unroll
          for (int n = 0; n < kCols / 8; n += 2) {
            std::uint32_t b[4];
            selection::load_b_rows(b, k_tile, n * 8, k0);
            selection::mma_pair<T>(acc[n], acc[n + 1], a, b);
          }
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 16 * warp + lane / 4 + 8 * half;
        const float l2 = row_lse[r];
        const int visible_end = l2 != -INFINITY ? row_visible_end[r] : 0;  // -inf: the row saw no block
#pragma unroll
        for (int n = 0; n < kCols / 8; ++n) {
          const int col = n * 8 + 2 * (lane % 4);
          float2 p;
          p.x = any_visible && j0 + col < visible_end ? exp2f(fmaf(acc[n][2 * half], c.scale_log2, -l2)) : 0.f;
          p.y = any_visible && j0 + col + 1 < visible_end ? exp2f(fmaf(acc[n][2 * half + 1], c.scale_log2, -l2)) : 0.f;
          *reinterpret_cast<float2*>(probs + r * kProbPitch + col) = p;
        }
      }
      __syncthreads();  // probs written; every warp is done with this K stage
      if (L::kStages == 1 && k + 1 < col_tiles) {
        load_k_tile<T, D>(k_stage(k + 1), k_cmp, seq.batch, cmp_begin,
                          first_cmp_block(c, static_cast<int>((k + 1) * c.blocks_per_tile)), cmp_count, h);
      }
      if (G > 1) {  // sum over the group heads into the token's first row
        for (i64 i = tid; i < tokens * kCols; i += kThreads) {
          const i64 m = i / kCols, col = i % kCols;
          float* column = probs + m * G * kProbPitch + col;
          float sum = 0.f;
          for (i64 g = 0; g < G; ++g) sum += column[g * kProbPitch];
          column[0] = sum;
        }
        __syncthreads();
      }
      // Pool: selection block b gets sum_j overlap(j, b) / stride * P[j] over its compressed blocks.
      const int nb = static_cast<int>(c.blocks_per_tile), b0 = static_cast<int>(k * c.blocks_per_tile);
      const int block = static_cast<int>(c.sel_block), cmp_block = static_cast<int>(c.cmp_block);
      const int stride = static_cast<int>(c.cmp_stride), first_token = static_cast<int>(t0);
      for (int i = tid; i < rows_used / G * nb; i += kThreads) {
        const int m = i / nb, b = b0 + (i - m * nb);
        if (b * block > first_token + m) continue;  // not a candidate of this token
        const float* p = probs + m * G * kProbPitch;
        const int first = b * block, end = first + block;
        float score = 0.f;
        for (int j = first_cmp_block(c, b); j < (b + 1) * c.cols_per_block; ++j) {
          const int overlap = min(j * stride + cmp_block, end) - max(j * stride, first);
          score = fmaf(static_cast<float>(overlap) * c.inv_stride, p[j - j0], score);
        }
        slot[m * c.slot_blocks + b] = score;
      }
    }
    __syncthreads();  // pooled rows complete
    for (i64 m = warp; m < tokens; m += kWarps) {
      const i64 t = t0 + m;
      choose_blocks(slot + m * c.slot_blocks, t / c.sel_block + 1, c, out.row(seq.batch, seq.begin + t, h));
    }
  }
}

struct LaunchPlan {
  Config config;
  selection::HostShape shape;
  i64 dim = 0;
  int ctas = 0;  // 0: nothing to do
  std::size_t slot_bytes = 0;
};

int multiprocessors(int device_index) {
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device_index) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  return std::max(count, 1);
}

// Everything from shapes, config and the device's SM count: the workspace size query and the launch agree.
LaunchPlan plan_of(const SelectBlocksParams& p) {
  LaunchPlan plan;
  plan.shape = selection::host_shape(p.q, p.seqs);
  const selection::HostShape& s = plan.shape;
  const i64 heads_q = p.q.shape[p.q.rank - 2];
  const i64 heads_kv = p.k_cmp.shape[p.k_cmp.rank - 2];
  plan.dim = p.q.shape[p.q.rank - 1];
  if (s.batch <= 0 || s.max_len <= 0 || heads_kv <= 0 || heads_q % heads_kv != 0 || heads_q / heads_kv > kRows ||
      p.cmp_stride <= 0 || p.sel_block <= 0 || !select_blocks_config_supported(p.cmp_block, p.cmp_stride, p.sel_block)) {
    return plan;
  }
  Config& c = plan.config;
  c.heads_kv = heads_kv;
  c.group = heads_q / heads_kv;
  c.tokens_per_tile = kRows / c.group;
  c.cmp_block = p.cmp_block;
  c.cmp_stride = p.cmp_stride;
  c.sel_block = p.sel_block;
  c.num_selected = p.num_selected;
  c.num_init = p.num_init;
  c.num_local = p.num_local;
  c.cols_per_block = p.sel_block / p.cmp_stride;
  c.border = p.cmp_block / p.cmp_stride - 1;
  c.inv_stride = 1.f / static_cast<float>(p.cmp_stride);
  c.blocks_per_tile = (kCols - c.border) / c.cols_per_block;
  c.slot_blocks = ceil_div(s.max_len, p.sel_block);
  c.position_tiles = ceil_div(s.max_len, c.tokens_per_tile);
  c.batch = s.batch;
  c.scale_log2 = static_cast<float>(softmax_scale(p.scale, plan.dim) * 1.4426950408889634);
  plan.slot_bytes = static_cast<std::size_t>(c.tokens_per_tile * c.slot_blocks) * sizeof(float);
  const i64 tiles = c.position_tiles * c.batch * c.heads_kv;
  const i64 by_cap = std::max<i64>(1, static_cast<i64>(kWorkspaceCap / plan.slot_bytes));
  plan.ctas = static_cast<int>(std::min({tiles, i64{2} * multiprocessors(p.q.device_index), by_cap}));
  return plan;
}

template <class T, int D>
void launch(const SelectBlocksParams& p, const LaunchPlan& plan) {
  auto kernel = select_blocks_kernel<T, D>;
  constexpr std::size_t smem = Layout<D>::kBytes;
  if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  kernel<<<plan.ctas, kThreads, smem, static_cast<cudaStream_t>(p.stream)>>>(
      tokens_of<const T>(p.q), tokens_of<const T>(p.k_cmp), selection::lse_of<const float>(p.lse_cmp),
      tokens_of<std::int32_t>(p.indices), selection::seq_table(plan.shape, p.seqs),
      static_cast<const std::int32_t*>(p.cu_seqlens_cmp.data), plan.config, static_cast<float*>(p.workspace));
  check_launch("select_blocks_kernel");
}

}  // namespace

std::size_t select_blocks_workspace_size(const SelectBlocksParams& p) {
  const LaunchPlan plan = plan_of(p);
  return static_cast<std::size_t>(plan.ctas) * plan.slot_bytes;
}

void select_blocks(const SelectBlocksParams& p) {
  const DeviceGuard device(p.q.device_index);
  const LaunchPlan plan = plan_of(p);
  if (plan.ctas == 0) return;
  const auto run = [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (plan.dim) {
      case 64: return launch<T, 64>(p, plan);
      case 128: return launch<T, 128>(p, plan);
      case 192: return launch<T, 192>(p, plan);
      case 256: return launch<T, 256>(p, plan);
      default: throw std::logic_error("sparseattn: select_blocks head dim not dispatched to CUDA (validated by the API)");
    }
  };
  switch (p.q.dtype) {
    case DType::float16: run(TypeTag<__half>{}); break;
    case DType::bfloat16: run(TypeTag<__nv_bfloat16>{}); break;
    default: throw std::logic_error("sparseattn: select_blocks dtype not dispatched to CUDA (validated by the API)");
  }
}

}  // namespace sparseattn::cuda
