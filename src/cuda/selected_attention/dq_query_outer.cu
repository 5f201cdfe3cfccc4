// The query-outer dQ of selected_attention's backward on tensor cores (mma.sync m16n8k16, fp32 accumulation),
// chosen for large groups (full tiles; backward_plan.h); no workspace.
//
// One warp per (token t, KV head h, chunk of 16 query heads of the group), as the query-outer forward
// (forward_query_outer.cu): the chunk's heads are the 16 rows of the mma tile. Per key tile of the token's
// selected blocks: dP = dO V^T, S = Q K^T, dS = P (g dP - g delta) in registers (g: the P factor of a folded NSA
// gate, 1 otherwise), dS as the A operand straight from the accumulators, dQ += dS K over all Dqk columns. K and
// V have one shared-memory buffer each, refilled as soon as the warp is done with it; no barriers.
#include "cuda/selected_attention/launchers.h"
#include "cuda/selected_attention/query_outer_common.cuh"

namespace sparseattn::cuda::selection {

namespace {

using namespace query_outer;

constexpr int kThreads = kTokenThreads;

// dQ's shared memory: one K and one V tile (as the forward), and from 192/128 on the token's Q and dO rows, whose
// fragments are read from there each tile: in registers with dQ's accumulators and the tile's S and dP they would
// spill (about 290 registers per thread at 256/256, 260 at 192/128). Both go there, not only dO: with Q in
// registers and dO in shared memory the 192/128 kernel does not spill but is much slower.
template <class T, int DQK, int DV>
struct DqSmem {
  static constexpr int kKeys = kKeysOf<DQK>;
  static constexpr bool kRowsInSmem = DQK + DV > 256;
  using K = SmemTile<T, kKeys, DQK>;
  using V = SmemTile<T, kKeys, DV>;
  using Q = SmemTile<T, kRows, DQK>;
  using DO = SmemTile<T, kRows, DV>;
  static constexpr std::size_t kBytes =
      (K::kElements + V::kElements + (kRowsInSmem ? Q::kElements + DO::kElements : 0)) * sizeof(T);
};

// Per tile: dP first (its V landed one step earlier), then S once K has landed; V is refilled after dP and K
// after dQ += dS K, so the next V loads during this tile's S, dS and dQ products and the next K during the
// next dP. Registers at 128/128: Q and dO fragments 32 each, dQ 64, S and dP 32 each (248 in all).
template <class T, int DQK, int DV>
__global__ void __launch_bounds__(kThreads) selected_dq_kernel(Tokens<const T> q, Tokens<const T> k,
                                                               Tokens<const T> v, IndexView indices,
                                                               LseView<const float> lse, Tokens<const T> d_o,
                                                               LseView<const float> delta,
                                                               LseView<const float> p_scale, Tokens<T> dq,
                                                               SeqPairTable seqs, QueryOuterConfig c) {
  if (form_not_chosen(c)) return;
  using S = DqSmem<T, DQK, DV>;
  constexpr int kKeys = S::kKeys;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const typename S::K ks{reinterpret_cast<T*>(smem_raw)};
  const typename S::V vs{ks.base + S::K::kElements};
  const typename S::Q qs{vs.base + S::V::kElements};  // used if S::kRowsInSmem
  const typename S::DO dos{qs.base + S::Q::kElements};

  const TokenTask<T, kKeys, DQK, DV> task(k, v, seqs, c);
  if (!task.valid) return;
  const auto& seq = task.seq;
  const std::int64_t row = task.row, hq0 = task.hq0;
  const int rows_here = task.rows_here;
  auto load_k = [&](const KeyTiles<kKeys>& tile) { task.copy_k(ks, tile); };
  auto load_v = [&](const KeyTiles<kKeys>& tile) { task.copy_v(vs, tile); };
  KeyTiles<kKeys> tile = task.key_tiles(indices, c);
  bool has_tile = tile.next();
  // Copy groups in the order they are needed (the rows of Q and dO that shared memory holds, V0, K0, then per tile
  // V next, K next), so that "wait until one group is pending" first means "V has landed" and, after the next V's
  // issue, "K has landed".
  if constexpr (S::kRowsInSmem) {
    load_rows<T, kRows, DQK, kThreads>(
        qs, [&](int r) { return r < rows_here ? q.row(seq.batch, row, hq0 + r) : nullptr; },
        q.row(seq.batch, row, hq0));
    load_rows<T, kRows, DV, kThreads>(
        dos, [&](int r) { return r < rows_here ? d_o.row(seq.batch, row, hq0 + r) : nullptr; },
        d_o.row(seq.batch, row, hq0));
  }
  if (has_tile) load_v(tile);
  cp_async_commit();
  if (has_tile) load_k(tile);
  cp_async_commit();

  // Q's and dO's A fragments: held in registers, or read from shared memory per k-step (DqSmem).
  constexpr bool kHeld = !S::kRowsInSmem;
  std::uint32_t qa[kHeld ? DQK / 16 : 1][4], doa[kHeld ? DV / 16 : 1][4];
  if constexpr (kHeld) {
    load_head_fragments<T, DQK>(qa, q, seq.batch, row, hq0, rows_here);
    load_head_fragments<T, DV>(doa, d_o, seq.batch, row, hq0, rows_here);
  }
  const auto row_fragment = [&](std::uint32_t(&a)[4], const auto& tile, const auto& held, int kk) {
    if constexpr (kHeld) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = held[kk][e];
    } else {
      load_a(a, tile, 0, kk * 16);
    }
  };
  const DqRowTerms terms(lse, delta, p_scale, seq.batch, row, hq0, rows_here);

