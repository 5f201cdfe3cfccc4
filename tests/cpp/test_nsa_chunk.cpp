// NSA over a query chunk (docs/semantics.md section 11): T queries against S >= T keys, query t at key position
// t + S - T. Every operation's chunk must give the rows of the full call (T = S) at those positions, and its
// gradients those of the full call whose output gradient is zero on the other rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "attention_testing.h"
#include "nsa_case.h"
#include "sparseattn/compressed_attention.h"
#include "sparseattn/select_blocks.h"
#include "sparseattn/selected_attention.h"

namespace sparseattn::test {
namespace {

// Which rows of a full problem a chunk keeps: sequence b keeps its last counts[b] queries. `sources[r]` is the
// full problem's flattened token row (b * S + s batched, the packed row otherwise) of chunk row r (b * T + t
// batched; packed rows past the chunk's sequences have none: -1).
struct ChunkRows {
  bool packed = false;
  std::int64_t batch = 0, keys = 0, rows = 0;  // batched: S and T; packed: Nk and Nq (padding included)
  std::vector<std::int64_t> sources;
  Host<std::int32_t> cu_q, cu_k;  // packed only
};

// Batched: every sequence keeps its last `count` of `keys` queries.
ChunkRows batched_chunk(std::int64_t batch, std::int64_t keys, std::int64_t count) {
  ChunkRows c;
  c.batch = batch;
  c.keys = keys;
  c.rows = count;
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t t = 0; t < count; ++t) c.sources.push_back(b * keys + keys - count + t);
  return c;
}

// Packed: sequence b has keys[b] keys and keeps its last counts[b] queries; `padding` rows follow the keys and
// the queries.
ChunkRows packed_chunk(const std::vector<std::int64_t>& keys, const std::vector<std::int64_t>& counts,
                       std::int64_t padding) {
  ChunkRows c;
  c.packed = true;
  c.batch = static_cast<std::int64_t>(keys.size());
  c.cu_q = host<std::int32_t>({c.batch + 1});
  c.cu_k = host<std::int32_t>({c.batch + 1});
  for (std::int64_t b = 0; b < c.batch; ++b) {
    c.cu_k.data[b + 1] = c.cu_k.data[b] + static_cast<std::int32_t>(keys[b]);
    c.cu_q.data[b + 1] = c.cu_q.data[b] + static_cast<std::int32_t>(counts[b]);
    for (std::int64_t t = 0; t < counts[b]; ++t) c.sources.push_back(c.cu_k.data[b] + keys[b] - counts[b] + t);
  }
  c.keys = c.cu_k.data.back() + padding;
  c.rows = c.cu_q.data.back() + padding;
  c.sources.resize(static_cast<std::size_t>(c.rows), -1);
  return c;
}

// The chunk's rows of a full token tensor ([B, S, ...] or packed [Nk, ...]); `fill` where a row has no source.
template <class T>
Host<T> pick(const Host<T>& full, const ChunkRows& c, T fill = T{}) {
  Host<T> out;
  out.shape = full.shape;
  out.shape[c.packed ? 0 : 1] = c.rows;
  const std::int64_t lead = c.packed ? full.shape[0] : full.shape[0] * full.shape[1];
  const std::int64_t row = full.numel() / std::max<std::int64_t>(lead, 1);
  out.data.assign(static_cast<std::size_t>(c.sources.size() * row), fill);
  for (std::size_t r = 0; r < c.sources.size(); ++r) {
    if (c.sources[r] < 0) continue;
    std::copy_n(full.data.begin() + c.sources[r] * row, row, out.data.begin() + static_cast<std::int64_t>(r) * row);
  }
  return out;
}

// The chunk's columns of a full log-sum-exp ([B, H, S] or packed [H, Nk]).
HostF64 pick_lse(const HostF64& full, const ChunkRows& c) {
  const std::int64_t heads = c.packed ? full.shape[0] : full.shape[1];
  HostF64 out = c.packed ? host<double>({heads, c.rows}, 0.0) : host<double>({c.batch, heads, c.rows});
  const std::int64_t full_rows = c.packed ? full.shape[1] : full.shape[2];
  for (std::size_t r = 0; r < c.sources.size(); ++r) {
    const std::int64_t source = c.sources[r];
    if (source < 0) continue;
    const std::int64_t b = c.packed ? 0 : source / full_rows, s = c.packed ? source : source % full_rows;
    const std::int64_t t = c.packed ? static_cast<std::int64_t>(r) : static_cast<std::int64_t>(r) % c.rows;
    for (std::int64_t h = 0; h < heads; ++h)
      out.data[(b * heads + h) * c.rows + t] = full.data[(b * heads + h) * full_rows + s];
  }
  return out;
}

// A full output gradient that is `chunk_d_o` on the chunk's rows and zero elsewhere.
HostF64 spread(const HostF64& chunk_d_o, const HostF64& full_like, const ChunkRows& c) {
  HostF64 full = full_like;
  std::fill(full.data.begin(), full.data.end(), 0.0);
  const std::int64_t row = chunk_d_o.numel() / std::max<std::int64_t>(static_cast<std::int64_t>(c.sources.size()), 1);
  for (std::size_t r = 0; r < c.sources.size(); ++r) {
    if (c.sources[r] < 0) continue;
    std::copy_n(chunk_d_o.data.begin() + static_cast<std::int64_t>(r) * row, row,
                full.data.begin() + c.sources[r] * row);
  }
  return full;
}

// Whether the full gradient is zero on the rows no chunk query comes from.
bool zero_outside(const HostF64& full, const ChunkRows& c) {
  const std::int64_t lead = c.packed ? full.shape[0] : full.shape[0] * full.shape[1];
  const std::int64_t row = full.numel() / std::max<std::int64_t>(lead, 1);
  std::vector<bool> kept(static_cast<std::size_t>(lead), false);
  for (std::int64_t s : c.sources) {
    if (s >= 0) kept[s] = true;
  }
  for (std::int64_t r = 0; r < lead; ++r) {
    if (kept[r]) continue;
    for (std::int64_t e = 0; e < row; ++e) {
      if (full.data[r * row + e] != 0.0) return false;
    }
  }
  return true;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& expected, double tolerance,
                  const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(expected[i])) {
      EXPECT_EQ(got[i], expected[i]) << what << "[" << i << "]";
    } else {
      EXPECT_NEAR(got[i], expected[i], tolerance * std::max(1.0, std::abs(expected[i]))) << what << "[" << i << "]";
    }
  }
}

