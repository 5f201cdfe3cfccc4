// Shared pieces of the query-outer kernels of selected_attention (mma.sync m16n8k16, fp32 accumulation):
// forward_query_outer.cu and dq_query_outer.cu (one warp per token: the forward and the dQ) and their group forms
// forward_query_group.cu and dq_query_group.cu (consecutive tokens per CTA sharing K/V tiles,
// query_group_common.cuh). A warp computes one token's chunk of 16 query heads of a KV head's group: the heads are
// the 16 rows of the mma tile (padded with zero rows when G < 16), Q (and dO) in registers or shared memory.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <optional>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mma.cuh"
#include "cuda/selected_attention/common.cuh"
#include "cuda/selected_attention/forward_plan.h"
#include "cuda/primitives/launch.cuh"
#include "cuda/primitives/swizzled_tile.cuh"

namespace sparseattn::cuda::selection::query_outer {

constexpr int kRows = 16;  // query heads per warp (mma M)

struct QueryOuterConfig {
  std::int64_t heads_kv, group, chunks, num_idx, block;
  float scale, scale_log2;
  bool accumulate_dq;  // dQ only: dq += the gradient
  // Where the form of the forward or dQ is chosen on the device (query_adaptive.cu): the word the choice is
  // written to, and this launch's form (QueryForm); null: the launch runs.
  const std::int32_t* chosen_form = nullptr;
  std::int32_t form = 0;
};

// The forms of the query-outer forward and dQ, as query_adaptive.cu writes its choice.
enum QueryForm : std::int32_t { kOneTokenForm = 1, kGroupForm = 2 };

// Whether this launch is the form not chosen on the device, whose CTAs return at once.
__device__ __forceinline__ bool form_not_chosen(const QueryOuterConfig& c) {
  return c.chosen_form != nullptr && *c.chosen_form != c.form;
}

// What both launchers derive from the shapes: the configuration, the grid (token, KV head x chunk of 16 query
// heads, sequence) and the query and key sequences (common.cuh: a query chunk's keys outnumber its queries); empty:
// nothing to launch.
struct QueryOuterLaunch {
  QueryOuterConfig config;
  dim3 grid;
  SeqPairTable table;
  std::int64_t dqk, dv;
  bool empty;
};

inline QueryOuterLaunch launch_of(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& indices, const Sequences& seqs, const Sequences& seqs_k, int block,
                                  const std::optional<double>& scale, bool accumulate_dq) {
  const HostShape s = host_shape(q, seqs);
  const std::int64_t heads_q = q.shape[q.rank - 2], heads_kv = k.shape[k.rank - 2], dqk = q.shape[q.rank - 1];
  const std::int64_t group = heads_kv > 0 ? heads_q / heads_kv : 0, chunks = (group + kRows - 1) / kRows;
  const double softmax = softmax_scale(scale, dqk);
  const QueryOuterConfig c{heads_kv, group, chunks, indices.shape[indices.rank - 1], block,
                           static_cast<float>(softmax), static_cast<float>(softmax * kLog2eDouble),
                           accumulate_dq};
  const dim3 grid(static_cast<unsigned>(s.max_len), static_cast<unsigned>(heads_kv * chunks),
                  static_cast<unsigned>(s.batch));
  return {c, grid, query_key_table(q, k, seqs, seqs_k), dqk, v.shape[v.rank - 1],
          s.batch <= 0 || s.max_len <= 0 || heads_q <= 0};
}

// What every query-outer kernel takes from blockIdx.y and .z: sequence blockIdx.z (its queries `seq`, and the
// key position offset S - T of a query chunk), KV head h, the chunk of query heads (first hq0, rows_here of them),
// and K's and V's key 0 of head h in the sequence, with the copies of a key tile's rows from there (rows [s0, s0 +
// keys) into a tile of kKeys rows, zero-filled past keys, by Threads threads).
template <class T>
struct HeadChunk {
  SeqTable::Seq seq;
  std::int64_t offset;  // query t sits at key position t + offset
  std::int64_t h, hq0;
  int rows_here;
  const T* k_head;
  const T* v_head;
  std::int64_t k_stride, v_stride;

