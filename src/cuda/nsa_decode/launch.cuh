// The body of launch_nsa_decode (launch.h), included by its instantiation units only: the compressed splits, the
// selection, the selected and window pieces and (unless the pieces' kernel does it) the combine, in that order on
// one stream.
#pragma once

#include <type_traits>

#include "cuda/nsa_decode/launch.h"
#include "cuda/primitives/launch.cuh"

namespace sparseattn::cuda::nsa_dec {

template <class T>
void launch_nsa_decode(const NsaDecodeArgs<T>& a, const Plan& plan, cudaStream_t stream) {
  const auto lists = static_cast<unsigned>(plan.batch * plan.q_len * plan.kv_heads);
  int device = 0;
  cudaGetDevice(&device);
  // Every kernel after the call's first starts as the one before it drains (each waits for it before reading).
  const bool dependent_ok = dependent_launch_supported(device);
  bool first = true;
  const auto dependent = [&] {
    const bool value = dependent_ok && !first;
    first = false;
    return value;
  };
  dispatch_head_dims(plan.dqk, plan.dv, [&](auto dim_qk, auto dim_v) {
    constexpr int Dqk = decltype(dim_qk)::value, Dv = decltype(dim_v)::value;
    if (plan.compressed) {
      const auto launch_compressed = [&](auto warps) {
        constexpr int Warps = decltype(warps)::value;
        const auto kernel = nsa_decode_compressed_kernel<T, Dqk, Dv, Warps>;
        set_dynamic_smem(kernel, plan.cmp_smem);
        launch_dependent(dependent(), kernel, dim3(static_cast<unsigned>(lists * plan.cmp_splits)),
                         dim3(32 * Warps), plan.cmp_smem, stream, a);
      };
      if (plan.cmp_warps == 2 * kWarps) {
        launch_compressed(std::integral_constant<int, 2 * kWarps>{});
      } else {
        launch_compressed(std::integral_constant<int, kWarps>{});
      }
      check_launch("nsa_decode_compressed_kernel");
    }
    if (plan.has_sel) {
      launch_dependent(dependent(), nsa_decode_select_kernel<T>, dim3(lists), dim3(kSelectThreads), 0, stream, a);
      check_launch("nsa_decode_select_kernel");
    }
    if (plan.pieces() > 0) {
      const auto kernel = nsa_decode_sparse_kernel<T, Dqk, Dv>;
      set_dynamic_smem(kernel, plan.attend_smem);
      launch_dependent(dependent(), kernel, dim3(static_cast<unsigned>(lists * plan.pieces())), dim3(kThreads),
                       plan.attend_smem, stream, a);
      check_launch("nsa_decode_sparse_kernel");
    }
    if (!plan.fused_combine) {  // otherwise the sparse kernel's last CTA of each list combines
      launch_dependent(dependent(), nsa_decode_combine_kernel<T, Dv>, dim3(static_cast<unsigned>(plan.rows_q())),
                       dim3(Dv), 0, stream, a);
      check_launch("nsa_decode_combine_kernel");
    }
  });
}

}  // namespace sparseattn::cuda::nsa_dec