// The shapes of a random chunk case: batched (one S and T for every sequence) or packed (per sequence).
struct ChunkShape {
  bool packed;
  std::int64_t batch, keys, count;                 // batched
  std::vector<std::int64_t> seq_keys, seq_counts;  // packed
};

// Chunk sizes that matter: one query (decoding), all of them (T = S), and a random number in between, with S
// not aligned to the blocks; packed batches mix them with empty sequences and sequences without queries.
std::vector<ChunkShape> chunk_shapes(std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> keys(1, 70);
  std::vector<ChunkShape> shapes;
  for (int i = 0; i < 4; ++i) {
    const std::int64_t s = keys(rng);
    for (std::int64_t t : {std::int64_t{1}, s, std::uniform_int_distribution<std::int64_t>(1, s)(rng)}) {
      shapes.push_back({false, 2, s, t, {}, {}});
    }
  }
  for (int i = 0; i < 4; ++i) {
    ChunkShape p{true, 0, 0, 0, {}, {}};
    for (int b = 0; b < 4; ++b) {
      const std::int64_t s = b == 3 && i % 2 == 0 ? 0 : keys(rng);
      const int kind = std::uniform_int_distribution<int>(0, 3)(rng);
      const std::int64_t t = kind == 0   ? std::min<std::int64_t>(1, s)
                             : kind == 1 ? s
                             : kind == 2 ? 0
                                         : std::uniform_int_distribution<std::int64_t>(0, s)(rng);
      p.seq_keys.push_back(s);
      p.seq_counts.push_back(t);
    }
    shapes.push_back(p);
  }
  return shapes;
}

ChunkRows rows_of(const ChunkShape& s) {
  return s.packed ? packed_chunk(s.seq_keys, s.seq_counts, 2) : batched_chunk(s.batch, s.keys, s.count);
}

std::string describe(const ChunkShape& s) {
  std::string text =
      s.packed ? "packed keys/queries:" : "batched S " + std::to_string(s.keys) + " T " + std::to_string(s.count);
  for (std::size_t b = 0; b < s.seq_keys.size(); ++b) {
    text += " " + std::to_string(s.seq_keys[b]) + "/" + std::to_string(s.seq_counts[b]);
  }
  return text;
}

