// flash_attention's gate on CUDA (docs/semantics.md section 8, "Gated attention"): the raw score of query t and
// key s (q.k in the kernels' units, before the softmax scale) gains g(alpha_t * delta_s), g = logsigmoid or the
// product, and the backward returns dalpha and ddelta.
//
// How the kernels hold the gate values (read once per tile, never per element from global memory):
//  - a query-row kernel (forward, dQ) keeps alpha of its two rows per 16-row tile in registers (one read per query
//    tile) and stages delta of each key tile in shared memory as fp32 (one read per key, stage_gate_keys), from
//    which each thread takes the columns it holds;
//  - a dK/dV kernel keeps delta of its two key rows in registers and stages alpha of each query step in shared
//    memory next to lse (load_gate_rows, cp.async from the fp32 copy the backward makes).
// The backward first copies alpha and delta to fp32 [B, H, rows] (packed [H, N]) in its workspace
// (gate_gradient.h), so that its loads are contiguous; the forward reads the caller's tensors (q's dtype or fp32).
//
// Gradients (deterministic, no atomics): with ds the gradient of the logit (P (dP - Delta) in the kernels),
// dg = ds * scale * g'(x). The dQ kernel, which owns a query row of one head over every key, sums dg * delta_s
// over its keys in a fixed order and writes dalpha once; the dK/dV kernel, which owns a key of one KV head over
// its share of the group's (query head, query tile) steps, sums dg * alpha_t in step order and writes one fp32
// partial per head split, which gate_gradient.cu adds up in split order into ddelta.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mma.cuh"
#include "cuda/primitives/softmax.cuh"

namespace sparseattn::cuda::attention {

// alpha or delta as a kernel reads it: element (batch, row, head) at batch * batch_stride + row * row_stride +
// head * head_stride (packed: batch 0, rows counted from the packed tensor's start).
struct GateView {
  const void* data;  // null: no gate
  std::int64_t batch_stride, row_stride, head_stride;
  bool fp32;  // float32; otherwise q's 16-bit dtype

  template <class T>
  __device__ __forceinline__ float at(std::int64_t batch, std::int64_t row, std::int64_t head) const {
    const std::int64_t i = batch * batch_stride + row * row_stride + head * head_stride;
    if (fp32) return static_cast<const float*>(data)[i];
    return to_float(static_cast<const T*>(data)[i]);
  }
};

// A gate gradient output in the caller's layout (dalpha), or null.
struct GateOutput {
  void* data;
  std::int64_t batch_stride, row_stride, head_stride;
  bool fp32;

  template <class T>
  __device__ __forceinline__ void store(std::int64_t batch, std::int64_t row, std::int64_t head, float x) const {
    const std::int64_t i = batch * batch_stride + row * row_stride + head * head_stride;
    if (fp32) {
      static_cast<float*>(data)[i] = x;
    } else {
      static_cast<T*>(data)[i] = from_float<T>(x);
    }
  }
};

// The ddelta partials of the dK/dV kernels: split `split`'s sum for key `row` (packed: from the tensor's start) of
// KV head hk at split * split_stride + batch * batch_stride + hk * head_stride + row (fp32).
struct GatePartials {
  float* data;  // null: no ddelta
  std::int64_t split_stride, batch_stride, head_stride;

  __device__ __forceinline__ float* at(std::int64_t split, std::int64_t batch, std::int64_t hk,
                                       std::int64_t row) const {
    return data + split * split_stride + batch * batch_stride + hk * head_stride + row;
  }
};

struct GateTerms {
  GateView alpha, delta;  // forward: the caller's tensors; backward: their fp32 copies
  bool product;           // g = alpha * delta; otherwise logsigmoid(alpha * delta)
  GateOutput dalpha;      // backward: written by the dQ kernels
  GatePartials ddelta;    // backward: written by the dK/dV kernels

