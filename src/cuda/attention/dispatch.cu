// Host entry points of flash_attention and compressed_attention on CUDA: params -> kernel arguments, head
// dims -> template constants (the kernels are instantiated in units that CMake generates from
// instantiation.cu.in, declared in instantiations.h), the backward's workspace and head splits. A flash_attention
// call with a mask, bias, tile map, work counter or per-head windows runs the FlashTermsMask kernels
// (score_terms.cuh; FlashTermsHeadMask's with per-head windows), or, where the mask and bias depend on the key alone
// and there is no tile map, work counter or per-head window, FlashKeyTermsMask's; dbias is
// summed through the workspace (bias_gradient.h); one with a gate and none of those runs FlashGateMask's; the gate's
// copies and ddelta partials live in the workspace too (gate_gradient.h); the others run FlashMask's. No host
// synchronisation.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cuda/attention/bias_gradient.h"
#include "cuda/attention/gate_gradient.h"
#include "cuda/attention/instantiations.h"
#include "cuda/attention/ops.h"
#include "cuda/attention/score_terms_host.h"

namespace sparseattn::cuda {

using attention::AttnArgs;
using attention::CompressedMask;
using attention::FlashGateMask;
using attention::FlashKeyTermsMask;
using attention::FlashMask;
using attention::FlashTermsHeadMask;
using attention::FlashTermsMask;
using attention::i64;
using attention::Launch;
using attention::Partials;

namespace {

// The delta workspace: [B, Hq, T] or packed [Hq, N], float32, contiguous (laid out like lse).
LseView<float> delta_rows(void* workspace, const TensorView& q) {
  const i64 heads = q.shape[q.rank - 2];
  if (q.rank == 3) return {static_cast<float*>(workspace), 0, 1, q.shape[0]};
  return {static_cast<float*>(workspace), heads * q.shape[1], 1, q.shape[1]};
}


std::size_t delta_bytes(const TensorView& q) {
  const i64 rows = q.rank == 3 ? q.shape[0] : q.shape[0] * q.shape[1];
  return align_up(static_cast<std::size_t>(rows * q.shape[q.rank - 2]) * sizeof(float));
}

// Head splits of the dK/dV kernels: a CTA owns a block of keys of one KV head and loops over the queries of
// its group's heads; with causal masks the first key blocks carry the most work, and a long sequence with few
// KV heads gives few CTAs (compressed keys at T = 64K, 4 KV heads: 256 blocks of 64). Splitting the group's
// heads over CTAs balances the load, at the cost of fp32 partials (split_bytes each) and a reduction. Target:
// about 16 blocks of 64 keys per SM (the compressed backward at 64/4, T = 64K gets faster with the splits up to
// there; docs/perf/2026-11-27-measurements-from-source-comments.md), with the partials kept under
// kSplitPartialsCap.
constexpr std::size_t kSplitPartialsCap = std::size_t{128} << 20;

int dkv_head_splits(i64 group, i64 key_blocks, int multiprocessor_count, std::size_t split_bytes) {
  if (key_blocks <= 0) return 1;
  const i64 wanted = ceil_div(16 * i64{multiprocessor_count}, key_blocks);
  const i64 affordable = static_cast<i64>(kSplitPartialsCap / std::max<std::size_t>(split_bytes, 1));
  return static_cast<int>(std::clamp<i64>(std::min(wanted, affordable), 1, group));
}

// The backward workspace: delta, then (with head splits) the fp32 dK and dV partials, then (flash_attention with
// dbias) the bias gradient's fp32 contributions (bias_gradient.h), then (with a gate) the gate's fp32 copies and
// ddelta partials (gate_gradient.h).
struct BackwardWorkspace {
  int head_splits = 1;
  i64 batch = 0, rows = 0, kv_heads = 0, dqk = 0, dv = 0;  // of the partials
  std::size_t delta = 0, dk_partial = 0, dv_partial = 0, dbias = 0, gate = 0;
  std::size_t bytes() const { return delta + dk_partial + dv_partial + dbias + gate; }
  std::size_t dbias_offset() const { return delta + dk_partial + dv_partial; }
  std::size_t gate_offset() const { return dbias_offset() + dbias; }
};

// allow_head_splits: false where the bias gradient sums a group's heads in one thread (BiasGradientPlan).
BackwardWorkspace backward_workspace(const TensorView& q, const TensorView& k, const TensorView& v, const Launch& l,
                                     bool allow_head_splits = true) {
  BackwardWorkspace w;
  if (!q.present() || q.device != DeviceType::cuda || (q.rank != 3 && q.rank != 4) || k.rank != q.rank ||
      v.rank != q.rank || l.kv_heads <= 0 || l.q_heads % l.kv_heads != 0) {
    return w;
  }
  w.delta = delta_bytes(q);
  w.batch = k.rank == 3 ? 1 : k.shape[0];
  w.rows = k.shape[k.rank - 3];
  w.kv_heads = l.kv_heads;
  w.dqk = k.shape[k.rank - 1];
  w.dv = v.shape[v.rank - 1];
  const std::size_t split_bytes =
      static_cast<std::size_t>(w.batch * w.rows * w.kv_heads * (w.dqk + w.dv)) * sizeof(float);
  w.head_splits = allow_head_splits ? dkv_head_splits(l.q_heads / l.kv_heads,
                                                      ceil_div(l.max_k, 64) * l.kv_heads * l.batch,
                                                      multiprocessors(q.device_index), split_bytes)
                                    : 1;
  if (w.head_splits == 1) return w;
  const std::size_t cells = static_cast<std::size_t>(w.head_splits * w.batch * w.rows * w.kv_heads) * sizeof(float);
  w.dk_partial = align_up(cells * static_cast<std::size_t>(w.dqk));
  w.dv_partial = align_up(cells * static_cast<std::size_t>(w.dv));
  return w;
}

Partials partials_at(char* base, const BackwardWorkspace& w, i64 dim) {
  const i64 head = dim, row = w.kv_heads * head, batch = w.rows * row;
  return {reinterpret_cast<float*>(base), w.batch * batch, batch, row, head};
}

template <class T>
void set_head_splits(AttnArgs<T>& a, void* workspace, const BackwardWorkspace& w) {
  a.head_splits = w.head_splits;
  if (w.head_splits == 1) return;
  char* base = static_cast<char*>(workspace) + w.delta;
  a.dk_partial = partials_at(base, w, w.dqk);
  a.dv_partial = partials_at(base + w.dk_partial, w, w.dv);
}

template <class T>
Tokens<T> tokens_or_null(const TensorView& view) {
  if (!view.present()) return {nullptr, 0, 0, 0};
  return tokens_of<T>(view);
}

template <class T>
AttnArgs<T> args_of(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                    const TensorView& lse, const TensorView& d_o, const TensorView& dq, const TensorView& dk,
                    const TensorView& dv, void* workspace, const std::optional<double>& scale) {
  AttnArgs<T> a{};
  a.q = tokens_of<T>(q);
  a.k = tokens_of<T>(k);
  a.v = tokens_of<T>(v);
  a.o = tokens_of<T>(o);
  a.lse = lse_of<float>(lse);
  a.d_o = tokens_or_null<T>(d_o);
  a.dq = tokens_or_null<T>(dq);
  a.dk = tokens_or_null<T>(dk);
  a.dv = tokens_or_null<T>(dv);
  a.delta = workspace ? delta_rows(workspace, q) : LseView<float>{nullptr, 0, 0, 0};
  a.group = static_cast<int>(q.shape[q.rank - 2] / k.shape[k.rank - 2]);
  a.head_splits = 1;
  const double s = softmax_scale(scale, q.shape[q.rank - 1]);
  a.scale = static_cast<float>(s);
  a.scale_log2 = static_cast<float>(s * kLog2eDouble);
  return a;
}

Launch launch_of(const TensorView& q, const TensorView& k, const Sequences& seqs_q, i64 max_k, Stream stream) {
  Launch l{};
  const bool packed = q.rank == 3;
  l.batch = packed ? seqs_q.cu_seqlens.shape[0] - 1 : q.shape[0];
  l.max_q = packed ? (seqs_q.max_seqlen > 0 ? std::min<i64>(seqs_q.max_seqlen, q.shape[0]) : q.shape[0]) : q.shape[1];
  l.max_k = max_k;
  l.q_heads = q.shape[q.rank - 2];
  l.kv_heads = k.shape[k.rank - 2];
  l.rows_q = packed ? q.shape[0] : q.shape[1];
  l.batch_rows = packed ? 1 : q.shape[0];
  l.multiprocessors = multiprocessors(q.device_index);
  l.stream = static_cast<cudaStream_t>(stream);
  return l;
}

// The forward's tensors, for the tensor maps of the wgmma forward's TMA variant (launchers.cuh).
void set_forward_views(Launch& l, const TensorView& q, const TensorView& k, const TensorView& v) {
  l.q_view = &q;
  l.k_view = &k;
  l.v_view = &v;
}

// The backward's tensors, for the tensor maps of the wgmma dQ's TMA variant (launchers.cuh); without d_o, none.
void set_backward_views(Launch& l, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& d_o) {
  set_forward_views(l, q, k, v);
  l.d_o_view = d_o.present() ? &d_o : nullptr;
}

template <class T, class Mask>
void dispatch(bool forward, i64 dqk, i64 dv, const AttnArgs<T>& a, const typename Mask::Config& mc,
              const Launch& l) {
#define SPARSEATTN_ATTENTION_RUN(DQK, DV)                                                    \
  if (dqk == DQK && dv == DV) {                                                              \
    if (forward) attention::run_forward<T, DQK, DV, Mask>(a, mc, l);                         \
    else attention::run_backward<T, DQK, DV, Mask>(a, mc, l);                                \
    return;                                                                                  \
  }
  SPARSEATTN_HEAD_DIMS(SPARSEATTN_ATTENTION_RUN)
#undef SPARSEATTN_ATTENTION_RUN
  throw std::logic_error("sparseattn: attention head dims not dispatched to CUDA (the API validates this)");
}

// Flash: key lengths come from k (batched S) or cu_seqlens_k (packed; max_seqlen_k bounds them).
template <class P>
i64 flash_max_k(const P& p) {
  if (p.k.rank == 4) return p.k.shape[1];
  return p.seqs_k.max_seqlen > 0 ? std::min<i64>(p.seqs_k.max_seqlen, p.k.shape[0]) : p.k.shape[0];
}

template <class P>
SeqPairTable flash_seqs(const P& p) {
  if (p.q.rank == 4) return {{nullptr, p.q.shape[1], p.q.shape[0]}, {nullptr, p.k.shape[1], p.k.shape[0]}};
  const i64 batch = p.seqs_q.cu_seqlens.shape[0] - 1;
  return {{static_cast<const std::int32_t*>(p.seqs_q.cu_seqlens.data), 0, batch},
          {static_cast<const std::int32_t*>(p.seqs_k.cu_seqlens.data), 0, batch}};
}

FlashMask::Config flash_mask(bool causal, std::int64_t left, std::int64_t right) { return {causal, left, right}; }

// Whether a flash_attention call needs FlashTermsMask (mask, bias, tile map, work counter, bias gradient, per-head
// windows, whose dK/dV steps FlashTermsMask's step walk skips per head, or the forward's softmax threshold); a gate
// alone takes FlashGateMask.
template <class P>
bool uses_terms(const P& p) {
  return p.mask.present() || p.bias.present() || p.blocks.block_mask.present() || p.work_counter.present() ||
         p.head_windows.present() || (std::is_same_v<P, FlashAttentionParams> && p.gates.softmax_threshold);
}

// The forward's sparse-softmax threshold (score_terms.cuh): its decision map (threshold_tiles, validated by the API)
// and log2(tau); none without it.
attention::SoftmaxThreshold softmax_threshold(const FlashAttentionParams& p) {
  attention::SoftmaxThreshold t{};
  if (!p.gates.softmax_threshold || !p.threshold_tiles.present()) return t;
  t.decisions = static_cast<std::uint8_t*>(p.threshold_tiles.data);
  t.heads = p.threshold_tiles.shape[1];
  t.query_tiles = p.threshold_tiles.shape[2];
  t.key_tiles = p.threshold_tiles.shape[3];
  t.log2_tau = static_cast<float>(std::log2(*p.gates.softmax_threshold));
  return t;
}

// Clears the decision map of the threshold: the kernels write the kept pairs only.
void clear_threshold_tiles(const FlashAttentionParams& p, cudaStream_t stream) {
  const TensorView& t = p.threshold_tiles;
  const std::size_t bytes = static_cast<std::size_t>(t.shape[0] * t.shape[1] * t.shape[2] * t.shape[3]);
  if (bytes == 0) return;
  zero_async(t.data, bytes, stream, "threshold_tiles");
}

// A per-head window tensor (int32 [Hq] on the device) as the kernels read it; absent: null.
attention::HeadBounds head_bounds(const TensorView& t) {
  if (!t.present()) return {};
  return {static_cast<const std::int32_t*>(t.data), t.stride[0]};
}

FlashGateMask::Config gate_config(bool causal, std::int64_t left, std::int64_t right, const attention::GateTerms& g) {
  FlashGateMask::Config c{};
  c.causal = causal;
  c.window_left = left;
  c.window_right = right;
  c.gate = g;
  return c;
}

// FlashTermsMask's configuration of a forward or backward call.
template <class P>
FlashTermsMask::Config terms_config(const P& p) {
  FlashTermsMask::Config c{};
  c.causal = p.causal;
  c.window_left = p.window_left;
  c.window_right = p.window_right;
  const i64 q_heads = p.q.shape[p.q.rank - 2], group = q_heads / p.k.shape[p.k.rank - 2];
  attention::ScoreTerms& t = c.terms;
  t.mask = attention::broadcast_view(p.mask, q_heads, group);
  t.bias = attention::broadcast_view(p.bias, q_heads, group);
  t.rows_shared = (!p.mask.present() || t.mask.row_stride == 0) && (!p.bias.present() || t.bias.row_stride == 0);
  t.inv_scale = static_cast<float>(1.0 / softmax_scale(p.scale, p.q.shape[p.q.rank - 1]));
  t.tiles = attention::tile_map(p.blocks, q_heads, group);
  t.work_counter = p.work_counter.present() ? static_cast<unsigned long long*>(p.work_counter.data) : nullptr;
  t.gate = attention::gate_terms(p.gates);  // the backward replaces it with its fp32 copies (gate_gradient.h)
  return c;
}

// FlashTermsHeadMask's configuration: the call's FlashTermsMask configuration and its per-head bounds.
template <class P>
FlashTermsHeadMask::Config head_terms_config(const P& p, const FlashTermsMask::Config& c) {
  FlashTermsHeadMask::Config h{};
  static_cast<FlashTermsMask::Config&>(h) = c;
  h.head_left = head_bounds(p.head_windows.left);
  h.head_right = head_bounds(p.head_windows.right);
  return h;
}

// Whether a call with terms takes them all by key (FlashKeyTermsMask): neither its mask nor its bias has query rows
// (its bias gradient is then a key sum, bias_gradient.h), and it has no tile map, no work counter and no per-head
// windows (FlashKeyTermsMask's bounds are the scalar window's).
template <class P>
bool takes_key_terms(const P& p, const FlashTermsMask::Config& c) {
  return c.terms.rows_shared && !p.blocks.block_mask.present() && !p.work_counter.present() &&
         !p.head_windows.present() && c.terms.threshold.decisions == nullptr;
}

FlashKeyTermsMask::Config key_terms_config(const FlashTermsMask::Config& c) {
  FlashKeyTermsMask::Config k{};
  static_cast<FlashMask::Config&>(k) = c;
  k.terms = c.terms;
  return k;
}

// Compressed: key j of sequence b is row cu_seqlens_cmp[b] + j (packed) or j of Tc (batched).
template <class P>
SeqPairTable compressed_seqs(const P& p) {
  if (p.q.rank == 4) return {{nullptr, p.q.shape[1], p.q.shape[0]}, {nullptr, p.k_cmp.shape[1], p.k_cmp.shape[0]}};
  const i64 batch = p.seqs.cu_seqlens.shape[0] - 1;
  return {{static_cast<const std::int32_t*>(p.seqs.cu_seqlens.data), 0, batch},
          {static_cast<const std::int32_t*>(p.cu_seqlens_cmp.data), 0, batch}};
}

// An upper bound of every sequence's compressed key count: a packed query chunk's keys outnumber its queries, so
// its bound comes from max_seqlen_k when given, else from the compressed rows.
template <class P>
i64 compressed_max_k(const P& p, i64 max_q) {
  if (p.q.rank == 4) return p.k_cmp.shape[1];
  if (p.seqs_k.cu_seqlens.present()) {
    if (p.seqs_k.max_seqlen <= 0) return p.k_cmp.shape[0];
    return std::min<i64>(num_compressed_blocks(p.seqs_k.max_seqlen, p.block, p.stride), p.k_cmp.shape[0]);
  }
  return std::min<i64>(num_compressed_blocks(max_q, p.block, p.stride), p.k_cmp.shape[0]);
}

// The mask of a call: a batched query chunk's queries sit seqlen_k - T key positions further; a packed chunk's
// sequences each by their own count, read on the device (bind_mask).
template <class P>
CompressedMask::Config compressed_mask(const P& p) {
  const i64 offset = p.q.rank == 4 && p.seqlen_k > 0 ? p.seqlen_k - p.q.shape[1] : 0;
  const auto* cu_seqlens_k =
      p.q.rank == 3 && p.seqs_k.cu_seqlens.present() ? static_cast<const std::int32_t*>(p.seqs_k.cu_seqlens.data)
                                                     : nullptr;
  return {p.block, p.stride, offset, cu_seqlens_k};
}

}  // namespace

void flash_attention(const FlashAttentionParams& p) {
  const DeviceGuard device(p.q.device_index);
  Launch l = launch_of(p.q, p.k, p.seqs_q, flash_max_k(p), p.stream);
  set_forward_views(l, p.q, p.k, p.v);
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    AttnArgs<T> a = args_of<T>(p.q, p.k, p.v, p.o, p.lse, {}, {}, {}, {}, nullptr, p.scale);
    a.seqs = flash_seqs(p);
    const i64 dqk = p.q.shape[p.q.rank - 1], dv = p.v.shape[p.v.rank - 1];
    if (uses_terms(p)) {
      FlashTermsMask::Config config = terms_config(p);
      config.terms.threshold = softmax_threshold(p);
      if (config.terms.threshold.decisions != nullptr) clear_threshold_tiles(p, l.stream);
      if (takes_key_terms(p, config)) {
        dispatch<T, FlashKeyTermsMask>(true, dqk, dv, a, key_terms_config(config), l);
      } else if (p.head_windows.present()) {
        dispatch<T, FlashTermsHeadMask>(true, dqk, dv, a, head_terms_config(p, config), l);
      } else {
        dispatch<T, FlashTermsMask>(true, dqk, dv, a, config, l);
      }
    } else if (p.gates.alpha.present()) {
      dispatch<T, FlashGateMask>(true, dqk, dv, a,
                                 gate_config(p.causal, p.window_left, p.window_right, attention::gate_terms(p.gates)),
                                 l);
    } else {
      dispatch<T, FlashMask>(true, dqk, dv, a, flash_mask(p.causal, p.window_left, p.window_right), l);
    }
  });
}

