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

// The batched key count S that compressed_attention and select_blocks take (they see no k); 0 when packed.
std::int64_t seqlen_k(const detail::NsaPlan& plan) { return plan.layout.packed ? 0 : plan.keys.layout.rows; }

// The forward calls of the steps that take a workspace, built in one place so that the workspace covers
// exactly what they ask for.
struct ForwardSteps {
  SelectBlocksParams select;
  SelectedAttentionParams slc;
};

ForwardSteps forward_steps(const detail::NsaPlan& plan, const NsaParams& p, const detail::NsaWorkspace& ws) {
  const NsaConfig& c = p.config;
  void* workspace = ws.step_workspace.data;
  const std::size_t workspace_bytes = ws.step_workspace.present() ? ws.step_workspace.numel() : 0;
  ForwardSteps steps;
  steps.select = {.q = p.q, .k_cmp = plan.user_cmp ? p.k_cmp : ws.k_cmp, .lse_cmp = ws.lse[0],
                  .indices = ws.indices, .seqs = p.seqs, .seqs_k = p.seqs_k, .seqlen_k = seqlen_k(plan),
                  .cu_seqlens_cmp = p.cu_seqlens_cmp,
                  .cmp_block = c.cmp_block, .cmp_stride = c.cmp_stride, .sel_block = c.sel_block,
                  .num_selected = c.num_selected, .num_init = c.num_init, .num_local = c.num_local,
                  .scale = c.scale, .workspace = workspace, .workspace_bytes = workspace_bytes,
                  .stream = p.stream};
  steps.slc = {.q = p.q, .k = p.k, .v = p.v, .indices = plan.run_selection ? ws.indices : p.block_indices,
               .o = ws.o[1], .lse = ws.lse[1], .seqs = p.seqs, .seqs_k = p.seqs_k, .block = c.sel_block,
               .scale = c.scale,
               .workspace = workspace, .workspace_bytes = workspace_bytes, .stream = p.stream};
  return steps;
}

// The workspace views, the step workspace sized for the largest one a step asks for (found from shape-only
// views) and placed in the window's output slice or in `scratch`.
detail::NsaWorkspace workspace_for(const detail::NsaPlan& plan, const NsaParams& params, void* base, void* scratch) {
  const ForwardSteps sizing = forward_steps(plan, params, detail::nsa_workspace(plan, nullptr, 0, nullptr));
  std::size_t bytes = 0;
  if (plan.run_selection) bytes = std::max(bytes, select_blocks_workspace_size(sizing.select));
  if (plan.branch[1]) bytes = std::max(bytes, selected_attention_workspace_size(sizing.slc));
  return detail::nsa_workspace(plan, base, bytes, scratch);
}

// Validates the forward params and the workspace; returns the plan and the workspace views (the step
// workspace's view is only valid in the forward, which alone checks the scratch holding it).
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
// compressed branch's K/V gradient.
struct BranchBackward {
  CompressedAttentionBackwardParams cmp;
  SelectedAttentionBackwardParams slc;
  FlashAttentionBackwardParams swa;
};

