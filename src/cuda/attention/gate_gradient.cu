// The gate's backward plan, copies and ddelta reduction (gate_gradient.h).
#include "cuda/attention/gate_gradient.h"

#include <algorithm>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/launch.cuh"

namespace sparseattn::cuda {

namespace {

using i64 = std::int64_t;

// A gate tensor [B, rows, H] (packed [rows, H]: B = 1) of `fp32` or 16-bit T, and its fp32 copy [B, H, rows].
struct GateCopy {
  const void* source;
  i64 batch_stride, row_stride, head_stride;  // of the source
  bool fp32;
  float* copy;
  i64 batch, rows, heads;
};

template <class T>
__global__ void __launch_bounds__(256) gate_copy_kernel(GateCopy c) {
  const i64 total = c.batch * c.rows * c.heads;
  for (i64 index = i64{blockIdx.x} * blockDim.x + threadIdx.x; index < total; index += i64{gridDim.x} * blockDim.x) {
    const i64 row = index % c.rows, head = (index / c.rows) % c.heads, b = index / (c.rows * c.heads);
    const i64 at = b * c.batch_stride + row * c.row_stride + head * c.head_stride;
    c.copy[index] = c.fp32 ? static_cast<const float*>(c.source)[at] : to_float(static_cast<const T*>(c.source)[at]);
  }
}

struct GateReduce {
  const float* partials;  // [splits][B][Hkv][rows] (packed B = 1)
  i64 split_stride, batch_stride, head_stride;
  int splits;
  void* out;  // ddelta [B, S, Hkv] / packed [Nk, Hkv]
  i64 out_batch_stride, out_row_stride, out_head_stride;
  bool fp32;
  SeqTable keys;
};

// One key of one KV head of one sequence per thread: grid (Hkv, key blocks, sequences).
template <class T>
__global__ void __launch_bounds__(256) gate_reduce_kernel(GateReduce r) {
  const SeqTable::Seq seq = r.keys[blockIdx.z];
  const i64 hk = blockIdx.x, key = i64{blockIdx.y} * blockDim.x + threadIdx.x;
  if (key >= seq.length) return;
  const i64 row = seq.begin + key;
  const float* p = r.partials + seq.batch * r.batch_stride + hk * r.head_stride + row;
  float sum = 0.f;
  for (int split = 0; split < r.splits; ++split) sum += p[split * r.split_stride];
  const i64 at = seq.batch * r.out_batch_stride + row * r.out_row_stride + hk * r.out_head_stride;
  if (r.fp32) {
    static_cast<float*>(r.out)[at] = sum;
  } else {
    static_cast<T*>(r.out)[at] = from_float<T>(sum);
  }
}

std::size_t float_bytes(i64 count) { return align_up(static_cast<std::size_t>(count) * sizeof(float)); }

// The [B, H, rows] fp32 view of a copy (packed: batch stride 0).
attention::GateView copy_view(const float* data, i64 batch, i64 rows, i64 heads) {
  return {data, batch > 1 ? heads * rows : 0, 1, rows, true};
}

}  // namespace

GateGradientPlan gate_gradient_plan(const FlashAttentionBackwardParams& p, int head_splits) {
  GateGradientPlan plan;
  const FlashGateOptions& g = p.gates;
  if (!g.alpha.present() || !g.delta.present() || !p.q.present() || !p.k.present()) return plan;
  const bool packed = p.q.rank == 3;
  plan.present = true;
  plan.ddelta = p.ddelta.present();
  plan.batch = packed ? 1 : p.q.shape[0];
  plan.q_rows = p.q.shape[packed ? 0 : 1];
  plan.k_rows = p.k.shape[packed ? 0 : 1];
  plan.q_heads = p.q.shape[p.q.rank - 2];
  plan.kv_heads = p.k.shape[p.k.rank - 2];
  plan.head_splits = head_splits;
  plan.alpha_bytes = float_bytes(plan.batch * plan.q_heads * plan.q_rows);
  plan.delta_bytes = float_bytes(plan.batch * plan.kv_heads * plan.k_rows);
  if (plan.ddelta) plan.partial_bytes = float_bytes(i64{head_splits} * plan.batch * plan.kv_heads * plan.k_rows);
  return plan;
}

attention::GateTerms GateGradientPlan::terms(const FlashAttentionBackwardParams& p, void* workspace) const {
  attention::GateTerms t{};
  if (!present) return t;
  char* base = static_cast<char*>(workspace);
  const auto* alpha = reinterpret_cast<const float*>(base);
  const auto* delta = reinterpret_cast<const float*>(base + alpha_bytes);
  t.alpha = copy_view(alpha, batch, q_rows, q_heads);
  t.delta = copy_view(delta, batch, k_rows, kv_heads);
  t.product = p.gates.gate == GateMode::product;
  if (p.dalpha.present()) {
    const TensorView& d = p.dalpha;
    const bool packed = d.rank == 2;
    t.dalpha = {d.data, packed ? 0 : d.stride[0], d.stride[packed ? 0 : 1], d.stride[packed ? 1 : 2],
                d.dtype == DType::float32};
  }
  if (ddelta) {
    const i64 head = k_rows, batch_stride = kv_heads * k_rows;
    t.ddelta = {reinterpret_cast<float*>(base + alpha_bytes + delta_bytes), batch * batch_stride,
                batch > 1 ? batch_stride : 0, head};
  }
  return t;
}

void prepare_gate_copies(const FlashAttentionBackwardParams& p, const GateGradientPlan& plan, void* workspace,
                         cudaStream_t stream) {
  if (!plan.present) return;
  char* base = static_cast<char*>(workspace);
  auto copy = [&](const TensorView& t, float* dst, i64 rows, i64 heads) {
    const bool packed = t.rank == 2;
    const GateCopy c{t.data,
                     packed ? 0 : t.stride[0],
                     t.stride[packed ? 0 : 1],
                     t.stride[packed ? 1 : 2],
                     t.dtype == DType::float32,
                     dst,
                     plan.batch,
                     rows,
                     heads};
    const i64 total = plan.batch * rows * heads;
    if (total == 0) return;
    const unsigned blocks = static_cast<unsigned>(std::min<i64>(ceil_div(total, 256), 1 << 16));
    dispatch_16bit(p.q.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      gate_copy_kernel<T><<<blocks, 256, 0, stream>>>(c);
    });
    check_launch("gate_copy_kernel");
  };
  copy(p.gates.alpha, reinterpret_cast<float*>(base), plan.q_rows, plan.q_heads);
  copy(p.gates.delta, reinterpret_cast<float*>(base + plan.alpha_bytes), plan.k_rows, plan.kv_heads);
}

void reduce_gate_gradient(const FlashAttentionBackwardParams& p, const GateGradientPlan& plan, void* workspace,
                          const SeqTable& keys, i64 max_keys, cudaStream_t stream) {
  if (!plan.present || !plan.ddelta || keys.count == 0 || max_keys == 0) return;
  const attention::GateTerms t = plan.terms(p, workspace);
  const TensorView& d = p.ddelta;
  const bool packed = d.rank == 2;
  const GateReduce r{t.ddelta.data,
                     t.ddelta.split_stride,
                     t.ddelta.batch_stride,
                     t.ddelta.head_stride,
                     plan.head_splits,
                     d.data,
                     packed ? 0 : d.stride[0],
                     d.stride[packed ? 0 : 1],
                     d.stride[packed ? 1 : 2],
                     d.dtype == DType::float32,
                     keys};
  const dim3 grid(static_cast<unsigned>(plan.kv_heads), static_cast<unsigned>(ceil_div(max_keys, 256)),
                  static_cast<unsigned>(keys.count));
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    gate_reduce_kernel<T><<<grid, 256, 0, stream>>>(r);
  });
  check_launch("gate_reduce_kernel");
}

}  // namespace sparseattn::cuda
