// Pieces shared by the two KV-block-outer dK/dV kernels of selected_attention (dkdv.cu: mma.sync;
// dkdv_wgmma.cuh: Hopper warpgroup MMAs): the configuration, which (key, chunk) a CTA takes and the tokens it
// walks, and the epilogue that writes the CTA's dK/dV accumulators (dK unscaled until then).
#pragma once

#include <cstdint>

#include "cuda/primitives/common.cuh"
#include "cuda/selected_attention/dkdv_chunks.cuh"
#include "cuda/selected_attention/common.cuh"

namespace sparseattn::cuda::selection {

struct DkvConfig {
  std::int64_t heads_kv, group, block, rows, blocks_per_seq, batch;  // blocks_per_seq: batched only
  std::int64_t keys, chunk_tokens;
  std::uint32_t blocks_bound;
  bool packed;
  float scale, scale_log2;
};

// One CTA's work: keys [first, end) of block `block` of the keys `seq` of a sequence, KV head h, and the (token,
// group head) pairs of its chunk of the block's inverse-index segment: pair p is token tokens[list_begin + p / G]
// (a query row from q_begin; its key position is that row + offset, common.cuh), head h * G + p % G. slot >= 0:
// the chunk of a split segment, whose fp32 partial goes to that workspace slot.
struct DkvTask {
  SeqTable::Seq seq;
  std::int64_t q_begin, offset;
  std::int64_t h, block, first, end, list_begin, pairs, slot;
};

// The task of CTA (blockIdx.x, key tile `sub` of the block); first >= end: nothing to do. Ends with a barrier.
__device__ __forceinline__ DkvTask dkv_task(const std::uint64_t* chunk_scan, const std::int32_t* offsets,
                                            const std::int32_t* seg_begin, const std::int32_t* seg_end,
                                            const SeqPairTable& seqs, const DkvConfig& c, std::int64_t sub,
                                            int keys) {
  __shared__ std::int64_t task_s[3];
  if (threadIdx.x == 0) {
    const ChunkTask task = locate_chunk(chunk_scan, c.keys, blockIdx.x);
    task_s[0] = task.key;
    task_s[1] = task.chunk;
    task_s[2] = task.slot;
  }
  __syncthreads();
  DkvTask t{};
  const std::int64_t key = task_s[0], chunk = task_s[1];
  t.slot = task_s[2];
  if (key < 0) {
    t.first = t.end = 0;
    return t;
  }
  const BlockOf where = block_of(static_cast<std::uint64_t>(key), c.blocks_bound, c.blocks_per_seq, offsets, c.batch,
                                 c.packed);
  t.h = where.head;
  t.block = where.block;
  const SeqPairTable::Seq pair = seqs[where.seq];
  t.seq = {pair.batch, pair.k_begin, pair.S};
  t.q_begin = pair.q_begin;
  t.offset = pair.S - pair.T;
  t.first = t.block * c.block + sub * keys;
  t.end = min(min((t.block + 1) * c.block, t.seq.length), t.first + keys);
  t.list_begin = seg_begin[key] + chunk * c.chunk_tokens;
  const std::int64_t list_end = min(std::int64_t{seg_end[key]}, t.list_begin + c.chunk_tokens);
  t.pairs = (list_end - t.list_begin) * c.group;
  return t;
}

// Writes the accumulators of this thread's key rows row0 + lane / 4 (+ 8) of the task, columns
// col0 + 8 n + 2 (lane % 4) + {0, 1} of dK (kCk of them) and dV (kCv): as an fp32 partial to the task's slot
// (rows relative to the block, dK unscaled; dkv_reduce_kernel finishes it), else scaled and rounded into dk, dv.
template <class T, int DQK, int DV, int kCk, int kCv>
__device__ __forceinline__ void store_dkv(const float (&dk_acc)[kCk / 8][4], const float (&dv_acc)[kCv / 8][4],
                                          const DkvTask& t, const DkvConfig& c, int row0, int col0_k, int col0_v,
                                          float* partials, const Tokens<T>& dk, const Tokens<T>& dv) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const std::int64_t s = t.first + row0 + lane / 4 + 8 * i;
    if (s >= t.end) continue;
    if (t.slot >= 0) {
      float* dk_part = partials + t.slot * c.block * (DQK + DV);
      float* dv_part = dk_part + c.block * DQK;
      const std::int64_t r = s - t.block * c.block;
#pragma unroll
      for (int nt = 0; nt < kCk / 8; ++nt) {
        const int col = col0_k + nt * 8 + 2 * (lane % 4);
        *reinterpret_cast<float2*>(dk_part + r * DQK + col) = make_float2(dk_acc[nt][2 * i], dk_acc[nt][2 * i + 1]);
      }
#pragma unroll
      for (int nt = 0; nt < kCv / 8; ++nt) {
        const int col = col0_v + nt * 8 + 2 * (lane % 4);
        *reinterpret_cast<float2*>(dv_part + r * DV + col) = make_float2(dv_acc[nt][2 * i], dv_acc[nt][2 * i + 1]);
      }
    } else {
      T* dkp = dk.row(t.seq.batch, t.seq.begin + s, t.h);
      T* dvp = dv.row(t.seq.batch, t.seq.begin + s, t.h);
#pragma unroll
      for (int nt = 0; nt < kCk / 8; ++nt) {
        const int col = col0_k + nt * 8 + 2 * (lane % 4);
        dkp[col] = from_float<T>(dk_acc[nt][2 * i] * c.scale);
        dkp[col + 1] = from_float<T>(dk_acc[nt][2 * i + 1] * c.scale);
      }
#pragma unroll
      for (int nt = 0; nt < kCv / 8; ++nt) {
        const int col = col0_v + nt * 8 + 2 * (lane % 4);
        dvp[col] = from_float<T>(dv_acc[nt][2 * i]);
        dvp[col + 1] = from_float<T>(dv_acc[nt][2 * i + 1]);
      }
    }
  }
}

}  // namespace sparseattn::cuda::selection
