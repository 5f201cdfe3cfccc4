// The TMA producer of the warp-specialised wgmma attention kernels (the forward, wgmma_forward.cuh, and the dQ and
// dK/dV, wgmma_backward.cuh): one warp of the producer warpgroup, whose lane 0 copies each whole tile with TMA boxes
// (tma.cuh: 64 columns x kRows rows per box, written with the 128-byte swizzle, the layout of wgmma.cuh's swizzled
// tiles: panel p of a kRows-row tile at tile + p * kRows * 64), so the producer takes a few instructions per tile
// instead of a copy per 16 bytes. The forward's and dQ's consumers are those of their cp.async kernels; the dK/dV's
// repeat its kernel's MMAs and arithmetic.
#pragma once

#include <type_traits>

#include "cuda/attention/masking_policy.cuh"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mma.cuh"
#include "cuda/primitives/pipeline.cuh"
#include "cuda/primitives/tma.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace sparseattn::cuda::attention {

// The masking policies whose wgmma forward, dQ and dK/dV have a TMA variant: those of NSA's compressed and
// sliding-window branches and of flash_attention's dense causal or windowed calls (the policies with terms or gates
// keep the cp.async kernels, which keeps their units' code size and compile time as they are).
template <class Mask>
inline constexpr bool kTmaMask = std::is_same_v<Mask, FlashMask> || std::is_same_v<Mask, CompressedMask>;

// The maps parameter of the cp.async kernels: none (the TMA kernels take ForwardTmaMaps or BackwardTmaMaps).
struct NoTmaMaps {};

// The kernel parameter of the dQ's and the dK/dV's TMA variants: the tensor maps (tma::token_map) of q and d_o with
// boxes of 64 columns x the kernel's query rows (the dQ's query tile, the dK/dV's query step) and of k and v with
// boxes of 64 columns x its key rows (the dQ's key tile, the keys of a dK/dV CTA).
struct BackwardTmaMaps {
  CUtensorMap q, d_o, k, v;
};

// The TMA producer's start, by the producer warpgroup: it gives registers back, down to kRegisters per thread
// (pipeline::ProducerConsumers' count unless the kernel sets its own), and keeps its first warp, whose lane 0 starts
// fetching the tensor maps; false for the other warps, which exit.
template <int kRegisters = pipeline::ProducerConsumers::kProducerRegisters, class... Maps>
__device__ __forceinline__ bool enter_tma_producer(const Maps*... maps) {
  pipeline::release_registers<kRegisters>();
  if (threadIdx.x >= 32) return false;  // one warp produces
  if (threadIdx.x == 0) (tma::prefetch_map(maps), ...);
  return true;
}

// Rows [0, valid) of a kRows x kDim swizzled tile (wgmma.cuh's layout) from rows row0 + r of head `head` of g, zero
// from row `valid` on, by the 32 lanes of a warp with cp.async: lane l copies 16-byte chunk l % 8 of rows l / 8 + 4 i
// of each 64-column panel. Loops that are not unrolled, in few registers: the TMA producer's warp runs it for the
// rare tiles that end before kRows rows.
template <int kRows, int kDim, class T, class G>
__device__ __forceinline__ void warp_copy_tile_rows(T* tile, const Tokens<G>& g, int batch, int row0, int valid,
                                                    int head) {
  const int lane = static_cast<int>(threadIdx.x % 32), chunk = lane % 8;
  // The row's address from values the compiler sees as made here, so that it computes it here, on this rare path,
  // instead of hoisting its 64-bit parts out of the producer's loop into registers that the loop's state needs.
  asm volatile("" : "+r"(batch), "+r"(row0), "+r"(head));
  const G* first = g.row(batch, row0, head) + chunk * 8;
#pragma unroll 1
  for (int panel = 0; panel < kDim / 64; ++panel) {
#pragma unroll 1
    for (int r = lane / 8; r < kRows; r += 4) {
      const bool ok = r < valid;
      cp_async_16(tile + wgmma::swizzled_offset<kRows>(r, panel * 64 + chunk * 8),
                  ok ? first + r * g.row_stride + panel * 64 : g.data, ok ? 16 : 0);
    }
  }
}

// A tile of kRows rows x kDim columns (rows [row0, row0 + valid) of head `head` of g, zero past them) into the
// swizzled `tile` of one use of `ring`, by the TMA producer's warp; it makes one of the arrivals that the use's full
// barrier expects (init_rings_with_full_arrivals: one per tile of the slot; a slot of the dQ holds two tiles, K and
// V or Q and dO). A whole tile (valid >= kRows) is kDim / 64 boxes of `map` at token coordinates (row0, head, batch)
// that lane 0 issues after an arrive.expect_tx of their bytes on the use's full barrier. A tile that ends early is
// copied by the warp with cp.async and zero fill, so that no row past `valid` (another sequence's, or a batch row's
// unwritten padding) reaches shared memory, without waiting: every lane adds an arrival that its copies' landing
// triggers (arrive_on_copies_extra), then, once all lanes have, lane 0 makes the counted arrival, so the phase
// completes when the last copy lands and the producer goes on to the next tile meanwhile. The consumers fence the
// generic proxy's writes for the async proxy after their wait on the full barrier (pipeline.cuh), before their
// wgmma reads and before they release the slot to a later TMA write.
template <int kRows, int kDim, class Ring, class T, class G>
__device__ __forceinline__ void produce_tma_tile(const Ring& ring, unsigned use, T* tile, const Tokens<G>& g,
                                                 const CUtensorMap* map, int batch, int row0, int valid, int head) {
  const bool leader = threadIdx.x % 32 == 0;
  if (valid >= kRows) {
    if (leader) {
      ring.acquire(use);
      tma::load_tile<kRows, kDim>(tile, map, ring.full_barrier(use), head, row0, batch);
    }
  } else {
    ring.acquire(use);
    warp_copy_tile_rows<kRows, kDim>(tile, g, batch, row0, valid, head);
    pipeline::arrive_on_copies_extra(ring.full_barrier(use));
    __syncwarp();
    if (leader) pipeline::arrive(ring.full_barrier(use));
  }
  __syncwarp();
}

}  // namespace sparseattn::cuda::attention
