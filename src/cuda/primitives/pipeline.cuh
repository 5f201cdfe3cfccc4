// Warp-specialised pipelines on sm_90a: a producer warpgroup copies tiles into shared-memory stages with
// cp.async and consumer warpgroups compute on them, synchronised by mbarriers instead of CTA-wide barriers
// (PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier").
//
// Each stage has a full and an empty barrier. The producer waits until a stage is empty, issues its copies,
// then `arrive_on_copies`: every producer thread's arrival is triggered when its copies have landed (the
// barrier expects one arrival per producer thread). Consumers wait until the stage is full and, when they no
// longer read it, arrive on its empty barrier (one arrival per consumer thread). Phases alternate; the n-th
// use of a stage waits for parity (n % 2) on full and ((n % 2) ^ 1) on empty (an empty barrier's "previous
// phase" counts as complete, so the first use of every stage passes at once).
//
// cp.async writes through the generic proxy and wgmma reads through the async proxy: a consumer runs
// `fence_shared_for_async` (wgmma.cuh) after its wait on a full barrier and before its MMAs read the stage.
#pragma once

#include <cstdint>

#include "cuda/primitives/mma.cuh"

namespace sparseattn::cuda::pipeline {

// One barrier per thread of a warpgroup for its arrivals; the whole warpgroup arrives or none of it.
__device__ __forceinline__ void init(std::uint64_t* barrier, int expected_arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(expected_arrivals)
               : "memory");
}

// After the barriers of a CTA are initialised (by one thread), before the CTA-wide barrier that publishes them.
__device__ __forceinline__ void fence_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void arrive(std::uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(barrier)) : "memory");
}

// `count` arrivals at once (count >= 1).
__device__ __forceinline__ void arrive(std::uint64_t* barrier, int count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(count)
               : "memory");
#else  // sm_80 arrives one at a time
  for (int i = 0; i < count; ++i) arrive(barrier);
#endif
}

// This thread's arrival, triggered once all of its earlier cp.async copies have landed.
__device__ __forceinline__ void arrive_on_copies(std::uint64_t* barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(shared_address(barrier)) : "memory");
}

// An arrival triggered once all of this thread's earlier cp.async copies have landed, on top of the barrier's expected
// arrivals: the pending count goes up by one now and down by one then, so the phase cannot complete before the
// copies land (a producer whose copies and whose counted arrival are separate: the TMA producer's zero-filled tiles).
__device__ __forceinline__ void arrive_on_copies_extra(std::uint64_t* barrier) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(shared_address(barrier)) : "memory");
}

// Blocks until the phase of the given parity has completed.
__device__ __forceinline__ void wait(std::uint64_t* barrier, int parity) {
  const std::uint32_t address = shared_address(barrier);
  std::uint32_t done = 0;
  do {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(address), "r"(parity)
                 : "memory");
#else  // sm_80 has only the non-blocking test
    asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(address), "r"(parity)
                 : "memory");
#endif
  } while (done == 0);
}

// A ring of kSlots shared-memory slots (pipeline stages or buffers), each with a full and an empty barrier,
// addressed by use: the n-th use of the ring is slot n % kSlots, for the (n / kSlots)-th time.
template <int kSlots>
class Ring {
 public:
  static constexpr int kBarriers = 2 * kSlots;

  // Takes its barriers from `barriers` (kBarriers of them).
  __device__ __forceinline__ explicit Ring(std::uint64_t* barriers) : full_(barriers), empty_(barriers + kSlots) {}

  // By one thread, before the CTA's barriers are published (fence_init, then a CTA-wide barrier).
  __device__ __forceinline__ void init(int producer_threads, int consumer_threads) const {
    for (int i = 0; i < kSlots; ++i) {
      pipeline::init(full_ + i, producer_threads);
      pipeline::init(empty_ + i, consumer_threads);
    }
  }
  __device__ __forceinline__ static int slot(unsigned use) { return static_cast<int>(use % kSlots); }