// ------------------------------------------------------------------------------------------ the operations

constexpr std::int64_t kHeadsQ = 4, kHeadsKv = 2, kDim = 5, kDimV = 3;
constexpr int kCmpBlock = 8, kCmpStride = 4, kSelBlock = 16;

std::vector<std::int64_t> token_shape(const ChunkRows& c, std::int64_t rows, std::int64_t heads, std::int64_t dim) {
  if (c.packed) return {rows, heads, dim};
  return {c.batch, rows, heads, dim};
}

std::vector<std::int64_t> lse_shape(const ChunkRows& c, std::int64_t rows) {
  if (c.packed) return {kHeadsQ, rows};
  return {c.batch, kHeadsQ, rows};
}

// The compressed layout of the keys: [B, Sc, ...] or packed by cu_seqlens_cmp (one spare row).
struct CompressedKeys {
  std::int64_t rows = 0;
  Host<std::int32_t> cu_cmp;
};

CompressedKeys compressed_keys(const ChunkRows& c) {
  CompressedKeys k;
  if (!c.packed) {
    k.rows = num_compressed_blocks(c.keys, kCmpBlock, kCmpStride);
    return k;
  }
  k.cu_cmp = host<std::int32_t>({c.batch + 1});
  for (std::int64_t b = 0; b < c.batch; ++b) {
    k.cu_cmp.data[b + 1] = k.cu_cmp.data[b] + static_cast<std::int32_t>(num_compressed_blocks(
                                                  c.cu_k.data[b + 1] - c.cu_k.data[b], kCmpBlock, kCmpStride));
  }
  k.rows = k.cu_cmp.data.back() + 1;
  return k;
}

// The full problem's sequences (T = S): the keys' layout for both q and k.
template <class Params>
void full_sequences(Params& p, ChunkRows& c, CompressedKeys& cmp) {
  if (!c.packed) return;
  p.seqs.cu_seqlens = c.cu_k.view();
  if constexpr (requires { p.cu_seqlens_cmp; }) p.cu_seqlens_cmp = cmp.cu_cmp.view();
}

// The chunk's sequences: q's, and the keys' (cu_seqlens_k, or seqlen_k batched where the op has one).
template <class Params>
void chunk_sequences(Params& p, ChunkRows& c, CompressedKeys& cmp) {
  if (c.packed) {
    p.seqs.cu_seqlens = c.cu_q.view();
    p.seqs_k.cu_seqlens = c.cu_k.view();
    if constexpr (requires { p.cu_seqlens_cmp; }) p.cu_seqlens_cmp = cmp.cu_cmp.view();
  } else if constexpr (requires { p.seqlen_k; }) {
    p.seqlen_k = c.keys;
  }
}

