// The KV-block-outer dK/dV of selected_attention's backward on tensor cores (mma.sync m16n8k16, fp32 accumulation;
// on sm_90a at 64/64, 128/128 and 192/128 the warpgroup-MMA kernel of dkdv_wgmma.cuh instead).
//
// backward.cu builds the inverse index (for each sequence, KV head and selection block, the ascending tokens whose
// index row lists it; inverse_index.h) and its segments; here they are cut into chunks of at most C tokens
// (dkdv_chunks.cuh; C is dkv_chunk_tokens of backward_plan.h), so that block 0, which NSA forces into every row and
// every token selects, is not walked by one CTA alone. One CTA per (chunk, 64-key tile of the block, Dqk/Dv half
// for head dims > 128) gathers its tokens' query rows (all G heads, 32 (token, head) rows at a time) and
// accumulates dK and dV in registers: warp w owns keys [16w, 16w+16) of the tile and computes S^T = K Q^T and
// dP^T = V dO^T directly in key-major form, so no reduction across warps is needed. The two kernels share the task
// and the epilogue (dkdv_common.cuh). A segment that fits one chunk writes dK/dV directly; the chunks of a longer
// one write fp32 partials to their own workspace slots and dkv_reduce_kernel sums them in chunk order: no float
// atomics, deterministic.
#include <cuda_runtime.h>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/launch.cuh"
#include "cuda/primitives/mma.cuh"
#include "cuda/primitives/swizzled_tile.cuh"
#include "cuda/selected_attention/common.cuh"
#include "cuda/selected_attention/dkdv_chunks.cuh"
#include "cuda/selected_attention/dkdv_common.cuh"
#include "cuda/selected_attention/dkdv_wgmma.cuh"
#include "cuda/selected_attention/launchers.h"

