// sparseattn from C++: Native Sparse Attention forward and backward on small float32 CPU tensors.
//
// The C++ API is plain data: the caller owns every buffer (here std::vectors), describes it with a
// TensorView, fills one params struct per call and passes a workspace whose size the API computes.
// The library never allocates the caller's tensors and reports bad arguments with sparseattn::Error.
#include <sparseattn/sparseattn.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

namespace sa = sparseattn;

namespace {

std::vector<float> randn(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  return x;
}

double norm(const std::vector<float>& x) {
  double s = 0.0;
  for (float v : x) s += double(v) * double(v);
  return std::sqrt(s);
}

sa::TensorView view(std::vector<float>& x, std::initializer_list<std::int64_t> shape) {
  return sa::TensorView::contiguous(x.data(), sa::DType::float32, shape);
}

}  // namespace

int main() {
  // One sequence of 200 tokens, 4 query heads sharing 2 KV heads (group size 2), head dim 32.
  constexpr std::int64_t B = 1, T = 200, Hq = 4, Hkv = 2, D = 32;
  std::mt19937 rng(0);

  std::vector<float> q = randn(B * T * Hq * D, rng), k = randn(B * T * Hkv * D, rng),
                     v = randn(B * T * Hkv * D, rng);
  std::vector<float> g_cmp(B * T * Hq), g_slc(B * T * Hq), g_swa(B * T * Hq);
  for (auto* g : {&g_cmp, &g_slc, &g_swa}) {
    for (float& x : *g) x = 1.0f / (1.0f + std::exp(-std::normal_distribution<float>()(rng)));  // sigmoid
  }
  std::vector<float> o(B * T * Hq * D);

  // The NSA paper's block sizes (compression 32/16, selection 64), fewer selected blocks and a shorter
  // window than its defaults so that every branch matters for 200 tokens.
  sa::NsaConfig config;
  config.num_selected = 3;  // 1 initial + 2 local forced blocks, at most 4 blocks exist
  config.window = 64;

  sa::NsaParams params;
  params.q = view(q, {B, T, Hq, D});
  params.k = view(k, {B, T, Hkv, D});
  params.v = view(v, {B, T, Hkv, D});
  params.gates = {view(g_cmp, {B, T, Hq}), view(g_slc, {B, T, Hq}), view(g_swa, {B, T, Hq})};
  params.o = view(o, {B, T, Hq, D});
  params.config = config;

  try {
    // Forward: the workspace keeps what the backward pass needs (branch outputs, lse, indices).
    // Any allocation will do: the API aligns its slices inside the buffer itself.
    std::vector<std::byte> workspace(sa::nsa_workspace_size(params));
    params.workspace = workspace.data();
    params.workspace_bytes = workspace.size();
    // Temporary memory of the forward alone (0 bytes on the CPU; on CUDA the selection steps' working memory
    // where the workspace cannot hold it).
    std::vector<std::byte> forward_scratch(sa::nsa_forward_scratch_size(params));
    params.scratch = forward_scratch.data();
    params.scratch_bytes = forward_scratch.size();
    sa::nsa_attention(params);
    std::printf("sparseattn %s (CUDA kernels: %s)\n", sa::kVersion, sa::built_with_cuda() ? "yes" : "no");
    std::printf("nsa_attention forward:  o %s  |o| = %.6f  (workspace %zu bytes)\n",
                params.o.shape_string().c_str(), norm(o), workspace.size());

    // Backward for the loss sum(o * d_o).
    std::vector<float> d_o = randn(o.size(), rng);
    std::vector<float> dq(q.size()), dk(k.size()), dv(v.size());
    std::vector<float> dg_cmp(g_cmp.size()), dg_slc(g_slc.size()), dg_swa(g_swa.size());
    std::vector<std::byte> scratch(sa::nsa_backward_scratch_size(params));
    sa::NsaBackwardParams grad;
    grad.forward = params;
    grad.d_o = view(d_o, {B, T, Hq, D});
    grad.dq = view(dq, {B, T, Hq, D});
    grad.dk = view(dk, {B, T, Hkv, D});
    grad.dv = view(dv, {B, T, Hkv, D});
    grad.d_gates = {view(dg_cmp, {B, T, Hq}), view(dg_slc, {B, T, Hq}), view(dg_swa, {B, T, Hq})};
    grad.scratch = scratch.data();
    grad.scratch_bytes = scratch.size();
    sa::nsa_attention_backward(grad);
    std::printf("nsa_attention backward: |dq| = %.6f  |dk| = %.6f  |dv| = %.6f  (scratch %zu bytes)\n",
                norm(dq), norm(dk), norm(dv), scratch.size());
    std::printf("gate gradients:         |dg_cmp| = %.6f  |dg_slc| = %.6f  |dg_swa| = %.6f\n", norm(dg_cmp),
                norm(dg_slc), norm(dg_swa));
    if (!std::isfinite(norm(o)) || !std::isfinite(norm(dq)) || !std::isfinite(norm(dk)) ||
        !std::isfinite(norm(dv))) {
      std::printf("error: non-finite result\n");
      return 1;
    }
  } catch (const sa::Error& e) {
    std::printf("sparseattn error (%s) in %s, argument %s: %s\n", sa::error_kind_name(e.kind()), e.op().c_str(),
                e.argument().c_str(), e.what());
    return 1;
  }

  // Bad arguments are reported before any work, with the operation and the argument named.
  sa::NsaParams bad = params;
  bad.config.cmp_stride = 24;  // must divide the compression block (32)
  try {
    sa::nsa_workspace_size(bad);
    sa::nsa_attention(bad);
    std::printf("error: an invalid config was accepted\n");
    return 1;
  } catch (const sa::Error& e) {
    std::printf("invalid config rejected as expected: [%s] %s\n", sa::error_kind_name(e.kind()), e.what());
  }
  return 0;
}
