// The group form of selected_attention's query-outer kernels (forward_query_group.cu, dq_query_group.cu): kTokens
// consecutive tokens per CTA, which load each K/V tile of the union of their selected blocks once for all of them.
//
// A producer warpgroup walks the union (GroupTiles) and copies each tile that some token reads into a ring of
// shared-memory stages (cp.async, mbarriers: pipeline.cuh); each consumer warp computes one token as the
// one-token kernel does, taking from its queue the stages it reads. Neighbouring tokens share the forced blocks
// (block 0 and the local ones), and with real inputs often more, so L2 serves fewer sectors than the one-token
// kernels ask for.
//
// The producer walks the tokens' index lists from shared memory (copied there at the start): read from global
// memory, every step of the walk would wait on a load and set the pace of the ring. Measurements of the forward and
// of the variants that were slower (separate K and V stages, a round-robin walk over the tokens, a persistent
// grid): docs/perf/2026-11-24-selected-forward.md and docs/perf/2026-11-27-measurements-from-source-comments.md.
//
// The synchronisation is written in forms that compute-sanitizer's racecheck follows, so that scripts/sanitize.sh
// runs clean (docs/perf/2026-11-27-sanitizer.md: what the earlier forms reported, and the cost):
//  - every consumer lane arrives on a stage's empty barrier after its own reads of the stage (32 arrivals per
//    token; the producer arrives 32 times for a token that does not read the use). A release by lane 0 after a
//    __syncwarp orders the other lanes' reads too under the PTX memory model, but racecheck does not carry them
//    through the __syncwarp and reports the producer's refill of the stage as racing with them;
//  - the queues' words are read and written by shared-memory atomics only (entry, fence, count; count, fence,
//    entry: message passing with relaxed atomics). Plain entries behind a volatile count are ordered as well, but
//    racecheck orders plain accesses by barriers only; it does not report atomics.
#pragma once

#include "cuda/primitives/pipeline.cuh"
#include "cuda/selected_attention/forward_plan.h"
#include "cuda/selected_attention/query_outer_common.cuh"

namespace sparseattn::cuda::selection::query_group {

using namespace query_outer;

// Tokens per CTA: one consumer warp each, beside a producer warpgroup (one producer warp does not issue the
// copies fast enough). Fewer tokens share less and leave fewer consumers per SM.
constexpr int kProducerThreads = 128;
constexpr int kTokens = kGroupTokens;
constexpr int kThreads = kProducerThreads + 32 * kTokens;
// Arrivals on a stage's empty barrier per token and use: one by every lane of its consumer warp after its own
// reads of the stage (see the top of the file), or as many by the producer for a token that does not read it.
constexpr int kReleasesPerToken = 32;

// The key tiles of the union of the blocks that a CTA's tokens t0 .. t0 + kTokens - 1 selected (visible ones:
// starting at or before the token), walked by the CTA's producer warp: lane i < kTokens follows token t0 + i's
// list, and each step takes the smallest block at the lanes' heads, with the tokens that chose it. The lists
// ascend, so a block shared by several tokens comes once (lists that do not ascend still have every entry walked
// once). A block's tiles end at the group's last token.
template <int kKeys>
class GroupTiles {
 public:
  std::int64_t s0 = 0, end = 0;  // the current tile: keys [s0, min(s0 + kKeys, end))
  unsigned choosers = 0;         // bit i: token t0 + i chose the current tile's block

  // lists: the tokens' lists, num_idx entries each (token t0's first).
  __device__ __forceinline__ GroupTiles(const std::int32_t* lists, std::int64_t num_idx, std::int64_t block,
                                        std::int64_t t0, std::int64_t t_last)
      : num_idx_(num_idx), block_(block), t0_(t0), t_last_(t_last) {
    const int lane = static_cast<int>(threadIdx.x % 32);
    list_ = lists + min(lane, static_cast<int>(t_last - t0)) * num_idx;
    if (lane >= kTokens || t0 + lane > t_last) pos_ = num_idx;  // no list
    advance();
  }

