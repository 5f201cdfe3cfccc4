// Where each sequence lives: on the device, a table from sequence index to its rows (batched or packed, read
// from cu_seqlens on the device: no host sync); on the host, the shape facts of a token tensor.
#pragma once

#include <cstdint>

#include "cuda/primitives/common.cuh"
#include "sparseattn/sequences.h"
#include "sparseattn/tensor.h"

namespace sparseattn::cuda {

// Sequence b: batched sequences are batch rows of fixed length; packed ones are read from cu_seqlens on
// the device (no host sync).
struct SeqTable {
  const std::int32_t* cu_seqlens;  // null for batched
  std::int64_t batched_length;     // T for batched
  std::int64_t count;              // B

  struct Seq {
    std::int64_t batch, begin, length;
  };
  __device__ __forceinline__ Seq operator[](std::int64_t b) const {
    if (cu_seqlens == nullptr) return {b, 0, batched_length};
    return {0, cu_seqlens[b], std::int64_t{cu_seqlens[b + 1]} - cu_seqlens[b]};
  }
};

// Where the query rows and the key rows of sequence b live, for two sets of sequences (flash attention's q and
// k; the tokens and compressed blocks of compressed attention and compress_kv): one SeqTable per side.
struct SeqPairTable {
  SeqTable q, k;

  struct Seq {
    std::int64_t batch, q_begin, T, k_begin, S;
  };
  __device__ __forceinline__ Seq operator[](std::int64_t b) const {
    const SeqTable::Seq sq = q[b], sk = k[b];
    return {sq.batch, sq.begin, sq.length, sk.begin, sk.length};
  }
};

// The last s in [0, count) with bounds[s] <= x, for ascending bounds with bounds[0] <= x: the sequence of packed
// row x when bounds is cu_seqlens, of global block x when bounds are the per-sequence block offsets.
__device__ __forceinline__ std::int64_t last_at_most(const std::int32_t* bounds, std::int64_t count, std::int64_t x) {
  std::int64_t lo = 0, hi = count;
  while (hi - lo > 1) {
    const std::int64_t mid = (lo + hi) / 2;
    if (bounds[mid] <= x) lo = mid; else hi = mid;
  }
  return lo;
}

// Host-side shape facts of a token tensor [B, T, H, D] / packed [N, H, D].
struct HostShape {
  bool packed;
  std::int64_t batch;    // B (packed: cu_seqlens.shape[0] - 1)
  std::int64_t rows;     // T (packed: N)
  std::int64_t max_len;  // upper bound of every sequence length
};

inline HostShape host_shape(const TensorView& tokens, const Sequences& seqs) {
  const bool packed = tokens.rank == 3;
  const std::int64_t rows = tokens.shape[packed ? 0 : 1];
  HostShape s{packed, packed ? seqs.cu_seqlens.shape[0] - 1 : tokens.shape[0], rows, rows};
  if (packed && seqs.max_seqlen > 0 && seqs.max_seqlen < rows) s.max_len = seqs.max_seqlen;
  return s;
}

inline SeqTable seq_table(const HostShape& s, const Sequences& seqs) {
  return {s.packed ? static_cast<const std::int32_t*>(seqs.cu_seqlens.data) : nullptr, s.rows, s.batch};
}

}  // namespace sparseattn::cuda
