// The inverse index of selected attention (see inverse_index.h).
#include "cuda/selected_attention/inverse_index.h"

#include <algorithm>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <stdexcept>
#include <string>

#include "cuda/primitives/common.cuh"

namespace sparseattn::cuda::selection {

namespace {

__global__ void block_offsets_kernel(const std::int32_t* cu_seqlens, std::int64_t batch, std::int64_t block,
                                     std::int32_t* offsets) {
  using Scan = cub::BlockScan<std::int32_t, 256>;
  __shared__ typename Scan::TempStorage temp;
  std::int32_t carry = 0;
  for (std::int64_t base = 0; base < batch; base += 256) {
    const std::int64_t s = base + threadIdx.x;
    std::int32_t count = 0;
    if (s < batch) {
      const std::int64_t len = std::int64_t{cu_seqlens[s + 1]} - cu_seqlens[s];
      count = static_cast<std::int32_t>(len > 0 ? (len + block - 1) / block : 0);
    }
    std::int32_t prefix, total;
    Scan(temp).ExclusiveSum(count, prefix, total);
    if (s < batch) offsets[s] = carry + prefix;
    carry += total;
    __syncthreads();
  }
}

// One thread per entry (pair, slot j), so that consecutive threads read and write consecutive slots: the key
// h * blocks_bound + global block if the slot lists a block that starts at or before the token's key position (its
// position, or t + S - T for a query chunk), the sentinel otherwise and from the first -1 of the row on; either with
// the entry's chunk above it. I is the type of the
// entry, pair and row arithmetic: 32-bit where all of it fits (launch_make_keys), as 64-bit divisions would take
// most of the kernel's time.
template <class I>
__global__ void make_keys_kernel(IndexView indices, const std::int32_t* cu_seqlens, const std::int32_t* offsets,
                                 KeyConfig c, std::uint32_t* keys, std::int32_t* values) {
  const I e = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x;
  const I num_idx = static_cast<I>(c.num_idx);
  if (e >= static_cast<I>(c.pair_count) * num_idx) return;
  const I local = e / num_idx, j = e - local * num_idx;
  const I chunk = local / static_cast<I>(c.chunk_pairs);
  const I pair = static_cast<I>(c.pair0) + local;
  const I h = pair / static_cast<I>(c.total_rows), row_g = pair - h * static_cast<I>(c.total_rows);
  std::int64_t t = 0, batch = 0, row = row_g, block_base = 0, offset = c.batched_offset;
  bool valid = true;
  if (c.packed) {
    if (c.batch <= 0 || row < cu_seqlens[0] || row >= cu_seqlens[c.batch]) {
      valid = false;
    } else {
      const std::int64_t seq = last_at_most(cu_seqlens, c.batch, row);
      t = row - cu_seqlens[seq];
      block_base = offsets[seq];
      if (c.cu_seqlens_k != nullptr) {
        offset = (std::int64_t{c.cu_seqlens_k[seq + 1]} - c.cu_seqlens_k[seq]) -
                 (std::int64_t{cu_seqlens[seq + 1]} - cu_seqlens[seq]);
      }
    }
  } else {
    const I b = row_g / static_cast<I>(c.rows);
    batch = b;
    row = t = row_g - b * static_cast<I>(c.rows);
    block_base = batch * c.blocks_per_seq;
  }
  std::uint32_t key = c.sentinel;
  if (valid) {
    const std::int32_t* idx = indices.row(batch, row, static_cast<std::int64_t>(h));
    const std::int64_t b = idx[j];
    bool listed = b >= 0;
    for (I i = 0; i < j; ++i) listed = listed && idx[i] >= 0;  // L1 hits: the row's earlier slots
    if (listed && b * c.block <= t + offset) {
      key = static_cast<std::uint32_t>(static_cast<std::int64_t>(h) * c.blocks_bound + block_base + b);
    }
  }
  keys[e] = key | static_cast<std::uint32_t>(static_cast<std::uint64_t>(chunk) << c.chunk_shift);
  values[e] = static_cast<std::int32_t>(c.value_is_entry ? e - chunk * static_cast<I>(c.chunk_pairs) * num_idx : t);
}

__global__ void segments_kernel(const std::uint32_t* keys, std::int64_t count, std::uint32_t sentinel,
                                std::int32_t* seg_begin, std::int32_t* seg_end) {
  const std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const std::uint32_t key = keys[i];
  if (key >= sentinel) return;
  if (i == 0 || keys[i - 1] != key) seg_begin[key] = static_cast<std::int32_t>(i);
  if (i == count - 1 || keys[i + 1] != key) seg_end[key] = static_cast<std::int32_t>(i + 1);
}

}  // namespace

int key_end_bit(std::uint32_t sentinel) {
  int end_bit = 1;
  while ((std::uint64_t{1} << end_bit) <= sentinel) ++end_bit;
  return end_bit;
}

void launch_block_offsets(const std::int32_t* cu_seqlens, std::int64_t batch, std::int64_t block,
                          std::int32_t* offsets, cudaStream_t stream) {
  block_offsets_kernel<<<1, 256, 0, stream>>>(cu_seqlens, batch, block, offsets);
  check_launch("block_offsets_kernel");
}

void launch_make_keys(const IndexView& indices, const std::int32_t* cu_seqlens, const std::int32_t* offsets,
                      const KeyConfig& c, std::uint32_t* keys, std::int32_t* values, cudaStream_t stream) {
  const std::int64_t entries = c.pair_count * c.num_idx;
  if (entries <= 0) return;
  const unsigned blocks = static_cast<unsigned>(ceil_div(entries, 256));
  // Every entry index (with the last block's padding threads) and pair index below 2^32: 32-bit arithmetic.
  const bool narrow = std::int64_t{blocks} * 256 <= std::int64_t{UINT32_MAX} &&
                      c.pair0 + c.pair_count <= std::int64_t{UINT32_MAX} / std::max<std::int64_t>(1, c.num_idx);
  if (narrow) {
    make_keys_kernel<std::uint32_t><<<blocks, 256, 0, stream>>>(indices, cu_seqlens, offsets, c, keys, values);
  } else {
    make_keys_kernel<std::uint64_t><<<blocks, 256, 0, stream>>>(indices, cu_seqlens, offsets, c, keys, values);
  }
  check_launch("make_keys_kernel");
}

std::size_t radix_sort_temp_bytes(std::int64_t count, int end_bit) {
  std::size_t temp_bytes = 0;
  if (count > 0) {
    cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, static_cast<const std::uint32_t*>(nullptr),
                                    static_cast<std::uint32_t*>(nullptr), static_cast<const std::int32_t*>(nullptr),
                                    static_cast<std::int32_t*>(nullptr), static_cast<int>(count), 0, end_bit);
  }
  return temp_bytes;
}