  __device__ __forceinline__ HeadChunk(const Tokens<const T>& k, const Tokens<const T>& v, const SeqPairTable& seqs,
                                       const QueryOuterConfig& c) {
    h = blockIdx.y / c.chunks;
    const std::int64_t chunk = blockIdx.y - h * c.chunks;
    const SeqPairTable::Seq pair = seqs[blockIdx.z];
    seq = {pair.batch, pair.q_begin, pair.T};
    offset = pair.S - pair.T;
    hq0 = h * c.group + chunk * kRows;
    rows_here = static_cast<int>(min(std::int64_t{kRows}, c.group - chunk * kRows));
    k_head = k.row(pair.batch, pair.k_begin, h);
    v_head = v.row(pair.batch, pair.k_begin, h);
    k_stride = k.row_stride;
    v_stride = v.row_stride;
  }
  template <int kKeys, int D, int Threads, class Tile>
  __device__ __forceinline__ void copy_k(const Tile& ks, std::int64_t s0, int keys) const {
    load_strided_rows<T, kKeys, D, Threads>(ks, k_head + s0 * k_stride, k_stride, keys, k_head);
  }
  template <int kKeys, int D, int Threads, class Tile>
  __device__ __forceinline__ void copy_v(const Tile& vs, std::int64_t s0, int keys) const {
    load_strided_rows<T, kKeys, D, Threads>(vs, v_head + s0 * v_stride, v_stride, keys, v_head);
  }
};

// The A fragments of the chunk's query heads h0 .. h0 + rows_here - 1 of one token row of x (D / 16 k-steps of
// 16 columns; rows past the chunk's heads: zero).
template <class T, int D>
__device__ __forceinline__ void load_head_fragments(std::uint32_t (&frag)[D / 16][4], const Tokens<const T>& x,
                                                    std::int64_t batch, std::int64_t row, std::int64_t h0,
                                                    int rows_here) {
  const int lane = threadIdx.x % 32, r = lane / 4, col = 2 * (lane % 4);
  const T* lo = x.row(batch, row, h0 + min(r, rows_here - 1));
  const T* hi = x.row(batch, row, h0 + min(r + 8, rows_here - 1));
  const bool lo_ok = r < rows_here, hi_ok = r + 8 < rows_here;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c0 = kk * 16 + col;
    frag[kk][0] = lo_ok ? *reinterpret_cast<const std::uint32_t*>(lo + c0) : 0u;
    frag[kk][1] = hi_ok ? *reinterpret_cast<const std::uint32_t*>(hi + c0) : 0u;
    frag[kk][2] = lo_ok ? *reinterpret_cast<const std::uint32_t*>(lo + c0 + 8) : 0u;
    frag[kk][3] = hi_ok ? *reinterpret_cast<const std::uint32_t*>(hi + c0 + 8) : 0u;
  }
}

// Keys per tile: 64, or 32 at Dqk = 192 and 256 (where Q takes 48 or 64 registers of the fragments).
template <int DQK>
inline constexpr int kKeysOf = DQK <= 128 ? 64 : 32;

// acc (16 x kKeys) += A B^T over D columns: A's fragment of k-step kk from a_of(a, kk), B = rows [0, kKeys) of
// `tile` (S = Q K^T, and dP = dO V^T in the dQ).
template <class T, int kKeys, int D, class Tile, class AOf>
__device__ __forceinline__ void accumulate_scores(float (&acc)[kKeys / 8][4], AOf a_of, const Tile& tile) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    std::uint32_t a[4];
    a_of(a, kk);
#pragma unroll
    for (int np = 0; np < kKeys / 16; ++np) {
      std::uint32_t b[4];
      load_b_rows(b, tile, np * 16, kk * 16);
      mma_pair<T>(acc[2 * np], acc[2 * np + 1], a, b);
    }
  }
}

// acc (16 x N) += X B: X (16 x kKeys) in mma accumulator layout, whose columns [16kk, 16kk + 16) packed to T are
// the A fragment of k-step kk, and B = rows [0, kKeys) x columns [0, N) of `tile` (P V in the forward, dS K in
// the dQ).
template <class T, int kKeys, int N, class Tile>
__device__ __forceinline__ void accumulate_product(float (&acc)[N / 8][4], const float (&x)[kKeys / 8][4],
                                                   const Tile& tile) {
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    const std::uint32_t a[4] = {pack2<T>(x[2 * kk][0], x[2 * kk][1]), pack2<T>(x[2 * kk][2], x[2 * kk][3]),
                                pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]),
                                pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3])};
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      std::uint32_t b[4];
      load_b_cols(b, tile, kk * 16, np * 16);
      mma_pair<T>(acc[2 * np], acc[2 * np + 1], a, b);
    }
  }
}

