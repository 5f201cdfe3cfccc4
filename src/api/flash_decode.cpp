#include "sparseattn/flash_decode.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "api/check.h"
#include "api/cuda_limits.h"
#include "reference/flash_decode.h"
#ifdef SPARSEATTN_WITH_CUDA
#include "cuda/decode/ops.h"
#endif

namespace sparseattn {

namespace {

struct DecodeShapes {
  bool paged = false;
  std::int64_t batch = 0, q_len = 0, q_heads = 0, kv_heads = 0, dim_qk = 0, dim_v = 0;
  std::int64_t page_size = 0, num_pages = 0, max_pages = 0;
  std::int64_t capacity = 0;  // keys a sequence can hold: S, or max_pages * page_size
};

// Shapes, dtypes, devices and options; on the CPU also the contents of cache_seqlens and block_table.
DecodeShapes check_decode(const detail::Check& check, const FlashDecodeParams& p) {
  const TensorView& q = p.q;
  check.present(q, "q");
  check.floating(q, "q");
  const DType dtype = q.dtype;
  check.tensor(q, "q", dtype, q, "q");
  check.require(q.rank == 4, ErrorKind::shape, "q", "expected 4 dimensions [B, Tq, Hq, Dqk], got " + q.shape_string());
  DecodeShapes s;
  s.paged = p.block_table.present();
  s.batch = q.shape[0];
  s.q_len = q.shape[1];
  s.q_heads = q.shape[2];
  s.dim_qk = q.shape[3];
  check.require(s.q_len >= 1 && s.q_len <= 16, ErrorKind::shape, "q",
                "has Tq = " + std::to_string(s.q_len) +
                    " queries per sequence; flash_decode takes 1 to 16 (flash_attention takes any)");
  check.require(s.dim_qk > 0, ErrorKind::shape, "q", "needs a positive head dim, got " + q.shape_string());

  const TensorView& k = p.k_cache;
  check.tensor(k, "k_cache", dtype, q, "q");
  const std::string k_form = s.paged ? "[num_pages, page_size, Hkv, Dqk] (a paged cache: block_table is given)"
                                     : "[B, S, Hkv, Dqk] (a dense cache: no block_table)";
  check.require(k.rank == 4, ErrorKind::shape, "k_cache",
                "expected 4 dimensions " + k_form + ", got " + k.shape_string());
  s.kv_heads = k.shape[2];
  check.require(s.kv_heads > 0, ErrorKind::shape, "k_cache", "needs at least one head, got " + k.shape_string());
  check.require(s.q_heads % s.kv_heads == 0, ErrorKind::shape, "k_cache",
                "has " + std::to_string(s.kv_heads) + " heads, which must divide the " + std::to_string(s.q_heads) +
                    " query heads of q (group size Hq / Hkv)");
  if (s.paged) {
    const TensorView& table = p.block_table;
    check.tensor(table, "block_table", DType::int32, q, "q");
    check.require(table.rank == 2 && table.shape[0] == s.batch, ErrorKind::shape, "block_table",
                  "expected shape [B, max_pages] = [" + std::to_string(s.batch) + ", max_pages], got " +
                      table.shape_string());
    s.num_pages = k.shape[0];
    s.page_size = k.shape[1];
    s.max_pages = table.shape[1];
    check.require(s.page_size > 0, ErrorKind::shape, "k_cache",
                  "has pages of 0 keys (dimension 1 of " + k_form + "), got " + k.shape_string());
    check.shape(k, "k_cache", {s.num_pages, s.page_size, s.kv_heads, s.dim_qk});
    s.capacity = s.max_pages * s.page_size;
  } else {
    check.shape(k, "k_cache", {s.batch, k.shape[1], s.kv_heads, s.dim_qk});
    s.capacity = k.shape[1];
  }
  const TensorView& v = p.v_cache;
  check.tensor(v, "v_cache", dtype, q, "q");
  check.require(v.rank == 4, ErrorKind::shape, "v_cache",
                "expected 4 dimensions like k_cache with the last one Dv, got " + v.shape_string());
  s.dim_v = v.shape[3];
  check.shape(v, "v_cache", {k.shape[0], k.shape[1], s.kv_heads, s.dim_v});

  if (p.cache_seqlens.present()) {
    check.tensor(p.cache_seqlens, "cache_seqlens", DType::int32, q, "q");
    check.shape(p.cache_seqlens, "cache_seqlens", {s.batch});
  } else {
    check.require(!s.paged, ErrorKind::config, "cache_seqlens",
                  "is required with a paged cache (block_table): it gives each sequence's key count");
  }
  check.tensor(p.o, "o", dtype, q, "q");
  check.shape(p.o, "o", {s.batch, s.q_len, s.q_heads, s.dim_v});
  check.tensor(p.lse, "lse", detail::lse_dtype(dtype), q, "q");
  check.shape(p.lse, "lse", {s.batch, s.q_heads, s.q_len});
  check.require(p.num_splits >= 0, ErrorKind::config, "num_splits",
                "expected 0 (the heuristic) or a positive count, got " + std::to_string(p.num_splits));
  detail::resolve_scale(check, p.scale, s.dim_qk);

  if (q.device != DeviceType::cpu) return s;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    const std::int64_t length = p.cache_seqlens.present() ? detail::int32_at(p.cache_seqlens, {b}) : s.capacity;
    check.require(length >= 0 && length <= s.capacity, ErrorKind::value, "cache_seqlens",
                  "entry " + std::to_string(b) + " is " + std::to_string(length) + ", outside [0, " +
                      std::to_string(s.capacity) + "] (the keys a sequence's cache holds: " +
                      (s.paged ? "max_pages x page_size" : "S") + ")");
    if (s.paged) detail::check_block_table_pages(check, p.block_table, b, length, s.page_size, s.num_pages);
  }
  return s;
}

void check_cuda_decode(const detail::Check& check, const FlashDecodeParams& p, const DecodeShapes& s) {
  detail::check_cuda_half(check, p.q);
  detail::check_cuda_head_dims(check, s.dim_qk, s.dim_v);
  detail::check_cuda_rows(check, p.q, "q");
  detail::check_cuda_rows(check, p.k_cache, "k_cache");
  detail::check_cuda_rows(check, p.v_cache, "v_cache");
  detail::check_cuda_rows(check, p.o, "o");
#ifdef SPARSEATTN_WITH_CUDA
  if (s.paged) {
    check.require(s.page_size % 16 == 0, ErrorKind::unsupported, "k_cache",
                  "has pages of " + std::to_string(s.page_size) +
                      " keys; the CUDA kernels take page sizes that are multiples of 16 (a 16-key chunk of a tile "
                      "never straddles two pages)");
  }
  check.require(s.capacity <= cuda::kCudaDecodeMaxCapacity, ErrorKind::unsupported,
                s.paged ? "block_table" : "k_cache",
                "gives a sequence room for " + std::to_string(s.capacity) + " keys; the CUDA kernels take at most " +
                    std::to_string(cuda::kCudaDecodeMaxCapacity));
  const std::int64_t rows = s.q_heads / s.kv_heads * s.q_len;
  const std::int64_t ctas = s.batch * s.kv_heads * ((rows + 63) / 64) * cuda::flash_decode_num_splits(p);
  check.require(ctas <= INT_MAX, ErrorKind::unsupported, "num_splits",
                "asks for " + std::to_string(ctas) + " CTAs (sequences x KV heads x row blocks x splits), more than "
                "a CUDA grid holds; use fewer splits");
#endif
}

}  // namespace