namespace sparseattn::cuda::selection {

namespace {

constexpr int kThreads = 128;
constexpr int kKeys = 64;     // keys per tile (16 per warp)
constexpr int kGather = 32;   // (token, head) rows per gathered chunk

template <class T, int DQK, int DV>
struct DkvSmem {
  using K = SmemTile<T, kKeys, DQK>;
  using V = SmemTile<T, kKeys, DV>;
  using Q = SmemTile<T, kGather, DQK>;
  using DO = SmemTile<T, kGather, DV>;
  static constexpr std::size_t kElements = K::kElements + V::kElements + Q::kElements + DO::kElements;
  static constexpr std::size_t kBytes = kElements * sizeof(T) + 4 * kGather * sizeof(float);
};

template <class T, int DQK, int DV, int SPLIT>
__global__ void __launch_bounds__(kThreads) selected_dkv_kernel(
    Tokens<const T> q, Tokens<const T> k, Tokens<const T> v, LseView<const float> lse, Tokens<const T> d_o,
    LseView<const float> delta, LseView<const float> p_scale, const std::int32_t* offsets,
    const std::int32_t* seg_begin, const std::int32_t* seg_end, const std::int32_t* tokens,
    const std::uint64_t* chunk_scan, float* partials, Tokens<T> dk, Tokens<T> dv, SeqPairTable seqs, DkvConfig c) {
  using S = DkvSmem<T, DQK, DV>;
  constexpr int kCk = DQK / SPLIT, kCv = DV / SPLIT;  // dK / dV columns of this CTA
  extern __shared__ __align__(128) unsigned char smem_raw[];  // as the wgmma kernel of this unit declares it
  T* base = reinterpret_cast<T*>(smem_raw);
  const typename S::K ks{base};
  const typename S::V vs{ks.base + S::K::kElements};
  const typename S::Q qs{vs.base + S::V::kElements};
  const typename S::DO dos{qs.base + S::Q::kElements};
  float* lse_s = reinterpret_cast<float*>(dos.base + S::DO::kElements);
  float* delta_s = lse_s + kGather;
  float* scale_s = delta_s + kGather;  // the P factor (p_scale_at)
  int* pos_s = reinterpret_cast<int*>(scale_s + kGather);

  const std::int64_t half = blockIdx.y % SPLIT;
  const selection::DkvTask task = selection::dkv_task(chunk_scan, offsets, seg_begin, seg_end, seqs, c,
                                                      blockIdx.y / SPLIT, kKeys);
  if (task.first >= task.end) return;
  const auto& seq = task.seq;
  const std::int64_t h = task.h, first = task.first, end = task.end, list_begin = task.list_begin,
                     pairs = task.pairs;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  load_rows<T, kKeys, DQK, kThreads>(
      ks, [&](int r) { return first + r < end ? k.row(seq.batch, seq.begin + first + r, h) : nullptr; },
      k.row(seq.batch, seq.begin + first, h));
  load_rows<T, kKeys, DV, kThreads>(
      vs, [&](int r) { return first + r < end ? v.row(seq.batch, seq.begin + first + r, h) : nullptr; },
      v.row(seq.batch, seq.begin + first, h));
  cp_async_commit();

  float dk_acc[kCk / 8][4] = {}, dv_acc[kCv / 8][4] = {};
  const int k_lo = warp * 16 + lane / 4, k_hi = k_lo + 8;  // key rows of this thread in the tile
  const T* q_fallback = q.row(seq.batch, task.q_begin, 0);
  const T* do_fallback = d_o.row(seq.batch, task.q_begin, 0);
  const std::uint32_t group32 = static_cast<std::uint32_t>(c.group);
  // Query head h * G of the sequence's query 0; head h * G + g is g head strides further.
  const auto x_head = [&](const Tokens<const T>& x) { return x.row(seq.batch, task.q_begin, h * c.group); };
  for (std::int64_t p0 = 0; p0 < pairs; p0 += kGather) {
    __syncthreads();  // the previous chunk is done with qs, dos, *_s
    // Pair p0 + r is (token list_begin + (p0 + r) / G, head (p0 + r) % G): 32-bit division (pairs < 2^31).
    auto q_row = [&](int r, const Tokens<const T>& x) -> const T* {
      const std::int64_t pidx = p0 + r;
      if (pidx >= pairs) return nullptr;
      const std::uint32_t token = static_cast<std::uint32_t>(pidx) / group32;
      const std::int64_t pos = tokens[list_begin + token];
      return x_head(x) + pos * x.row_stride + (static_cast<std::uint32_t>(pidx) - token * group32) * x.head_stride;
    };
    load_rows<T, kGather, DQK, kThreads>(qs, [&](int r) { return q_row(r, q); }, q_fallback);
    load_rows<T, kGather, DV, kThreads>(dos, [&](int r) { return q_row(r, d_o); }, do_fallback);
    cp_async_commit();
    if (threadIdx.x < kGather) {
      const int r = threadIdx.x;
      const std::int64_t pidx = p0 + r;
      float lv = INFINITY, dl = 0.f, g = 0.f;
      int pos = -1;
      if (pidx < pairs) {
        const std::uint32_t token = static_cast<std::uint32_t>(pidx) / group32;
        pos = tokens[list_begin + token];
        const std::int64_t hq = h * c.group + (static_cast<std::uint32_t>(pidx) - token * group32);
        const float x = lse.at(seq.batch, task.q_begin + pos, hq);
        if (x != -INFINITY) lv = x * kLog2e;
        dl = delta.at(seq.batch, task.q_begin + pos, hq);
        g = selection::p_scale_at(p_scale, seq.batch, task.q_begin + pos, hq);
      }
      lse_s[r] = lv;
      delta_s[r] = dl;
      scale_s[r] = g;
      pos_s[r] = pos < 0 ? -1 : static_cast<int>(pos + task.offset);  // the row's key position
    }
    cp_async_wait<0>();
    __syncthreads();

    // S^T and dP^T: 16 keys of this warp x 32 gathered rows.
    float st[kGather / 8][4] = {}, dpt[kGather / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < DQK / 16; ++kk) {
      std::uint32_t a[4];
      load_a(a, ks, warp * 16, kk * 16);
#pragma unroll
      for (int np = 0; np < kGather / 16; ++np) {
        std::uint32_t bq[4];
        load_b_rows(bq, qs, np * 16, kk * 16);
        mma_pair<T>(st[2 * np], st[2 * np + 1], a, bq);
      }
    }
#pragma unroll
    for (int kk = 0; kk < DV / 16; ++kk) {
      std::uint32_t a[4];
      load_a(a, vs, warp * 16, kk * 16);
#pragma unroll
      for (int np = 0; np < kGather / 16; ++np) {
        std::uint32_t bo[4];
        load_b_rows(bo, dos, np * 16, kk * 16);
        mma_pair<T>(dpt[2 * np], dpt[2 * np + 1], a, bo);
      }
    }
    // P^T and dS^T in place.
#pragma unroll
    for (int nt = 0; nt < kGather / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * (lane % 4) + (e & 1);
        const std::int64_t s = first + (e < 2 ? k_lo : k_hi);
        const int pos = pos_s[col];
        const bool visible = s < end && pos >= 0 && s <= pos;
        const float p = visible ? fast_exp2(fmaf(st[nt][e], c.scale_log2, -lse_s[col])) * scale_s[col] : 0.f;
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - delta_s[col]);
      }
    }
    // dV += P^T dO, dK += dS^T Q (k = the 32 gathered rows, two k-steps).
#pragma unroll
    for (int kk = 0; kk < kGather / 16; ++kk) {
      std::uint32_t ap[4], ads[4];
      ap[0] = pack2<T>(st[2 * kk][0], st[2 * kk][1]);
      ap[1] = pack2<T>(st[2 * kk][2], st[2 * kk][3]);
      ap[2] = pack2<T>(st[2 * kk + 1][0], st[2 * kk + 1][1]);
      ap[3] = pack2<T>(st[2 * kk + 1][2], st[2 * kk + 1][3]);
      ads[0] = pack2<T>(dpt[2 * kk][0], dpt[2 * kk][1]);
      ads[1] = pack2<T>(dpt[2 * kk][2], dpt[2 * kk][3]);
      ads[2] = pack2<T>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
      ads[3] = pack2<T>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
      for (int np = 0; np < kCv / 16; ++np) {
        std::uint32_t bo[4];
        load_b_cols(bo, dos, kk * 16, static_cast<int>(half) * kCv + np * 16);
        mma_pair<T>(dv_acc[2 * np], dv_acc[2 * np + 1], ap, bo);
      }
#pragma unroll
      for (int np = 0; np < kCk / 16; ++np) {
        std::uint32_t bq[4];
        load_b_cols(bq, qs, kk * 16, static_cast<int>(half) * kCk + np * 16);
        mma_pair<T>(dk_acc[2 * np], dk_acc[2 * np + 1], ads, bq);
      }
    }
  }
  cp_async_wait<0>();
  selection::store_dkv<T, DQK, DV, kCk, kCv>(dk_acc, dv_acc, task, c, warp * 16, static_cast<int>(half) * kCk,
                                             static_cast<int>(half) * kCv, partials, dk, dv);
}

