#include "api/block_checks.h"

namespace sparseattn::detail {

void check_compression(const Check& check, std::int64_t block, const std::string& block_arg, std::int64_t stride,
                       const std::string& stride_arg) {
  check.positive(block, block_arg);
  check.positive(stride, stride_arg);
  check.require(block % stride == 0, ErrorKind::config, stride_arg,
                "must divide " + block_arg + " (" + std::to_string(block) + "), got " + std::to_string(stride));
}

void check_selection_config(const Check& check, const SelectionConfig& config) {
  check_compression(check, config.cmp_block, "cmp_block", config.cmp_stride, "cmp_stride");
  check.positive(config.sel_block, "sel_block");
  check.require(config.sel_block % config.cmp_stride == 0, ErrorKind::config, "cmp_stride",
                "must divide sel_block (" + std::to_string(config.sel_block) + "), got " +
                    std::to_string(config.cmp_stride));
  check.require(config.cmp_block <= config.sel_block, ErrorKind::config, "sel_block",
                "must be at least cmp_block (" + std::to_string(config.cmp_block) + "), got " +
                    std::to_string(config.sel_block));
  check.positive(config.num_selected, "num_selected");
  check.require(config.num_init >= 0, ErrorKind::config, "num_init",
                "expected a value >= 0, got " + std::to_string(config.num_init));
  check.require(config.num_local >= 0, ErrorKind::config, "num_local",
                "expected a value >= 0, got " + std::to_string(config.num_local));
  check.require(config.num_init + config.num_local <= config.num_selected, ErrorKind::config, "num_selected",
                "must be at least num_init + num_local (" + std::to_string(config.num_init + config.num_local) +
                    "), got " + std::to_string(config.num_selected));
}

std::int64_t compressed_rows(const Check& check, const TokenLayout& tokens, const TensorView& cmp,
                             const std::string& arg, std::int64_t block, std::int64_t stride) {
  if (!tokens.packed) return num_compressed_blocks(tokens.rows, block, stride);
  check.require(cmp.rank == 3, ErrorKind::shape, arg,
                "expected 3 dimensions [Nc, H, D] with the packed layout, got " + cmp.shape_string());
  return cmp.shape[0];
}

std::vector<std::int64_t> compressed_shape(const TokenLayout& tokens, std::int64_t rows, std::int64_t heads,
                                           std::int64_t dim) {
  if (tokens.packed) return {rows, heads, dim};
  return {tokens.batch, rows, heads, dim};
}

namespace {

std::int64_t cu_at(const TensorView& cu, std::int64_t i) {
  return static_cast<const std::int32_t*>(cu.data)[i * cu.stride[0]];
}

}  // namespace

ChunkKeys chunk_key_sequences(const Check& check, const TokenLayout& queries, const Sequences& seqs,
                              const Sequences& seqs_k, bool read_contents) {
  const std::string arg = "cu_seqlens_k";
  ChunkKeys keys;
  keys.layout.packed = queries.packed;
  keys.layout.batch = queries.batch;
  if (!queries.packed) {
    check.require(!seqs_k.cu_seqlens.present(), ErrorKind::config, arg,
                  "is given without cu_seqlens: the keys' sequences need the packed layout of q");
    return keys;
  }
  if (!seqs_k.cu_seqlens.present()) {
    keys.seqs = seqs;
    return keys;
  }
  const TensorView& cu = seqs_k.cu_seqlens;
  check.dtype(cu, arg, DType::int32);
  check.same_device(cu, arg, seqs.cu_seqlens, "cu_seqlens");
  check.shape(cu, arg, {queries.batch + 1});
  check.inner_contiguous(cu, arg);
  check.require(seqs_k.max_seqlen >= 0, ErrorKind::config, arg + " max_seqlen",
                "expected >= 0, got " + std::to_string(seqs_k.max_seqlen));
  keys.seqs = seqs_k;
  keys.chunk = true;
  if (!read_contents || cu.device != DeviceType::cpu) return keys;
  check.require(cu.data != nullptr, ErrorKind::value, arg, "has elements but a null data pointer");
  check.require(cu_at(cu, 0) == 0, ErrorKind::value, arg, "must start at 0, got " + std::to_string(cu_at(cu, 0)));
  for (std::int64_t b = 0; b < queries.batch; ++b) {
    const std::int64_t keys_b = cu_at(cu, b + 1) - cu_at(cu, b);
    const std::int64_t queries_b = cu_at(seqs.cu_seqlens, b + 1) - cu_at(seqs.cu_seqlens, b);
    check.require(keys_b >= 0, ErrorKind::value, arg, "must be non-decreasing (entry " + std::to_string(b + 1) + ")");
    check.require(seqs_k.max_seqlen == 0 || keys_b <= seqs_k.max_seqlen, ErrorKind::value, arg,
                  "sequence " + std::to_string(b) + " has " + std::to_string(keys_b) +
                      " keys, more than max_seqlen_k " + std::to_string(seqs_k.max_seqlen));
    check.require(keys_b >= queries_b, ErrorKind::value, arg,
                  "sequence " + std::to_string(b) + " has " + std::to_string(keys_b) + " keys but " +
                      std::to_string(queries_b) +
                      " queries (cu_seqlens); a query chunk needs at least as many keys as queries");
  }
  return keys;
}

ChunkKeys chunk_keys(const Check& check, const TokenLayout& queries, const Sequences& seqs, const Sequences& seqs_k,
                     const TensorView& k, const std::string& k_arg, bool read_contents) {
  ChunkKeys keys = chunk_key_sequences(check, queries, seqs, seqs_k, read_contents);
  if (!queries.packed) {
    check.require(k.rank == 4, ErrorKind::shape, k_arg,
                  "expected 4 dimensions [B, S, Hkv, D] like q, got " + k.shape_string());
    check.require(k.shape[0] == queries.batch && k.shape[1] >= queries.rows, ErrorKind::shape, k_arg,
                  "expected [B, S, Hkv, D] with B = " + std::to_string(queries.batch) + " and S >= T = " +
                      std::to_string(queries.rows) +
                      " (a query chunk needs at least as many keys as queries), got " + k.shape_string());
    keys.layout.rows = k.shape[1];
    keys.chunk = keys.layout.rows != queries.rows;
    return keys;
  }
  check.packed_rank(k, k_arg, seqs_k.cu_seqlens.present() ? "cu_seqlens_k" : "cu_seqlens");
  keys.layout.rows = k.shape[0];
  const TensorView& cu = keys.seqs.cu_seqlens;
  if (read_contents && cu.device == DeviceType::cpu && cu.data != nullptr) {
    const std::int64_t last = cu_at(cu, queries.batch);
    check.require(last <= keys.layout.rows, ErrorKind::value,
                  seqs_k.cu_seqlens.present() ? "cu_seqlens_k" : "cu_seqlens",
                  "last entry " + std::to_string(last) + " exceeds the " + std::to_string(keys.layout.rows) +
                      " rows of '" + k_arg + "'");
  }
  return keys;
}

ChunkKeys chunk_key_count(const Check& check, const TokenLayout& queries, const Sequences& seqs,
                          const Sequences& seqs_k, std::int64_t seqlen_k) {
  ChunkKeys keys = chunk_key_sequences(check, queries, seqs, seqs_k, /*read_contents=*/true);
  if (queries.packed) {
    check.require(seqlen_k == 0, ErrorKind::config, "seqlen_k",
                  "is the batched key count; packed calls give the keys' sequences as cu_seqlens_k, got " +
                      std::to_string(seqlen_k));
    return keys;
  }
  check.require(seqlen_k == 0 || seqlen_k >= queries.rows, ErrorKind::config, "seqlen_k",
                "expected 0 (as many keys as queries) or at least T = " + std::to_string(queries.rows) +
                    " (a query chunk needs at least as many keys as queries), got " + std::to_string(seqlen_k));
  keys.layout.rows = seqlen_k == 0 ? queries.rows : seqlen_k;
  keys.chunk = keys.layout.rows != queries.rows;
  return keys;
}

}  // namespace sparseattn::detail