  // Moves to the next tile (the rest of the current block, else the next block of the union).
  __device__ __forceinline__ bool next() {
    if (s0 + kKeys < end) {
      s0 += kKeys;
      return true;
    }
    if ((choosers >> (threadIdx.x % 32)) & 1u) advance();
    const int b = __reduce_min_sync(0xffffffffu, head_);
    if (b == kNone) return false;
    choosers = __ballot_sync(0xffffffffu, head_ == b);
    s0 = std::int64_t{b} * block_;
    end = min(s0 + block_, t_last_ + 1);
    return true;
  }
  __device__ __forceinline__ int keys() const { return static_cast<int>(min(end - s0, std::int64_t{kKeys})); }
  // The tokens that attend to the current tile: those that chose its block and come at or after s0.
  __device__ __forceinline__ unsigned readers() const {
    const std::int64_t first = s0 - t0_;  // the first token index at or after s0
    if (first <= 0) return choosers;
    return first >= 32 ? 0u : choosers & ~((1u << first) - 1u);
  }
  // The current tile's keys that token t0 + i attends to, where it is a reader.
  __device__ __forceinline__ int keys_of(int i) const {
    return static_cast<int>(min(min(end, t0_ + i + 1) - s0, std::int64_t{kKeys}));
  }

 private:
  static constexpr int kNone = 0x7fffffff;  // no head: a block index never visible (its first key is past 2^31)
  // This lane's next visible block (the first -1 ends its list).
  __device__ __forceinline__ void advance() {
    head_ = kNone;
    const std::int64_t t = t0_ + threadIdx.x % 32;
    while (++pos_ < num_idx_) {
      const std::int32_t b = list_[pos_];
      if (b < 0) break;
      if (std::int64_t{b} * block_ <= t) {
        head_ = b;
        return;
      }
    }
    pos_ = num_idx_;
  }
  const std::int32_t* list_;
  std::int64_t num_idx_, block_, t0_, t_last_;
  std::int64_t pos_ = -1;
  int head_ = kNone;
};


// The shared memory of a group kernel (group_smem_bytes, forward_plan.h): kRowsBytes of the kernel's own
// per-token rows (rows()), a ring of stages, each one key tile's K and V rows (what the rows leave of 224 KB),
// the ring's barriers, and per token a queue of the uses of the ring it reads.
//
// Only the producer walks the union of the tokens' blocks; a consumer reads its next use from its queue. A queue
// holds at most one lap of the ring: the producer pushes a token's entry for use u after acquiring u, when the
// token has released its read of u - kCount or earlier, so it has popped every entry but the last kCount - 1.
// A consumer waits on a stage's full barrier only for the uses it reads, which the producer acquired before it
// pushed them: the barrier's pending phase is then the use's own (the parity alone would also pass on a stale
// phase, laps earlier).
template <class T, int DQK, int DV, std::size_t kRowsBytes = 0>
struct GroupStages {
  static constexpr int kKeys = kKeysOf<DQK>;
  using K = SmemTile<T, kKeys, DQK>;
  using V = SmemTile<T, kKeys, DV>;
  static constexpr std::size_t kStageBytes = (K::kElements + V::kElements) * sizeof(T);
  static_assert(kRowsBytes % 1024 == 0 && kRowsBytes < 224 * 1024, "the stages start at a swizzle atom");
  static constexpr std::size_t kRoom = 224 * 1024 - kRowsBytes;
  static constexpr int kCount = kRoom / kStageBytes < 16 ? static_cast<int>(kRoom / kStageBytes) : 16;
  static_assert(kCount >= 2, "a ring of two stages at least");
  using Ring = pipeline::Ring<kCount>;
  static constexpr unsigned kDone = 1u << 31;  // in a queue's count: no more entries will come
  static constexpr std::size_t kQueueBytes = kTokens * (2 * kCount + 1) * sizeof(std::uint32_t);
  // Then the tokens' index lists: group_forward_smem_bytes(DQK, DV, num_idx) in all.
  static constexpr std::size_t kFixedBytes = kRowsBytes + kCount * kStageBytes + Ring::kBarriers * 8 + kQueueBytes;
  static_assert(kFixedBytes == group_smem_bytes(DQK, DV, 0, kRowsBytes), "forward_plan.h sizes the same memory");
  unsigned char* base;