FlashThresholdTiles flash_attention_threshold_tiles(const FlashAttentionParams& p) {
  const DeviceGuard device(p.q.device_index);
  const i64 dqk = p.q.shape[p.q.rank - 1], dv = p.v.shape[p.v.rank - 1];
  FlashThresholdTiles tiles;
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
#define SPARSEATTN_THRESHOLD_TILES(DQK, DV)                                          \
  if (dqk == DQK && dv == DV) {                                                      \
    const attention::ForwardTiles f = attention::forward_tiles<T, DQK, DV, FlashTermsMask>(); \
    tiles.block_q = f.rows;                                                          \
    tiles.block_k = f.keys;                                                          \
  }
    SPARSEATTN_HEAD_DIMS(SPARSEATTN_THRESHOLD_TILES)
#undef SPARSEATTN_THRESHOLD_TILES
  });
  return tiles;
}

namespace {

// The backward workspace of a flash_attention call, with its bias gradient's and gate's slices.
BackwardWorkspace flash_backward_workspace(const FlashAttentionBackwardParams& p, const Launch& l,
                                           const BiasGradientPlan& plan) {
  BackwardWorkspace w = backward_workspace(p.q, p.k, p.v, l, !plan.single_head_split);
  if (plan.present) w.dbias = align_up(plan.bytes);
  w.gate = gate_gradient_plan(p, w.head_splits).bytes();
  return w;
}

}  // namespace