TEST(NsaChunk, CompressedAttentionRowsAndGradients) {
  std::mt19937_64 rng(7);
  for (const ChunkShape& shape : chunk_shapes(rng)) {
    SCOPED_TRACE(describe(shape));
    ChunkRows c = rows_of(shape);
    CompressedKeys cmp = compressed_keys(c);
    HostF64 q = host<double>(token_shape(c, c.keys, kHeadsQ, kDim));
    HostF64 k_cmp = host<double>(token_shape(c, cmp.rows, kHeadsKv, kDim));
    HostF64 v_cmp = host<double>(token_shape(c, cmp.rows, kHeadsKv, kDimV));
    for (HostF64* t : {&q, &k_cmp, &v_cmp}) fill_random(*t, rng);
    // Full call.
    HostF64 o = host<double>(token_shape(c, c.keys, kHeadsQ, kDimV)), lse = host<double>(lse_shape(c, c.keys));
    CompressedAttentionParams full{.q = q.view(),
                                   .k_cmp = k_cmp.view(),
                                   .v_cmp = v_cmp.view(),
                                   .o = o.view(),
                                   .lse = lse.view(),
                                   .block = kCmpBlock,
                                   .stride = kCmpStride};
    full_sequences(full, c, cmp);
    compressed_attention(full);
    // Chunk.
    HostF64 q_chunk = pick(q, c);
    HostF64 o_chunk = host<double>(token_shape(c, c.rows, kHeadsQ, kDimV)),
            lse_chunk = host<double>(lse_shape(c, c.rows));
    CompressedAttentionParams part{.q = q_chunk.view(),
                                   .k_cmp = k_cmp.view(),
                                   .v_cmp = v_cmp.view(),
                                   .o = o_chunk.view(),
                                   .lse = lse_chunk.view(),
                                   .block = kCmpBlock,
                                   .stride = kCmpStride};
    chunk_sequences(part, c, cmp);
    compressed_attention(part);
    expect_close(o_chunk.data, pick(o, c).data, 0, "o");
    expect_close(lse_chunk.data, pick_lse(lse, c).data, 0, "lse");

    HostF64 d_o_chunk = o_chunk;
    fill_random(d_o_chunk, rng);
    HostF64 d_o = spread(d_o_chunk, o, c);
    const auto backward = [&](const CompressedAttentionParams& f, HostF64& q_, HostF64& o_, HostF64& lse_,
                              HostF64& d_o_) {
      HostF64 dq = host<double>(q_.shape), dk = host<double>(k_cmp.shape), dv = host<double>(v_cmp.shape);
      CompressedAttentionBackwardParams b{.q = f.q,
                                          .k_cmp = f.k_cmp,
                                          .v_cmp = f.v_cmp,
                                          .o = o_.view(),
                                          .lse = lse_.view(),
                                          .d_o = d_o_.view(),
                                          .dq = dq.view(),
                                          .dk_cmp = dk.view(),
                                          .dv_cmp = dv.view(),
                                          .seqs = f.seqs,
                                          .seqs_k = f.seqs_k,
                                          .seqlen_k = f.seqlen_k,
                                          .cu_seqlens_cmp = f.cu_seqlens_cmp,
                                          .block = kCmpBlock,
                                          .stride = kCmpStride};
      (void)q_;
      compressed_attention_backward(b);
      return std::array<HostF64, 3>{dq, dk, dv};
    };
    const auto g_full = backward(full, q, o, lse, d_o);
    const auto g_chunk = backward(part, q_chunk, o_chunk, lse_chunk, d_o_chunk);
    expect_close(g_chunk[0].data, pick(g_full[0], c).data, 1e-12, "dq");
    EXPECT_TRUE(zero_outside(g_full[0], c));
    expect_close(g_chunk[1].data, g_full[1].data, 1e-12, "dk_cmp");
    expect_close(g_chunk[2].data, g_full[2].data, 1e-12, "dv_cmp");
  }
}

// Random block indices [.., heads_kv, n] for the full problem (a query per key) over the selection blocks of each
// query's sequence, ascending, -1 padded.
Host<std::int32_t> random_indices(const ChunkRows& c, std::int64_t heads_kv, std::int64_t n, std::int64_t block,
                                  std::mt19937_64& rng) {
  Host<std::int32_t> indices = host<std::int32_t>(token_shape(c, c.keys, heads_kv, n), -1);
  const auto seq_keys = [&](std::int64_t row) -> std::int64_t {
    if (!c.packed) return c.keys;
    for (std::int64_t b = 0; b < c.batch; ++b) {
      if (row < c.cu_k.data[b + 1]) return c.cu_k.data[b + 1] - c.cu_k.data[b];
    }
    return 0;
  };
  const std::int64_t lead = c.packed ? c.keys : c.batch * c.keys;
  for (std::int64_t r = 0; r < lead; ++r) {
    const std::int64_t blocks = num_selection_blocks(seq_keys(r), block);
    for (std::int64_t h = 0; h < heads_kv; ++h) {
      std::int32_t* row = indices.data.data() + (r * heads_kv + h) * n;
      std::int64_t slot = 0;
      for (std::int64_t b = 0; b < blocks && slot < n; ++b) {
        if (rng() % 2 == 0) row[slot++] = static_cast<std::int32_t>(b);
      }
    }
  }
  return indices;
}