  // The kernel's per-token rows (kRowsBytes).
  __device__ __forceinline__ T* rows() const { return reinterpret_cast<T*>(base); }
  __device__ __forceinline__ K k(int stage) const {
    return {reinterpret_cast<T*>(base + kRowsBytes + stage * kStageBytes)};
  }
  __device__ __forceinline__ V v(int stage) const { return {k(stage).base + K::kElements}; }
  __device__ __forceinline__ std::uint64_t* barriers() const {
    return reinterpret_cast<std::uint64_t*>(base + kRowsBytes + kCount * kStageBytes);
  }
  // Token i's queue: entries (use, keys) in slots entry % kCount, and the count pushed so far (| kDone at the end).
  // After the start (thread 0 zeroes the counts before the CTA barrier) every access to these words is an atomic
  // (push, finish, pop), so racecheck reports no hazard on them.
  __device__ __forceinline__ std::uint32_t* uses(int i) const {
    return reinterpret_cast<std::uint32_t*>(barriers() + Ring::kBarriers) + i * 2 * kCount;
  }
  __device__ __forceinline__ std::uint32_t* keys(int i) const { return uses(i) + kCount; }
  __device__ __forceinline__ std::uint32_t* count(int i) const { return uses(kTokens) + i; }
  // Token i's index list: lists() + i * num_idx.
  __device__ __forceinline__ std::int32_t* lists() const {
    return reinterpret_cast<std::int32_t*>(uses(kTokens) + kTokens);
  }

  // By the producer's lane i: token i's entry number n (the entry, then the count: the fences order them as
  // release and acquire would; relaxed atomics on both sides make it the memory model's message passing).
  __device__ __forceinline__ void push(int i, unsigned n, unsigned use, int keys_here) const {
    atomicExch(uses(i) + n % kCount, use);
    atomicExch(keys(i) + n % kCount, static_cast<std::uint32_t>(keys_here));
    __threadfence_block();
    atomicExch(count(i), n + 1);
  }
  __device__ __forceinline__ void finish(int i, unsigned n) const { atomicExch(count(i), n | kDone); }
  // By token i's consumer warp: its entry number n, or false once there are no more. `seen`: the count the warp
  // read last (0 at first), whose entries are all published, so the count is read again only past them. Lane 0
  // reads for the whole warp (an atomic OR of 0 is an atomic read): lanes that saw different counts would leave
  // the loop apart, and the mma.sync that follows needs the whole warp.
  __device__ __forceinline__ bool pop(int i, unsigned n, std::uint32_t& seen, unsigned& use, int& keys_here) const {
    const bool reader = threadIdx.x % 32 == 0;
    if ((seen & ~kDone) <= n) {
      for (;;) {
        if (seen & kDone) return false;
        seen = __shfl_sync(0xffffffffu, reader ? atomicOr(count(i), 0u) : 0u, 0);
        if ((seen & ~kDone) > n) break;
        if (seen & kDone) return false;
        __nanosleep(200);  // off the issue slots of the warps that compute
      }
      __threadfence_block();
    }
    std::uint32_t entry[2] = {0u, 0u};
    if (reader) {
      entry[0] = atomicOr(uses(i) + n % kCount, 0u);
      entry[1] = atomicOr(keys(i) + n % kCount, 0u);
    }
    use = __shfl_sync(0xffffffffu, entry[0], 0);
    keys_here = static_cast<int>(__shfl_sync(0xffffffffu, entry[1], 0));
    return true;
  }
};

// What a group kernel takes from its CTA's coordinates: HeadChunk's, and tokens t0 .. t0 + kTokens - 1 of the
// sequence (blockIdx.x), their index lists staged in shared memory, the walk over their key tiles, and the copies
// of a tile's K and V rows by the producer warpgroup. valid: t0 lies within the sequence.
template <class T, int kKeys, int DQK, int DV>
struct GroupTask : HeadChunk<T> {
  std::int64_t t0;
  bool valid;