std::size_t flash_attention_backward_workspace_size(const FlashAttentionBackwardParams& p) {
  if (!p.q.present() || !p.k.present() || p.k.rank != p.q.rank) return 0;
  const Launch l = launch_of(p.q, p.k, p.seqs_q, flash_max_k(p), p.stream);
  return flash_backward_workspace(p, l, bias_gradient_plan(p)).bytes();
}

void flash_attention_backward(const FlashAttentionBackwardParams& p, const detail::BranchBackwardOptions& options) {
  const DeviceGuard device(p.q.device_index);
  Launch l = launch_of(p.q, p.k, p.seqs_q, flash_max_k(p), p.stream);
  l.delta_given = options.delta.present();
  set_backward_views(l, p.q, p.k, p.v, p.d_o);
  const BiasGradientPlan plan = bias_gradient_plan(p);
  const BackwardWorkspace workspace = flash_backward_workspace(p, l, plan);
  float* dbias_workspace =
      plan.present ? reinterpret_cast<float*>(static_cast<char*>(p.workspace) + workspace.dbias_offset()) : nullptr;
  const GateGradientPlan gate_plan = gate_gradient_plan(p, workspace.head_splits);
  void* gate_workspace = static_cast<char*>(p.workspace) + workspace.gate_offset();
  prepare_gate_copies(p, gate_plan, gate_workspace, l.stream);
  if (plan.present) {
    // Entries no kernel writes (keys or query tiles no step visits) add 0.
    zero_async(dbias_workspace, plan.bytes, l.stream, "the bias gradient's workspace");
  }
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    AttnArgs<T> a = args_of<T>(p.q, p.k, p.v, p.o, p.lse, p.d_o, p.dq, p.dk, p.dv, p.workspace, p.scale);
    if (l.delta_given) a.delta = lse_of<float>(options.delta);
    if (options.d_o_scale.present()) a.d_o_scale = lse_of<float>(options.d_o_scale);
    a.accumulate_dq = options.accumulate_dq;
    set_head_splits(a, p.workspace, workspace);
    a.seqs = flash_seqs(p);
    const i64 dqk = p.q.shape[p.q.rank - 1], dv = p.v.shape[p.v.rank - 1];
    if (uses_terms(p)) {
      FlashTermsMask::Config config = terms_config(p);
      config.terms.dbias = plan.sink(dbias_workspace);
      config.terms.gate = gate_plan.terms(p, gate_workspace);
      if (takes_key_terms(p, config)) {
        dispatch<T, FlashKeyTermsMask>(false, dqk, dv, a, key_terms_config(config), l);
      } else if (p.head_windows.present()) {
        dispatch<T, FlashTermsHeadMask>(false, dqk, dv, a, head_terms_config(p, config), l);
      } else {
        dispatch<T, FlashTermsMask>(false, dqk, dv, a, config, l);
      }
    } else if (gate_plan.present) {
      const attention::GateTerms gate = gate_plan.terms(p, gate_workspace);
      dispatch<T, FlashGateMask>(false, dqk, dv, a, gate_config(p.causal, p.window_left, p.window_right, gate), l);
    } else {
      dispatch<T, FlashMask>(false, dqk, dv, a, flash_mask(p.causal, p.window_left, p.window_right), l);
    }
  });
  if (plan.present) reduce_bias_gradient(p, plan, dbias_workspace, l.stream);
  reduce_gate_gradient(p, gate_plan, gate_workspace, flash_seqs(p).k, l.max_k, l.stream);
}