TEST(NsaChunk, SelectedAttentionRowsAndGradients) {
  std::mt19937_64 rng(8);
  for (const ChunkShape& shape : chunk_shapes(rng)) {
    SCOPED_TRACE(describe(shape));
    ChunkRows c = rows_of(shape);
    CompressedKeys cmp = compressed_keys(c);
    HostF64 q = host<double>(token_shape(c, c.keys, kHeadsQ, kDim));
    HostF64 k = host<double>(token_shape(c, c.keys, kHeadsKv, kDim));
    HostF64 v = host<double>(token_shape(c, c.keys, kHeadsKv, kDimV));
    for (HostF64* t : {&q, &k, &v}) fill_random(*t, rng);
    Host<std::int32_t> indices = random_indices(c, kHeadsKv, 3, kSelBlock, rng);
    HostF64 o = host<double>(token_shape(c, c.keys, kHeadsQ, kDimV)), lse = host<double>(lse_shape(c, c.keys));
    SelectedAttentionParams full{.q = q.view(),
                                 .k = k.view(),
                                 .v = v.view(),
                                 .indices = indices.view(),
                                 .o = o.view(),
                                 .lse = lse.view(),
                                 .block = kSelBlock};
    full_sequences(full, c, cmp);
    selected_attention(full);
    HostF64 q_chunk = pick(q, c);
    Host<std::int32_t> indices_chunk = pick(indices, c, -1);
    HostF64 o_chunk = host<double>(token_shape(c, c.rows, kHeadsQ, kDimV)),
            lse_chunk = host<double>(lse_shape(c, c.rows));
    SelectedAttentionParams part{.q = q_chunk.view(),
                                 .k = k.view(),
                                 .v = v.view(),
                                 .indices = indices_chunk.view(),
                                 .o = o_chunk.view(),
                                 .lse = lse_chunk.view(),
                                 .block = kSelBlock};
    chunk_sequences(part, c, cmp);
    selected_attention(part);
    expect_close(o_chunk.data, pick(o, c).data, 0, "o");
    expect_close(lse_chunk.data, pick_lse(lse, c).data, 0, "lse");

    HostF64 d_o_chunk = o_chunk;
    fill_random(d_o_chunk, rng);
    HostF64 d_o = spread(d_o_chunk, o, c);
    const auto backward = [&](const SelectedAttentionParams& f, HostF64& d_o_) {
      HostF64 dq = host<double>(std::vector<std::int64_t>(f.q.shape.begin(), f.q.shape.begin() + f.q.rank));
      HostF64 dk = host<double>(k.shape), dv = host<double>(v.shape);
      SelectedAttentionBackwardParams b{.q = f.q,
                                        .k = f.k,
                                        .v = f.v,
                                        .indices = f.indices,
                                        .o = f.o,
                                        .lse = f.lse,
                                        .d_o = d_o_.view(),
                                        .dq = dq.view(),
                                        .dk = dk.view(),
                                        .dv = dv.view(),
                                        .seqs = f.seqs,
                                        .seqs_k = f.seqs_k,
                                        .block = kSelBlock};
      selected_attention_backward(b);
      return std::array<HostF64, 3>{dq, dk, dv};
    };
    const auto g_full = backward(full, d_o);
    const auto g_chunk = backward(part, d_o_chunk);
    expect_close(g_chunk[0].data, pick(g_full[0], c).data, 1e-12, "dq");
    EXPECT_TRUE(zero_outside(g_full[0], c));
    expect_close(g_chunk[1].data, g_full[1].data, 1e-12, "dk");
    expect_close(g_chunk[2].data, g_full[2].data, 1e-12, "dv");
  }
}