  __device__ __forceinline__ GroupTask(const Tokens<const T>& k, const Tokens<const T>& v, const SeqPairTable& seqs,
                                       const QueryOuterConfig& c)
      : HeadChunk<T>(k, v, seqs, c), t0(std::int64_t{blockIdx.x} * kTokens), valid(t0 < this->seq.length) {}
  __device__ __forceinline__ std::int64_t t_last() const { return min(t0 + kTokens, this->seq.length) - 1; }
  // By the whole CTA: the lists of the tokens into `lists` (-1 for tokens past the sequence).
  __device__ __forceinline__ void stage_lists(std::int32_t* lists, const IndexView& indices,
                                              const QueryOuterConfig& c) const {
    const std::int32_t* first = indices.row(this->seq.batch, this->seq.begin + t0, this->h);
    const int num_idx = static_cast<int>(c.num_idx);
    for (int e = static_cast<int>(threadIdx.x); e < kTokens * num_idx; e += static_cast<int>(blockDim.x)) {
      const int token = e / num_idx;
      lists[e] = t0 + token <= t_last() ? first[token * indices.row_stride + e % num_idx] : -1;
    }
  }
  // The walk at the tokens' key positions (a query chunk's queries sit `offset` further).
  __device__ __forceinline__ GroupTiles<kKeys> tiles(const std::int32_t* lists, const QueryOuterConfig& c) const {
    return {lists, c.num_idx, c.block, t0 + this->offset, t_last() + this->offset};
  }
  template <class KTile, class VTile>
  __device__ __forceinline__ void copy(const KTile& ks, const VTile& vs, const GroupTiles<kKeys>& tile) const {
    this->template copy_k<kKeys, DQK, kProducerThreads>(ks, tile.s0, tile.keys());
    this->template copy_v<kKeys, DV, kProducerThreads>(vs, tile.s0, tile.keys());
  }
};

// The producer warp of a group kernel: fills the ring's stages with the walk's tiles that some token reads, in
// walk order; releases each stage at once for the tokens that do not read it (the ring's empty barriers expect
// one release per consumer lane, kReleasesPerToken per token), so that a stage is free as soon as its readers
// are done with it; and pushes each use to its readers' queues.
template <class Task, class Stages>
__device__ __forceinline__ void produce(const Task& task, const Stages& stages, const typename Stages::Ring& ring,
                                        const QueryOuterConfig& c) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  auto tiles = task.tiles(stages.lists(), c);
  unsigned pushed = 0;  // lane i < kTokens: entries pushed to token i's queue
  for (unsigned use = 0; tiles.next();) {
    const unsigned readers = tiles.readers();
    if (readers == 0) continue;
    ring.acquire(use);
    task.copy(stages.k(ring.slot(use)), stages.v(ring.slot(use)), tiles);
    ring.commit(use);
    const int others = kTokens - __popc(readers);
    if (threadIdx.x == 0 && others > 0) ring.release(use, others * kReleasesPerToken);
    if (threadIdx.x < kTokens && ((readers >> lane) & 1u)) stages.push(lane, pushed++, use, tiles.keys_of(lane));
    ++use;
  }
  if (threadIdx.x < kTokens) stages.finish(lane, pushed);
  cp_async_wait<0>();
}

// The start of a group kernel, by the whole CTA: the ring's barriers, the queues' counts and the tokens' index
// lists; then the producer warpgroup fills the ring and is done (false), and the consumer warps claim their
// registers (true). The kernel returns at once on false and finds the consumer's token itself: folding that into
// the return value (a token or -1) makes ptxas allocate the two roles' registers together, and the group kernels
// spill kilobytes.
template <class Task, class Stages>
__device__ __forceinline__ bool start_group(const Task& task, const Stages& stages, const typename Stages::Ring& ring,
                                            const IndexView& indices, const QueryOuterConfig& c) {
  if (threadIdx.x == 0) {
    ring.init(kProducerThreads, kTokens * kReleasesPerToken);
    for (int i = 0; i < kTokens; ++i) *stages.count(i) = 0;
    pipeline::fence_init();
  }
  task.stage_lists(stages.lists(), indices, c);
  __syncthreads();
  if (threadIdx.x < kProducerThreads) {
    pipeline::release_registers<40>();
    produce(task, stages, ring, c);
    return false;
  }
  pipeline::claim_registers<232>();
  return true;
}

}  // namespace sparseattn::cuda::selection::query_group