BranchBackward branch_backward(const detail::NsaPlan& plan, const NsaParams& f, const detail::NsaWorkspace& ws,
                               const detail::NsaScratch& scratch, const TensorView& d_o_caller, const TensorView& dq,
                               const TensorView& dk_cmp, const TensorView& dv_cmp) {
  const auto dq_of = [&](int i) { return scratch.dq[i].present() ? scratch.dq[i] : dq; };
  const TensorView d_o = scratch.d_o.present() ? scratch.d_o : d_o_caller;
  const NsaConfig& c = f.config;
  void* workspace = scratch.branch_workspace.data;
  const std::size_t workspace_bytes = scratch.branch_workspace.present() ? scratch.branch_workspace.numel() : 0;
  BranchBackward b;
  b.cmp = {.q = f.q, .k_cmp = plan.user_cmp ? f.k_cmp : ws.k_cmp, .v_cmp = plan.user_cmp ? f.v_cmp : ws.v_cmp,
           .o = ws.o[0], .lse = ws.lse[0], .d_o = d_o, .dq = dq_of(0), .dk_cmp = dk_cmp,
           .dv_cmp = dv_cmp, .seqs = f.seqs, .seqs_k = f.seqs_k, .seqlen_k = seqlen_k(plan),
           .cu_seqlens_cmp = f.cu_seqlens_cmp, .block = c.cmp_block,
           .stride = c.cmp_stride, .scale = c.scale, .workspace = workspace, .workspace_bytes = workspace_bytes,
           .stream = f.stream};
  b.slc = {.q = f.q, .k = f.k, .v = f.v, .indices = plan.run_selection ? ws.indices : f.block_indices,
           .o = ws.o[1], .lse = ws.lse[1], .d_o = d_o, .dq = dq_of(1), .dk = scratch.dk[1],
           .dv = scratch.dv[1], .seqs = f.seqs, .seqs_k = f.seqs_k, .block = c.sel_block, .scale = c.scale,
           .workspace = workspace,
           .workspace_bytes = workspace_bytes, .stream = f.stream};
  b.swa = {.q = f.q, .k = f.k, .v = f.v, .mask = {}, .bias = {}, .o = ws.o[2], .lse = ws.lse[2],
           .d_o = d_o, .dq = dq_of(2), .dk = scratch.dk[2], .dv = scratch.dv[2], .dbias = {},
           .dalpha = {}, .ddelta = {}, .seqs_q = f.seqs, .seqs_k = plan.keys.seqs, .causal = true,
           .window_left = c.window - 1, .window_right = 0, .scale = c.scale, .gates = {}, .blocks = {},
           .head_windows = {}, .workspace = workspace, .workspace_bytes = workspace_bytes, .stream = f.stream};
  return b;
}

