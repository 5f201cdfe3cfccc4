// The group dQ of selected_attention's backward (query_group_common.cuh): 8 consecutive tokens per CTA share each
// K/V tile of the union of their selected blocks; each consumer warp computes one token's dQ as the one-token dQ
// does (dq_query_outer.cu: per key tile dP = dO V^T, S = Q K^T, dS in registers, dQ += dS K), taking from its
// queue the stages it reads. Inputs where neighbouring tokens choose alike then read fewer K/V rows from L2, as in
// the group forward. Where backward_plan.h allows this form (use_group_dq), query_adaptive.cu chooses between it and
// the one-token dQ on the device. dQ is bitwise the one-token dQ's where the index lists ascend (the union's walk
// then visits each token's blocks in its list's order).
//
// Registers: with Q's and dO's fragments, dQ, S and dP in registers the consumer needs about 250 and gets 232
// beside the producer, so each warp copies its token's dO rows (and Q's where Dqk + Dv > 256, as the one-token
// dQ does) into its part of the CTA's rows (GroupDqRows) and reads dO's A fragments from there per key tile.
#include "cuda/selected_attention/backward_plan.h"
#include "cuda/selected_attention/launchers.h"
#include "cuda/selected_attention/query_group_common.cuh"

namespace sparseattn::cuda::selection {

namespace {

using namespace query_group;

// A token's rows in shared memory: dO's 16 rows, then Q's where Dqk + Dv > 256 (kQInSmem).
template <class T, int DQK, int DV>
struct GroupDqRows {
  static constexpr bool kQInSmem = DQK + DV > 256;
  using DO = SmemTile<T, kRows, DV>;
  using Q = SmemTile<T, kRows, DQK>;
  static constexpr int kTokenElements = DO::kElements + (kQInSmem ? Q::kElements : 0);
  static constexpr std::size_t kBytes = std::size_t{kTokens} * kTokenElements * sizeof(T);
  static_assert(kBytes == group_dq_rows_bytes(DQK, DV), "backward_plan.h sizes the same rows");
};

template <class T, int DQK, int DV>
__global__ void __launch_bounds__(kThreads, 1)
    selected_group_dq_kernel(Tokens<const T> q, Tokens<const T> k, Tokens<const T> v, IndexView indices,
                             LseView<const float> lse, Tokens<const T> d_o, LseView<const float> delta,
                             LseView<const float> p_scale, Tokens<T> dq, SeqPairTable seqs, QueryOuterConfig c) {
  if (form_not_chosen(c)) return;
  using R = GroupDqRows<T, DQK, DV>;
  using S = GroupStages<T, DQK, DV, R::kBytes>;
  constexpr int kKeys = S::kKeys;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const S stages{smem_raw};
  const typename S::Ring ring(stages.barriers());

  const GroupTask<T, kKeys, DQK, DV> task(k, v, seqs, c);
  if (!task.valid) return;
  if (!start_group(task, stages, ring, indices, c)) return;

  // Consumer warp: token t0 + its index among the consumers.
  const int token = static_cast<int>(threadIdx.x - kProducerThreads) / 32, lane = static_cast<int>(threadIdx.x % 32);
  const auto& seq = task.seq;
  const std::int64_t t = task.t0 + token, row = task.seq.begin + t, hq0 = task.hq0;
  const int rows_here = task.rows_here;
  if (t >= seq.length) return;  // past the sequence: no reads (the producer releases for it)
  T* const mine = stages.rows() + token * R::kTokenElements;
  const typename R::DO dos{mine};
  const typename R::Q qs{mine + R::DO::kElements};  // used if R::kQInSmem
  load_rows<T, kRows, DV, 32>(
      dos, [&](int r) { return r < rows_here ? d_o.row(seq.batch, row, hq0 + r) : nullptr; },
      d_o.row(seq.batch, row, hq0), lane);
  if constexpr (R::kQInSmem) {
    load_rows<T, kRows, DQK, 32>(
        qs, [&](int r) { return r < rows_here ? q.row(seq.batch, row, hq0 + r) : nullptr; },
        q.row(seq.batch, row, hq0), lane);
  }
  cp_async_commit();
  std::uint32_t qa[R::kQInSmem ? 1 : DQK / 16][4];
  if constexpr (!R::kQInSmem) load_head_fragments<T, DQK>(qa, q, seq.batch, row, hq0, rows_here);
  const DqRowTerms terms(lse, delta, p_scale, seq.batch, row, hq0, rows_here);
  cp_async_wait<0>();
  __syncwarp();

  float acc[DQK / 8][4] = {};
  unsigned use;
  int keys;
  std::uint32_t seen = 0;
  for (unsigned n = 0; stages.pop(token, n, seen, use, keys); ++n) {
    ring.wait_full(use);
    const auto ks = stages.k(ring.slot(use));
    float dp[kKeys / 8][4] = {};
    accumulate_scores<T, kKeys, DV>(dp, [&](std::uint32_t(&a)[4], int kk) { load_a(a, dos, 0, kk * 16); },
                                    stages.v(ring.slot(use)));
    float s[kKeys / 8][4] = {};
    accumulate_scores<T, kKeys, DQK>(
        s,
        [&](std::uint32_t(&a)[4], int kk) {
          if constexpr (R::kQInSmem) {
            load_a(a, qs, 0, kk * 16);
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] = qa[kk][e];
          }
        },
        ks);
    terms.ds_in_place<kKeys>(s, dp, keys, c.scale_log2);
    accumulate_product<T, kKeys, DQK>(acc, s, ks);  // dQ += dS K
    ring.release(use);  // every lane, after its own reads of the stage
  }

  store_dq_rows<T, DQK>(dq, acc, seq.batch, row, hq0, rows_here, c.scale, c.accumulate_dq);
}

}  // namespace

void dq_query_group(const SelectedAttentionBackwardParams& p, const LseView<const float>& delta,
                    const LseView<const float>& p_scale, bool accumulate_dq, const std::int32_t* chosen_form) {
  dispatch_query_outer(p, accumulate_dq, [&](auto tag, auto dqk_c, auto dv_c, const QueryOuterLaunch& launch) {
    using T = typename decltype(tag)::type;
    constexpr int DQK = decltype(dqk_c)::value, DV = decltype(dv_c)::value;
    const QueryOuterLaunch l = with_form(launch, chosen_form, kGroupForm);
    const dim3 grid = group_grid(l.grid);
    launch_dq<T>(selected_group_dq_kernel<T, DQK, DV>, grid, kThreads,
                 group_dq_smem_bytes(DQK, DV, l.config.num_idx), p, l, delta, p_scale, "selected_group_dq_kernel");
  });
}

}  // namespace sparseattn::cuda::selection
