// When the group forms of the query-outer forward and dQ (forward_query_group.cu, dq_query_group.cu) pay against the
// one-token kernels: a group form loads each distinct block that its kGroupTokens consecutive tokens chose once for
// all of them, a one-token kernel loads every (token, block) entry's tiles but its tokens never wait on each other.
// Which is faster depends on how many distinct blocks there are per visible entry, which query_adaptive.cu samples on
// the device. Plain C++ for the host (tests/cpp) and the device.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SPARSEATTN_SHARING_HOST_DEVICE __host__ __device__
#else
#define SPARSEATTN_SHARING_HOST_DEVICE
#endif

namespace sparseattn::cuda::selection {

// The group form runs where the sampled groups chose at most this many distinct blocks per 1000 visible entries (or
// where no entry was sampled), the one-token forward elsewhere. The bound comes from timing both forms over inputs
// that share more and less (docs/perf/2026-11-28-adaptive-group-forward.md).
inline constexpr std::int64_t kGroupDistinctPerMille = 480;

SPARSEATTN_SHARING_HOST_DEVICE inline bool group_form_pays(std::int64_t distinct, std::int64_t entries) {
  return distinct * 1000 <= kGroupDistinctPerMille * entries;
}

}  // namespace sparseattn::cuda::selection