// dK/dV of the split segments: one CTA per key; the sum of its partial slots in chunk order.
template <class T>
__global__ void dkv_reduce_kernel(const std::uint64_t* chunk_scan, const float* partials, const std::int32_t* offsets,
                                  Tokens<T> dk, Tokens<T> dv, SeqTable seqs, DkvConfig c, int dqk, int dv_dim) {
  const std::int64_t key = blockIdx.x;
  const std::int64_t end_slot = static_cast<std::int64_t>(chunk_scan[key] >> 32);
  const std::int64_t slot0 = key > 0 ? static_cast<std::int64_t>(chunk_scan[key - 1] >> 32) : 0;
  if (end_slot == slot0) return;
  const selection::BlockOf w = selection::block_of(static_cast<std::uint64_t>(key), c.blocks_bound, c.blocks_per_seq,
                                                   offsets, c.batch, c.packed);
  const auto seq = seqs[w.seq];
  const std::int64_t first = w.block * c.block;
  const std::int64_t rows = min(c.block, seq.length - first);
  const std::int64_t stride = c.block * (dqk + dv_dim);
  const std::int64_t dk_pairs = rows * dqk / 2, pairs = dk_pairs + rows * dv_dim / 2;
  for (std::int64_t i = threadIdx.x; i < pairs; i += blockDim.x) {
    const bool is_k = i < dk_pairs;
    const std::int64_t e = is_k ? 2 * i : 2 * (i - dk_pairs);
    const int dim = is_k ? dqk : dv_dim;
    const std::int64_t r = e / dim, col = e % dim;
    const std::int64_t off = is_k ? e : c.block * dqk + e;
    float2 acc = make_float2(0.f, 0.f);
    for (std::int64_t sl = slot0; sl < end_slot; ++sl) {
      const float2 x = *reinterpret_cast<const float2*>(partials + sl * stride + off);
      acc.x += x.x;
      acc.y += x.y;
    }
    const float mul = is_k ? c.scale : 1.f;
    T* dst = (is_k ? dk : dv).row(seq.batch, seq.begin + first + r, w.head) + col;
    dst[0] = from_float<T>(acc.x * mul);
    dst[1] = from_float<T>(acc.y * mul);
  }
}

}  // namespace

