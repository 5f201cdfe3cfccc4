// The query-outer forward and dQ whose form is chosen on the device (forward_plan.h, ForwardPath::query_adaptive;
// backward_plan.h, DqForm::adaptive): a sampling kernel walks the index lists of groups of kGroupTokens consecutive
// tokens, counts the distinct blocks they chose against their visible entries and writes the form that pays
// (group_sharing.h) to the workspace; then both forms are launched, and every CTA of the one not chosen returns at
// once (form_not_chosen). No host synchronisation: the choice stays on the stream, and the same calls replay under
// CUDA graphs.
#include <cstdint>

#include "cuda/selected_attention/group_sharing.h"
#include "cuda/selected_attention/launchers.h"
#include "cuda/selected_attention/query_outer_common.cuh"

namespace sparseattn::cuda::selection {

namespace {

using namespace query_outer;

// kSamplingCtas CTAs of kSamplingWarps warps, each warp walking kSamplesPerWarp groups: 512 groups, spread evenly
// over the group forward's grid.
constexpr int kSamplingCtas = 32, kSamplingWarps = 8, kSamplesPerWarp = 2;
constexpr std::int64_t kSamples = std::int64_t{kSamplingCtas} * kSamplingWarps * kSamplesPerWarp;

// The workspace: the chosen form, the count of CTAs done, then each CTA's (distinct, entries).
struct SamplingWords {
  std::int32_t form;
  std::int32_t done;
  std::uint32_t partial[kSamplingCtas][2];
};
static_assert(sizeof(SamplingWords) <= kAdaptiveWorkspaceBytes, "forward_plan.h sizes the workspace");

// By one warp: the distinct blocks and visible entries of `tokens` lists (num_idx entries, `stride` apart) of
// consecutive tokens whose first sits at key position first_pos. Lane i < tokens follows list i; each step takes the
// smallest block at the lanes' heads (one distinct block) and moves on the lanes that hold it, as the group forms'
// walk does (query_group_common.cuh, GroupTiles), here over the index's rows in global memory. An entry is visible where it is a block (>= 0, before its list's
// first -1) that starts at or before its token's position.
__device__ __forceinline__ void walk_group(const std::int32_t* lists, std::int64_t stride, int tokens,
                                           std::int64_t num_idx, std::int64_t block, std::int64_t first_pos,
                                           std::uint32_t& distinct, std::uint32_t& entries) {
  constexpr int kNone = 0x7fffffff;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int32_t* list = lists + min(lane, tokens - 1) * stride;
  std::int64_t pos = lane < tokens ? -1 : num_idx;
  int head = kNone;
  const auto advance = [&] {
    head = kNone;
    while (++pos < num_idx) {
      const std::int32_t b = list[pos];
      if (b < 0) break;
      if (std::int64_t{b} * block <= first_pos + lane) {
        head = b;
        return;
      }
    }
    pos = num_idx;
  };
  advance();
  for (;;) {
    const int b = __reduce_min_sync(0xffffffffu, head);
    if (b == kNone) break;
    ++distinct;
    const bool holds = head == b;
    entries += __popc(__ballot_sync(0xffffffffu, holds));
    if (holds) advance();
  }
}

// grid: the group forward's grid (group_grid), whose CTA (x, y, z) takes tokens 8x .. 8x + 7 of sequence z and the
// KV head of head chunk y.
__global__ void __launch_bounds__(32 * kSamplingWarps)
    choose_group_form_kernel(IndexView indices, SeqPairTable seqs, QueryOuterConfig c, dim3 grid,
                             SamplingWords* words) {
  __shared__ std::uint32_t sums[2];
  if (threadIdx.x == 0) sums[0] = sums[1] = 0;
  __syncthreads();
  const std::int64_t gx = grid.x, gy = grid.y, total = gx * gy * grid.z;
  const std::int64_t samples = min(total, kSamples);
  const int warp = static_cast<int>(threadIdx.x / 32);
  std::uint32_t distinct = 0, entries = 0;
  for (int i = 0; i < kSamplesPerWarp; ++i) {
    const std::int64_t sample = (std::int64_t{blockIdx.x} * kSamplingWarps + warp) * kSamplesPerWarp + i;
    if (sample >= samples) break;
    const std::int64_t id = sample * total / samples;
    const std::int64_t x = id % gx, y = id / gx % gy, z = id / (gx * gy);
    const SeqPairTable::Seq pair = seqs[z];
    const std::int64_t t0 = x * kGroupTokens;
    if (t0 >= pair.T) continue;
    const int tokens = static_cast<int>(min(std::int64_t{kGroupTokens}, pair.T - t0));
    walk_group(indices.row(pair.batch, pair.q_begin + t0, y / c.chunks), indices.row_stride, tokens, c.num_idx,
               c.block, t0 + pair.S - pair.T, distinct, entries);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums[0], distinct);
    atomicAdd(&sums[1], entries);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    words->partial[blockIdx.x][0] = sums[0];
    words->partial[blockIdx.x][1] = sums[1];
  }
  __shared__ int last;
  if (!last_to_arrive(&words->done, static_cast<int>(gridDim.x), last) || threadIdx.x != 0) return;
  std::int64_t all_distinct = 0, all_entries = 0;
  for (unsigned b = 0; b < gridDim.x; ++b) {
    all_distinct += __ldcg(&words->partial[b][0]);
    all_entries += __ldcg(&words->partial[b][1]);
  }
  words->form = group_form_pays(all_distinct, all_entries) ? kGroupForm : kOneTokenForm;
}

// Enqueues the choice for the query-outer launch `l` over `indices` into `workspace`; returns the word of the form.
const std::int32_t* choose_form(const QueryOuterLaunch& l, const TensorView& indices, void* workspace,
                                void* stream_handle) {
  auto* words = static_cast<SamplingWords*>(workspace);
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  zero_async(&words->done, sizeof(words->done), stream, "the form choice's CTA count");
  choose_group_form_kernel<<<kSamplingCtas, 32 * kSamplingWarps, 0, stream>>>(index_of(indices), l.table, l.config,
                                                                              group_grid(l.grid), words);
  check_launch("choose_group_form_kernel");
  return &words->form;
}

}  // namespace

void forward_query_adaptive(const SelectedAttentionParams& p) {
  const QueryOuterLaunch l = launch_of(p.q, p.k, p.v, p.indices, p.seqs, p.seqs_k, p.block, p.scale, false);
  if (l.empty) return;
  const std::int32_t* form = choose_form(l, p.indices, p.workspace, p.stream);
  forward_query_group(p, form);
  forward_query_outer(p, form);
}

void dq_query_adaptive(const SelectedAttentionBackwardParams& p, const LseView<const float>& delta,
                       const LseView<const float>& p_scale, bool accumulate_dq, void* workspace) {
  const QueryOuterLaunch l =
      launch_of(p.q, p.k, p.v, p.indices, p.seqs, p.seqs_k, p.block, p.scale, accumulate_dq);
  if (l.empty) return;
  const std::int32_t* form = choose_form(l, p.indices, workspace, p.stream);
  dq_query_group(p, delta, p_scale, accumulate_dq, form);
  dq_query_outer(p, delta, p_scale, accumulate_dq, form);
}

}  // namespace sparseattn::cuda::selection
