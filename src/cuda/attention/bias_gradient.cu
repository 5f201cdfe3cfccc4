// The bias gradient's plan and reduction (bias_gradient.h).
#include "cuda/attention/bias_gradient.h"

#include <algorithm>

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/launch.cuh"

namespace sparseattn::cuda {

namespace {

using i64 = std::int64_t;

template <class T>
__global__ void __launch_bounds__(256) bias_gradient_reduce_kernel(attention::BiasReduceArgs a, i64 total) {
  for (i64 index = i64{blockIdx.x} * blockDim.x + threadIdx.x; index < total; index += i64{gridDim.x} * blockDim.x) {
    i64 offset = 0;
    float sum = 0.f;
    if (attention::bias_gradient_entry(a, index, offset, sum)) static_cast<T*>(a.out)[offset] = from_float<T>(sum);
  }
}

}  // namespace

void reduce_bias_gradient(const FlashAttentionBackwardParams& p, const BiasGradientPlan& plan, const float* workspace,
                          cudaStream_t stream) {
  const TensorView& out = p.dbias;
  const i64 total = out.numel();
  if (!plan.present || total == 0) return;
  attention::BiasReduceArgs a{};
  a.out = out.data;
  a.rank = out.rank;
  for (int d = 0; d < out.rank; ++d) {
    a.shape[d] = out.shape[d];
    a.stride[d] = out.stride[d];
  }
  a.workspace = workspace;
  a.key_sums = plan.key_sums;
  a.workspace_heads = static_cast<int>(plan.workspace_heads);
  a.q_heads = static_cast<int>(p.q.shape[p.q.rank - 2]);
  a.kv_heads = static_cast<int>(p.k.shape[p.k.rank - 2]);
  a.group = a.q_heads / a.kv_heads;
  a.head_stride = plan.head_stride;
  a.batch_stride = plan.batch_stride;
  a.row_stride = plan.row_stride;
  const bool packed = p.q.rank == 3;
  a.batch = packed ? p.seqs_q.cu_seqlens.shape[0] - 1 : p.q.shape[0];
  a.cu_seqlens_q = packed ? static_cast<const std::int32_t*>(p.seqs_q.cu_seqlens.data) : nullptr;
  a.cu_seqlens_k = packed ? static_cast<const std::int32_t*>(p.seqs_k.cu_seqlens.data) : nullptr;
  constexpr int kThreadsPerBlock = 256;
  const unsigned blocks = static_cast<unsigned>(std::min<i64>(ceil_div(total, kThreadsPerBlock), 1 << 16));
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    bias_gradient_reduce_kernel<T><<<blocks, kThreadsPerBlock, 0, stream>>>(a, total);
  });
  check_launch("bias_gradient_reduce_kernel");
}

}  // namespace sparseattn::cuda