void dkdv_kv_block_outer(const SelectedAttentionBackwardParams& p, const DkvConfig& c, const ChunkConfig& cc,
                         const DkdvBuffers& b, const LseView<const float>& delta, const LseView<const float>& p_scale,
                         const SeqPairTable& table) {
  const auto stream = static_cast<cudaStream_t>(p.stream);
  const std::int64_t dqk = p.q.shape[p.q.rank - 1], dv = p.v.shape[p.v.rank - 1];
  launch_chunk_counts(b.seg_begin, b.seg_end, b.offsets, table.k, cc, b.counts, stream);
  chunk_scan(b.scan_temp, b.scan_temp_bytes, b.counts, b.scan, c.keys, stream);
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_head_dims(dqk, dv, [&](auto dqk_c, auto dv_c) {
      constexpr int DQK = decltype(dqk_c)::value, DV = decltype(dv_c)::value;
      constexpr int SPLIT = DQK > 128 ? 2 : 1;
      const std::int64_t subtiles = (c.block + kKeys - 1) / kKeys;
      // The wgmma kernel where it runs (sm_90a; 64/64, 128/128, 192/128), else the mma.sync one; same arguments.
      auto kernel = selected_dkv_kernel<T, DQK, DV, SPLIT>;
      std::size_t smem = DkvSmem<T, DQK, DV>::kBytes;
      std::int64_t split = SPLIT;
      if constexpr (DkvWgmmaTile<DQK, DV>::kSupported) {
        auto wgmma_kernel = selected_dkv_wgmma_kernel<T, DQK, DV>;
        if (wgmma::kernel_runs(wgmma_kernel)) {
          kernel = wgmma_kernel;
          smem = DkvWgmmaTile<DQK, DV>::kSmemBytes;
          split = 1;
        }
      }
      set_dynamic_smem(kernel, smem);
      const dim3 grid(static_cast<unsigned>(b.grid), static_cast<unsigned>(subtiles * split));
      kernel<<<grid, kThreads, smem, stream>>>(
          tokens_of<const T>(p.q), tokens_of<const T>(p.k), tokens_of<const T>(p.v), lse_of<const float>(p.lse),
          tokens_of<const T>(p.d_o), delta, p_scale, b.offsets, b.seg_begin, b.seg_end, b.values_out, b.scan,
          b.partials, tokens_of<T>(p.dk), tokens_of<T>(p.dv), table, c);
      check_launch("selected_dkv_kernel");
      if (b.slots > 0) {
        dkv_reduce_kernel<T><<<static_cast<unsigned>(c.keys), 256, 0, stream>>>(
            b.scan, b.partials, b.offsets, tokens_of<T>(p.dk), tokens_of<T>(p.dv), table.k, c, DQK, DV);
        check_launch("dkv_reduce_kernel");
      }
    });
  });
}

}  // namespace sparseattn::cuda::selection
