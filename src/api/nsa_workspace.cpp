#include <cstdint>
#include <vector>

#include "api/block_checks.h"
#include "api/nsa_plan.h"

namespace sparseattn::detail {

namespace {

constexpr std::size_t kAlignment = 256;

// Hands out consecutive slices at 256-byte offsets from the base as contiguous views on the plan's
// device. Offsets are relative to the base, not to addresses, so the layout (and every byte the forward
// writes) is the same wherever the buffer lives.
class Carver {
 public:
  Carver(const NsaPlan& plan, void* base) : plan_(plan), base_(static_cast<char*>(base)) {}

  TensorView take(DType dtype, const std::vector<std::int64_t>& shape) {
    TensorView t;
    t.dtype = dtype;
    t.device = plan_.device;
    t.device_index = plan_.device_index;
    t.rank = static_cast<int>(shape.size());
    std::int64_t elements = 1;
    for (int i = t.rank - 1; i >= 0; --i) {
      t.shape[i] = shape[i];
      t.stride[i] = elements;
      elements *= shape[i];
    }
    t.data = base_ == nullptr ? nullptr : base_ + offset_;
    const std::size_t bytes = static_cast<std::size_t>(elements) * element_size(dtype);
    const std::size_t end = offset_ + bytes;
    offset_ += (bytes + kAlignment - 1) / kAlignment * kAlignment;
    if (offset_ > end) padding_.push_back(bytes_at(end, offset_ - end));
    return t;
  }

  // A view of the shape with no bytes (data null): a buffer that lives elsewhere, for sizing.
  TensorView shape_only(DType dtype, const std::vector<std::int64_t>& shape) const {
    Carver sizing(plan_, nullptr);
    return sizing.take(dtype, shape);
  }

  // The bytes [offset, offset + bytes) as a float16 view (bytes even: every slice holds 2- or 4-byte
  // elements): rows of 256 bytes where they divide it (a 16-byte vector per thread when it is zeroed), else
  // one row.
  TensorView bytes_at(std::size_t offset, std::size_t bytes) const {
    TensorView t;
    t.dtype = DType::float16;
    t.device = plan_.device;
    t.device_index = plan_.device_index;
    t.rank = 2;
    const bool rows = bytes % kAlignment == 0;
    t.shape[0] = rows ? static_cast<std::int64_t>(bytes / kAlignment) : 1;
    t.shape[1] = static_cast<std::int64_t>(rows ? kAlignment / 2 : bytes / 2);
    t.stride[0] = t.shape[1];
    t.stride[1] = 1;
    t.data = base_ == nullptr ? nullptr : base_ + offset;
    return t;
  }

  std::size_t bytes() const { return offset_; }
  std::vector<TensorView> take_padding() { return std::move(padding_); }

