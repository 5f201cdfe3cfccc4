#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "reference/attention_core.h"
#include "reference/dense.h"
#include "reference/query_chunk.h"
#include "reference/reference.h"
#include "reference/sequence_rows.h"

namespace sparseattn::reference {

namespace {

// Importance of the candidate selection blocks 0..floor(t / sel_block) for one query at key position t and KV
// head, from
// the group-summed compressed-attention probabilities P[j]: S[b] = sum_j overlap(j, b) / stride * P[j].
std::vector<double> block_scores(const std::vector<double>& probabilities, std::int64_t t,
                                 const SelectBlocksParams& params) {
  std::vector<double> scores(static_cast<std::size_t>(t / params.sel_block + 1), 0.0);
  for (std::int64_t j = 0; j < static_cast<std::int64_t>(probabilities.size()); ++j) {
    const std::int64_t first = j * params.cmp_stride;
    const std::int64_t end = first + params.cmp_block;  // a visible block ends at or before t
    // cmp_block <= sel_block, so a compressed block overlaps at most two selection blocks.
    for (std::int64_t b = first / params.sel_block; b <= (end - 1) / params.sel_block; ++b) {
      const std::int64_t overlap =
          std::min(end, (b + 1) * params.sel_block) - std::max(first, b * params.sel_block);
      scores[b] += static_cast<double>(overlap) / params.cmp_stride * probabilities[j];
    }
  }
  return scores;
}

// Forced blocks first, then the highest scores (ties to the lower index); ascending, -1 padded.
void choose(const std::vector<double>& scores, const SelectBlocksParams& params, std::int32_t* out) {
  const std::int64_t candidates = static_cast<std::int64_t>(scores.size());
  const std::int64_t current = candidates - 1;  // the query's own block
  std::vector<char> chosen(scores.size(), 0);
  for (std::int64_t b = 0; b < std::min<std::int64_t>(params.num_init, candidates); ++b) chosen[b] = 1;
  for (std::int64_t b = std::max<std::int64_t>(0, current - params.num_local + 1); b <= current; ++b) chosen[b] = 1;
  std::vector<std::int64_t> rest;
  for (std::int64_t b = 0; b < candidates; ++b) {
    if (!chosen[b]) rest.push_back(b);
  }
  std::stable_sort(rest.begin(), rest.end(), [&](std::int64_t a, std::int64_t b) { return scores[a] > scores[b]; });
  const std::int64_t count = std::min<std::int64_t>(params.num_selected, candidates);
  const std::int64_t forced = std::accumulate(chosen.begin(), chosen.end(), std::int64_t{0});
  for (std::int64_t i = 0; i < count - forced; ++i) chosen[rest[i]] = 1;
  std::int64_t slot = 0;
  for (std::int64_t b = 0; b < candidates; ++b) {
    if (chosen[b]) out[slot++] = static_cast<std::int32_t>(b);
  }
  std::fill(out + slot, out + params.num_selected, -1);
}

}  // namespace

void select_blocks(const SelectBlocksParams& params) {
  const detail::TokenLayout layout = token_layout(params.q, params.seqs.cu_seqlens);
  const Dense q = load_tokens(params.q, layout.packed);
  const Dense k_cmp = load_tokens(params.k_cmp, layout.packed);
  const Dense lse = load(params.lse_cmp);  // [B, Hq, T] or packed [Hq, N]
  const std::vector<Span> token_spans = spans(layout, params.seqs.cu_seqlens);
  const std::vector<std::int64_t> offsets = chunk_offsets(
      token_spans, key_spans(layout, params.seqs, params.seqs_k, params.seqlen_k > 0 ? params.seqlen_k : layout.rows));
  detail::TokenLayout cmp_layout = layout;
  cmp_layout.rows = k_cmp.dim(1);
  const std::vector<Span> cmp_spans = spans(cmp_layout, params.cu_seqlens_cmp);

  const std::int64_t heads_q = q.dim(2), dim = q.dim(3), heads_kv = k_cmp.dim(2);
  const std::int64_t group = heads_q / heads_kv;
  const double scale = softmax_scale(params.scale, dim);
  const TensorView covered = covered_rows(params.indices, params.seqs.cu_seqlens);
  std::vector<std::int32_t> indices(static_cast<std::size_t>(covered.numel()));

  parallel_for(static_cast<std::int64_t>(token_spans.size()) * heads_kv, [&](std::int64_t i) {
    const Span& seq = token_spans[i / heads_kv];
    const Span& cmp = cmp_spans[i / heads_kv];
    const std::int64_t h = i % heads_kv, offset = offsets[i / heads_kv];
    for (std::int64_t t = 0; t < seq.length; ++t) {
      const std::int64_t row = seq.batch * layout.rows + seq.begin + t;
      const std::int64_t a = t + offset;  // the query's key position
      std::vector<double> probabilities;  // P[j] for the compressed blocks visible from a
      for (std::int64_t j = 0; j < cmp.length && j * params.cmp_stride + params.cmp_block - 1 <= a; ++j) {
        double p = 0;
        for (std::int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
          const double row_lse = layout.packed ? lse(hq, seq.begin + t) : lse(seq.batch, hq, t);
          if (row_lse == -std::numeric_limits<double>::infinity()) continue;  // the row saw no block
          const double* qt = q.row(seq.batch, seq.begin + t, hq);
          const double* kj = k_cmp.row(cmp.batch, cmp.begin + j, h);
          double logit = 0;
          for (std::int64_t d = 0; d < dim; ++d) logit += qt[d] * kj[d];
          p += std::exp(scale * logit - row_lse);
        }
        probabilities.push_back(p);
      }
      choose(block_scores(probabilities, a, params), params,
             indices.data() + (row * heads_kv + h) * params.num_selected);
    }
  });
  store_int32(indices, covered);
}

}  // namespace sparseattn::reference