// The scratch views, the last slice sized for the largest branch workspace (found from shape-only views).
detail::NsaScratch scratch_for(const detail::NsaPlan& plan, const NsaParams& f, const detail::NsaWorkspace& ws,
                               void* base) {
  const BranchBackward sizing =
      branch_backward(plan, f, ws, detail::nsa_scratch(plan, nullptr, 0), f.o, f.q, f.k_cmp, f.v_cmp);
  std::size_t bytes = 0;
  if (plan.branch[0]) bytes = std::max(bytes, compressed_attention_backward_workspace_size(sizing.cmp));
  if (plan.branch[1]) bytes = std::max(bytes, selected_attention_backward_workspace_size(sizing.slc));
  if (plan.branch[2]) bytes = std::max(bytes, flash_attention_backward_workspace_size(sizing.swa));
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
  const TensorView k_cmp = plan.user_cmp ? params.k_cmp : ws.k_cmp;
  const TensorView v_cmp = plan.user_cmp ? params.v_cmp : ws.v_cmp;
  if (plan.run_compression) {
    compress_kv({.k = params.k, .v = params.v, .k_cmp = ws.k_cmp, .v_cmp = ws.v_cmp, .seqs = plan.keys.seqs,
                 .cu_seqlens_cmp = params.cu_seqlens_cmp, .block = c.cmp_block, .stride = c.cmp_stride,
                 .stream = params.stream});
  }
  if (plan.run_compressed_attention) {
    compressed_attention({.q = params.q, .k_cmp = k_cmp, .v_cmp = v_cmp, .o = ws.o[0], .lse = ws.lse[0],
                          .seqs = params.seqs, .seqs_k = params.seqs_k, .seqlen_k = seqlen_k(plan),
                          .cu_seqlens_cmp = params.cu_seqlens_cmp, .block = c.cmp_block,
                          .stride = c.cmp_stride, .scale = c.scale, .stream = params.stream});
  }
  const ForwardSteps steps = forward_steps(plan, params, ws);
  if (plan.run_selection) select_blocks(steps.select);
  if (plan.branch[1]) selected_attention(steps.slc);
  if (plan.branch[2]) {
    flash_attention({.q = params.q, .k = params.k, .v = params.v, .mask = {}, .bias = {}, .o = ws.o[2],
                     .lse = ws.lse[2], .seqs_q = params.seqs, .seqs_k = plan.keys.seqs, .causal = true,
                     .window_left = c.window - 1, .window_right = 0, .scale = c.scale, .gates = {}, .blocks = {},
                     .head_windows = {}, .stream = params.stream});
  }
  if (!plan.layout.packed) {
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

  const NsaConfig& c = f.config;
  const BranchBackward branches =
      branch_backward(plan, f, ws, scratch, params.d_o, params.dq, plan.user_cmp ? params.dk_cmp : scratch.dk_cmp,
                      plan.user_cmp ? params.dv_cmp : scratch.dv_cmp);
  // CUDA: the gates are folded into the branches' backward (branch_backward.h): one combine_backward pass writes
  // every branch's delta, gate and gate gradient; the first branch writes dq, the others add to it (scratch.dq
  // is empty there). CPU: each branch's scaled output gradient goes through scratch.d_o in turn.
  const bool cuda = plan.device == DeviceType::cuda;
  // The gate gradients (packed: through scratch, so that rows past cu_seqlens[B] of the caller's stay untouched).
  const auto d_gate_of = [&](int i) {
    return plan.layout.packed && params.d_gates[i].present() ? scratch.d_gates[i] : params.d_gates[i];
  };
  const auto copy_packed_d_gate = [&](int i) {
    if (plan.layout.packed && params.d_gates[i].present()) {
      sum_into(params.d_gates[i], {scratch.d_gates[i]}, f.seqs.cu_seqlens, f.stream);
    }
  };
  if (cuda) {
    CombineBackwardParams gated{.outputs = {}, .gates = {}, .d_o = params.d_o, .d_outputs = {}, .d_gates = {},
                                .stream = f.stream};
    for (int i = 0; i < kNumBranches; ++i) {
      if (!plan.branch[i]) continue;
      gated.outputs[i] = ws.o[i];
      gated.gates[i] = f.gates[i];
      gated.d_gates[i] = d_gate_of(i);
    }
    detail::combine_backward(gated, scratch.deltas, scratch.d_o_scales);
    for (int i = 0; i < kNumBranches; ++i) {
      if (plan.branch[i]) copy_packed_d_gate(i);
    }
  }
  bool accumulate_dq = false;
  for (int i = 0; i < kNumBranches; ++i) {
    if (!plan.branch[i]) continue;
    if (!cuda) {
      CombineBackwardParams gated{.outputs = {}, .gates = {}, .d_o = params.d_o, .d_outputs = {}, .d_gates = {},
                                  .stream = f.stream};
      gated.outputs[i] = ws.o[i];
      gated.gates[i] = f.gates[i];
      gated.d_outputs[i] = scratch.d_o;
      gated.d_gates[i] = d_gate_of(i);
      detail::combine_backward(gated, {}, {});
      copy_packed_d_gate(i);
    }
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
  if (plan.branch[0] && !plan.user_cmp) {
    // dk = the other branches' dk + the gradient through the pooling of dk_cmp, in one pass (dv alike).
    static_assert(detail::kMaxCompressTerms == kNumBranches - 1, "a term per branch after the compressed one");
    detail::CompressBackwardTerms terms;
    for (int i = 1; i < kNumBranches; ++i) {
      terms.dk[i - 1] = scratch.dk[i];
      terms.dv[i - 1] = scratch.dv[i];
    }
    detail::compress_kv_backward_adding({.dk_cmp = scratch.dk_cmp, .dv_cmp = scratch.dv_cmp, .dk = params.dk,
                                         .dv = params.dv, .seqs = plan.keys.seqs, .cu_seqlens_cmp = f.cu_seqlens_cmp,
                                         .block = c.cmp_block, .stride = c.cmp_stride, .stream = f.stream},
                                        terms);
  } else {
    sum_into(params.dk, scratch.dk, plan.keys.seqs.cu_seqlens, f.stream);
    sum_into(params.dv, scratch.dv, plan.keys.seqs.cu_seqlens, f.stream);
  }
}

}  // namespace sparseattn
