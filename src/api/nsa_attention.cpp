// nsa_attention composes the public operations on views of the caller's workspace and scratch, so it runs
// on every device its steps run on and allocates nothing.
#include "sparseattn/nsa_attention.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "api/accumulate.h"
#include "api/compress_kv_backward.h"
#include "api/branch_backward.h"
#include "api/check.h"
#include "api/nsa_plan.h"
#include "sparseattn/compress_kv.h"
#include "sparseattn/compressed_attention.h"
#include "sparseattn/flash_attention.h"
#include "sparseattn/select_blocks.h"
#include "sparseattn/selected_attention.h"

namespace sparseattn {

namespace {

const char* const kGradGate[kNumBranches] = {"d_g_cmp", "d_g_slc", "d_g_swa"};

std::string strides_string(const TensorView& t) {
  std::string text = "[";
  for (int i = 0; i < t.rank; ++i) text += (i > 0 ? ", " : "") + std::to_string(t.stride[i]);
  return text + "]";
}

// The batched key count S that compressed_attention and select_blocks take (they see no k); 0 when packed.
std::int64_t seqlen_k(const detail::NsaPlan& plan) { return plan.layout.packed ? 0 : plan.keys.layout.rows; }

// The attention forwards of the three branches into `o`/`lse` (the selected one with `workspace`), built in one
// place: the forward and the backward's recomputation (NsaRecompute) run the same calls, so the recomputed
// outputs are the forward's bit for bit.
struct BranchForward {
  CompressedAttentionParams cmp;
  SelectedAttentionParams slc;
  FlashAttentionParams swa;
};

BranchForward branch_forward(const detail::NsaPlan& plan, const NsaParams& p, const detail::NsaWorkspace& ws,
                             const std::array<TensorView, kNumBranches>& o,
                             const std::array<TensorView, kNumBranches>& lse, const TensorView& workspace) {
  const NsaConfig& c = p.config;
  void* const workspace_data = workspace.data;
  const std::size_t workspace_bytes = workspace.present() ? workspace.numel() : 0;
  BranchForward f;
  f.cmp = {.q = p.q, .k_cmp = plan.user_cmp ? p.k_cmp : ws.k_cmp, .v_cmp = plan.user_cmp ? p.v_cmp : ws.v_cmp,
           .o = o[0], .lse = lse[0], .seqs = p.seqs, .seqs_k = p.seqs_k, .seqlen_k = seqlen_k(plan),
           .cu_seqlens_cmp = p.cu_seqlens_cmp, .block = c.cmp_block, .stride = c.cmp_stride, .scale = c.scale,
           .stream = p.stream};
  f.slc = {.q = p.q, .k = p.k, .v = p.v, .indices = plan.run_selection ? ws.indices : p.block_indices,
           .o = o[1], .lse = lse[1], .seqs = p.seqs, .seqs_k = p.seqs_k, .block = c.sel_block, .scale = c.scale,
           .workspace = workspace_data, .workspace_bytes = workspace_bytes, .stream = p.stream};
  f.swa = {.q = p.q, .k = p.k, .v = p.v, .mask = {}, .bias = {}, .o = o[2], .lse = lse[2], .seqs_q = p.seqs,
           .seqs_k = plan.keys.seqs, .causal = true, .window_left = c.window - 1, .window_right = 0,
           .scale = c.scale, .gates = {}, .blocks = {}, .head_windows = {}, .stream = p.stream};
  return f;
}

void run_branch_forward(const BranchForward& f, int branch) {
  if (branch == 0) compressed_attention(f.cmp);
  if (branch == 1) selected_attention(f.slc);
  if (branch == 2) flash_attention(f.swa);
}

SelectBlocksParams select_params(const detail::NsaPlan& plan, const NsaParams& p, const detail::NsaWorkspace& ws) {
  const NsaConfig& c = p.config;
  const TensorView& workspace = ws.step_workspace;
  return {.q = p.q, .k_cmp = plan.user_cmp ? p.k_cmp : ws.k_cmp, .lse_cmp = ws.lse[0], .indices = ws.indices,
          .seqs = p.seqs, .seqs_k = p.seqs_k, .seqlen_k = seqlen_k(plan), .cu_seqlens_cmp = p.cu_seqlens_cmp,
          .cmp_block = c.cmp_block, .cmp_stride = c.cmp_stride, .sel_block = c.sel_block,
          .num_selected = c.num_selected, .num_init = c.num_init, .num_local = c.num_local, .scale = c.scale,
          .workspace = workspace.data, .workspace_bytes = workspace.present() ? workspace.numel() : 0,
          .stream = p.stream};
}

// The workspace of the selected branch's forward (0 without it).
std::size_t selected_forward_workspace_size(const detail::NsaPlan& plan, const NsaParams& params,
                                            const detail::NsaWorkspace& ws) {
  if (!plan.branch[1]) return 0;
  return selected_attention_workspace_size(branch_forward(plan, params, ws, ws.o, ws.lse, {}).slc);
}

// The workspace views, the step workspace sized for the largest one a step asks for (found from shape-only
// views) and placed in the window's output slice or in `scratch`.
detail::NsaWorkspace workspace_for(const detail::NsaPlan& plan, const NsaParams& params, void* base, void* scratch) {
  const detail::NsaWorkspace sizing = detail::nsa_workspace(plan, nullptr, 0, nullptr, params.o);
  std::size_t bytes = selected_forward_workspace_size(plan, params, sizing);
  if (plan.run_selection) bytes = std::max(bytes, select_blocks_workspace_size(select_params(plan, params, sizing)));
  return detail::nsa_workspace(plan, base, bytes, scratch, params.o);
}

// Validates the forward params and the workspace; returns the plan and the workspace views (the views of the
// forward's scratch are only valid in the forward, which alone checks the scratch holding them).
std::pair<detail::NsaPlan, detail::NsaWorkspace> prepare(const detail::Check& check, const NsaParams& params) {
  detail::NsaPlan plan = detail::plan_nsa(check, params, /*read_contents=*/true);
  detail::NsaWorkspace workspace = workspace_for(plan, params, params.workspace, params.scratch);
  check.buffer(params.workspace, params.workspace_bytes, workspace.bytes, "workspace", "nsa_workspace_size");
  return {plan, workspace};
}


void check_gradients(const detail::Check& check, const NsaBackwardParams& params, const detail::NsaPlan& plan) {
  const NsaParams& forward = params.forward;
  const auto like = [&](const TensorView& t, const std::string& arg, const TensorView& model) {
    check.tensor(t, arg, plan.dtype, forward.q, "q");
    check.shape(t, arg, detail::shape_of(model));
  };
  like(params.d_o, "d_o", forward.o);
  like(params.dq, "dq", forward.q);
  like(params.dk, "dk", forward.k);
  like(params.dv, "dv", forward.v);
  if (plan.user_cmp) {
    like(params.dk_cmp, "dk_cmp", forward.k_cmp);
    like(params.dv_cmp, "dv_cmp", forward.v_cmp);
  } else {
    check.absent(params.dk_cmp, "dk_cmp", "without a user-supplied k_cmp");
    check.absent(params.dv_cmp, "dv_cmp", "without a user-supplied v_cmp");
  }
  for (int i = 0; i < kNumBranches; ++i) {
    if (!plan.branch[i]) {
      check.absent(params.d_gates[i], kGradGate[i], "for a branch without a gate");
    } else if (params.d_gates[i].present()) {
      like(params.d_gates[i], kGradGate[i], forward.gates[i]);
    }
  }
}

// out = the sum of the present views among `terms` (0 if none).
void sum_into(const TensorView& out, const std::array<TensorView, kNumBranches>& terms, const TensorView& cu_seqlens,
              Stream stream) {
  detail::AccumulateParams params{.out = out, .terms = {}, .cu_seqlens = cu_seqlens, .stream = stream};
  for (const TensorView& term : terms) {
    if (term.present()) params.terms.push_back(term);
  }
  detail::accumulate(params);
}

// The pipeline runs on the CUDA kernels of its steps; they take bfloat16 and float16 (compress_kv and
// combine also take float32, the attention steps do not), so that is checked before any step runs.
void check_backend(const detail::Check& check, const TensorView& q, const detail::NsaPlan& plan) {
  if (detail::backend(check, q, "q", detail::kCudaBuilt) == detail::Backend::cuda) {
    check.require(q.dtype == DType::bfloat16 || q.dtype == DType::float16, ErrorKind::unsupported, "q",
                  std::string("the CUDA pipeline takes bfloat16 or float16, got ") + dtype_name(q.dtype));
  }
}

// The backward calls of the three branches, built in one place so that the scratch size covers exactly the
// workspaces they ask for. `d_o`: the caller's output gradient (CUDA: each branch's gate is folded into its
// backward, branch_backward.h; CPU: the branches read scratch.d_o instead). `dk_cmp`/`dv_cmp` receive the
// compressed branch's K/V gradient. `o`: the branch outputs (backward_outputs); the log-sum-exps are the
// workspace's. `dk`/`dv`: where the branch NsaScratch::kv_direct writes its K/V gradient (the caller's; shape-only
// views while sizing).
struct BranchBackward {
  CompressedAttentionBackwardParams cmp;
  SelectedAttentionBackwardParams slc;
  FlashAttentionBackwardParams swa;
};

BranchBackward branch_backward(const detail::NsaPlan& plan, const NsaParams& f, const detail::NsaWorkspace& ws,
                               const std::array<TensorView, kNumBranches>& o, const detail::NsaScratch& scratch,
                               const TensorView& d_o_caller, const TensorView& dq, const TensorView& dk_cmp,
                               const TensorView& dv_cmp, const TensorView& dk, const TensorView& dv) {
  const auto dq_of = [&](int i) { return scratch.dq[i].present() ? scratch.dq[i] : dq; };
  const auto dk_of = [&](int i) { return scratch.kv_direct == i ? dk : scratch.dk[i]; };
  const auto dv_of = [&](int i) { return scratch.kv_direct == i ? dv : scratch.dv[i]; };
  const TensorView d_o = scratch.d_o.present() ? scratch.d_o : d_o_caller;
  const NsaConfig& c = f.config;
  void* workspace = scratch.branch_workspace.data;
  const std::size_t workspace_bytes = scratch.branch_workspace.present() ? scratch.branch_workspace.numel() : 0;
  BranchBackward b;
  b.cmp = {.q = f.q, .k_cmp = plan.user_cmp ? f.k_cmp : ws.k_cmp, .v_cmp = plan.user_cmp ? f.v_cmp : ws.v_cmp,
           .o = o[0], .lse = ws.lse[0], .d_o = d_o, .dq = dq_of(0), .dk_cmp = dk_cmp,
           .dv_cmp = dv_cmp, .seqs = f.seqs, .seqs_k = f.seqs_k, .seqlen_k = seqlen_k(plan),
           .cu_seqlens_cmp = f.cu_seqlens_cmp, .block = c.cmp_block,
           .stride = c.cmp_stride, .scale = c.scale, .workspace = workspace, .workspace_bytes = workspace_bytes,
           .stream = f.stream};
  b.slc = {.q = f.q, .k = f.k, .v = f.v, .indices = plan.run_selection ? ws.indices : f.block_indices,
           .o = o[1], .lse = ws.lse[1], .d_o = d_o, .dq = dq_of(1), .dk = dk_of(1),
           .dv = dv_of(1), .seqs = f.seqs, .seqs_k = f.seqs_k, .block = c.sel_block, .scale = c.scale,
           .workspace = workspace,
           .workspace_bytes = workspace_bytes, .stream = f.stream};
  b.swa = {.q = f.q, .k = f.k, .v = f.v, .mask = {}, .bias = {}, .o = o[2], .lse = ws.lse[2],
           .d_o = d_o, .dq = dq_of(2), .dk = dk_of(2), .dv = dv_of(2), .dbias = {},
           .dalpha = {}, .ddelta = {}, .seqs_q = f.seqs, .seqs_k = plan.keys.seqs, .causal = true,
           .window_left = c.window - 1, .window_right = 0, .scale = c.scale, .gates = {}, .blocks = {},
           .head_windows = {}, .workspace = workspace, .workspace_bytes = workspace_bytes, .stream = f.stream};
  return b;
}

// Where the backward recomputes a branch output: scratch.o, or (NsaPlan::outputs_in_dq) a contiguous view of the
// output's shape on dq's memory (dq, contiguous and at least as large, is written only after).
TensorView recomputed_output(const detail::NsaPlan& plan, const detail::NsaScratch& scratch, const TensorView& dq) {
  if (!plan.outputs_in_dq) return scratch.o;
  const std::vector<std::int64_t> shape = plan.layout.tokens(plan.heads_q, plan.dim_v);
  TensorView view = dq;
  view.rank = static_cast<int>(shape.size());
  std::int64_t stride = 1;
  for (int i = view.rank - 1; i >= 0; --i) {
    view.shape[i] = shape[i];
    view.stride[i] = stride;
    stride *= shape[i];
  }
  return view;
}

// The branch outputs the backward reads: the workspace's, or for a recomputed one the buffer each recomputed
// output goes into (`recomputed`).
std::array<TensorView, kNumBranches> backward_outputs(const detail::NsaPlan& plan, const detail::NsaWorkspace& ws,
                                                      const TensorView& recomputed) {
  std::array<TensorView, kNumBranches> outputs = ws.o;
  for (int i = 0; i < kNumBranches; ++i) {
    if (plan.recompute_output[i]) outputs[i] = recomputed;
  }
  return outputs;
}

// The scratch views, the last slice sized for the largest branch workspace (found from shape-only views), which
// when the selected branch's output is recomputed also holds that forward's workspace.
detail::NsaScratch scratch_for(const detail::NsaPlan& plan, const NsaParams& f, const detail::NsaWorkspace& ws,
                               void* base) {
  const detail::NsaScratch shapes = detail::nsa_scratch(plan, nullptr, 0);
  const std::array<TensorView, kNumBranches> outputs =
      backward_outputs(plan, ws, recomputed_output(plan, shapes, f.q));
  const TensorView direct_dk = shapes.kv_direct >= 0 ? shapes.dk[shapes.kv_direct] : TensorView{};
  const TensorView direct_dv = shapes.kv_direct >= 0 ? shapes.dv[shapes.kv_direct] : TensorView{};
  const BranchBackward sizing =
      branch_backward(plan, f, ws, outputs, shapes, f.o, f.q, f.k_cmp, f.v_cmp, direct_dk, direct_dv);
  std::size_t bytes = 0;
  if (plan.branch[0]) bytes = std::max(bytes, compressed_attention_backward_workspace_size(sizing.cmp));
  if (plan.branch[1]) bytes = std::max(bytes, selected_attention_backward_workspace_size(sizing.slc));
  if (plan.branch[2]) bytes = std::max(bytes, flash_attention_backward_workspace_size(sizing.swa));
  if (plan.recompute_output[1]) bytes = std::max(bytes, selected_forward_workspace_size(plan, f, ws));
  return detail::nsa_scratch(plan, base, bytes);
}

}  // namespace

std::size_t nsa_workspace_size(const NsaParams& params) {
  const detail::Check check("nsa_workspace_size");
  return workspace_for(detail::plan_nsa(check, params, /*read_contents=*/false), params, nullptr, nullptr).bytes;
}

std::size_t nsa_forward_scratch_size(const NsaParams& params) {
  const detail::Check check("nsa_forward_scratch_size");
  const detail::NsaPlan plan = detail::plan_nsa(check, params, /*read_contents=*/false);
  return workspace_for(plan, params, nullptr, nullptr).scratch_bytes;
}

std::size_t nsa_backward_scratch_size(const NsaParams& params) {
  const detail::Check check("nsa_backward_scratch_size");
  const detail::NsaPlan plan = detail::plan_nsa(check, params, /*read_contents=*/false);
  return scratch_for(plan, params, workspace_for(plan, params, nullptr, nullptr), nullptr).bytes;
}

void nsa_attention(const NsaParams& params) {
  const detail::Check check("nsa_attention");
  const auto [plan, ws] = prepare(check, params);
  check.buffer(params.scratch, params.scratch_bytes, ws.scratch_bytes, "scratch", "nsa_forward_scratch_size");
  check_backend(check, params.q, plan);
  if (plan.output_in_o >= 0) {
    check.require(params.o.is_contiguous(), ErrorKind::shape, "o",
                  "must be contiguous with recomputation (a branch writes its output there before combine), "
                  "got strides " + strides_string(params.o));
  }

  const NsaConfig& c = params.config;
  // Every byte of the workspace ends up deterministic (the caller may pass it uninitialised): what no step
  // writes is zero-filled (NsaWorkspace::unwritten).
  const auto zero = [&](const TensorView& view) {
    if (view.present() && view.numel() > 0) sum_into(view, {}, {}, params.stream);
  };
  if (plan.layout.packed) {
    zero(ws.whole);
  } else {
    for (const TensorView& gap : ws.unwritten) zero(gap);
  }
  if (plan.run_compression) {
    compress_kv({.k = params.k, .v = params.v, .k_cmp = ws.k_cmp, .v_cmp = ws.v_cmp, .seqs = plan.keys.seqs,
                 .cu_seqlens_cmp = params.cu_seqlens_cmp, .block = c.cmp_block, .stride = c.cmp_stride,
                 .stream = params.stream});
  }
  const BranchForward branches = branch_forward(plan, params, ws, ws.o, ws.lse, ws.step_workspace);
  if (plan.run_compressed_attention) run_branch_forward(branches, 0);
  if (plan.run_selection) select_blocks(select_params(plan, params, ws));
  if (plan.branch[1]) run_branch_forward(branches, 1);
  if (plan.branch[2]) run_branch_forward(branches, 2);
  if (!plan.layout.packed) {
    // With NsaPlan::output_in_o one of the outputs is params.o itself: combine reads each element of the outputs
    // before it writes that element of o.
    combine({.outputs = ws.o, .gates = params.gates, .o = params.o, .stream = params.stream});
    return;
  }
  combine({.outputs = ws.o, .gates = params.gates, .o = ws.combined, .stream = params.stream});
  sum_into(params.o, {ws.combined}, params.seqs.cu_seqlens, params.stream);
}

void nsa_attention_backward(const NsaBackwardParams& params) {
  const detail::Check check("nsa_attention_backward");
  const NsaParams& f = params.forward;
  const auto [plan, ws] = prepare(check, f);
  const detail::NsaScratch scratch = scratch_for(plan, f, ws, params.scratch);
  check.buffer(params.scratch, params.scratch_bytes, scratch.bytes, "scratch", "nsa_backward_scratch_size");
  check_gradients(check, params, plan);
  check_backend(check, f.q, plan);
  if (plan.outputs_in_dq) {
    check.require(params.dq.is_contiguous(), ErrorKind::shape, "dq",
                  "must be contiguous when the backward recomputes branch outputs on CUDA (they use its memory "
                  "before it is written), got strides " + strides_string(params.dq));
  }

  const NsaConfig& c = f.config;
  const std::array<TensorView, kNumBranches> outputs =
      backward_outputs(plan, ws, recomputed_output(plan, scratch, params.dq));
  const BranchBackward branches = branch_backward(plan, f, ws, outputs, scratch, params.d_o, params.dq,
                                                  plan.user_cmp ? params.dk_cmp : scratch.dk_cmp,
                                                  plan.user_cmp ? params.dv_cmp : scratch.dv_cmp, params.dk,
                                                  params.dv);
  // Recomputation (NsaPlan::recompute_output): the branch's forward runs again (the forward's own call,
  // branch_forward) into its buffer just before that branch's gate gradient; its log-sum-exp goes to scratch.lse
  // (the backward reads the workspace's, the same values). On the CPU (scratch.o) the branch's backward, which
  // computes its delta from the output, follows at once; on CUDA (dq's memory) every branch's gate gradient and
  // delta come first, then the branch backwards, which read no output.
  const BranchForward recomputation = branch_forward(plan, f, ws, outputs, {scratch.lse, scratch.lse, scratch.lse},
                                                     scratch.branch_workspace);
  const auto recompute_output = [&](int i) {
    // Packed: rows past cu_seqlens[B], which no branch writes, are zero as in the forward's zero-filled workspace
    // (in dq's memory they stay the caller's: their deltas and gate gradients are not used).
    if (plan.layout.packed && !plan.outputs_in_dq) sum_into(scratch.recomputed, {}, {}, f.stream);
    run_branch_forward(recomputation, i);
  };
  // CUDA: the gates are folded into the branches' backward (branch_backward.h): combine_backward writes each
  // branch's delta, gate and gate gradient (one pass for every branch, or with recomputation one per branch, which
  // writes the same values: each branch's are computed on their own); the first branch writes dq, the others add to
  // it (scratch.dq is empty there). CPU: each branch's scaled output gradient goes through scratch.d_o in turn.
  const bool cuda = plan.device == DeviceType::cuda;
  // The gate gradients (packed: through scratch, so that rows past cu_seqlens[B] of the caller's stay untouched).
  const auto d_gate_of = [&](int i) {
    return plan.layout.packed && params.d_gates[i].present() ? scratch.d_gates[i] : params.d_gates[i];
  };
  const auto gate_backward = [&](const std::array<bool, kNumBranches>& which) {
    CombineBackwardParams gated{.outputs = {}, .gates = {}, .d_o = params.d_o, .d_outputs = {}, .d_gates = {},
                                .stream = f.stream};
    std::array<TensorView, kNumBranches> deltas{}, scales{};
    for (int i = 0; i < kNumBranches; ++i) {
      if (!which[i]) continue;
      gated.outputs[i] = outputs[i];
      gated.gates[i] = f.gates[i];
      gated.d_gates[i] = d_gate_of(i);
      if (cuda) {
        deltas[i] = scratch.deltas[i];
        scales[i] = scratch.d_o_scales[i];
      } else {
        gated.d_outputs[i] = scratch.d_o;
      }
    }
    detail::combine_backward(gated, deltas, scales);
    for (int i = 0; i < kNumBranches; ++i) {
      if (which[i] && plan.layout.packed && params.d_gates[i].present()) {
        sum_into(params.d_gates[i], {scratch.d_gates[i]}, f.seqs.cu_seqlens, f.stream);
      }
    }
  };
  const auto branch_gates = [&](int i) {
    if (plan.recompute_output[i]) recompute_output(i);
    std::array<bool, kNumBranches> only{};
    only[i] = true;
    gate_backward(only);
  };
  const bool one_pass = cuda && !plan.recomputes;
  if (one_pass) gate_backward(plan.branch);
  if (plan.outputs_in_dq) {
    for (int i = 0; i < kNumBranches; ++i) {
      if (plan.branch[i]) branch_gates(i);
    }
  }
  bool accumulate_dq = false;
  for (int i = 0; i < kNumBranches; ++i) {
    if (!plan.branch[i]) continue;
    if (!one_pass && !plan.outputs_in_dq) branch_gates(i);
    const detail::BranchBackwardOptions options{
        .delta = scratch.deltas[i], .d_o_scale = scratch.d_o_scales[i], .accumulate_dq = accumulate_dq};
    if (i == 0) detail::compressed_attention_backward(branches.cmp, options);
    if (i == 1) detail::selected_attention_backward(branches.slc, options);
    if (i == 2) detail::flash_attention_backward(branches.swa, options);
    accumulate_dq = cuda;
  }
  if (!plan.branch[0] && plan.user_cmp) {  // the compressed branch is skipped: the caller's k_cmp/v_cmp get no gradient
    sum_into(params.dk_cmp, {}, f.cu_seqlens_cmp, f.stream);
    sum_into(params.dv_cmp, {}, f.cu_seqlens_cmp, f.stream);
  }
  // CPU: the last branch wrote params.dq; add the others' (each element is read before it is written).
  std::array<TensorView, kNumBranches> dq_terms = scratch.dq;
  if (std::any_of(dq_terms.begin(), dq_terms.end(), [](const TensorView& t) { return t.present(); })) {
    dq_terms[kNumBranches - 1] = params.dq;  // the last slot never holds a scratch dq
    sum_into(params.dq, dq_terms, f.seqs.cu_seqlens, f.stream);
  }
  // The branches' K/V gradients: scratch's, and (CUDA) the caller's dk/dv already holding branch kv_direct's, read
  // in place (each element is read before it is written).
  std::array<TensorView, kNumBranches> dk_terms = scratch.dk, dv_terms = scratch.dv;
  if (scratch.kv_direct >= 0) {
    dk_terms[scratch.kv_direct] = params.dk;
    dv_terms[scratch.kv_direct] = params.dv;
  }
  // Whether the caller's dk/dv already hold the only term: branch kv_direct ran without the other one (kv_direct is
  // the last present of the selected and window branches, so only the window can have the selected one beside it).
  const bool caller_holds_all = scratch.kv_direct == 1 || (scratch.kv_direct == 2 && !plan.branch[1]);
  if (plan.branch[0] && !plan.user_cmp) {
    // dk = the other branches' dk + the gradient through the pooling of dk_cmp, in one pass (dv alike).
    static_assert(detail::kMaxCompressTerms == kNumBranches - 1, "a term per branch after the compressed one");
    detail::CompressBackwardTerms terms;
    for (int i = 1; i < kNumBranches; ++i) {
      terms.dk[i - 1] = dk_terms[i];
      terms.dv[i - 1] = dv_terms[i];
    }
    detail::compress_kv_backward_adding({.dk_cmp = scratch.dk_cmp, .dv_cmp = scratch.dv_cmp, .dk = params.dk,
                                         .dv = params.dv, .seqs = plan.keys.seqs, .cu_seqlens_cmp = f.cu_seqlens_cmp,
                                         .block = c.cmp_block, .stride = c.cmp_stride, .stream = f.stream},
                                        terms);
  } else if (!caller_holds_all) {
    sum_into(params.dk, dk_terms, plan.keys.seqs.cu_seqlens, f.stream);
    sum_into(params.dv, dv_terms, plan.keys.seqs.cu_seqlens, f.stream);
  }
}

}  // namespace sparseattn
