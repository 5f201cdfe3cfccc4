// nsa_decode on CUDA: the plan from shapes, config and the device (plan.h), the kernel arguments on views of the
// caller's workspace, and the four launches (launch.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda/nsa_decode/launch.h"
#include "cuda/nsa_decode/ops.h"
#include "cuda/nsa_decode/plan.h"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/launch.cuh"
#include "sparseattn/sequences.h"

namespace sparseattn::cuda {

namespace {

using nsa_dec::Plan;

// The plan of a call (a default empty plan where the shapes are not those of a valid call: the size query runs
// before validation); the compressed kernel's warp count from the environment (nsa_dec::kCompressedWarpsEnv).
Plan plan_of(const NsaDecodeParams& p) {
  if (p.q.rank != 4 || p.k_cache.rank != 4 || p.v_cache.rank != 4 || p.block_table.rank != 2) return {};
  const bool branch[3] = {p.gates[0].present(), p.gates[1].present(), p.gates[2].present()};
  const std::int64_t capacity = p.block_table.shape[1] * p.k_cache.shape[1];
  const std::int64_t max_cmp = p.k_cmp.rank == 4 ? p.k_cmp.shape[1] : 0;
  const NsaConfig& c = p.config;
  return nsa_dec::plan_nsa_decode(p.q.shape[0], p.q.shape[1], p.q.shape[2], p.k_cache.shape[2], p.q.shape[3],
                                     p.v_cache.shape[3], capacity, max_cmp, c.cmp_block, c.cmp_stride, c.sel_block,
                                     c.num_selected, c.window, branch, p.num_splits,
                                     multiprocessors(p.q.device_index),
                                     nsa_dec::compressed_warps_of(std::getenv(nsa_dec::kCompressedWarpsEnv)));
}

template <class T>
nsa_dec::PagedCache<T> paged_of(const TensorView& t) {
  return {static_cast<const T*>(t.data), t.stride[0], t.stride[1], t.stride[2]};
}

}  // namespace

std::size_t nsa_decode_workspace_size(const NsaDecodeParams& params) { return plan_of(params).bytes; }

std::string nsa_decode_launch_limit(const NsaDecodeParams& params) {
  const Plan plan = plan_of(params);
  const std::int64_t lists = plan.batch * plan.q_len * plan.kv_heads;
  if (lists * std::max(plan.cmp_splits, plan.pieces()) > INT_MAX || plan.rows_q() > INT_MAX) {
    return "asks for more CTAs (sequences x queries x KV heads x splits) than a CUDA grid holds; use a smaller batch";
  }
  if (params.config.num_selected > nsa_dec::kMaxSelected) {
    return "the CUDA kernels select at most " + std::to_string(nsa_dec::kMaxSelected) + " blocks (num_selected = " +
           std::to_string(params.config.num_selected) + ")";
  }
  const std::size_t optin = smem_optin_bytes(params.q.device_index);
  if (std::max(plan.cmp_smem, plan.attend_smem) > optin) {
    return "needs " + std::to_string(std::max(plan.cmp_smem, plan.attend_smem)) +
           " bytes of shared memory per CTA, more than the device's " + std::to_string(optin);
  }
  return {};
}

void nsa_decode(const NsaDecodeParams& p) {
  const Plan plan = plan_of(p);
  if (plan.rows_q() == 0) return;
  const DeviceGuard guard(p.q.device_index);
  const auto stream = static_cast<cudaStream_t>(p.stream);
  const NsaConfig& c = p.config;
  unsigned char* const base = aligned_workspace(p.workspace);
  dispatch_16bit(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    nsa_dec::NsaDecodeArgs<T> a{};
    a.q = tokens_of<const T>(p.q);
    a.k = paged_of<T>(p.k_cache);
    a.v = paged_of<T>(p.v_cache);
    if (plan.compressed) {
      a.k_cmp = tokens_of<const T>(p.k_cmp);
      a.v_cmp = tokens_of<const T>(p.v_cmp);
    }
    a.block_table = static_cast<const std::int32_t*>(p.block_table.data);
    a.table_batch_stride = p.block_table.stride[0];
    a.table_page_stride = p.block_table.stride[1];
    a.cache_seqlens = static_cast<const std::int32_t*>(p.cache_seqlens.data);
    a.seqlens_stride = p.cache_seqlens.stride[0];
    for (int i = 0; i < 3; ++i) {
      if (p.gates[i].present()) a.gate[i] = per_head_of<const T>(p.gates[i]);
    }
    a.o = tokens_of<T>(p.o);
    if (p.block_indices.present()) {
      a.indices_out = static_cast<std::int32_t*>(p.block_indices.data);
      for (int i = 0; i < 4; ++i) a.indices_out_stride[i] = p.block_indices.stride[i];
    }
    a.cmp_o = reinterpret_cast<float*>(base + plan.cmp_o);
    a.cmp_lse = reinterpret_cast<float*>(base + plan.cmp_lse);
    a.cmp_score = reinterpret_cast<float*>(base + plan.cmp_score);
    a.scores = reinterpret_cast<float*>(base + plan.scores);
    a.indices = reinterpret_cast<std::int32_t*>(base + plan.indices);
    a.piece_o = reinterpret_cast<float*>(base + plan.piece_o);
    a.piece_lse = reinterpret_cast<float*>(base + plan.piece_lse);
    a.fused_combine = plan.fused_combine;
    if (plan.fused_combine) {
      a.counters = reinterpret_cast<std::int32_t*>(base + plan.counters);
      zero_async(a.counters, plan.counter_bytes, stream, "nsa_decode's combine counters");
    }
    a.batch = static_cast<int>(plan.batch);
    a.q_len = static_cast<int>(plan.q_len);
    a.q_heads = static_cast<int>(plan.q_heads);
    a.kv_heads = static_cast<int>(plan.kv_heads);
    a.group = static_cast<int>(plan.group);
    a.page_size = static_cast<int>(p.k_cache.shape[1]);
    a.num_pages = static_cast<int>(std::min<std::int64_t>(p.k_cache.shape[0], INT_MAX));
    a.capacity = static_cast<int>(plan.capacity);
    a.max_cmp = static_cast<int>(plan.max_cmp);
    a.cmp_block = c.cmp_block;
    a.cmp_stride = c.cmp_stride;
    a.sel_block = c.sel_block;
    a.num_selected = c.num_selected;
    a.num_init = c.num_init;
    a.num_local = c.num_local;
    a.window = static_cast<int>(std::min<std::int64_t>(c.window, plan.capacity + 1));
    a.split_rows = static_cast<int>(plan.split_rows);
    a.cmp_splits = static_cast<int>(plan.cmp_splits);
    a.score_span = static_cast<int>(plan.score_span);
    a.max_blocks = static_cast<int>(plan.max_blocks);
    a.sel_chunks = static_cast<int>(plan.sel_chunks);
    a.swa_chunks = static_cast<int>(plan.swa_chunks);
    a.tiles_per_piece = static_cast<int>(plan.tiles_per_piece);
    a.sel_pieces = static_cast<int>(plan.sel_pieces);
    a.swa_pieces = static_cast<int>(plan.swa_pieces);
    a.has_cmp = plan.has_cmp;
    a.has_sel = plan.has_sel;
    a.has_swa = plan.has_swa;
    a.scale_log2 = static_cast<float>(softmax_scale(c.scale, p.q.shape[3]) * kLog2eDouble);
    nsa_dec::launch_nsa_decode<T>(a, plan, stream);
  });
}

}  // namespace sparseattn::cuda