// A forward warp's rows (its chunk of query heads of one token): Q's A fragments over the Dqk / 16 k-steps, O's
// accumulators, and the online softmax's running maxima and sums. Per key tile: scores (S = Q K^T), softmax (over
// the tile's first `keys` columns: P in place of S), product (O += P V); at the end, store.
template <class T, int DQK, int DV>
struct ForwardRows {
  static constexpr int kKeys = kKeysOf<DQK>;
  std::uint32_t qa[DQK / 16][4];
  float acc[DV / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  __device__ __forceinline__ ForwardRows(const Tokens<const T>& q, std::int64_t batch, std::int64_t row,
                                         std::int64_t hq0, int rows_here) {
    load_head_fragments<T, DQK>(qa, q, batch, row, hq0, rows_here);
  }
  template <class KTile>
  __device__ __forceinline__ void scores(float (&s)[kKeys / 8][4], const KTile& ks) const {
    accumulate_scores<T, kKeys, DQK>(
        s,
        [&](std::uint32_t(&a)[4], int kk) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[e] = qa[kk][e];
        },
        ks);
  }
  __device__ __forceinline__ void softmax(float (&s)[kKeys / 8][4], int keys, float scale_log2) {
    with_mask(keys < kKeys, [&](auto masked) {
      const int col_lo[2] = {0, 0}, col_hi[2] = {keys - 1, keys - 1};
      online_softmax_step<kKeys, DV, decltype(masked)::value>(s, acc, m, l, col_lo, col_hi, scale_log2);
    });
  }
  template <class VTile>
  __device__ __forceinline__ void product(const float (&s)[kKeys / 8][4], const VTile& vs) {
    accumulate_product<T, kKeys, DV>(acc, s, vs);
  }

  // o = acc / l for the chunk's rows of token `row` (pairs of 16-bit values where the row is 4-byte aligned: any
  // stride is allowed) and lse (natural log; -inf for a row without keys).
  __device__ __forceinline__ void store(const Tokens<T>& o, const LseView<float>& lse, std::int64_t batch,
                                        std::int64_t row, std::int64_t hq0, int rows_here) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = lane / 4 + 8 * i;
      l[i] = quad_sum(l[i]);
      if (r >= rows_here) continue;
      const std::int64_t hq = hq0 + r;
      const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
      T* dst = o.row(batch, row, hq);
      const bool pairs_aligned = reinterpret_cast<std::uintptr_t>(dst) % 4 == 0;
#pragma unroll
      for (int nt = 0; nt < DV / 8; ++nt) {
        const int col = nt * 8 + 2 * (lane % 4);
        if (pairs_aligned) {
          *reinterpret_cast<std::uint32_t*>(dst + col) = pack2<T>(acc[nt][2 * i] * inv, acc[nt][2 * i + 1] * inv);
        } else {
          dst[col] = from_float<T>(acc[nt][2 * i] * inv);
          dst[col + 1] = from_float<T>(acc[nt][2 * i + 1] * inv);
        }
      }
      if (lane % 4 == 0) lse.at(batch, row, hq) = l[i] > 0.f ? (m[i] + log2f(l[i])) * kLn2 : -INFINITY;
    }
  }
};

// What a dQ warp (one-token or group form) holds of its chunk's rows lane / 4 and lane / 4 + 8 of one token: lse in
// the log2 domain (+inf where it is -inf or the row is padding: P = 0), the P factor g and g delta (dS = g P (dP -
// delta) = P (g dP - g delta); g is the P factor of a folded NSA gate, 1 otherwise).
struct DqRowTerms {
  float lse2[2], g[2], g_delta[2];

