// The body of launch_decode_kernel (launch.h), included by its instantiation units only.
#pragma once

#include <type_traits>

#include "cuda/decode/launch.h"
#include "cuda/primitives/launch.cuh"

namespace sparseattn::cuda::decode {

template <class T, bool kPaged>
void launch_decode_kernel(const DecodeArgs<T>& args, const DecodePlan& plan, int dqk, int dv, cudaStream_t stream) {
  dispatch_head_dims(dqk, dv, [&](auto dim_qk, auto dim_v) {
    constexpr int Dqk = decltype(dim_qk)::value, Dv = decltype(dim_v)::value;
    const auto launch = [&](auto warps_m) {
      constexpr int kWarpsM = decltype(warps_m)::value;
      constexpr std::size_t kSmem = DecodeTile<Dqk, Dv, kWarpsM>::kSmemBytes;
      const auto kernel = flash_decode_kernel<T, Dqk, Dv, kWarpsM, kPaged>;
      set_dynamic_smem(kernel, kSmem);
      const i64 blocks = plan.row_blocks * plan.splits * args.batch * args.kv_heads;
      kernel<<<dim3(static_cast<unsigned>(blocks)), kThreads, kSmem, stream>>>(args);
      check_launch("flash_decode_kernel");
    };
    switch (plan.warps_m) {
      case 1: launch(std::integral_constant<int, 1>{}); break;
      case 2: launch(std::integral_constant<int, 2>{}); break;
      default: launch(std::integral_constant<int, 4>{}); break;
    }
  });
}

}  // namespace sparseattn::cuda::decode