void compressed_attention(const CompressedAttentionParams& p) {
  const DeviceGuard device(p.q.device_index);
  Launch l = launch_of(p.q, p.k_cmp, p.seqs, 0, p.stream);
  l.max_k = compressed_max_k(p, l.max_q);
  set_forward_views(l, p.q, p.k_cmp, p.v_cmp);
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    AttnArgs<T> a = args_of<T>(p.q, p.k_cmp, p.v_cmp, p.o, p.lse, {}, {}, {}, {}, nullptr, p.scale);
    a.seqs = compressed_seqs(p);
    dispatch<T, CompressedMask>(true, p.q.shape[p.q.rank - 1], p.v_cmp.shape[p.v_cmp.rank - 1], a,
                                compressed_mask(p), l);
  });
}

std::size_t compressed_attention_backward_workspace_size(const CompressedAttentionBackwardParams& p) {
  if (!p.q.present() || !p.k_cmp.present() || p.k_cmp.rank != p.q.rank) return 0;
  Launch l = launch_of(p.q, p.k_cmp, p.seqs, 0, p.stream);
  l.max_k = compressed_max_k(p, l.max_q);
  return backward_workspace(p.q, p.k_cmp, p.v_cmp, l).bytes();
}

void compressed_attention_backward(const CompressedAttentionBackwardParams& p,
                                   const detail::BranchBackwardOptions& options) {
  const DeviceGuard device(p.q.device_index);
  Launch l = launch_of(p.q, p.k_cmp, p.seqs, 0, p.stream);
  l.max_k = compressed_max_k(p, l.max_q);
  l.delta_given = options.delta.present();
  set_backward_views(l, p.q, p.k_cmp, p.v_cmp, p.d_o);
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    AttnArgs<T> a = args_of<T>(p.q, p.k_cmp, p.v_cmp, p.o, p.lse, p.d_o, p.dq, p.dk_cmp, p.dv_cmp, p.workspace,
                               p.scale);
    if (l.delta_given) a.delta = lse_of<float>(options.delta);
    if (options.d_o_scale.present()) a.d_o_scale = lse_of<float>(options.d_o_scale);
    a.accumulate_dq = options.accumulate_dq;
    set_head_splits(a, p.workspace, backward_workspace(p.q, p.k_cmp, p.v_cmp, l));
    a.seqs = compressed_seqs(p);
    dispatch<T, CompressedMask>(false, p.q.shape[p.q.rank - 1], p.v_cmp.shape[p.v_cmp.rank - 1], a,
                                compressed_mask(p), l);
  });
}

}  // namespace sparseattn::cuda
