// Checks shared by the NSA operations: block-size arithmetic of the config and the shape of compressed K/V.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "api/check.h"

namespace sparseattn::detail {

// Compression blocks: both sizes positive and `stride` divides `block` (ErrorKind::config).
void check_compression(const Check& check, std::int64_t block, const std::string& block_arg, std::int64_t stride,
                       const std::string& stride_arg);

// The block arithmetic of selection, shared by select_blocks and nsa_attention.
struct SelectionConfig {
  std::int64_t cmp_block = 0;
  std::int64_t cmp_stride = 0;
  std::int64_t sel_block = 0;
  std::int64_t num_selected = 0;
  std::int64_t num_init = 0;
  std::int64_t num_local = 0;
};

// ErrorKind::config naming the field: cmp_stride divides cmp_block and sel_block, cmp_block <= sel_block,
// num_selected >= 1, num_init >= 0, num_local >= 0, num_init + num_local <= num_selected.
void check_selection_config(const Check& check, const SelectionConfig& config);

// The first dimension of compressed K/V: num_compressed_blocks(T) for the batched layout; for the packed
// layout the rows of `cmp` itself (which must then have 3 dimensions).
std::int64_t compressed_rows(const Check& check, const TokenLayout& tokens, const TensorView& cmp,
                             const std::string& arg, std::int64_t block, std::int64_t stride);

// [B, rows, heads, dim] or packed [rows, heads, dim].
std::vector<std::int64_t> compressed_shape(const TokenLayout& tokens, std::int64_t rows, std::int64_t heads,
                                           std::int64_t dim);

// The keys of an NSA operation over a query chunk (docs/semantics.md section 11): sequence b has T_b queries
// and S_b >= T_b keys, and its query t sits at key position t + S_b - T_b.
struct ChunkKeys {
  TokenLayout layout;  // of the keys: batched rows S; packed rows Nk (0 for an operation without key tensor)
  Sequences seqs;      // packed: the keys' sequences (seqs_k where given, else q's seqs); batched: absent
  bool chunk = false;  // the keys may outnumber the queries: packed with seqs_k, batched with S != T
};

// Checks seqs_k against q's layout and sequences: absent with the batched layout; packed, int32 [B+1] on the
// device of cu_seqlens; with `read_contents` and on the CPU its contents (starts at 0, non-decreasing, within
// max_seqlen, S_b >= T_b). Returns the key sequences; the layout's rows are left 0.
ChunkKeys chunk_key_sequences(const Check& check, const TokenLayout& queries, const Sequences& seqs,
                              const Sequences& seqs_k, bool read_contents);
// The keys of an operation with a key tensor `k` (selected_attention, nsa_attention): batched [B, S, ...] with
// S >= T, packed [Nk, ...] with the sequences above (cu_seqlens_k's last entry <= Nk on the CPU).
ChunkKeys chunk_keys(const Check& check, const TokenLayout& queries, const Sequences& seqs, const Sequences& seqs_k,
                     const TensorView& k, const std::string& k_arg, bool read_contents);
// The keys of an operation without key tensor (compressed_attention, select_blocks): batched S = seqlen_k
// (0: T), which must be at least T; packed, seqlen_k must be 0.
ChunkKeys chunk_key_count(const Check& check, const TokenLayout& queries, const Sequences& seqs,
                          const Sequences& seqs_k, std::int64_t seqlen_k);

}  // namespace sparseattn::detail
