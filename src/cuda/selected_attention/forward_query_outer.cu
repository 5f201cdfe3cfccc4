// The query-outer forward of selected_attention on tensor cores (mma.sync m16n8k16, fp32 accumulation), chosen
// for large groups (full tiles; forward_plan.h); no workspace.
//
// One warp per (token t, KV head h, chunk of 16 query heads of the group): the chunk's heads are the 16 rows of the
// mma tile (padded with zero rows when G < 16). The warp walks the key tiles of the selected blocks of indices[t, h]
// (tokens <= t only; blocks starting after t are skipped; the first -1 ends the list), kKeys keys per tile, and
// does everything of a tile itself, Q's fragments in registers: S = Q K^T, the online softmax in registers
// (softmax.cuh), P as the A operand straight from the accumulators, O += P V over all Dv columns. Nothing is
// exchanged between warps, so there is no barrier; K and V have one shared-memory buffer each, refilled (cp.async)
// as soon as the warp is done with it, so loads overlap the math. CTAs hold one warp: shared memory alone (32 KB
// at D = 128, seven warps per SM) sets how many run per SM. Every (token, block) pair re-reads the block's K and V
// rows from L2, which is what this kernel spends its time on; forward_query_group.cu shares them between
// neighbouring tokens.
#include "cuda/selected_attention/launchers.h"
#include "cuda/selected_attention/query_outer_common.cuh"

namespace sparseattn::cuda::selection {

namespace {

using namespace query_outer;

constexpr int kThreads = kTokenThreads;

// One K and one V tile per warp: 32 KB at D = 128, so seven warps fit an SM.
template <class T, int DQK, int DV>
struct FwdSmem {
  static constexpr int kKeys = kKeysOf<DQK>;
  using K = SmemTile<T, kKeys, DQK>;
  using V = SmemTile<T, kKeys, DV>;
  static constexpr std::size_t kBytes = (K::kElements + V::kElements) * sizeof(T);
};

template <class T, int DQK, int DV>
__global__ void __launch_bounds__(kThreads) selected_forward_kernel(Tokens<const T> q, Tokens<const T> k,
                                                                    Tokens<const T> v, IndexView indices,
                                                                    Tokens<T> o, LseView<float> lse, SeqPairTable seqs,
                                                                    QueryOuterConfig c) {
  if (form_not_chosen(c)) return;
  using S = FwdSmem<T, DQK, DV>;
  constexpr int kKeys = S::kKeys;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const typename S::K ks{reinterpret_cast<T*>(smem_raw)};
  const typename S::V vs{ks.base + S::K::kElements};

  const TokenTask<T, kKeys, DQK, DV> task(k, v, seqs, c);
  if (!task.valid) return;
  const auto& seq = task.seq;
  const std::int64_t row = task.row;
  const int rows_here = task.rows_here;
  auto load_k = [&](const KeyTiles<kKeys>& tile) { task.copy_k(ks, tile); };
  auto load_v = [&](const KeyTiles<kKeys>& tile) { task.copy_v(vs, tile); };
  KeyTiles<kKeys> tile = task.key_tiles(indices, c);
  bool has_tile = tile.next();
  // K and V have one buffer each, and every buffer is refilled as soon as the warp is done with it: the next
  // tile's K loads during this tile's softmax and P V, its V during its own scores (groups in order K0 V0 K1
  // V1 ...; with empty groups past the last tile, "wait until one group is pending" always means "the buffer
  // about to be read has landed").
  if (has_tile) load_k(tile);
  cp_async_commit();
  if (has_tile) load_v(tile);
  cp_async_commit();

  ForwardRows<T, DQK, DV> rows(q, seq.batch, row, task.hq0, rows_here);
  while (has_tile) {
    cp_async_wait<1>();  // K of this tile
    __syncwarp();
    float s[kKeys / 8][4] = {};
    rows.scores(s, ks);  // S = Q K^T
    const int keys = tile.keys();
    KeyTiles<kKeys> next = tile;
    const bool has_next = next.next();
    __syncwarp();  // every lane has read K
    if (has_next) load_k(next);
    cp_async_commit();

    rows.softmax(s, keys, c.scale_log2);
    cp_async_wait<1>();  // V of this tile
    __syncwarp();
    rows.product(s, vs);  // O += P V
    __syncwarp();  // every lane has read V
    if (has_next) load_v(next);
    cp_async_commit();
    tile = next;
    has_tile = has_next;
  }
  cp_async_wait<0>();

  rows.store(o, lse, seq.batch, row, task.hq0, rows_here);
}

}  // namespace

void forward_query_outer(const SelectedAttentionParams& p, const std::int32_t* chosen_form) {
  dispatch_query_outer(p, false, [&](auto tag, auto dqk_c, auto dv_c, const QueryOuterLaunch& launch) {
    using T = typename decltype(tag)::type;
    constexpr int DQK = decltype(dqk_c)::value, DV = decltype(dv_c)::value;
    const QueryOuterLaunch l = with_form(launch, chosen_form, kOneTokenForm);
    launch_forward<T>(selected_forward_kernel<T, DQK, DV>, l.grid, kThreads, FwdSmem<T, DQK, DV>::kBytes, p, l,
                      "selected_forward_kernel");
  });
}

}  // namespace sparseattn::cuda::selection
