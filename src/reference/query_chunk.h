// The keys of an NSA operation over a query chunk (docs/semantics.md section 11) in the reference backend:
// sequence b has T_b queries and S_b >= T_b keys, and its query row t sits at key position t + S_b - T_b.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/dense.h"

namespace sparseattn::reference {

// The keys' cu_seqlens of a packed call: seqs_k's where given, else q's (absent for the batched layout).
inline const TensorView& key_cu_seqlens(const Sequences& seqs, const Sequences& seqs_k) {
  return seqs_k.cu_seqlens.present() ? seqs_k.cu_seqlens : seqs.cu_seqlens;
}

// The keys' spans: batched {b, 0, batched_keys}; packed from the keys' cu_seqlens.
inline std::vector<Span> key_spans(const detail::TokenLayout& queries, const Sequences& seqs, const Sequences& seqs_k,
                                   std::int64_t batched_keys) {
  detail::TokenLayout keys = queries;
  keys.rows = batched_keys;
  return spans(keys, key_cu_seqlens(seqs, seqs_k));
}

// S_b - T_b for every sequence: what a query row adds to become a key position.
inline std::vector<std::int64_t> chunk_offsets(const std::vector<Span>& query_spans,
                                               const std::vector<Span>& key_spans) {
  std::vector<std::int64_t> offsets(query_spans.size());
  for (std::size_t b = 0; b < offsets.size(); ++b) offsets[b] = key_spans[b].length - query_spans[b].length;
  return offsets;
}

}  // namespace sparseattn::reference