 private:
  const NsaPlan& plan_;
  char* base_ = nullptr;
  std::size_t offset_ = 0;
  std::vector<TensorView> padding_;  // the alignment gaps after the slices
};

}  // namespace

NsaWorkspace nsa_workspace(const NsaPlan& plan, void* base, std::size_t step_workspace_bytes, void* scratch,
                           const TensorView& o) {
  Carver carve(plan, base);    // the workspace: what the backward reads
  Carver temp(plan, scratch);  // the forward's scratch: what only the forward reads
  const TokenLayout& layout = plan.layout;
  const bool keep_all = plan.recompute == NsaRecompute::none;
  NsaWorkspace ws;
  if (plan.run_compression) {
    // The backward reads the pooled K/V in the compressed branch's backward (and its recomputation).
    Carver& pooled = keep_all || plan.branch[0] ? carve : temp;
    ws.k_cmp = pooled.take(plan.dtype, compressed_shape(plan.keys.layout, plan.cmp_rows, plan.heads_kv, plan.dim_qk));
    ws.v_cmp = pooled.take(plan.dtype, compressed_shape(plan.keys.layout, plan.cmp_rows, plan.heads_kv, plan.dim_v));
  }
  for (int i = 0; i < kNumBranches; ++i) {
    if (i == 0 ? !plan.run_compressed_attention : !plan.branch[i]) continue;
    // Kept: what the backward reads (a compressed output that serves selection only is not read).
    if (keep_all || (plan.branch[i] && !plan.recompute_output[i])) {
      ws.o[i] = carve.take(plan.dtype, layout.tokens(plan.heads_q, plan.dim_v));
    } else if (i == plan.output_in_o) {
      ws.o[i] = o;
    } else {
      ws.o[i] = temp.take(plan.dtype, layout.tokens(plan.heads_q, plan.dim_v));
    }
    // Without the compressed branch its log-sum-exp serves block selection only.
    ws.lse[i] = (keep_all || plan.branch[i] ? carve : temp).take(plan.lse_dtype, layout.lse(plan.heads_q));
  }
  if (plan.run_selection) ws.indices = carve.take(DType::int32, layout.tokens(plan.heads_kv, plan.num_selected));
  if (layout.packed) {
    ws.combined = (keep_all ? carve : temp).take(plan.dtype, layout.tokens(plan.heads_q, plan.dim_v));
  }
  if (step_workspace_bytes > 0) {
    // The steps that use it (select_blocks, selected_attention) run before the sliding window writes its
    // output, so that slice holds it when it fits: the workspace kept for the backward does not grow.
    const TensorView& window = ws.o[2];
    const bool fits = window.present() && window.numel() * element_size(window.dtype) >= step_workspace_bytes;
    if (fits) {
      ws.step_workspace = window;
    } else {
      ws.step_workspace = temp.take(DType::boolean, {static_cast<std::int64_t>(step_workspace_bytes)});
    }
    ws.step_workspace.dtype = DType::boolean;
    ws.step_workspace.rank = 1;
    ws.step_workspace.shape[0] = static_cast<std::int64_t>(step_workspace_bytes);
    ws.step_workspace.stride[0] = 1;
  }
  ws.unwritten = carve.take_padding();
  ws.bytes = carve.bytes();
  ws.whole = carve.bytes_at(0, ws.bytes);
  ws.scratch_bytes = temp.bytes();
  return ws;
}

NsaScratch nsa_scratch(const NsaPlan& plan, void* base, std::size_t branch_workspace_bytes) {
  Carver carve(plan, base);
  const TokenLayout& layout = plan.layout;
  NsaScratch scratch;
  const bool pooled_cmp = plan.branch[0] && !plan.user_cmp;
  if (pooled_cmp) {
    scratch.dk_cmp =
        carve.take(plan.dtype, compressed_shape(plan.keys.layout, plan.cmp_rows, plan.heads_kv, plan.dim_qk));
    scratch.dv_cmp =
        carve.take(plan.dtype, compressed_shape(plan.keys.layout, plan.cmp_rows, plan.heads_kv, plan.dim_v));
  }
  const bool cuda = plan.device == DeviceType::cuda;
  if (!cuda) scratch.d_o = carve.take(plan.dtype, layout.tokens(plan.heads_q, plan.dim_v));
  int last = kNumBranches - 1;
  while (!plan.branch[last]) --last;  // the plan has at least one branch
  for (int i = 0; i < kNumBranches; ++i) {
    if (!plan.branch[i]) continue;
    if (layout.packed) scratch.d_gates[i] = carve.take(plan.dtype, layout.per_head(plan.heads_q));
    if (cuda) {
      scratch.deltas[i] = carve.take(DType::float32, layout.lse(plan.heads_q));
      scratch.d_o_scales[i] = carve.take(DType::float32, layout.lse(plan.heads_q));
    }
    // On CUDA the branches add their dq in place (branch_backward.h); the CPU reference sums buffers.
    if (i != last && !cuda) {
      scratch.dq[i] = carve.take(plan.dtype, layout.tokens(plan.heads_q, plan.dim_qk));
    }
    if (i == 0) continue;  // the pooling's gradient goes straight into dk/dv (compress_kv_backward_adding)
    const std::vector<std::int64_t> k_shape = plan.keys.layout.tokens(plan.heads_kv, plan.dim_qk);
    const std::vector<std::int64_t> v_shape = plan.keys.layout.tokens(plan.heads_kv, plan.dim_v);
    if (cuda && i == last) {  // this branch writes the caller's dk/dv (NsaScratch::kv_direct)
      scratch.kv_direct = i;
      scratch.dk[i] = carve.shape_only(plan.dtype, k_shape);
      scratch.dv[i] = carve.shape_only(plan.dtype, v_shape);
      continue;
    }
    scratch.dk[i] = carve.take(plan.dtype, k_shape);
    scratch.dv[i] = carve.take(plan.dtype, v_shape);
  }
  if (plan.recomputes) {
    const std::size_t start = carve.bytes();
    if (!plan.outputs_in_dq) scratch.o = carve.take(plan.dtype, layout.tokens(plan.heads_q, plan.dim_v));
    scratch.lse = carve.take(plan.lse_dtype, layout.lse(plan.heads_q));
    scratch.recomputed = carve.bytes_at(start, carve.bytes() - start);
  }
  if (branch_workspace_bytes > 0) {
    scratch.branch_workspace = carve.take(DType::boolean, {static_cast<std::int64_t>(branch_workspace_bytes)});
  }
  scratch.bytes = carve.bytes();
  return scratch;
}

}  // namespace sparseattn::detail
