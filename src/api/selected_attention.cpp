#include "sparseattn/selected_attention.h"

#include <string>
#include <vector>

#include "api/check.h"
#include "reference/reference.h"

namespace sparseattn {

namespace {

struct SelectedShapes {
  detail::TokenLayout layout;
  std::int64_t q_heads = 0, kv_heads = 0, dim_qk = 0, dim_v = 0;
};

// Checks the sparse index convention row by row on the CPU: non-negative entries strictly ascending, -1
// only as tail padding, every entry < num_selection_blocks(T_b). Packed rows past cu_seqlens[B] are ignored.
void check_index_contents(const detail::Check& check, const TensorView& indices, const detail::TokenLayout& layout,
                          const Sequences& seqs, std::int64_t block) {
  const auto* data = static_cast<const std::int32_t*>(indices.data);
  const auto cu = [&](std::int64_t i) {
    return std::int64_t{static_cast<const std::int32_t*>(seqs.cu_seqlens.data)[i * seqs.cu_seqlens.stride[0]]};
  };
  const int r = indices.rank;
  const std::int64_t kv_heads = indices.shape[r - 2], count = indices.shape[r - 1];
  for (std::int64_t b = 0; b < layout.batch; ++b) {
    const std::int64_t begin = layout.packed ? cu(b) : 0;
    const std::int64_t length = layout.packed ? cu(b + 1) - begin : layout.rows;
    const std::int64_t blocks = num_selection_blocks(length, block);
    for (std::int64_t t = 0; t < length; ++t) {
      for (std::int64_t h = 0; h < kv_heads; ++h) {
        const std::int64_t base = layout.packed ? (begin + t) * indices.stride[0] + h * indices.stride[1]
                                                : b * indices.stride[0] + t * indices.stride[1] + h * indices.stride[2];
        const auto where = [&](std::int64_t j) {
          return "row (sequence " + std::to_string(b) + ", token " + std::to_string(t) + ", KV head " +
                 std::to_string(h) + "), entry " + std::to_string(j) + ": ";
        };
        std::int64_t previous = -1;
        bool padding = false;
        for (std::int64_t j = 0; j < count; ++j) {
          const std::int64_t index = data[base + j * indices.stride[r - 1]];
          if (index == -1) {
            padding = true;
            continue;
          }
          check.require(index >= 0, ErrorKind::value, "indices",
                        where(j) + std::to_string(index) + " is negative (only -1 pads)");
          check.require(!padding, ErrorKind::value, "indices",
                        where(j) + std::to_string(index) + " follows a -1 (padding must be at the tail)");
          check.require(index > previous, ErrorKind::value, "indices",
                        where(j) + std::to_string(index) + " is not above the previous entry " +
                            std::to_string(previous) + " (entries must be strictly ascending)");
          check.require(index < blocks, ErrorKind::value, "indices",
                        where(j) + std::to_string(index) + " is out of range: a sequence of " +
                            std::to_string(length) + " tokens has " + std::to_string(blocks) +
                            " selection blocks of " + std::to_string(block));
          previous = index;
        }
      }
    }
  }
}

// Checks what the forward and the backward share (for the backward, o and lse are inputs).
template <class Params>
SelectedShapes check_common(const detail::Check& check, const Params& params) {
  const TensorView& q = params.q;
  check.present(q, "q");
  check.floating(q, "q");
  const DType dtype = q.dtype;
  check.tensor(q, "q", dtype, q, "q");
  SelectedShapes shapes;
  shapes.layout = check.layout(q, "q", params.seqs, "cu_seqlens");
  check.positive(params.block, "block");
  shapes.q_heads = q.shape[q.rank - 2];
  shapes.dim_qk = q.shape[q.rank - 1];
  check.require(shapes.dim_qk > 0, ErrorKind::shape, "q", "needs a positive head dim, got " + q.shape_string());

  const TensorView& k = params.k;
  check.tensor(k, "k", dtype, q, "q");
  check.require(k.rank == q.rank, ErrorKind::shape, "k",
                "expected " + std::to_string(q.rank) + " dimensions like q, got " + k.shape_string());
  shapes.kv_heads = k.shape[k.rank - 2];
  check.require(shapes.kv_heads > 0, ErrorKind::shape, "k", "needs at least one head, got " + k.shape_string());
  check.require(shapes.q_heads % shapes.kv_heads == 0, ErrorKind::shape, "k",
                "has " + std::to_string(shapes.kv_heads) + " heads, which must divide the " +
                    std::to_string(shapes.q_heads) + " query heads of q (group size Hq / Hkv)");
  check.shape(k, "k", shapes.layout.tokens(shapes.kv_heads, shapes.dim_qk));
  check.tensor(params.v, "v", dtype, q, "q");
  shapes.dim_v = params.v.shape[params.v.rank - 1];
  check.shape(params.v, "v", shapes.layout.tokens(shapes.kv_heads, shapes.dim_v));

  const TensorView& indices = params.indices;
  check.tensor(indices, "indices", DType::int32, q, "q");
  const std::int64_t count = indices.shape[indices.rank - 1];
  check.require(count >= 1, ErrorKind::shape, "indices",
                "needs at least one slot per row (n >= 1), got " + indices.shape_string());
  check.shape(indices, "indices", shapes.layout.tokens(shapes.kv_heads, count));
  check.tensor(params.o, "o", dtype, q, "q");
  check.shape(params.o, "o", shapes.layout.tokens(shapes.q_heads, shapes.dim_v));
  check.tensor(params.lse, "lse", detail::lse_dtype(dtype), q, "q");
  check.shape(params.lse, "lse", shapes.layout.lse(shapes.q_heads));
  detail::resolve_scale(check, params.scale, shapes.dim_qk);
  if (indices.device == DeviceType::cpu) {
    check_index_contents(check, indices, shapes.layout, params.seqs, params.block);
  }
  return shapes;
}

}  // namespace

void selected_attention(const SelectedAttentionParams& params) {
  const detail::Check check("selected_attention");
  check_common(check, params);
  switch (detail::backend(check, params.q, "q", /*has_cuda_kernels=*/false)) {
    case detail::Backend::cpu: reference::selected_attention(params); break;
    case detail::Backend::cuda: break;
  }
}

void selected_attention_backward(const SelectedAttentionBackwardParams& params) {
  const detail::Check check("selected_attention_backward");
  const SelectedShapes shapes = check_common(check, params);
  const DType dtype = params.q.dtype;
  check.tensor(params.d_o, "d_o", dtype, params.q, "q");
  check.shape(params.d_o, "d_o", shapes.layout.tokens(shapes.q_heads, shapes.dim_v));
  check.tensor(params.dq, "dq", dtype, params.q, "q");
  check.shape(params.dq, "dq", shapes.layout.tokens(shapes.q_heads, shapes.dim_qk));
  check.tensor(params.dk, "dk", dtype, params.q, "q");
  check.shape(params.dk, "dk", shapes.layout.tokens(shapes.kv_heads, shapes.dim_qk));
  check.tensor(params.dv, "dv", dtype, params.q, "q");
  check.shape(params.dv, "dv", shapes.layout.tokens(shapes.kv_heads, shapes.dim_v));
  switch (detail::backend(check, params.q, "q", /*has_cuda_kernels=*/false)) {
    case detail::Backend::cpu: reference::selected_attention_backward(params); break;
    case detail::Backend::cuda: break;
  }
}

}  // namespace sparseattn