  __device__ __forceinline__ bool on() const { return alpha.data != nullptr; }
};

// ln(1 + e) for e in [0, 1] on the FMA units: a degree-6 polynomial fitted to minimise the largest error (1.4e-6
// in float32 over [0, 1]). The elementwise loops of the attention kernels are bound by the MUFU unit, which each
// probability already uses once; the polynomial keeps the logsigmoid gate at one more MUFU operation (e^-|x|)
// instead of two.
__device__ __forceinline__ float log1p_unit(float e) {
  float p = -0.01780461147427559f;
  p = fmaf(p, e, 0.08385910838842392f);
  p = fmaf(p, e, -0.19166314601898193f);
  p = fmaf(p, e, 0.31642255187034607f);
  p = fmaf(p, e, -0.4975302815437317f);
  p = fmaf(p, e, 0.999860942363739f);
  return fmaf(p, e, 1.3000557146369829e-06f);
}

// The gate modes as compile-time constants of the kernels' elementwise loops: with_gate calls its body with one.
enum GateKind : int { kNoGate = 0, kProductGate = 1, kLogsigmoidGate = 2 };

template <class Body>
__device__ __forceinline__ void with_gate(const GateTerms& gate, Body&& body) {
  if (!gate.on()) {
    body(std::integral_constant<int, kNoGate>{});
  } else if (gate.product) {
    body(std::integral_constant<int, kProductGate>{});
  } else {
    body(std::integral_constant<int, kLogsigmoidGate>{});
  }
}

// g(x): logsigmoid(x) = min(x, 0) - log(1 + e^-|x|), with e^-|x| in (0, 1], or the product x.
template <int kGate>
__device__ __forceinline__ float gate_value(float x) {
  if constexpr (kGate == kProductGate) {
    return x;
  } else {
    const float e = fast_exp2(-fabsf(x) * kLog2e);
    return fminf(x, 0.f) - log1p_unit(e);
  }
}

// g(x) and g'(x): logsigmoid'(x) = sigmoid(-x) = (x >= 0 ? e^-|x| : 1) / (1 + e^-|x|); the product's slope is 1.
template <int kGate>
__device__ __forceinline__ float gate_value_slope(float x, float& slope) {
  if constexpr (kGate == kProductGate) {
    slope = 1.f;
    return x;
  } else {
    const float e = fast_exp2(-fabsf(x) * kLog2e);
    slope = __fdividef(x >= 0.f ? e : 1.f, 1.f + e);
    return fminf(x, 0.f) - log1p_unit(e);
  }
}

// alpha of query row t (of the sequence) of query head h; 0 past the sequence.
template <class T, class Seq>
__device__ __forceinline__ float gate_alpha(const GateTerms& gate, const Seq& seq, std::int64_t h, std::int64_t t) {
  return t < seq.T ? gate.alpha.at<T>(seq.batch, seq.q_begin + t, h) : 0.f;
}

// delta of key s (of the sequence) of KV head hk; 0 past the sequence.
template <class T, class Seq>
__device__ __forceinline__ float gate_delta(const GateTerms& gate, const Seq& seq, std::int64_t hk, std::int64_t s) {
  return s < seq.S ? gate.delta.at<T>(seq.batch, seq.k_begin + s, hk) : 0.f;
}

// alpha of a query-row thread's rows row0 + 16 mt + lane / 4 + 8 half (kMT row tiles) of head h, into registers.
template <class T, int kMT, class Seq>
__device__ __forceinline__ void load_gate_alpha_rows(float (&alpha)[kMT][2], const GateTerms& gate, const Seq& seq,
                                                     std::int64_t h, std::int64_t row0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      alpha[mt][half] = gate_alpha<T>(gate, seq, h, row0 + 16 * mt + lane / 4 + 8 * half);
    }
  }
}

// delta of a dK/dV thread's key rows key0 + lane / 4 + 8 half of KV head hk, into registers.
template <class T, class Seq>
__device__ __forceinline__ void load_gate_delta_rows(float (&delta)[2], const GateTerms& gate, const Seq& seq,
                                                     std::int64_t hk, std::int64_t key0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) delta[half] = gate_delta<T>(gate, seq, hk, key0 + lane / 4 + 8 * half);
}

// Thread `index` of `count` writes its share of delta of keys [j0, j0 + kN) of KV head hk (fp32, 0 past the
// sequence) into dst[kN]; a barrier of the `count` threads must follow before the entries are read.
template <class T, int kN, class Seq>
__device__ __forceinline__ void stage_gate_keys(float* dst, const GateTerms& gate, const Seq& seq, std::int64_t j0,
                                                std::int64_t hk, int index, int count) {
  for (int i = index; i < kN; i += count) dst[i] = gate_delta<T>(gate, seq, hk, j0 + i);
}

