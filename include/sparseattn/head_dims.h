// The (Dqk, Dv) head-dim pairs that have CUDA kernels (the CPU reference takes any). This is the one list that
// the kernels' instantiations and dispatch, the API's validation, Python's sparseattn.CUDA_HEAD_DIMS and the tests'
// parameter lists derive from. Adding a pair is one line in SPARSEATTN_HEAD_DIMS; CMake reads the same line to
// generate the attention kernels' instantiation units (CMakeLists.txt), so it keeps the form X(Dqk, Dv).
#pragma once

#include <cstdint>
#include <string>

// clang-format off
#define SPARSEATTN_HEAD_DIMS(X) X(64, 64) X(128, 128) X(192, 128) X(256, 256)
// clang-format on

namespace sparseattn {

struct HeadDims {
  int qk;
  int v;
};

#define SPARSEATTN_HEAD_DIMS_ENTRY(QK, V) HeadDims{QK, V},
inline constexpr HeadDims kCudaHeadDims[] = {SPARSEATTN_HEAD_DIMS(SPARSEATTN_HEAD_DIMS_ENTRY)};
#undef SPARSEATTN_HEAD_DIMS_ENTRY

// Whether (dim_qk, dim_v) is one of the pairs.
constexpr bool cuda_head_dims_supported(std::int64_t dim_qk, std::int64_t dim_v) {
  for (const HeadDims& d : kCudaHeadDims) {
    if (d.qk == dim_qk && d.v == dim_v) return true;
  }
  return false;
}

// Whether some pair has this Dqk (select_blocks reads q and k only).
constexpr bool cuda_head_dim_qk_supported(std::int64_t dim_qk) {
  for (const HeadDims& d : kCudaHeadDims) {
    if (d.qk == dim_qk) return true;
  }
  return false;
}

// "(64, 64), (128, 128), ..." for error messages.
inline std::string cuda_head_dims_list() {
  std::string out;
  for (const HeadDims& d : kCudaHeadDims) {
    out += (out.empty() ? "(" : ", (") + std::to_string(d.qk) + ", " + std::to_string(d.v) + ")";
  }
  return out;
}

}  // namespace sparseattn
