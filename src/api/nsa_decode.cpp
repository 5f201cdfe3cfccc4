// nsa_decode: validation, the CPU path (gather each sequence's pages and compressed rows, then nsa_attention on the
// contiguous copies: the definition of the result) and the dispatch to the CUDA kernels.
#include "sparseattn/nsa_decode.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "api/block_checks.h"
#include "api/check.h"
#include "api/cuda_limits.h"
#include "sparseattn/compressed_attention.h"
#include "sparseattn/select_blocks.h"
#include "sparseattn/sequences.h"
#ifdef SPARSEATTN_WITH_CUDA
#include "cuda/nsa_decode/ops.h"
#endif

namespace sparseattn {

namespace {

constexpr const char* kGateNames[kNumBranches] = {"g_cmp", "g_slc", "g_swa"};

struct NsaDecodeShapes {
  std::int64_t batch = 0, q_len = 0, q_heads = 0, kv_heads = 0, dim_qk = 0, dim_v = 0;
  std::int64_t page_size = 0, num_pages = 0, max_pages = 0, capacity = 0, max_cmp = 0;
  bool branch[kNumBranches] = {false, false, false};
  bool compressed = false;  // the compressed attention runs: g_cmp, or selection (g_slc) needs its probabilities
};

std::int32_t int32_at(const TensorView& t, std::int64_t i, std::int64_t j = 0) {
  return static_cast<const std::int32_t*>(t.data)[i * t.stride[0] + (t.rank > 1 ? j * t.stride[1] : 0)];
}

NsaDecodeShapes check_nsa_decode(const detail::Check& check, const NsaDecodeParams& p) {
  NsaDecodeShapes s;
  const TensorView& q = p.q;
  check.present(q, "q");
  check.floating(q, "q");
  const DType dtype = q.dtype;
  check.tensor(q, "q", dtype, q, "q");
  check.require(q.rank == 4, ErrorKind::shape, "q", "expected 4 dimensions [B, Tq, Hq, Dqk], got " + q.shape_string());
  s.batch = q.shape[0];
  s.q_len = q.shape[1];
  s.q_heads = q.shape[2];
  s.dim_qk = q.shape[3];
  check.require(s.q_len >= 1 && s.q_len <= 16, ErrorKind::shape, "q",
                "has Tq = " + std::to_string(s.q_len) +
                    " queries per sequence; nsa_decode takes 1 to 16 (nsa_attention takes any chunk)");
  check.require(s.dim_qk > 0 && s.q_heads > 0, ErrorKind::shape, "q",
                "needs heads and a head dim, got " + q.shape_string());

  const TensorView& k = p.k_cache;
  check.tensor(k, "k_cache", dtype, q, "q");
  check.require(k.rank == 4, ErrorKind::shape, "k_cache",
                "expected 4 dimensions [num_pages, page_size, Hkv, Dqk], got " + k.shape_string());
  s.num_pages = k.shape[0];
  s.page_size = k.shape[1];
  s.kv_heads = k.shape[2];
  check.require(s.kv_heads > 0 && s.q_heads % s.kv_heads == 0, ErrorKind::shape, "k_cache",
                "has " + std::to_string(s.kv_heads) + " heads, which must divide the " + std::to_string(s.q_heads) +
                    " query heads of q (group size Hq / Hkv)");
  check.require(s.page_size > 0, ErrorKind::shape, "k_cache", "has pages of 0 keys: " + k.shape_string());
  check.shape(k, "k_cache", {s.num_pages, s.page_size, s.kv_heads, s.dim_qk});
  const TensorView& v = p.v_cache;
  check.tensor(v, "v_cache", dtype, q, "q");
  check.require(v.rank == 4, ErrorKind::shape, "v_cache",
                "expected 4 dimensions [num_pages, page_size, Hkv, Dv], got " + v.shape_string());
  s.dim_v = v.shape[3];
  check.require(s.dim_v > 0, ErrorKind::shape, "v_cache", "needs a head dim, got " + v.shape_string());
  check.shape(v, "v_cache", {s.num_pages, s.page_size, s.kv_heads, s.dim_v});

  check.tensor(p.block_table, "block_table", DType::int32, q, "q");
  check.require(p.block_table.rank == 2 && p.block_table.shape[0] == s.batch, ErrorKind::shape, "block_table",
                "expected shape [B, max_pages] = [" + std::to_string(s.batch) + ", max_pages], got " +
                    p.block_table.shape_string());
  s.max_pages = p.block_table.shape[1];
  s.capacity = s.max_pages * s.page_size;
  check.tensor(p.cache_seqlens, "cache_seqlens", DType::int32, q, "q");
  check.shape(p.cache_seqlens, "cache_seqlens", {s.batch});

  const NsaConfig& c = p.config;
  detail::check_compression(check, c.cmp_block, "cmp_block", c.cmp_stride, "cmp_stride");
  detail::check_selection_config(check, {c.cmp_block, c.cmp_stride, c.sel_block, c.num_selected, c.num_init,
                                         c.num_local});
  check.require(c.window >= 1, ErrorKind::config, "window",
                "expected a width >= 1 (the query included), got " + std::to_string(c.window));
  detail::resolve_scale(check, c.scale, s.dim_qk);

  for (int i = 0; i < kNumBranches; ++i) {
    s.branch[i] = p.gates[i].present();
    if (!s.branch[i]) continue;
    check.tensor(p.gates[i], kGateNames[i], dtype, q, "q");
    check.shape(p.gates[i], kGateNames[i], {s.batch, s.q_len, s.q_heads});
  }
  check.require(s.branch[0] || s.branch[1] || s.branch[2], ErrorKind::config, "gates",
                "at least one branch gate (g_cmp, g_slc or g_swa) must be given");
  s.compressed = s.branch[0] || s.branch[1];
  if (s.compressed) {
    check.tensor(p.k_cmp, "k_cmp", dtype, q, "q");
    check.require(p.k_cmp.rank == 4, ErrorKind::shape, "k_cmp",
                  "expected 4 dimensions [B, max_cmp, Hkv, Dqk], got " + p.k_cmp.shape_string());
    s.max_cmp = p.k_cmp.shape[1];
    check.shape(p.k_cmp, "k_cmp", {s.batch, s.max_cmp, s.kv_heads, s.dim_qk});
    check.tensor(p.v_cmp, "v_cmp", dtype, q, "q");
    check.shape(p.v_cmp, "v_cmp", {s.batch, s.max_cmp, s.kv_heads, s.dim_v});
  }
  check.tensor(p.o, "o", dtype, q, "q");
  check.shape(p.o, "o", {s.batch, s.q_len, s.q_heads, s.dim_v});
  if (p.block_indices.present()) {
    check.require(s.branch[1], ErrorKind::config, "block_indices",
                  "is the output of the selection, which runs only with the g_slc gate");
    check.tensor(p.block_indices, "block_indices", DType::int32, q, "q");
    check.shape(p.block_indices, "block_indices", {s.batch, s.q_len, s.kv_heads, c.num_selected});
  }
  check.require(p.num_splits >= 0, ErrorKind::config, "num_splits",
                "expected 0 (the heuristic) or a positive count, got " + std::to_string(p.num_splits));

  if (q.device != DeviceType::cpu) return s;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    const std::int64_t length = int32_at(p.cache_seqlens, b);
    check.require(length >= s.q_len && length <= s.capacity, ErrorKind::value, "cache_seqlens",
                  "entry " + std::to_string(b) + " is " + std::to_string(length) + ", outside [Tq, capacity] = [" +
                      std::to_string(s.q_len) + ", " + std::to_string(s.capacity) +
                      "] (the new queries are among the cached keys; capacity = max_pages x page_size)");
    const std::int64_t used = (length + s.page_size - 1) / s.page_size;
    for (std::int64_t j = 0; j < used; ++j) {
      const std::int64_t page = int32_at(p.block_table, b, j);
      check.require(page >= 0 && page < s.num_pages, ErrorKind::value, "block_table",
                    "entry [" + std::to_string(b) + ", " + std::to_string(j) + "] is " + std::to_string(page) +
                        ", outside the " + std::to_string(s.num_pages) + " pages of k_cache (sequence " +
                        std::to_string(b) + " reads its first " + std::to_string(used) + " entries)");
    }
    if (s.compressed) {
      const std::int64_t rows = num_compressed_blocks(length, c.cmp_block, c.cmp_stride);
      check.require(rows <= s.max_cmp, ErrorKind::value, "k_cmp",
                    "holds " + std::to_string(s.max_cmp) + " compressed rows per sequence; sequence " +
                        std::to_string(b) + " of " + std::to_string(length) + " keys has " + std::to_string(rows));
    }
  }
  return s;
}

void check_cuda_nsa_decode(const detail::Check& check, const NsaDecodeParams& p, const NsaDecodeShapes& s) {
  detail::check_cuda_half(check, p.q);
  detail::check_cuda_head_dims(check, s.dim_qk, s.dim_v);
  detail::check_cuda_rows(check, p.q, "q");
  detail::check_cuda_rows(check, p.k_cache, "k_cache");
  detail::check_cuda_rows(check, p.v_cache, "v_cache");
  detail::check_cuda_rows(check, p.o, "o");
  if (s.compressed) {
    detail::check_cuda_rows(check, p.k_cmp, "k_cmp");
    detail::check_cuda_rows(check, p.v_cmp, "v_cmp");
  }
#ifdef SPARSEATTN_WITH_CUDA
  const std::int64_t group = s.q_heads / s.kv_heads;
  check.require(group <= 16, ErrorKind::unsupported, "q",
                "has " + std::to_string(group) +
                    " query heads per KV head; the CUDA kernels take groups of at most 16 (one tensor-core tile of "
                    "rows sharing the selection)");
  check.require(s.page_size % 16 == 0, ErrorKind::unsupported, "k_cache",
                "has pages of " + std::to_string(s.page_size) +
                    " keys; the CUDA kernels take page sizes that are multiples of 16");
  check.require(p.config.sel_block % 16 == 0, ErrorKind::unsupported, "sel_block",
                "is " + std::to_string(p.config.sel_block) + "; the CUDA kernels take multiples of 16");
  check.require(s.capacity <= cuda::kNsaDecodeMaxCapacity, ErrorKind::unsupported, "block_table",
                "gives a sequence room for " + std::to_string(s.capacity) + " keys; the CUDA kernels take at most " +
                    std::to_string(cuda::kNsaDecodeMaxCapacity));
  check.require(s.max_cmp <= cuda::kNsaDecodeMaxCapacity, ErrorKind::unsupported, "k_cmp",
                "has " + std::to_string(s.max_cmp) + " rows per sequence; the CUDA kernels take at most " +
                    std::to_string(cuda::kNsaDecodeMaxCapacity));
  const std::string limit = cuda::nsa_decode_launch_limit(p);
  check.require(limit.empty(), ErrorKind::unsupported, "q", limit);
#endif
}

// A view of batch row b of a [B, ...] tensor as a [1, ...] tensor.
TensorView batch_row(const TensorView& t, std::int64_t b) {
  if (!t.present()) return t;
  TensorView r = t;
  r.data = static_cast<unsigned char*>(t.data) + b * t.stride[0] * static_cast<std::int64_t>(element_size(t.dtype));
  r.shape[0] = 1;
  return r;
}

// Copies `rows` token rows [Hkv, D] of sequence b into a contiguous [1, rows, Hkv, D] buffer; row s comes from
// source_row(s), a pointer to its [Hkv, D] block with the given head stride.
template <class SourceRow>
TensorView gather_rows(std::vector<unsigned char>& buffer, const TensorView& like, std::int64_t rows,
                       SourceRow&& source_row) {
  const std::int64_t heads = like.shape[2], dim = like.shape[3];
  const std::size_t elem = element_size(like.dtype), row_bytes = static_cast<std::size_t>(dim) * elem;
  buffer.assign(static_cast<std::size_t>(std::max<std::int64_t>(rows, 0) * heads) * row_bytes + 16, 0);
  for (std::int64_t s = 0; s < rows; ++s) {
    const unsigned char* src = source_row(s);
    for (std::int64_t h = 0; h < heads; ++h) {
      std::memcpy(buffer.data() + static_cast<std::size_t>(s * heads + h) * row_bytes,
                  src + static_cast<std::size_t>(h * like.stride[2]) * elem, row_bytes);
    }
  }
  return TensorView::contiguous(buffer.data(), like.dtype, {1, rows, heads, dim});
}

// The CPU path: per sequence, the keys and compressed rows gathered into contiguous tensors, then nsa_attention
// over the chunk (its last Tq queries); with block_indices, also compressed_attention and select_blocks on them.
void nsa_decode_cpu(const NsaDecodeParams& p, const NsaDecodeShapes& s) {
  const NsaConfig& c = p.config;
  const std::size_t elem = element_size(p.q.dtype);
  std::vector<unsigned char> k_buf, v_buf, kc_buf, vc_buf, workspace, scratch, o_cmp, lse_cmp, select_ws;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    const std::int64_t length = int32_at(p.cache_seqlens, b);
    const auto paged_row = [&](const TensorView& cache) {
      return [&, b](std::int64_t key) {
        const std::int64_t page = int32_at(p.block_table, b, key / s.page_size);
        return static_cast<const unsigned char*>(cache.data) +
               static_cast<std::size_t>(page * cache.stride[0] + (key % s.page_size) * cache.stride[1]) * elem;
      };
    };
    NsaParams n;
    n.q = batch_row(p.q, b);
    n.k = gather_rows(k_buf, p.k_cache, length, paged_row(p.k_cache));
    n.v = gather_rows(v_buf, p.v_cache, length, paged_row(p.v_cache));
    if (s.compressed) {
      const std::int64_t rows = num_compressed_blocks(length, c.cmp_block, c.cmp_stride);
      const auto cmp_row = [&](const TensorView& cmp) {
        return [&, b](std::int64_t j) {
          return static_cast<const unsigned char*>(cmp.data) +
                 static_cast<std::size_t>(b * cmp.stride[0] + j * cmp.stride[1]) * elem;
        };
      };
      n.k_cmp = gather_rows(kc_buf, p.k_cmp, rows, cmp_row(p.k_cmp));
      n.v_cmp = gather_rows(vc_buf, p.v_cmp, rows, cmp_row(p.v_cmp));
    }
    for (int i = 0; i < kNumBranches; ++i) n.gates[i] = batch_row(p.gates[i], b);
    n.o = batch_row(p.o, b);
    n.config = c;
    workspace.assign(nsa_workspace_size(n) + 16, 0);
    scratch.assign(nsa_forward_scratch_size(n) + 16, 0);
    n.workspace = workspace.data();
    n.workspace_bytes = workspace.size();
    n.scratch = scratch.data();
    n.scratch_bytes = scratch.size();
    nsa_attention(n);

    if (!p.block_indices.present()) continue;
    const DType lse_type = detail::lse_dtype(p.q.dtype);
    CompressedAttentionParams ca;
    ca.q = n.q;
    ca.k_cmp = n.k_cmp;
    ca.v_cmp = n.v_cmp;
    o_cmp.assign(static_cast<std::size_t>(s.q_len * s.q_heads * s.dim_v) * elem + 16, 0);
    lse_cmp.assign(static_cast<std::size_t>(s.q_heads * s.q_len) * element_size(lse_type) + 16, 0);
    ca.o = TensorView::contiguous(o_cmp.data(), p.q.dtype, {1, s.q_len, s.q_heads, s.dim_v});
    ca.lse = TensorView::contiguous(lse_cmp.data(), lse_type, {1, s.q_heads, s.q_len});
    ca.seqlen_k = length;
    ca.block = c.cmp_block;
    ca.stride = c.cmp_stride;
    ca.scale = c.scale;
    compressed_attention(ca);
    SelectBlocksParams sb;
    sb.q = n.q;
    sb.k_cmp = n.k_cmp;
    sb.lse_cmp = ca.lse;
    sb.indices = batch_row(p.block_indices, b);
    sb.seqlen_k = length;
    sb.cmp_block = c.cmp_block;
    sb.cmp_stride = c.cmp_stride;
    sb.sel_block = c.sel_block;
    sb.num_selected = c.num_selected;
    sb.num_init = c.num_init;
    sb.num_local = c.num_local;
    sb.scale = c.scale;
    select_ws.assign(select_blocks_workspace_size(sb) + 16, 0);
    sb.workspace = select_ws.data();
    sb.workspace_bytes = select_ws.size();
    select_blocks(sb);
  }
}

}  // namespace

std::size_t nsa_decode_workspace_size(const NsaDecodeParams& params) {
#ifdef SPARSEATTN_WITH_CUDA
  if (params.q.present() && params.q.device == DeviceType::cuda) return cuda::nsa_decode_workspace_size(params);
#endif
  (void)params;
  return 0;
}

void nsa_decode(const NsaDecodeParams& params) {
  const detail::Check check("nsa_decode");
  const NsaDecodeShapes shapes = check_nsa_decode(check, params);
  switch (detail::backend(check, params.q, "q", detail::kCudaBuilt)) {
    case detail::Backend::cpu: nsa_decode_cpu(params, shapes); break;
    case detail::Backend::cuda:
      check_cuda_nsa_decode(check, params, shapes);
      check.buffer(params.workspace, params.workspace_bytes, nsa_decode_workspace_size(params), "workspace",
                   "nsa_decode_workspace_size");
#ifdef SPARSEATTN_WITH_CUDA
      cuda::nsa_decode(params);
#endif
      break;
  }
}

}  // namespace sparseattn