TEST(NsaChunk, SelectBlocksChoosesTheFullRowsBlocks) {
  std::mt19937_64 rng(9);
  for (const ChunkShape& shape : chunk_shapes(rng)) {
    SCOPED_TRACE(describe(shape));
    ChunkRows c = rows_of(shape);
    CompressedKeys cmp = compressed_keys(c);
    HostF64 q = host<double>(token_shape(c, c.keys, kHeadsQ, kDim));
    HostF64 k_cmp = host<double>(token_shape(c, cmp.rows, kHeadsKv, kDim));
    HostF64 v_cmp = host<double>(token_shape(c, cmp.rows, kHeadsKv, kDimV));
    for (HostF64* t : {&q, &k_cmp, &v_cmp}) fill_random(*t, rng);
    HostF64 o = host<double>(token_shape(c, c.keys, kHeadsQ, kDimV)), lse = host<double>(lse_shape(c, c.keys));
    CompressedAttentionParams attention{.q = q.view(),
                                        .k_cmp = k_cmp.view(),
                                        .v_cmp = v_cmp.view(),
                                        .o = o.view(),
                                        .lse = lse.view(),
                                        .block = kCmpBlock,
                                        .stride = kCmpStride};
    full_sequences(attention, c, cmp);
    compressed_attention(attention);
    const auto select = [&](HostF64& q_, HostF64& lse_, std::int64_t rows, bool chunk) {
      Host<std::int32_t> indices = host<std::int32_t>(token_shape(c, rows, kHeadsKv, 4), -1);
      SelectBlocksParams p{.q = q_.view(),
                           .k_cmp = k_cmp.view(),
                           .lse_cmp = lse_.view(),
                           .indices = indices.view(),
                           .cmp_block = kCmpBlock,
                           .cmp_stride = kCmpStride,
                           .sel_block = kSelBlock,
                           .num_selected = 4,
                           .num_init = 1,
                           .num_local = 2};
      if (chunk) {
        chunk_sequences(p, c, cmp);
      } else {
        full_sequences(p, c, cmp);
      }
      select_blocks(p);
      return indices;
    };
    const Host<std::int32_t> full = select(q, lse, c.keys, false);
    HostF64 q_chunk = pick(q, c), lse_chunk = pick_lse(lse, c);
    const Host<std::int32_t> part = select(q_chunk, lse_chunk, c.rows, true);
    EXPECT_EQ(part.data, pick(full, c, -1).data);
  }
}

// ------------------------------------------------------------------------------------------ nsa_attention

// The chunk of a full NSA case: its queries' rows of q, the gates and the block indices, the same keys.
NsaCase chunk_case(const NsaCase& full, const ChunkRows& c) {
  NsaCase part = full;
  part.rows = c.rows;
  part.q = pick(full.q, c);
  for (int i = 0; i < kNumBranches; ++i) part.gates[i] = pick(full.gates[i], c);
  part.block_indices = pick(full.block_indices, c, -1);
  if (c.packed) {
    part.cu = c.cu_q;
    part.cu_k = c.cu_k;
  }
  return part;
}

void expect_nsa_chunk(const ChunkShape& shape, std::array<bool, kNumBranches> gates, bool user_cmp, bool user_indices,
                      std::int64_t heads_q, std::int64_t heads_kv, std::mt19937_64& rng) {
  SCOPED_TRACE(describe(shape) + (user_cmp ? " user k_cmp" : "") + (user_indices ? " user indices" : "") + " gates " +
               std::to_string(gates[0]) + std::to_string(gates[1]) + std::to_string(gates[2]));
  ChunkRows c = rows_of(shape);
  NsaCase full = shape.packed ? NsaCase::varlen(shape.seq_keys, 2, heads_q, heads_kv, rng)
                              : NsaCase::batched(shape.batch, shape.keys, heads_q, heads_kv, rng);
  full.use_gate = gates;
  full.use_cmp = user_cmp;
  full.use_indices = user_indices;
  if (user_indices) {
    full.block_indices = random_indices(c, heads_kv, full.config.num_selected, full.config.sel_block, rng);
  }
  NsaCase part = chunk_case(full, c);
  const HostF64 o_full = full.forward();
  expect_close(part.forward().data, pick(o_full, c).data, 0, "o");

  HostF64 d_o_chunk = part.new_output();
  fill_random(d_o_chunk, rng);
  HostF64 d_o = spread(d_o_chunk, o_full, c);
  const NsaGrads g_full = full.backward(d_o);
  const NsaGrads g_part = part.backward(d_o_chunk);
  expect_close(g_part.dq.data, pick(g_full.dq, c).data, 1e-12, "dq");
  EXPECT_TRUE(zero_outside(g_full.dq, c));
  expect_close(g_part.dk.data, g_full.dk.data, 1e-12, "dk");
  expect_close(g_part.dv.data, g_full.dv.data, 1e-12, "dv");
  if (user_cmp) {
    expect_close(g_part.dk_cmp.data, g_full.dk_cmp.data, 1e-12, "dk_cmp");
    expect_close(g_part.dv_cmp.data, g_full.dv_cmp.data, 1e-12, "dv_cmp");
  }
  for (int i = 0; i < kNumBranches; ++i) {
    if (gates[i]) expect_close(g_part.d_gates[i].data, pick(g_full.d_gates[i], c).data, 1e-12, "d_gate");
  }
}

