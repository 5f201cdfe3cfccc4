// The body of launch_nsa_decode (launch.h), included by its instantiation units only: the compressed splits, the
// selection, the selected and window pieces and the combine, in that order on one stream.
#pragma once

#include "cuda/nsa_decode/launch.h"
#include "cuda/primitives/launch.cuh"

namespace sparseattn::cuda::nsa_dec {

template <class T>
void launch_nsa_decode(const NsaDecodeArgs<T>& a, const Plan& plan, cudaStream_t stream) {
  const auto lists = static_cast<unsigned>(plan.batch * plan.q_len * plan.kv_heads);
  dispatch_head_dims(plan.dqk, plan.dv, [&](auto dim_qk, auto dim_v) {
    constexpr int Dqk = decltype(dim_qk)::value, Dv = decltype(dim_v)::value;
    if (plan.compressed) {
      const auto kernel = nsa_decode_compressed_kernel<T, Dqk, Dv>;
      set_dynamic_smem(kernel, plan.cmp_smem);
      kernel<<<static_cast<unsigned>(lists * plan.cmp_splits), kThreads, plan.cmp_smem, stream>>>(a);
      check_launch("nsa_decode_compressed_kernel");
    }
    if (plan.has_sel) {
      nsa_decode_select_kernel<T><<<lists, kSelectThreads, 0, stream>>>(a);
      check_launch("nsa_decode_select_kernel");
    }
    if (plan.pieces() > 0) {
      const auto kernel = nsa_decode_sparse_kernel<T, Dqk, Dv>;
      set_dynamic_smem(kernel, plan.attend_smem);
      kernel<<<static_cast<unsigned>(lists * plan.pieces()), kThreads, plan.attend_smem, stream>>>(a);
      check_launch("nsa_decode_sparse_kernel");
    }
    nsa_decode_combine_kernel<T, Dv><<<static_cast<unsigned>(plan.rows_q()), Dv, 0, stream>>>(a);
    check_launch("nsa_decode_combine_kernel");
  });
}

}  // namespace sparseattn::cuda::nsa_dec
