#include "api/nsa_plan.h"

#include <string>
#include <vector>

#include "api/block_checks.h"

namespace sparseattn::detail {

namespace {

const char* const kGate[kNumBranches] = {"g_cmp", "g_slc", "g_swa"};

// The checks whose full form reads data: with read_contents false (the size queries, shape-only views)
// they check everything but data pointers and the contents of index tensors.
class Validator {
 public:
  Validator(const Check& check, bool read_contents) : check_(check), read_(read_contents) {}

  void present(const TensorView& t, const std::string& arg) const {
    if (read_) return check_.present(t, arg);
    check_.require(t.present(), ErrorKind::shape, arg, "is required but was not given");
    for (int i = 0; i < t.rank; ++i) {
      check_.require(t.shape[i] >= 0, ErrorKind::shape, arg, "has a negative size " + t.shape_string());
    }
  }

  void tensor(const TensorView& t, const std::string& arg, DType dtype, const TensorView& q) const {
    present(t, arg);
    check_.dtype(t, arg, dtype, q, "q");
    check_.same_device(t, arg, q, "q");
    check_.inner_contiguous(t, arg);
  }

  TokenLayout layout(const TensorView& q, const Sequences& seqs) const {
    if (read_) return check_.layout(q, "q", seqs, "cu_seqlens");
    present(q, "q");
    const TensorView& cu = seqs.cu_seqlens;
    TokenLayout layout;
    layout.packed = cu.present();
    if (!layout.packed) {
      check_.require(q.rank == 4, ErrorKind::shape, "q",
                     "expected 4 dimensions [B, T, H, D] (or 3 dimensions [N, H, D] with cu_seqlens), got " +
                         q.shape_string());
      layout.batch = q.shape[0];
      layout.rows = q.shape[1];
      return layout;
    }
    check_.packed_rank(q, "q", "cu_seqlens");
    present(cu, "cu_seqlens");
    check_.dtype(cu, "cu_seqlens", DType::int32);
    check_.same_device(cu, "cu_seqlens", q, "q");
    check_.require(cu.rank == 1 && cu.shape[0] >= 1, ErrorKind::shape, "cu_seqlens",
                   "expected shape [B+1], got " + cu.shape_string());
    check_.require(seqs.max_seqlen >= 0, ErrorKind::config, "cu_seqlens max_seqlen",
                   "expected >= 0, got " + std::to_string(seqs.max_seqlen));
    layout.batch = cu.shape[0] - 1;
    layout.rows = q.shape[0];
    return layout;
  }

  void compressed_layout(const TokenLayout& layout, const Sequences& seqs, const TensorView& cu_cmp,
                         std::int64_t rows, std::int64_t block, std::int64_t stride) const {
    if (read_) return check_.compressed_layout(layout, seqs, cu_cmp, rows, block, stride);
    if (!layout.packed) return check_.absent(cu_cmp, "cu_seqlens_cmp", "with the batched layout");
    present(cu_cmp, "cu_seqlens_cmp");
    check_.dtype(cu_cmp, "cu_seqlens_cmp", DType::int32);
    check_.same_device(cu_cmp, "cu_seqlens_cmp", seqs.cu_seqlens, "cu_seqlens");
    check_.shape(cu_cmp, "cu_seqlens_cmp", {layout.batch + 1});
  }