std::size_t flash_decode_workspace_size(const FlashDecodeParams& params) {
#ifdef SPARSEATTN_WITH_CUDA
  if (params.q.present() && params.q.device == DeviceType::cuda) return cuda::flash_decode_workspace_size(params);
#endif
  (void)params;
  return 0;
}

std::int64_t flash_decode_num_splits(const FlashDecodeParams& params) {
#ifdef SPARSEATTN_WITH_CUDA
  if (params.q.present() && params.q.device == DeviceType::cuda) return cuda::flash_decode_num_splits(params);
#endif
  (void)params;
  return 1;
}

void flash_decode(const FlashDecodeParams& params) {
  const detail::Check check("flash_decode");
  const DecodeShapes shapes = check_decode(check, params);
  switch (detail::backend(check, params.q, "q", detail::kCudaBuilt)) {
    case detail::Backend::cpu: reference::flash_decode(params); break;
    case detail::Backend::cuda:
      check_cuda_decode(check, params, shapes);
      check.buffer(params.workspace, params.workspace_bytes, flash_decode_workspace_size(params), "workspace",
                   "flash_decode_workspace_size");
#ifdef SPARSEATTN_WITH_CUDA
      cuda::flash_decode(params);
#endif
      break;
  }
}

}  // namespace sparseattn