  __device__ __forceinline__ DqRowTerms(const LseView<const float>& lse, const LseView<const float>& delta,
                                        const LseView<const float>& p_scale, std::int64_t batch, std::int64_t row,
                                        std::int64_t hq0, int rows_here) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = lane / 4 + 8 * i;
      const bool used = r < rows_here;
      const float x = used ? lse.at(batch, row, hq0 + r) : -INFINITY;
      lse2[i] = x == -INFINITY ? INFINITY : x * kLog2e;
      g[i] = used ? p_scale_at(p_scale, batch, row, hq0 + r) : 0.f;
      g_delta[i] = used ? g[i] * delta.at(batch, row, hq0 + r) : 0.f;
    }
  }

  // dS (without the softmax scale) in place of S from the tile's S and dP; columns past the tile's first `keys`
  // get P = 0.
  template <int kKeys>
  __device__ __forceinline__ void ds_in_place(float (&s)[kKeys / 8][4], const float (&dp)[kKeys / 8][4], int keys,
                                              float scale_log2) const {
    const int lane = threadIdx.x % 32;
    with_mask(keys < kKeys, [&](auto masked) {
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = fast_exp2(fmaf(s[n][e], scale_log2, -lse2[e / 2]));
          if constexpr (decltype(masked)::value) {
            if (n * 8 + 2 * (lane % 4) + (e & 1) >= keys) p = 0.f;
          }
          s[n][e] = p * fmaf(g[e / 2], dp[n][e], -g_delta[e / 2]);
        }
      }
    });
  }
};

// dq = acc * scale (+= where accumulate) for the chunk's rows of token `row`.
template <class T, int DQK>
__device__ __forceinline__ void store_dq_rows(const Tokens<T>& dq, const float (&acc)[DQK / 8][4], std::int64_t batch,
                                              std::int64_t row, std::int64_t hq0, int rows_here, float scale,
                                              bool accumulate) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = lane / 4 + 8 * i;
    if (r >= rows_here) continue;
    T* dst = dq.row(batch, row, hq0 + r);
#pragma unroll
    for (int nt = 0; nt < DQK / 8; ++nt) {
      auto* pair = reinterpret_cast<std::uint32_t*>(dst + nt * 8 + 2 * (lane % 4));
      float x = acc[nt][2 * i] * scale, y = acc[nt][2 * i + 1] * scale;
      if (accumulate) add_unpacked<T>(*pair, x, y);
      *pair = pack2<T>(x, y);
    }
  }
}

// Launches a forward kernel (one-token or group form) on p's tensors: grid, threads and shared memory as given.
template <class T, class Kernel>
void launch_forward(Kernel kernel, dim3 grid, int threads, std::size_t smem, const SelectedAttentionParams& p,
                    const QueryOuterLaunch& l, const char* name) {
  set_dynamic_smem(kernel, smem);
  kernel<<<grid, threads, smem, static_cast<cudaStream_t>(p.stream)>>>(
      tokens_of<const T>(p.q), tokens_of<const T>(p.k), tokens_of<const T>(p.v), index_of(p.indices),
      tokens_of<T>(p.o), lse_of<float>(p.lse), l.table, l.config);
  check_launch(name);
}

// Launches a dQ kernel (one-token or group form) on p's tensors, with delta and the P factor (backward.cu).
template <class T, class Kernel>
void launch_dq(Kernel kernel, dim3 grid, int threads, std::size_t smem, const SelectedAttentionBackwardParams& p,
               const QueryOuterLaunch& l, const LseView<const float>& delta, const LseView<const float>& p_scale,
               const char* name) {
  set_dynamic_smem(kernel, smem);
  kernel<<<grid, threads, smem, static_cast<cudaStream_t>(p.stream)>>>(
      tokens_of<const T>(p.q), tokens_of<const T>(p.k), tokens_of<const T>(p.v), index_of(p.indices),
      lse_of<const float>(p.lse), tokens_of<const T>(p.d_o), delta, p_scale, tokens_of<T>(p.dq), l.table, l.config);
  check_launch(name);
}

// The four entry points' common part (the forward and dQ, one-token and group forms): the launch from p's shapes
// (nothing when it is empty), then body(tag, dqk, dv, l) for p's dtype and head dims, with dispatch_16bit's type tag
// and dispatch_head_dims' constants.
template <class Params, class Body>
void dispatch_query_outer(const Params& p, bool accumulate_dq, Body&& body) {
  const QueryOuterLaunch l = launch_of(p.q, p.k, p.v, p.indices, p.seqs, p.seqs_k, p.block, p.scale, accumulate_dq);
  if (l.empty) return;
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    dispatch_head_dims(l.dqk, l.dv, [&](auto dqk_c, auto dv_c) { body(tag, dqk_c, dv_c, l); });
  });
}

