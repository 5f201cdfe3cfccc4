#include "api/cuda_limits.h"

#include <algorithm>

#include "sparseattn/head_dims.h"

namespace sparseattn::detail {

void check_cuda_half(const Check& check, const TensorView& q) {
  check.require(q.dtype == DType::float16 || q.dtype == DType::bfloat16, ErrorKind::unsupported, "q",
                std::string("is ") + dtype_name(q.dtype) +
                    "; the CUDA attention kernels take float16 or bfloat16 (float32 and float64 run on the CPU)");
}

void check_cuda_head_dims(const Check& check, std::int64_t dim_qk, std::int64_t dim_v) {
  check.require(cuda_head_dims_supported(dim_qk, dim_v), ErrorKind::unsupported,
                cuda_head_dim_qk_supported(dim_qk) ? "v" : "q",
                "head dims (Dqk, Dv) = (" + std::to_string(dim_qk) + ", " + std::to_string(dim_v) +
                    ") have no CUDA kernel; supported: " + cuda_head_dims_list());
}

void check_cuda_rows(const Check& check, const TensorView& t, const std::string& arg) {
  if (!t.present()) return;
  bool aligned = reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0;
  for (int d = 0; d + 1 < t.rank; ++d) aligned = aligned && t.stride[d] % 8 == 0;
  check.require(aligned, ErrorKind::unsupported, arg,
                "the CUDA kernels need a 16-byte aligned data pointer and strides (except the innermost) that are "
                "multiples of 8 elements");
}

void check_cuda_length(const Check& check, const TensorView& t, const Sequences& seqs, const std::string& arg) {
  const bool packed = t.rank == 3;
  std::int64_t longest = t.shape[packed ? 0 : 1];
  if (packed && seqs.max_seqlen > 0) longest = std::min(longest, seqs.max_seqlen);
  check.require(longest <= kCudaMaxTokens, ErrorKind::unsupported, arg,
                "has a sequence of up to " + std::to_string(longest) + " tokens; the CUDA attention kernels take at most " +
                    std::to_string(kCudaMaxTokens) + " (pass max_seqlen for packed batches of shorter sequences)");
}

}  // namespace sparseattn::detail
