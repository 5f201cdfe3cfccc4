// select_blocks: for each (token t, KV head h) the group-summed compressed-attention probabilities, pooled
// to selection blocks, and top-n with forced blocks (semantics.md sections 3-4).
//
// One CTA (4 warps) per (t, h, sequence). The G query rows and their log-sum-exps sit in shared memory as
// fp32; one row of pooled scores S[t, 0..t/l'] (ceil(T/l') floats: 16 KB at T = 256K, l' = 64) too, so
// nothing grows as T^2. A warp computes S[t, b] for one selection block b at a time from the compressed
// blocks j overlapping it (a border block j is computed for both of its selection blocks), which keeps the
// sum order fixed: no atomics, deterministic. Top-n: forced blocks first, then count - forced rounds of a
// CTA-wide argmax (ties to the lower index, as the reference's stable sort). SIMT fp32 throughout; expf
// (not __expf) so that scores track the float64 reference to ~1e-6 relative.
#include <cuda_runtime.h>

#include <cmath>

#include "cuda/common.cuh"
#include "cuda/selection/common.cuh"
#include "cuda/selection/ops.h"

namespace sparseattn::cuda {

namespace {

using selection::LseView;
using selection::SeqTable;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxDimPerLane = kSelectBlocksMaxDim / 32;

struct SelectConfig {
  std::int64_t heads_kv, group, dim;
  std::int64_t cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local;
  float scale;
};

std::size_t smem_bytes(std::int64_t max_len, std::int64_t sel_block, std::int64_t group, std::int64_t dim,
                       std::int64_t num_selected) {
  const std::int64_t blocks = (max_len + sel_block - 1) / sel_block + 1;
  return static_cast<std::size_t>(4 * (group * dim + group + blocks + num_selected + 2 * kWarps));
}

template <class T>
__global__ void __launch_bounds__(kThreads) select_blocks_kernel(Tokens<const T> q, Tokens<const T> k_cmp,
                                                                 LseView<const float> lse, Tokens<std::int32_t> out,
                                                                 SeqTable seqs, const std::int32_t* cu_seqlens_cmp,
                                                                 SelectConfig c, std::int64_t max_blocks) {
  extern __shared__ float smem[];
  const std::int64_t t = blockIdx.x, h = blockIdx.y, sq = blockIdx.z;
  const auto seq = seqs[sq];
  if (t >= seq.length) return;
  const std::int64_t cmp_begin = cu_seqlens_cmp != nullptr ? cu_seqlens_cmp[sq] : 0;
  const std::int64_t cmp_count = seq.length >= c.cmp_block ? (seq.length - c.cmp_block) / c.cmp_stride + 1 : 0;

  float* qs = smem;                       // [G][dim]
  float* lse_s = qs + c.group * c.dim;    // [G]
  float* scores = lse_s + c.group;        // [max_blocks]
  int* chosen = reinterpret_cast<int*>(scores + max_blocks);  // [num_selected]
  float* red_v = reinterpret_cast<float*>(chosen + c.num_selected);
  int* red_i = reinterpret_cast<int*>(red_v + kWarps);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const std::int64_t row = seq.begin + t;
  for (std::int64_t i = tid; i < c.group * c.dim; i += kThreads) {
    const std::int64_t g = i / c.dim, d = i % c.dim;
    qs[i] = to_float(q.row(seq.batch, row, h * c.group + g)[d]);
  }
  for (std::int64_t g = tid; g < c.group; g += kThreads) lse_s[g] = lse.at(seq.batch, row, h * c.group + g);
  __syncthreads();

  const std::int64_t nb = t / c.sel_block + 1;  // candidates
  // Compressed blocks visible from t: j*d + l - 1 <= t, and j < cmp_count.
  const std::int64_t j_visible_end =
      t + 1 >= c.cmp_block ? min((t + 1 - c.cmp_block) / c.cmp_stride + 1, cmp_count) : 0;
  for (std::int64_t b = warp; b < nb; b += kWarps) {
    const std::int64_t first = b * c.sel_block, end = first + c.sel_block;
    const std::int64_t j_lo = first >= c.cmp_block ? (first - c.cmp_block) / c.cmp_stride + 1 : 0;
    const std::int64_t j_hi = min((end - 1) / c.cmp_stride + 1, j_visible_end);  // exclusive
    float score = 0.f;
    for (std::int64_t j = j_lo; j < j_hi; ++j) {
      const T* kj = k_cmp.row(seq.batch, cmp_begin + j, h);
      float kr[kMaxDimPerLane];
#pragma unroll
      for (int i = 0; i < kMaxDimPerLane; ++i) {
        const std::int64_t d = lane + 32 * i;
        kr[i] = d < c.dim ? to_float(kj[d]) : 0.f;
      }
      float p = 0.f;
      for (std::int64_t g = 0; g < c.group; ++g) {
        const float* qg = qs + g * c.dim;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kMaxDimPerLane; ++i) {
          const std::int64_t d = lane + 32 * i;
          if (d < c.dim) dot = fmaf(qg[d], kr[i], dot);
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        const float l = lse_s[g];
        if (l != -INFINITY) p += expf(c.scale * dot - l);
      }
      const std::int64_t jf = j * c.cmp_stride;
      const std::int64_t overlap = min(jf + c.cmp_block, end) - max(jf, first);
      score += static_cast<float>(overlap) / static_cast<float>(c.cmp_stride) * p;
    }
    if (lane == 0) scores[b] = score;
  }
  __syncthreads();

  // Forced blocks (thread 0), marked -inf so that the argmax skips them (real scores are >= 0).
  __shared__ int picked;
  if (tid == 0) {
    int n = 0;
    for (std::int64_t b = 0; b < min(c.num_init, nb); ++b) {
      chosen[n++] = static_cast<int>(b);
      scores[b] = -INFINITY;
    }
    for (std::int64_t b = max(std::int64_t{0}, nb - c.num_local); b < nb; ++b) {
      if (scores[b] == -INFINITY) continue;
      chosen[n++] = static_cast<int>(b);
      scores[b] = -INFINITY;
    }
    picked = n;
  }
  __syncthreads();
  const std::int64_t count = min(c.num_selected, nb);
  for (std::int64_t round = picked; round < count; ++round) {
    float best = -INFINITY;
    int best_i = 0x7fffffff;
    for (std::int64_t b = tid; b < nb; b += kThreads) {
      float v = scores[b];
      if (v == -INFINITY) continue;
      if (v != v) v = -3.0e38f;  // NaN (garbage input) ranks last but still fills a slot
      if (v > best) {
        best = v;
        best_i = static_cast<int>(b);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (ov > best || (ov == best && oi < best_i)) {
        best = ov;
        best_i = oi;
      }
    }
    if (lane == 0) {
      red_v[warp] = best;
      red_i[warp] = best_i;
    }
    __syncthreads();
    if (tid == 0) {
      for (int w = 1; w < kWarps; ++w) {
        if (red_v[w] > best || (red_v[w] == best && red_i[w] < best_i)) {
          best = red_v[w];
          best_i = red_i[w];
        }
      }
      if (best_i < nb) {
        chosen[round] = best_i;
        scores[best_i] = -INFINITY;
      }
    }
    __syncthreads();
  }
  if (tid == 0) {
    const int n = static_cast<int>(count);
    for (int i = 1; i < n; ++i) {  // insertion sort, n is small
      const int v = chosen[i];
      int j = i - 1;
      while (j >= 0 && chosen[j] > v) {
        chosen[j + 1] = chosen[j];
        --j;
      }
      chosen[j + 1] = v;
    }
  }
  __syncthreads();
  std::int32_t* dst = out.row(seq.batch, row, h);
  for (std::int64_t i = tid; i < c.num_selected; i += kThreads) dst[i] = i < count ? chosen[i] : -1;
}

}  // namespace

bool select_blocks_fits(std::int64_t max_length, std::int64_t sel_block, std::int64_t heads_per_group,
                        std::int64_t dim, std::int64_t num_selected, int device_index) {
  int limit = 0;
  if (cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_index) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return smem_bytes(max_length, sel_block, heads_per_group, dim, num_selected) + 64 <= static_cast<std::size_t>(limit);
}

void select_blocks(const SelectBlocksParams& p) {
  const DeviceGuard device(p.q.device_index);
  const selection::HostShape s = selection::host_shape(p.q, p.seqs);
  const std::int64_t heads_q = p.q.shape[p.q.rank - 2], dim = p.q.shape[p.q.rank - 1];
  const std::int64_t heads_kv = p.k_cmp.shape[p.k_cmp.rank - 2];
  if (s.batch <= 0 || s.max_len <= 0) return;
  const SelectConfig c{heads_kv,      heads_q / heads_kv, dim,          p.cmp_block, p.cmp_stride,
                       p.sel_block,   p.num_selected,     p.num_init,   p.num_local,
                       static_cast<float>(softmax_scale(p.scale, dim))};
  const std::int64_t max_blocks = (s.max_len + p.sel_block - 1) / p.sel_block + 1;
  const std::size_t smem = smem_bytes(s.max_len, p.sel_block, c.group, dim, p.num_selected);
  const dim3 grid(static_cast<unsigned>(s.max_len), static_cast<unsigned>(heads_kv), static_cast<unsigned>(s.batch));
  const auto stream = static_cast<cudaStream_t>(p.stream);
  dispatch_float(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto kernel = select_blocks_kernel<T>;
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    kernel<<<grid, kThreads, smem, stream>>>(tokens_of<const T>(p.q), tokens_of<const T>(p.k_cmp),
                                             selection::lse_of<const float>(p.lse_cmp),
                                             tokens_of<std::int32_t>(p.indices), selection::seq_table(s, p.seqs),
                                             static_cast<const std::int32_t*>(p.cu_seqlens_cmp.data), c, max_blocks);
    check_launch("select_blocks_kernel");
  });
}

}  // namespace sparseattn::cuda