  // Producer: wait until the slot of this use is empty; then, after issuing its copies, commit them.
  __device__ __forceinline__ void acquire(unsigned use) const { wait(empty_ + slot(use), parity(use) ^ 1); }
  __device__ __forceinline__ void commit(unsigned use) const { arrive_on_copies(full_ + slot(use)); }
  // Consumer: wait until the slot of this use is full; release it once nothing reads it any more.
  __device__ __forceinline__ void wait_full(unsigned use) const { wait(full_ + slot(use), parity(use)); }
  __device__ __forceinline__ void release(unsigned use) const { arrive(empty_ + slot(use)); }
  // Consumer: uses [first, end) that it does not read, passed on in order (each waited for, then released), so
  // that every release lands in its own use's phase.
  __device__ __forceinline__ void pass_on(unsigned first, unsigned end) const {
    for (unsigned use = first; use < end; ++use) {
      wait_full(use);
      release(use);
    }
  }
  // `count` releases at once: for consumers that do not read this use of the slot.
  __device__ __forceinline__ void release(unsigned use, int count) const { arrive(empty_ + slot(use), count); }
  // The full barrier of this use's slot: a TMA producer's copies complete it (expected bytes, one arrival).
  __device__ __forceinline__ std::uint64_t* full_barrier(unsigned use) const { return full_ + slot(use); }

 private:
  __device__ __forceinline__ static int parity(unsigned use) { return static_cast<int>((use / kSlots) & 1u); }
  std::uint64_t* full_;
  std::uint64_t* empty_;
};

// The roles of a warp-specialised CTA: warpgroup 0 produces (copies tiles), warpgroups 1 and 2 consume.
struct ProducerConsumers {
  static constexpr int kConsumers = 2;
  static constexpr int kProducerThreads = 128, kConsumerThreads = 128 * kConsumers;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  // 40 x 128 + 232 x 256 <= 64K registers of an SM; the producer's copy loops fit its 40 unrolled 4 times (each
  // unrolled pass holds a 64-bit address).
  static constexpr int kProducerRegisters = 40, kConsumerRegisters = 232, kProducerUnroll = 4;
};

// By the whole CTA at its start: thread 0 initialises the rings' barriers (arrivals: one per producer thread on
// full, one per consumer thread on empty), which every thread sees after the CTA barrier.
template <class... Rings>
__device__ __forceinline__ void init_rings(const Rings&... rings) {
  if (threadIdx.x == 0) {
    (rings.init(ProducerConsumers::kProducerThreads, ProducerConsumers::kConsumerThreads), ...);
    fence_init();
  }
  __syncthreads();
}

// init_rings for a producer of `full_arrivals` arrivals per filled slot (1: one thread issues TMA copies whose bytes
// complete the phase).
template <class... Rings>
__device__ __forceinline__ void init_rings_with_full_arrivals(int full_arrivals, const Rings&... rings) {
  if (threadIdx.x == 0) {
    (rings.init(full_arrivals, ProducerConsumers::kConsumerThreads), ...);
    fence_init();
  }
  __syncthreads();
}

// Register reallocation between warpgroups (sm_90a): the producer gives registers back, the consumers take them.
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

// Ping-pong of two consumer warpgroups over the tensor cores (named barriers 1 and 2, 256 threads each): a
// warpgroup takes its turn before it issues a step's MMAs and passes it to the other after, so the two issue
// alternately and one's elementwise work runs while the other's MMAs occupy the tensor cores. Warpgroup 0
// goes first.
class Turns {
 public:
  __device__ __forceinline__ explicit Turns(int consumer) : own_(1 + consumer), other_(2 - consumer) {
    if (consumer == 1) pass();
  }
  __device__ __forceinline__ void take() const { asm volatile("bar.sync %0, 256;\n" ::"r"(own_) : "memory"); }
  __device__ __forceinline__ void pass() const { asm volatile("bar.arrive %0, 256;\n" ::"r"(other_) : "memory"); }
  // After the last step: warpgroup 0 takes the turn that warpgroup 1 passed last, so that no arrival on a
  // named barrier is left pending when the CTA exits.
  __device__ __forceinline__ void finish() const {
    if (own_ == 1) take();
  }

 private:
  int own_, other_;
};

// The order of a single warpgroup's MMAs needs no turns (the dQ and dK/dV loops without a producer).
struct NoTurns {
  __device__ __forceinline__ void take() const {}
  __device__ __forceinline__ void pass() const {}
};

}  // namespace sparseattn::cuda::pipeline
