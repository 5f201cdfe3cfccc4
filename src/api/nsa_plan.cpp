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
    check_.dtype(t, arg, dtype);
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
    check_.require(q.rank == 3, ErrorKind::shape, "q",
                   "expected 3 dimensions [N, H, D] because cu_seqlens is given, got " + q.shape_string());
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

// The sparse index convention on a CPU tensor, row by row: entries strictly ascending in
// [0, num_selection_blocks(T_b)), -1 only as tail padding. Packed rows past cu_seqlens[B] are ignored.
void check_index_contents(const Check& check, const TensorView& indices, const TokenLayout& layout,
                          const Sequences& seqs, std::int64_t sel_block) {
  const auto* data = static_cast<const std::int32_t*>(indices.data);
  const auto cu = [&](std::int64_t b) {
    return std::int64_t{static_cast<const std::int32_t*>(seqs.cu_seqlens.data)[b * seqs.cu_seqlens.stride[0]]};
  };
  const int rank = indices.rank;
  const std::int64_t heads = indices.shape[rank - 2], count = indices.shape[rank - 1];
  for (std::int64_t b = 0; b < layout.batch; ++b) {
    const std::int64_t begin = layout.packed ? cu(b) : 0;
    const std::int64_t length = layout.packed ? cu(b + 1) - begin : layout.rows;
    const std::int64_t blocks = num_selection_blocks(length, sel_block);
    for (std::int64_t t = 0; t < length; ++t) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t row = layout.packed ? (begin + t) * indices.stride[0] + h * indices.stride[1]
                                               : b * indices.stride[0] + t * indices.stride[1] + h * indices.stride[2];
        std::int64_t previous = -1;
        bool padding = false;
        for (std::int64_t j = 0; j < count; ++j) {
          const std::int64_t index = data[row + j * indices.stride[rank - 1]];
          if (index == -1) {
            padding = true;
            continue;
          }
          check.require(!padding && index > previous && index < blocks, ErrorKind::value, "block_indices",
                        "row (sequence " + std::to_string(b) + ", token " + std::to_string(t) + ", KV head " +
                            std::to_string(h) + ") entry " + std::to_string(j) + " is " + std::to_string(index) +
                            ": entries must be strictly ascending in [0, " + std::to_string(blocks) +
                            ") (the selection blocks of the sequence) with -1 only as tail padding");
          previous = index;
        }
      }
    }
  }
}

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
  plan.heads_kv = k.shape[k.rank - 2];
  check.require(plan.heads_kv > 0 && plan.heads_q % plan.heads_kv == 0, ErrorKind::shape, "k",
                "has " + std::to_string(plan.heads_kv) + " heads, which must divide the " +
                    std::to_string(plan.heads_q) + " query heads of q");
  check.shape(k, "k", layout.tokens(plan.heads_kv, plan.dim_qk));
  valid.tensor(params.v, "v", plan.dtype, q);
  plan.dim_v = params.v.shape[params.v.rank - 1];
  check.shape(params.v, "v", layout.tokens(plan.heads_kv, plan.dim_v));
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
    plan.cmp_rows = compressed_rows(check, layout, params.k_cmp, "k_cmp", config.cmp_block, config.cmp_stride);
    check.shape(params.k_cmp, "k_cmp", compressed_shape(layout, plan.cmp_rows, plan.heads_kv, plan.dim_qk));
    valid.tensor(params.v_cmp, "v_cmp", plan.dtype, q);
    check.shape(params.v_cmp, "v_cmp", compressed_shape(layout, plan.cmp_rows, plan.heads_kv, plan.dim_v));
  } else {
    plan.cmp_rows = layout.packed ? compressed_rows_bound(layout.rows, config.cmp_stride)
                                  : num_compressed_blocks(layout.rows, config.cmp_block, config.cmp_stride);
  }
  // Packed calls that use no compressed K/V need no cu_seqlens_cmp; when it is given it is checked anyway.
  if (plan.user_cmp || plan.run_compressed_attention || params.cu_seqlens_cmp.present()) {
    valid.compressed_layout(layout, params.seqs, params.cu_seqlens_cmp, plan.cmp_rows, config.cmp_block,
                            config.cmp_stride);
  }
  if (indices.present() && read_contents && indices.device == DeviceType::cpu) {
    check_index_contents(check, indices, layout, params.seqs, config.sel_block);
  }
  return plan;
}

}  // namespace sparseattn::detail
