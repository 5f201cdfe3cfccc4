// flash_decode on CUDA: the plan from shapes and the device, the workspace's arrival counters zeroed, then the
// split-KV kernel (launch.h), whose CTAs also merge the splits' partials (kernel.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/decode/kernel.cuh"
#include "cuda/decode/launch.h"
#include "cuda/decode/ops.h"
#include "cuda/decode/plan.h"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/launch.cuh"
#include "sparseattn/sequences.h"

namespace sparseattn::cuda {

namespace {

using decode::DecodePlan;

bool paged(const FlashDecodeParams& p) { return p.block_table.present(); }

// The shared memory of one SM (228 KB on an H100); 0 when the query fails, which plans one CTA per SM.
std::size_t smem_per_multiprocessor(int device) {
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return static_cast<std::size_t>(bytes);
}

// The plan of a call from its shapes and device (a default single-split plan where the shapes are not those of a
// valid call: the size queries run before validation).
DecodePlan plan_of(const FlashDecodeParams& p) {
  if (p.q.rank != 4 || p.k_cache.rank != 4 || p.v_cache.rank != 4 || (paged(p) && p.block_table.rank != 2)) return {};
  const std::int64_t capacity = paged(p) ? p.block_table.shape[1] * p.k_cache.shape[1] : p.k_cache.shape[1];
  return decode::plan_decode(p.q.shape[0], p.q.shape[1], p.q.shape[2], p.k_cache.shape[2],
                             static_cast<int>(p.q.shape[3]), static_cast<int>(p.v_cache.shape[3]), capacity,
                             p.num_splits, multiprocessors(p.q.device_index),
                             smem_per_multiprocessor(p.q.device_index));
}

decode::DecodeWorkspace workspace_of(const FlashDecodeParams& p, const DecodePlan& plan) {
  if (p.q.rank != 4 || p.k_cache.rank != 4 || p.v_cache.rank != 4) return {};
  return decode::decode_workspace(plan, p.q.shape[0], p.q.shape[2], p.k_cache.shape[2], p.q.shape[1],
                                  p.v_cache.shape[3]);
}

template <class T>
decode::Cache<T> cache_of(const TensorView& t) {
  return {static_cast<const T*>(t.data), t.stride[0], t.stride[1], t.stride[2]};
}

}  // namespace

std::int64_t flash_decode_num_splits(const FlashDecodeParams& params) { return plan_of(params).splits; }

std::size_t flash_decode_workspace_size(const FlashDecodeParams& params) {
  return workspace_of(params, plan_of(params)).bytes;
}

void flash_decode(const FlashDecodeParams& p) {
  const std::int64_t batch = p.q.shape[0], q_len = p.q.shape[1], q_heads = p.q.shape[2];
  if (batch == 0 || q_len == 0 || q_heads == 0) return;
  const DeviceGuard guard(p.q.device_index);
  const DecodePlan plan = plan_of(p);
  const decode::DecodeWorkspace workspace = workspace_of(p, plan);
  const int dqk = static_cast<int>(p.q.shape[3]), dv = static_cast<int>(p.v_cache.shape[3]);
  const auto stream = static_cast<cudaStream_t>(p.stream);
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    decode::DecodeArgs<T> a{};
    a.q = tokens_of<const T>(p.q);
    a.k = cache_of<T>(p.k_cache);
    a.v = cache_of<T>(p.v_cache);
    if (paged(p)) {
      a.block_table = static_cast<const std::int32_t*>(p.block_table.data);
      a.table_batch_stride = p.block_table.stride[0];
      a.table_page_stride = p.block_table.stride[1];
    }
    if (p.cache_seqlens.present()) {
      a.cache_seqlens = static_cast<const std::int32_t*>(p.cache_seqlens.data);
      a.seqlens_stride = p.cache_seqlens.stride[0];
    }
    a.o = tokens_of<T>(p.o);
    a.lse = lse_of<float>(p.lse);
    if (plan.splits > 1) {
      auto* base = static_cast<unsigned char*>(p.workspace);
      a.partial_o = reinterpret_cast<float*>(base);
      a.partial_lse = reinterpret_cast<float*>(base + workspace.lse_offset);
      if (decode::merge_groups(plan.splits) > 1) {
        a.group_o = reinterpret_cast<float*>(base + workspace.group_o_offset);
        a.group_lse = reinterpret_cast<float*>(base + workspace.group_lse_offset);
      }
      a.counters = reinterpret_cast<std::int32_t*>(base + workspace.counters_offset);
      zero_async(a.counters, workspace.counter_bytes, stream, "flash_decode's merge counters");
    }
    a.batch = static_cast<int>(batch);
    a.q_len = static_cast<int>(q_len);
    a.q_heads = static_cast<int>(q_heads);
    a.kv_heads = static_cast<int>(p.k_cache.shape[2]);
    a.group = static_cast<int>(q_heads / p.k_cache.shape[2]);
    a.capacity = static_cast<int>(plan.capacity);
    a.page_size = static_cast<int>(p.k_cache.shape[1]);
    a.num_pages = static_cast<int>(std::min<std::int64_t>(p.k_cache.shape[0], INT_MAX));
    a.splits = static_cast<int>(plan.splits);
    a.split_keys = static_cast<int>(plan.split_keys);
    a.row_blocks = static_cast<int>(plan.row_blocks);
    a.causal = p.causal;
    a.window_left = p.window_left;
    a.window_right = p.window_right;
    const double scale = softmax_scale(p.scale, dqk);
    a.scale_log2 = static_cast<float>(scale * kLog2eDouble);
    if (paged(p)) {
      decode::launch_decode_kernel<T, true>(a, plan, dqk, dv, stream);
    } else {
      decode::launch_decode_kernel<T, false>(a, plan, dqk, dv, stream);
    }
  });
}

}  // namespace sparseattn::cuda
