#include "reference/flash_decode.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "reference/dense.h"
#include "reference/reference.h"

namespace sparseattn::reference {

namespace {

// `rows` consecutive token rows [rows, H, D] of a cache tensor [outer, rows, H, D], starting at (outer, row).
TensorView cache_rows(const TensorView& cache, std::int64_t outer, std::int64_t row, std::int64_t rows) {
  TensorView view = cache;
  view.rank = 3;
  const std::int64_t offset = outer * cache.stride[0] + row * cache.stride[1];
  view.data = static_cast<unsigned char*>(cache.data) + offset * static_cast<std::int64_t>(element_size(cache.dtype));
  view.shape = {rows, cache.shape[2], cache.shape[3], 0};
  view.stride = {cache.stride[1], cache.stride[2], cache.stride[3], 0};
  return view;
}

// Appends keys [0, length) of sequence b, in order, to `out` (float64 rows of H x D values): dense, the sequence's
// own rows; paged, page block_table[b][s / page_size], row s % page_size, one page's run at a time.
void gather(const TensorView& cache, bool paged, const std::vector<std::int32_t>& table, std::int64_t max_pages,
            std::int64_t b, std::int64_t length, std::vector<double>& out) {
  const std::int64_t run = paged ? cache.shape[1] : length;  // rows per contiguous run
  for (std::int64_t s = 0; s < length; s += run) {
    const std::int64_t rows = std::min(run, length - s);
    const TensorView view = paged ? cache_rows(cache, table[b * max_pages + s / run], 0, rows)
                                  : cache_rows(cache, b, s, rows);
    const Dense values = load(view);
    out.insert(out.end(), values.values.begin(), values.values.end());
  }
}

}  // namespace

void flash_decode(const FlashDecodeParams& params) {
  const TensorView& q = params.q;
  const std::int64_t batch = q.shape[0], q_len = q.shape[1], q_heads = q.shape[2], dim_qk = q.shape[3];
  const std::int64_t kv_heads = params.k_cache.shape[2], dim_v = params.v_cache.shape[3];
  const bool paged = params.block_table.present();
  const std::int64_t max_pages = paged ? params.block_table.shape[1] : 0;
  const std::vector<std::int32_t> table = paged ? load_int32(params.block_table) : std::vector<std::int32_t>{};
  const std::int64_t capacity = paged ? max_pages * params.k_cache.shape[1] : params.k_cache.shape[1];
  const std::vector<std::int32_t> lengths =
      params.cache_seqlens.present() ? load_int32(params.cache_seqlens)
                                     : std::vector<std::int32_t>(static_cast<std::size_t>(batch),
                                                                 static_cast<std::int32_t>(capacity));

  // The packed layout of flash_attention: sequence b has queries [b Tq, (b + 1) Tq) and its gathered keys.
  std::vector<std::int32_t> cu_q{0}, cu_k{0};
  std::vector<double> k, v;
  for (std::int64_t b = 0; b < batch; ++b) {
    cu_q.push_back(static_cast<std::int32_t>((b + 1) * q_len));
    cu_k.push_back(cu_k.back() + lengths[b]);
    gather(params.k_cache, paged, table, max_pages, b, lengths[b], k);
    gather(params.v_cache, paged, table, max_pages, b, lengths[b], v);
  }
  Dense q64 = load(q);
  const std::int64_t rows = batch * q_len, keys = cu_k.back();
  std::vector<double> o(static_cast<std::size_t>(rows * q_heads * dim_v));
  std::vector<double> lse(static_cast<std::size_t>(q_heads * rows));

  FlashAttentionParams flash;
  flash.q = TensorView::contiguous(q64.values.data(), DType::float64, {rows, q_heads, dim_qk});
  flash.k = TensorView::contiguous(k.data(), DType::float64, {keys, kv_heads, dim_qk});
  flash.v = TensorView::contiguous(v.data(), DType::float64, {keys, kv_heads, dim_v});
  flash.o = TensorView::contiguous(o.data(), DType::float64, {rows, q_heads, dim_v});
  flash.lse = TensorView::contiguous(lse.data(), DType::float64, {q_heads, rows});
  flash.seqs_q.cu_seqlens = TensorView::contiguous(cu_q.data(), DType::int32, {batch + 1});
  flash.seqs_k.cu_seqlens = TensorView::contiguous(cu_k.data(), DType::int32, {batch + 1});
  flash.causal = params.causal;
  flash.window_left = params.window_left;
  flash.window_right = params.window_right;
  flash.scale = params.scale;
  reference::flash_attention(flash);

  // o is laid out as q's [B, Tq, Hq, Dv] already; lse goes from [Hq, B Tq] to [B, Hq, Tq].
  store(Dense{{batch, q_len, q_heads, dim_v}, std::move(o)}, params.o);
  Dense lse_out = Dense::zeros({batch, q_heads, q_len});
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t h = 0; h < q_heads; ++h) {
      for (std::int64_t t = 0; t < q_len; ++t) lse_out(b, h, t) = lse[h * rows + b * q_len + t];
    }
  }
  store(lse_out, params.lse);
}

}  // namespace sparseattn::reference