TEST(NsaChunk, NsaAttentionRowsAndGradients) {
  std::mt19937_64 rng(10);
  for (const ChunkShape& shape : chunk_shapes(rng))
    expect_nsa_chunk(shape, {true, true, true}, false, false, 4, 2, rng);
}

TEST(NsaChunk, NsaAttentionBranchesAndUserInputs) {
  std::mt19937_64 rng(11);
  const std::vector<ChunkShape> shapes = chunk_shapes(rng);
  for (std::size_t i = 0; i < shapes.size(); i += 3) {
    expect_nsa_chunk(shapes[i], {true, false, false}, false, false, 3, 1, rng);
    expect_nsa_chunk(shapes[i], {false, true, false}, false, false, 3, 3, rng);
    expect_nsa_chunk(shapes[i], {false, false, true}, false, false, 2, 1, rng);
    expect_nsa_chunk(shapes[i], {true, true, false}, true, false, 4, 2, rng);
    expect_nsa_chunk(shapes[i], {false, true, true}, false, true, 4, 2, rng);
  }
}

TEST(NsaChunk, WorkedExampleOfTheSemantics) {
  // docs/semantics.md section 11: S = 10, T = 3, l = 4, d = 2, l' = 4, n = 2 (1 initial, 1 local).
  std::mt19937_64 rng(12);
  ChunkRows c = batched_chunk(1, 10, 3);
  HostF64 q = host<double>({1, 3, 1, 2}), k_cmp = host<double>({1, 4, 1, 2}), v_cmp = host<double>({1, 4, 1, 2});
  for (HostF64* t : {&q, &k_cmp, &v_cmp}) fill_random(*t, rng);
  HostF64 o = host<double>({1, 3, 1, 2}), lse = host<double>({1, 1, 3});
  CompressedAttentionParams cmp{.q = q.view(),
                                .k_cmp = k_cmp.view(),
                                .v_cmp = v_cmp.view(),
                                .o = o.view(),
                                .lse = lse.view(),
                                .seqlen_k = 10,
                                .block = 4,
                                .stride = 2};
  compressed_attention(cmp);
  Host<std::int32_t> indices = host<std::int32_t>({1, 3, 1, 2}, 7);
  SelectBlocksParams select{.q = q.view(),
                            .k_cmp = k_cmp.view(),
                            .lse_cmp = lse.view(),
                            .indices = indices.view(),
                            .seqlen_k = 10,
                            .cmp_block = 4,
                            .cmp_stride = 2,
                            .sel_block = 4,
                            .num_selected = 2,
                            .num_init = 1,
                            .num_local = 1};
  select_blocks(select);
  EXPECT_EQ(indices.data, (std::vector<std::int32_t>{0, 1, 0, 2, 0, 2}));
  // Query 0 (a = 7) sees compressed blocks 0..2 only: changing block 3 leaves its row alone but not query 2's.
  HostF64 before = o;
  for (std::int64_t d = 0; d < 2; ++d) v_cmp.data[3 * 2 + d] += 1.0;
  compressed_attention(cmp);
  EXPECT_EQ(std::vector<double>(o.data.begin(), o.data.begin() + 4),
            std::vector<double>(before.data.begin(), before.data.begin() + 4));
  EXPECT_NE(o.data[4], before.data[4]);
  (void)c;
}

// ------------------------------------------------------------------------------------------ validation