void radix_sort_pairs(void* temp, std::size_t temp_bytes, const std::uint32_t* keys_in, std::uint32_t* keys_out,
                      const std::int32_t* values_in, std::int32_t* values_out, std::int64_t count, int end_bit,
                      cudaStream_t stream) {
  if (count <= 0) return;
  const cudaError_t status = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, values_in,
                                                             values_out, static_cast<int>(count), 0, end_bit, stream);
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("sparseattn: radix sort of the inverse index failed: ") +
                             cudaGetErrorString(status));
  }
}

void launch_segments(const std::uint32_t* sorted_keys, std::int64_t count, std::uint32_t sentinel,
                     std::int32_t* seg_begin, std::int32_t* seg_end, std::int64_t keys, cudaStream_t stream) {
  cudaMemsetAsync(seg_begin, 0, sizeof(std::int32_t) * keys, stream);
  cudaMemsetAsync(seg_end, 0, sizeof(std::int32_t) * keys, stream);
  if (count <= 0) return;
  segments_kernel<<<static_cast<unsigned>(ceil_div(count, 256)), 256, 0, stream>>>(sorted_keys, count, sentinel,
                                                                                  seg_begin, seg_end);
  check_launch("segments_kernel");
}

}  // namespace sparseattn::cuda::selection
