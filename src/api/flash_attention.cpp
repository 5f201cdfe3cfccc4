#include "sparseattn/flash_attention.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "api/branch_backward.h"
#include "api/check.h"
#include "api/cuda_limits.h"
#include "reference/reference.h"
#ifdef SPARSEATTN_WITH_CUDA
#include "cuda/attention/ops.h"
#endif

namespace sparseattn {

namespace {

struct FlashShapes {
  detail::TokenLayout layout_q, layout_k;
  std::int64_t q_heads = 0, kv_heads = 0, dim_qk = 0, dim_v = 0;

  // The shape of a key-side token tensor: batched key tensors share q's batch size.
  std::vector<std::int64_t> key_tokens(std::int64_t heads, std::int64_t dim) const {
    std::vector<std::int64_t> shape = layout_k.tokens(heads, dim);
    if (!layout_k.packed) shape[0] = layout_q.batch;
    return shape;
  }
};

// mask and bias broadcast as [B|1, Hq|Hkv|1, T|1, S] and exist in the batched layout only.
void check_broadcast(const detail::Check& check, const TensorView& t, const std::string& arg, DType dtype,
                     const TensorView& q, const FlashShapes& shapes) {
  if (!t.present()) return;
  if (shapes.layout_q.packed) {
    check.absent(t, arg, "with the packed layout (mask and bias are batched-layout only)");
  }
  check.tensor(t, arg, dtype, q, "q");
  const std::int64_t batch = shapes.layout_q.batch, rows = shapes.layout_q.rows, keys = shapes.layout_k.rows;
  const bool ok = t.rank == 4 && (t.shape[0] == batch || t.shape[0] == 1) &&
                  (t.shape[1] == shapes.q_heads || t.shape[1] == shapes.kv_heads || t.shape[1] == 1) &&
                  (t.shape[2] == rows || t.shape[2] == 1) && t.shape[3] == keys;
  check.require(ok, ErrorKind::shape, arg,
                "expected a shape broadcastable as [B|1, Hq|Hkv|1, T|1, S] = [" + std::to_string(batch) + "|1, " +
                    std::to_string(shapes.q_heads) + "|" + std::to_string(shapes.kv_heads) + "|1, " +
                    std::to_string(rows) + "|1, " + std::to_string(keys) + "], got " + t.shape_string());
}

// A gate tensor: [B, rows, heads] (batched) or [rows, heads] (packed), dtype of q or float32.
void check_gate_tensor(const detail::Check& check, const TensorView& t, const std::string& arg,
                       const TensorView& q, const detail::TokenLayout& layout, std::int64_t batch,
                       std::int64_t heads) {
  check.tensor(t, arg, t.dtype == DType::float32 ? DType::float32 : q.dtype, q, "q");
  std::vector<std::int64_t> expected{layout.rows, heads};
  if (!layout.packed) expected.insert(expected.begin(), batch);
  check.shape(t, arg, expected);
}

// alpha and delta (both or neither), the gate mode and the two thresholds with their tile sizes.
void check_gates(const detail::Check& check, const FlashGateOptions& gates, const TensorView& q,
                 const FlashShapes& shapes) {
  const bool has_alpha = gates.alpha.present(), has_delta = gates.delta.present();
  check.require(has_alpha == has_delta, ErrorKind::config, has_alpha ? "delta" : "alpha",
                "alpha and delta must be given together (gated attention) or not at all");
  if (has_alpha) {
    check_gate_tensor(check, gates.alpha, "alpha", q, shapes.layout_q, shapes.layout_q.batch, shapes.q_heads);
    check_gate_tensor(check, gates.delta, "delta", q, shapes.layout_k, shapes.layout_q.batch, shapes.kv_heads);
  }
  check.require(gates.gate == GateMode::logsigmoid || gates.gate == GateMode::product, ErrorKind::config, "gate",
                "must be GateMode::logsigmoid or GateMode::product");
  if (gates.gate_threshold) {
    check.require(has_alpha, ErrorKind::config, "gate_threshold", "needs alpha and delta (gated attention)");
    check.require(std::isfinite(*gates.gate_threshold), ErrorKind::config, "gate_threshold",
                  "must be finite, got " + std::to_string(*gates.gate_threshold));
  }
  if (gates.softmax_threshold) {
    const double tau = *gates.softmax_threshold;
    check.require(tau > 0 && tau <= 1, ErrorKind::config, "softmax_threshold",
                  "must lie in (0, 1], got " + std::to_string(tau));
  }
  check.require(gates.threshold_block_q > 0, ErrorKind::config, "threshold_block_q",
                "must be positive, got " + std::to_string(gates.threshold_block_q));
  check.require(gates.threshold_block_k > 0, ErrorKind::config, "threshold_block_k",
                "must be positive, got " + std::to_string(gates.threshold_block_k));
}

// Checks what the forward and the backward share (for the backward, o and lse are inputs).
template <class Params>
FlashShapes check_common(const detail::Check& check, const Params& params) {
  const TensorView& q = params.q;
  check.present(q, "q");
  check.floating(q, "q");
  const DType dtype = q.dtype;
  const bool packed = params.seqs_q.cu_seqlens.present();
  check.require(packed == params.seqs_k.cu_seqlens.present(), ErrorKind::config,
                packed ? "cu_seqlens_k" : "cu_seqlens_q",
                "cu_seqlens_q and cu_seqlens_k must be given together (packed layout) or not at all (batched)");
  FlashShapes shapes;
  check.tensor(q, "q", dtype, q, "q");
  shapes.layout_q = check.layout(q, "q", params.seqs_q, "cu_seqlens_q");
  check.tensor(params.k, "k", dtype, q, "q");
  shapes.layout_k = check.layout(params.k, "k", params.seqs_k, "cu_seqlens_k");
  if (packed) check.shape(params.seqs_k.cu_seqlens, "cu_seqlens_k", {shapes.layout_q.batch + 1});

  shapes.q_heads = q.shape[q.rank - 2];
  shapes.dim_qk = q.shape[q.rank - 1];
  shapes.kv_heads = params.k.shape[params.k.rank - 2];
  check.require(shapes.dim_qk > 0, ErrorKind::shape, "q", "needs a positive head dim, got " + q.shape_string());
  check.require(shapes.kv_heads > 0, ErrorKind::shape, "k", "needs at least one head, got " + params.k.shape_string());
  check.require(shapes.q_heads % shapes.kv_heads == 0, ErrorKind::shape, "k",
                "has " + std::to_string(shapes.kv_heads) + " heads, which must divide the " +
                    std::to_string(shapes.q_heads) + " query heads of q (group size Hq / Hkv)");
  check.shape(params.k, "k", shapes.key_tokens(shapes.kv_heads, shapes.dim_qk));
  check.tensor(params.v, "v", dtype, q, "q");
  shapes.dim_v = params.v.shape[params.v.rank - 1];
  check.shape(params.v, "v", shapes.key_tokens(shapes.kv_heads, shapes.dim_v));
  check.tensor(params.o, "o", dtype, q, "q");
  check.shape(params.o, "o", shapes.layout_q.tokens(shapes.q_heads, shapes.dim_v));
  check.tensor(params.lse, "lse", detail::lse_dtype(dtype), q, "q");
  check.shape(params.lse, "lse", shapes.layout_q.lse(shapes.q_heads));
  check_broadcast(check, params.mask, "mask", DType::boolean, q, shapes);
  check_broadcast(check, params.bias, "bias", dtype, q, shapes);
  check_gates(check, params.gates, q, shapes);
  detail::resolve_scale(check, params.scale, shapes.dim_qk);
  return shapes;
}

template <class Params>
void check_cuda_flash(const detail::Check& check, const Params& params, const FlashShapes& shapes) {
  check.require(!params.mask.present(), ErrorKind::unsupported, "mask",
                "is not supported on CUDA yet (the CUDA kernels have no mask); use CPU tensors");
  check.require(!params.bias.present(), ErrorKind::unsupported, "bias",
                "is not supported on CUDA yet (the CUDA kernels have no bias); use CPU tensors");
  const FlashGateOptions& gates = params.gates;
  check.require(!gates.alpha.present(), ErrorKind::unsupported, "alpha",
                "(gated attention) is not supported on CUDA yet; use CPU tensors");
  check.require(!gates.delta.present(), ErrorKind::unsupported, "delta",
                "(gated attention) is not supported on CUDA yet; use CPU tensors");
  check.require(!gates.gate_threshold, ErrorKind::unsupported, "gate_threshold",
                "is not supported on CUDA yet; use CPU tensors");
  check.require(!gates.softmax_threshold, ErrorKind::unsupported, "softmax_threshold",
                "is not supported on CUDA yet; use CPU tensors");
  detail::check_cuda_half(check, params.q);
  detail::check_cuda_head_dims(check, shapes.dim_qk, shapes.dim_v);
  detail::check_cuda_rows(check, params.q, "q");
  detail::check_cuda_rows(check, params.k, "k");
  detail::check_cuda_rows(check, params.v, "v");
  detail::check_cuda_rows(check, params.o, "o");
  detail::check_cuda_length(check, params.q, params.seqs_q, "q");
  detail::check_cuda_length(check, params.k, params.seqs_k, "k");
}

}  // namespace

void flash_attention(const FlashAttentionParams& params) {
  const detail::Check check("flash_attention");
  const FlashShapes shapes = check_common(check, params);
  switch (detail::backend(check, params.q, "q", detail::kCudaBuilt)) {
    case detail::Backend::cpu: reference::flash_attention(params); break;
    case detail::Backend::cuda:
      check_cuda_flash(check, params, shapes);
#ifdef SPARSEATTN_WITH_CUDA
      cuda::flash_attention(params);
#endif
      break;
  }
}

std::size_t flash_attention_backward_workspace_size(const FlashAttentionBackwardParams& params) {
  // The CPU reference keeps its scratch on the host; CUDA needs delta = rowsum(dO * O) (fp32, one per row) and,
  // when the dK/dV kernel splits the group's heads over CTAs, their fp32 partials.
#ifdef SPARSEATTN_WITH_CUDA
  if (params.q.present() && params.q.device == DeviceType::cuda) return cuda::flash_attention_backward_workspace_size(params);
#endif
  (void)params;
  return 0;
}

void flash_attention_backward(const FlashAttentionBackwardParams& params) {
  detail::flash_attention_backward(params, {});
}

void detail::flash_attention_backward(const FlashAttentionBackwardParams& params,
                                      const BranchBackwardOptions& options) {
  const detail::Check check("flash_attention_backward");
  const FlashShapes shapes = check_common(check, params);
  const DType dtype = params.q.dtype;
  check.tensor(params.d_o, "d_o", dtype, params.q, "q");
  check.shape(params.d_o, "d_o", shapes.layout_q.tokens(shapes.q_heads, shapes.dim_v));
  check.tensor(params.dq, "dq", dtype, params.q, "q");
  check.shape(params.dq, "dq", shapes.layout_q.tokens(shapes.q_heads, shapes.dim_qk));
  check.tensor(params.dk, "dk", dtype, params.q, "q");
  check.shape(params.dk, "dk", shapes.key_tokens(shapes.kv_heads, shapes.dim_qk));
  check.tensor(params.dv, "dv", dtype, params.q, "q");
  check.shape(params.dv, "dv", shapes.key_tokens(shapes.kv_heads, shapes.dim_v));
  if (params.dbias.present()) {
    check.require(params.bias.present(), ErrorKind::config, "dbias", "is given but bias is not");
    check.tensor(params.dbias, "dbias", dtype, params.q, "q");
    const TensorView& bias = params.bias;
    check.shape(params.dbias, "dbias", std::vector<std::int64_t>(bias.shape.begin(), bias.shape.begin() + bias.rank));
  }
  if (params.dalpha.present()) {
    check.require(params.gates.alpha.present(), ErrorKind::config, "dalpha", "is given but alpha is not");
    check.tensor(params.dalpha, "dalpha", params.gates.alpha.dtype, params.gates.alpha, "alpha");
    check.shape(params.dalpha, "dalpha", detail::shape_of(params.gates.alpha));
  }
  if (params.ddelta.present()) {
    check.require(params.gates.delta.present(), ErrorKind::config, "ddelta", "is given but delta is not");
    check.tensor(params.ddelta, "ddelta", params.gates.delta.dtype, params.gates.delta, "delta");
    check.shape(params.ddelta, "ddelta", detail::shape_of(params.gates.delta));
  }
  check.buffer(params.workspace, params.workspace_bytes, flash_attention_backward_workspace_size(params), "workspace",
               "flash_attention_backward_workspace_size");
  detail::check_options(check, options, shapes.layout_q.lse(shapes.q_heads), params.q);
  switch (detail::backend(check, params.q, "q", detail::kCudaBuilt)) {
    case detail::Backend::cpu: reference::flash_attention_backward(params); break;
    case detail::Backend::cuda:
      check_cuda_flash(check, params, shapes);
      detail::check_cuda_rows(check, params.d_o, "d_o");
      detail::check_cuda_rows(check, params.dq, "dq");
      detail::check_cuda_rows(check, params.dk, "dk");
      detail::check_cuda_rows(check, params.dv, "dv");
#ifdef SPARSEATTN_WITH_CUDA
      cuda::flash_attention_backward(params, options);
#endif
      break;
  }
}

}  // namespace sparseattn