TEST(NsaChunk, ValidationNamesTheArgument) {
  std::mt19937_64 rng(13);
  HostF64 q = host<double>({1, 6, 2, 4}), k = host<double>({1, 5, 1, 4}), v = host<double>({1, 5, 1, 4});
  HostF64 o = host<double>({1, 6, 2, 4}), lse = host<double>({1, 2, 6});
  Host<std::int32_t> indices = host<std::int32_t>({1, 6, 1, 1}, 0);
  SelectedAttentionParams slc{.q = q.view(),
                              .k = k.view(),
                              .v = v.view(),
                              .indices = indices.view(),
                              .o = o.view(),
                              .lse = lse.view(),
                              .block = 4};
  expect_error([&] { selected_attention(slc); }, ErrorKind::shape, "k");  // S = 5 < T = 6

  HostF64 k_cmp = host<double>({1, 1, 1, 4}), v_cmp = host<double>({1, 1, 1, 4});
  CompressedAttentionParams cmp{.q = q.view(),
                                .k_cmp = k_cmp.view(),
                                .v_cmp = v_cmp.view(),
                                .o = o.view(),
                                .lse = lse.view(),
                                .seqlen_k = 5,
                                .block = 4,
                                .stride = 2};
  expect_error([&] { compressed_attention(cmp); }, ErrorKind::config, "seqlen_k");
  cmp.seqlen_k = 9;  // 3 compressed blocks, k_cmp has 1
  expect_error([&] { compressed_attention(cmp); }, ErrorKind::shape, "k_cmp");

  // Packed: cu_seqlens_k needs cu_seqlens, has [B+1] entries and at least as many keys as queries per sequence.
  HostF64 qp = host<double>({6, 2, 4}), kp = host<double>({8, 1, 4}), vp = host<double>({8, 1, 4});
  HostF64 op = host<double>({6, 2, 4}), lsep = host<double>({2, 6});
  Host<std::int32_t> ip = host<std::int32_t>({6, 1, 1}, 0);
  Host<std::int32_t> cu_q = host<std::int32_t>({3}), cu_k = host<std::int32_t>({3}), cu_short = host<std::int32_t>({2});
  cu_q.data = {0, 2, 6};
  cu_k.data = {0, 5, 8};  // sequence 1: 3 keys, 4 queries
  SelectedAttentionParams packed{.q = qp.view(),
                                 .k = kp.view(),
                                 .v = vp.view(),
                                 .indices = ip.view(),
                                 .o = op.view(),
                                 .lse = lsep.view(),
                                 .seqs = {cu_q.view()},
                                 .seqs_k = {cu_k.view()},
                                 .block = 4};
  expect_error([&] { selected_attention(packed); }, ErrorKind::value, "cu_seqlens_k");
  packed.seqs_k.cu_seqlens = cu_short.view();
  expect_error([&] { selected_attention(packed); }, ErrorKind::shape, "cu_seqlens_k");
  cu_k.data = {0, 2, 8};
  packed.seqs_k.cu_seqlens = cu_k.view();
  selected_attention(packed);  // sequence 1: 6 keys, 2 selection blocks of 4
  ip.data[5] = 1;              // a block of the keys, past the queries' own count (1 block of 4 tokens)
  selected_attention(packed);
  ip.data[5] = 2;
  expect_error([&] { selected_attention(packed); }, ErrorKind::value, "indices");
  ip.data[5] = 0;
  slc.seqs_k.cu_seqlens = cu_k.view();  // batched
  slc.k = q.view();
  slc.v = q.view();
  expect_error([&] { selected_attention(slc); }, ErrorKind::config, "cu_seqlens_k");

  HostF64 k_cmp_packed = host<double>({4, 1, 4}), v_cmp_packed = host<double>({4, 1, 4});
  CompressedAttentionParams cmp_packed{.q = qp.view(),
                                       .k_cmp = k_cmp_packed.view(),
                                       .v_cmp = v_cmp_packed.view(),
                                       .o = op.view(),
                                       .lse = lsep.view(),
                                       .seqs = {cu_q.view()},
                                       .seqs_k = {cu_k.view()},
                                       .seqlen_k = 8,
                                       .block = 4,
                                       .stride = 2};
  expect_error([&] { compressed_attention(cmp_packed); }, ErrorKind::config, "seqlen_k");

  // nsa_attention: the same rules, and the keys' sequences lay out the compressed tensors.
  NsaCase full = NsaCase::varlen({5, 20}, 0, 2, 1, rng);
  NsaCase part = full;
  part.q = host<double>({6, 2, full.dim});
  for (HostF64& g : part.gates) g = host<double>({6, 2}, 0.5);
  part.rows = 6;
  part.cu = cu_q;
  part.cu_k = full.cu;
  part.cu.data = {0, 6, 6};  // sequence 0: 6 queries, 5 keys
  expect_error([&] { part.forward(); }, ErrorKind::value, "cu_seqlens_k");
  part.cu.data = {0, 2, 6};
  EXPECT_NO_THROW(part.forward());
}

}  // namespace
}  // namespace sparseattn::test