  float acc[DQK / 8][4] = {};
  while (has_tile) {
    cp_async_wait<1>();  // V of this tile (and dO's rows)
    __syncwarp();
    float dp[kKeys / 8][4] = {};
    accumulate_scores<T, kKeys, DV>(dp, [&](std::uint32_t(&a)[4], int kk) { row_fragment(a, dos, doa, kk); }, vs);
    KeyTiles<kKeys> next = tile;
    const bool has_next = next.next();
    __syncwarp();  // every lane has read V
    if (has_next) load_v(next);
    cp_async_commit();
    cp_async_wait<1>();  // K of this tile
    __syncwarp();
    float s[kKeys / 8][4] = {};
    accumulate_scores<T, kKeys, DQK>(s, [&](std::uint32_t(&a)[4], int kk) { row_fragment(a, qs, qa, kk); }, ks);
    terms.ds_in_place<kKeys>(s, dp, tile.keys(), c.scale_log2);
    accumulate_product<T, kKeys, DQK>(acc, s, ks);  // dQ += dS K
    __syncwarp();  // every lane has read K
    if (has_next) load_k(next);
    cp_async_commit();
    tile = next;
    has_tile = has_next;
  }
  cp_async_wait<0>();

  store_dq_rows<T, DQK>(dq, acc, seq.batch, row, hq0, rows_here, c.scale, c.accumulate_dq);
}

}  // namespace

void dq_query_outer(const SelectedAttentionBackwardParams& p, const LseView<const float>& delta,
                    const LseView<const float>& p_scale, bool accumulate_dq, const std::int32_t* chosen_form) {
  dispatch_query_outer(p, accumulate_dq, [&](auto tag, auto dqk_c, auto dv_c, const QueryOuterLaunch& launch) {
    using T = typename decltype(tag)::type;
    constexpr int DQK = decltype(dqk_c)::value, DV = decltype(dv_c)::value;
    const QueryOuterLaunch l = with_form(launch, chosen_form, kOneTokenForm);
    launch_dq<T>(selected_dq_kernel<T, DQK, DV>, l.grid, kThreads, DqSmem<T, DQK, DV>::kBytes, p, l, delta,
                 p_scale, "selected_dq_kernel");
  });
}

}  // namespace sparseattn::cuda::selection
