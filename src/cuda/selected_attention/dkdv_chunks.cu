// Chunk table of the dK/dV backward (see dkdv_chunks.cuh).
#include "cuda/selected_attention/dkdv_chunks.cuh"

#include <cub/device/device_scan.cuh>
#include <stdexcept>
#include <string>

#include "cuda/primitives/common.cuh"

namespace sparseattn::cuda::selection {

namespace {

__global__ void chunk_counts_kernel(const std::int32_t* seg_begin, const std::int32_t* seg_end,
                                    const std::int32_t* offsets, SeqTable seqs, ChunkConfig c, std::uint64_t* counts) {
  const std::int64_t key = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (key >= c.keys) return;
  const BlockOf w = block_of(static_cast<std::uint64_t>(key), c.blocks_bound, c.blocks_per_seq, offsets, c.batch,
                             c.packed);
  std::uint64_t value = 0;
  if (w.seq < c.batch && w.block * c.block < seqs[w.seq].length) {
    const std::int64_t length = std::int64_t{seg_end[key]} - seg_begin[key];
    value = length > c.chunk_tokens
                ? static_cast<std::uint64_t>((length + c.chunk_tokens - 1) / c.chunk_tokens) << 32
                : std::uint64_t{1};
  }
  counts[key] = value;
}

}  // namespace

void launch_chunk_counts(const std::int32_t* seg_begin, const std::int32_t* seg_end, const std::int32_t* offsets,
                         const SeqTable& seqs, const ChunkConfig& c, std::uint64_t* counts, cudaStream_t stream) {
  if (c.keys <= 0) return;
  chunk_counts_kernel<<<static_cast<unsigned>(ceil_div(c.keys, 256)), 256, 0, stream>>>(seg_begin, seg_end, offsets,
                                                                                        seqs, c, counts);
  check_launch("chunk_counts_kernel");
}

std::size_t chunk_scan_temp_bytes(std::int64_t keys) {
  std::size_t bytes = 0;
  if (keys > 0) {
    cub::DeviceScan::InclusiveSum(nullptr, bytes, static_cast<const std::uint64_t*>(nullptr),
                                  static_cast<std::uint64_t*>(nullptr), static_cast<int>(keys));
  }
  return bytes;
}

void chunk_scan(void* temp, std::size_t temp_bytes, const std::uint64_t* counts, std::uint64_t* scan,
                std::int64_t keys, cudaStream_t stream) {
  if (keys <= 0) return;
  const cudaError_t status =
      cub::DeviceScan::InclusiveSum(temp, temp_bytes, counts, scan, static_cast<int>(keys), stream);
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("sparseattn: scan of the dK/dV chunk table failed: ") +
                             cudaGetErrorString(status));
  }
}

}  // namespace sparseattn::cuda::selection
