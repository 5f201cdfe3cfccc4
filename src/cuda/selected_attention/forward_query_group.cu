// The group forward of selected_attention (query_group_common.cuh): 8 consecutive tokens per CTA share each K/V
// tile of the union of their selected blocks; each consumer warp computes one token as the one-token forward does
// (S = Q K^T, online softmax, O += P V, all in registers). Where forward_plan.h allows this form (use_group_forward),
// query_adaptive.cu chooses between it and the one-token forward on the device. Outputs are bitwise the one-token
// forward's where the index lists ascend (the union's walk then visits each token's blocks in its list's order).
#include "cuda/selected_attention/launchers.h"
#include "cuda/selected_attention/query_group_common.cuh"

namespace sparseattn::cuda::selection {

namespace {

using namespace query_group;

template <class T, int DQK, int DV>
__global__ void __launch_bounds__(kThreads, 1)
    selected_group_forward_kernel(Tokens<const T> q, Tokens<const T> k, Tokens<const T> v, IndexView indices,
                                  Tokens<T> o, LseView<float> lse, SeqPairTable seqs, QueryOuterConfig c) {
  if (form_not_chosen(c)) return;
  using S = GroupStages<T, DQK, DV>;
  constexpr int kKeys = S::kKeys;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const S stages{smem_raw};
  const typename S::Ring ring(stages.barriers());

  const GroupTask<T, kKeys, DQK, DV> task(k, v, seqs, c);
  if (!task.valid) return;
  if (!start_group(task, stages, ring, indices, c)) return;

  // Consumer warp: token t0 + its index among the consumers, Q in registers as the A fragments of the Dqk / 16 k-steps.
  const int token = static_cast<int>(threadIdx.x - kProducerThreads) / 32;
  const auto& seq = task.seq;
  const std::int64_t t = task.t0 + token, row = task.seq.begin + t;
  const int rows_here = task.rows_here;
  if (t >= seq.length) return;  // past the sequence: no reads (the producer releases for it)
  ForwardRows<T, DQK, DV> rows(q, seq.batch, row, task.hq0, rows_here);
  unsigned use;
  int keys;
  std::uint32_t seen = 0;
  for (unsigned n = 0; stages.pop(token, n, seen, use, keys); ++n) {
    ring.wait_full(use);
    float s[kKeys / 8][4] = {};
    rows.scores(s, stages.k(ring.slot(use)));  // S = Q K^T
    rows.softmax(s, keys, c.scale_log2);
    rows.product(s, stages.v(ring.slot(use)));  // O += P V
    ring.release(use);  // every lane, after its own reads of the stage
  }

  rows.store(o, lse, seq.batch, row, task.hq0, rows_here);
}

}  // namespace

void forward_query_group(const SelectedAttentionParams& p, const std::int32_t* chosen_form) {
  dispatch_query_outer(p, false, [&](auto tag, auto dqk_c, auto dv_c, const QueryOuterLaunch& launch) {
    using T = typename decltype(tag)::type;
    constexpr int DQK = decltype(dqk_c)::value, DV = decltype(dv_c)::value;
    const QueryOuterLaunch l = with_form(launch, chosen_form, kGroupForm);
    const dim3 grid = group_grid(l.grid);
    launch_forward<T>(selected_group_forward_kernel<T, DQK, DV>, grid, kThreads,
                      group_forward_smem_bytes(DQK, DV, l.config.num_idx), p, l, "selected_group_forward_kernel");
  });
}

}  // namespace sparseattn::cuda::selection