// Starts copying alpha of query rows [t0, t0 + kM) of head h from the backward's fp32 copy into rows[kM] (cp.async,
// 0 past the sequence): part of the caller's load group.
template <int kM, int kThreadCount, class Seq>
__device__ __forceinline__ void load_gate_rows(float* rows, const GateTerms& gate, const Seq& seq, std::int64_t t0,
                                               std::int64_t h) {
  const float* base = static_cast<const float*>(gate.alpha.data);
  for (int r = threadIdx.x % kThreadCount; r < kM; r += kThreadCount) {
    const bool ok = t0 + r < seq.T;
    const std::int64_t row = seq.q_begin + (ok ? t0 + r : 0);
    cp_async_4(rows + r, base + seq.batch * gate.alpha.batch_stride + row * gate.alpha.row_stride +
                             h * gate.alpha.head_stride,
               ok ? 4 : 0);
  }
}

// Adds g(alpha_row * delta_col) to a thread's raw scores s [kCols / 8][4] of a query-row tile (rows: queries with
// alpha[2] for its rows lane / 4 and lane / 4 + 8; columns: keys, delta_cols their staged delta, column 0 of the
// tile first). Elements past the sequence or masked get a finite term (their alpha or delta is 0) that the
// kernels' bounds then hide.
template <int kCols, int kGate>
__device__ __forceinline__ void add_query_gate(float (&s)[kCols / 8][4], const float (&alpha)[2],
                                               const float* delta_cols) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    const float2 d = *reinterpret_cast<const float2*>(delta_cols + n * 8 + 2 * (lane % 4));
#pragma unroll
    for (int i = 0; i < 4; ++i) s[n][i] += gate_value<kGate>(alpha[i / 2] * (i % 2 ? d.y : d.x));
  }
}

// Adds g(alpha_col * delta_row) to a thread's transposed raw scores s [kCols / 8][4] of a dK/dV step (rows: keys
// with delta[2]; columns: queries, alpha_cols their staged alpha).
template <int kCols, int kGate>
__device__ __forceinline__ void add_key_gate(float (&s)[kCols / 8][4], const float (&delta)[2],
                                             const float* alpha_cols) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    const float2 a = *reinterpret_cast<const float2*>(alpha_cols + n * 8 + 2 * (lane % 4));
#pragma unroll
    for (int i = 0; i < 4; ++i) s[n][i] += gate_value<kGate>((i % 2 ? a.y : a.x) * delta[i / 2]);
  }
}

// dalpha of a query-row thread's two rows (row0 + lane / 4 + 8 half) of head h: the quad's sums times the softmax
// scale, written once by the quad's first lane.
template <class T, class Seq>
__device__ __forceinline__ void store_dalpha(const GateTerms& gate, const float (&sums)[2], float scale,
                                             const Seq& seq, std::int64_t h, std::int64_t row0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float total = quad_sum(sums[half]);
    const std::int64_t t = row0 + lane / 4 + 8 * half;
    if (lane % 4 == 0 && t < seq.T && gate.dalpha.data != nullptr) {
      gate.dalpha.store<T>(seq.batch, seq.q_begin + t, h, total * scale);
    }
  }
}

// A dK/dV thread's ddelta partial of its two key rows (key0 + lane / 4 + 8 half) of KV head hk, head split
// `split`: the quad's sums times the softmax scale, written once by the quad's first lane.
template <class Seq>
__device__ __forceinline__ void store_ddelta_partial(const GateTerms& gate, const float (&sums)[2], float scale,
                                                     const Seq& seq, std::int64_t split, std::int64_t hk,
                                                     std::int64_t key0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float total = quad_sum(sums[half]);
    const std::int64_t key = key0 + lane / 4 + 8 * half;
    if (lane % 4 == 0 && key < seq.S && gate.ddelta.data != nullptr) {
      *gate.ddelta.at(split, seq.batch, hk, seq.k_begin + key) = total * scale;
    }
  }
}

}  // namespace sparseattn::cuda::attention