 private:
  const Check& check_;
  bool read_;
};


}  // namespace

NsaPlan plan_nsa(const Check& check, const NsaParams& params, bool read_contents) {
  const Validator valid(check, read_contents);
  const NsaConfig& config = params.config;
  check_selection_config(check, {config.cmp_block, config.cmp_stride, config.sel_block, config.num_selected,
                                 config.num_init, config.num_local});
  check.require(config.window >= 1, ErrorKind::config, "window",
                "expected a width >= 1 (the query included), got " + std::to_string(config.window));

  NsaPlan plan;
  const TensorView& q = params.q;
  plan.layout = valid.layout(q, params.seqs);
  const TokenLayout& layout = plan.layout;
  check.floating(q, "q");
  check.inner_contiguous(q, "q");
  plan.dtype = q.dtype;
  plan.lse_dtype = lse_dtype(q.dtype);
  plan.device = q.device;
  plan.device_index = q.device_index;
  plan.heads_q = q.shape[q.rank - 2];
  plan.dim_qk = q.shape[q.rank - 1];
  check.require(plan.heads_q > 0 && plan.dim_qk > 0, ErrorKind::shape, "q",
                "needs at least one head and a positive head dim, got " + q.shape_string());
  resolve_scale(check, config.scale, plan.dim_qk);

  const TensorView& k = params.k;
  valid.tensor(k, "k", plan.dtype, q);
  check.require(k.rank == q.rank, ErrorKind::shape, "k",
                "expected " + std::to_string(q.rank) + " dimensions like q, got " + k.shape_string());
  plan.keys = chunk_keys(check, layout, params.seqs, params.seqs_k, k, "k", read_contents);
  const TokenLayout& key_layout = plan.keys.layout;
  plan.heads_kv = k.shape[k.rank - 2];
  check.require(plan.heads_kv > 0 && plan.heads_q % plan.heads_kv == 0, ErrorKind::shape, "k",
                "has " + std::to_string(plan.heads_kv) + " heads, which must divide the " +
                    std::to_string(plan.heads_q) + " query heads of q");
  check.shape(k, "k", key_layout.tokens(plan.heads_kv, plan.dim_qk));
  valid.tensor(params.v, "v", plan.dtype, q);
  plan.dim_v = params.v.shape[params.v.rank - 1];
  check.shape(params.v, "v", key_layout.tokens(plan.heads_kv, plan.dim_v));
  valid.tensor(params.o, "o", plan.dtype, q);
  check.shape(params.o, "o", layout.tokens(plan.heads_q, plan.dim_v));
  for (int i = 0; i < kNumBranches; ++i) {
    plan.branch[i] = params.gates[i].present();
    if (!plan.branch[i]) continue;
    valid.tensor(params.gates[i], kGate[i], plan.dtype, q);
    check.shape(params.gates[i], kGate[i], layout.per_head(plan.heads_q));
  }
  check.require(plan.branch[0] || plan.branch[1] || plan.branch[2], ErrorKind::config, "gates",
                "at least one branch gate (g_cmp, g_slc or g_swa) must be given");

  const TensorView& indices = params.block_indices;
  if (indices.present()) {
    check.require(plan.branch[1], ErrorKind::config, "block_indices",
                  "is given but g_slc is not (the selected branch is skipped)");
    valid.tensor(indices, "block_indices", DType::int32, q);
    check.require(indices.rank == q.rank && indices.shape[indices.rank - 1] >= 1, ErrorKind::shape, "block_indices",
                  "expected [B, T, Hkv, n] or packed [N, Hkv, n] with n >= 1, got " + indices.shape_string());
    plan.num_selected = indices.shape[indices.rank - 1];
    check.shape(indices, "block_indices", layout.tokens(plan.heads_kv, plan.num_selected));
  } else {
    plan.num_selected = config.num_selected;
  }

  check.require(params.k_cmp.present() == params.v_cmp.present(), ErrorKind::config,
                params.k_cmp.present() ? "v_cmp" : "k_cmp",
                "k_cmp and v_cmp must be given together (user-supplied compression) or not at all");
  plan.user_cmp = params.k_cmp.present();
  plan.run_selection = plan.branch[1] && !indices.present();
  plan.run_compressed_attention = plan.branch[0] || plan.run_selection;
  plan.run_compression = plan.run_compressed_attention && !plan.user_cmp;
  if (plan.user_cmp) {
    valid.tensor(params.k_cmp, "k_cmp", plan.dtype, q);
    plan.cmp_rows =
        compressed_rows(check, key_layout, params.k_cmp, "k_cmp", config.cmp_block, config.cmp_stride);
    check.shape(params.k_cmp, "k_cmp", compressed_shape(key_layout, plan.cmp_rows, plan.heads_kv, plan.dim_qk));
    valid.tensor(params.v_cmp, "v_cmp", plan.dtype, q);
    check.shape(params.v_cmp, "v_cmp", compressed_shape(key_layout, plan.cmp_rows, plan.heads_kv, plan.dim_v));
  } else {
    plan.cmp_rows = key_layout.packed ? compressed_rows_bound(key_layout.rows, config.cmp_stride)
                                      : num_compressed_blocks(key_layout.rows, config.cmp_block, config.cmp_stride);
  }
  // Packed calls that use no compressed K/V need no cu_seqlens_cmp; when it is given it is checked anyway.
  if (plan.user_cmp || plan.run_compressed_attention || params.cu_seqlens_cmp.present()) {
    valid.compressed_layout(key_layout, plan.keys.seqs, params.cu_seqlens_cmp, plan.cmp_rows, config.cmp_block,
                            config.cmp_stride);
  }
  plan.recompute = params.recompute;
  check.require(plan.recompute == NsaRecompute::none || plan.recompute == NsaRecompute::branches ||
                    plan.recompute == NsaRecompute::selected_and_window,
                ErrorKind::config, "recompute",
                "expected NsaRecompute::none, branches or selected_and_window, got " +
                    std::to_string(static_cast<int>(plan.recompute)));
  for (int i = 0; i < kNumBranches; ++i) {
    const bool mode_recomputes = plan.recompute == NsaRecompute::branches ||
                                 (plan.recompute == NsaRecompute::selected_and_window && i != 0);
    plan.recompute_output[i] = plan.branch[i] && mode_recomputes;
    plan.recomputes = plan.recomputes || plan.recompute_output[i];
    if (plan.recompute_output[i] && !layout.packed) plan.output_in_o = i;
  }
  plan.outputs_in_dq = plan.recomputes && plan.device == DeviceType::cuda && plan.dim_qk >= plan.dim_v;
  if (indices.present() && read_contents && indices.device == DeviceType::cpu) {
    check.index_contents(indices, "block_indices", layout, params.seqs, key_layout, plan.keys.seqs,
                         config.sel_block);
  }
  return plan;
}

}  // namespace sparseattn::detail