// A launch of form `form` that runs only where the device chose it (chosen_form; null: always).
inline QueryOuterLaunch with_form(const QueryOuterLaunch& l, const std::int32_t* chosen_form, QueryForm form) {
  QueryOuterLaunch out = l;
  out.config.chosen_form = chosen_form;
  out.config.form = form;
  return out;
}

// The group kernels' grid (query_group_common.cuh): kGroupTokens consecutive tokens per CTA along x.
inline dim3 group_grid(const dim3& token_grid) {
  return dim3((token_grid.x + kGroupTokens - 1) / kGroupTokens, token_grid.y, token_grid.z);
}

// The one-token kernels (forward_query_outer.cu, dq_query_outer.cu): a CTA of one warp per (token, KV head, chunk
// of 16 query heads).
inline constexpr int kTokenThreads = 32;

// The key tiles of one token's selected blocks, in slot order: [s0, end) of at most kKeys keys, all <= t. The
// warp walks them together (every lane calls next()); the slots' block indices sit in registers, lane i holding
// slot chunk_base + i, so finding the next tile costs a shuffle, not a global load on the path to the next tile's
// K load.
template <int kKeys>
struct KeyTiles {
  const std::int32_t* idx;
  std::int64_t num_idx, block, t;
  std::int64_t slot = -1, s0 = 0, end = 0;  // the current tile; slot == num_idx: no more
  std::int64_t chunk_base = 0;
  std::int32_t lane_block = -1;

  __device__ __forceinline__ KeyTiles(const std::int32_t* idx_, std::int64_t num_idx_, std::int64_t block_,
                                      std::int64_t t_)
      : idx(idx_), num_idx(num_idx_), block(block_), t(t_) {
    const int lane = threadIdx.x % 32;
    if (lane < num_idx) lane_block = idx[lane];
  }

  // Moves to the next tile (the rest of the current block, else the next visible block).
  __device__ __forceinline__ bool next() {
    if (slot >= 0 && s0 + kKeys < end) {
      s0 += kKeys;
      return true;
    }
    while (++slot < num_idx) {
      if (slot - chunk_base == 32) {
        chunk_base += 32;
        const std::int64_t mine = chunk_base + threadIdx.x % 32;
        lane_block = mine < num_idx ? idx[mine] : -1;
      }
      const std::int64_t b = __shfl_sync(0xffffffffu, lane_block, static_cast<int>(slot - chunk_base));
      if (b < 0) break;
      const std::int64_t first = b * block;
      if (first > t) continue;  // starts after t (or out of range): contributes nothing
      s0 = first;
      end = min(first + block, t + 1);
      return true;
    }
    slot = num_idx;
    return false;
  }
  __device__ __forceinline__ int keys() const { return static_cast<int>(min(end - s0, std::int64_t{kKeys})); }
};

// What both kernels take from their CTA's coordinates: HeadChunk's, and token t of the sequence (blockIdx.x; its
// row), the key tiles of indices[row, h], and the copies of a tile's K and V rows into the warp's shared-memory
// tiles. valid: t lies within the sequence.
template <class T, int kKeys, int DQK, int DV>
struct TokenTask : HeadChunk<T> {
  std::int64_t t, row;
  bool valid;

  __device__ __forceinline__ TokenTask(const Tokens<const T>& k, const Tokens<const T>& v, const SeqPairTable& seqs,
                                       const QueryOuterConfig& c)
      : HeadChunk<T>(k, v, seqs, c), t(blockIdx.x), row(this->seq.begin + t), valid(t < this->seq.length) {}
  // The tiles of the token's selected blocks up to its key position.
  __device__ __forceinline__ KeyTiles<kKeys> key_tiles(const IndexView& indices, const QueryOuterConfig& c) const {
    return {indices.row(this->seq.batch, row, this->h), c.num_idx, c.block, t + this->offset};
  }
  template <class Tile>
  __device__ __forceinline__ void copy_k(const Tile& ks, const KeyTiles<kKeys>& tile) const {
    HeadChunk<T>::template copy_k<kKeys, DQK, kTokenThreads>(ks, tile.s0, tile.keys());
  }
  template <class Tile>
  __device__ __forceinline__ void copy_v(const Tile& vs, const KeyTiles<kKeys>& tile) const {
    HeadChunk<T>::template copy_v<kKeys, DV, kTokenThreads>(vs, tile.s0, tile.keys());
  }
};

}  // namespace sparseattn::cuda::selection::query_outer
