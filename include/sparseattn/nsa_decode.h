// nsa_decode: Native Sparse Attention for 1 to 16 new queries per sequence against a paged KV cache and the
// compressed rows kept beside it (decode, or a short chunk of speculative tokens). Forward only.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "sparseattn/combine.h"
#include "sparseattn/nsa_attention.h"
#include "sparseattn/tensor.h"

namespace sparseattn {

// Sequence b holds L_b = cache_seqlens[b] keys (the Tq new tokens already appended, so Tq <= L_b); query t sits at
// key position a = L_b - Tq + t. The result is exactly nsa_attention's rows for those queries on the gathered keys
// (docs/semantics.md section 12): key s of sequence b is row s % page_size of page block_table[b][s / page_size]
// (the paged layout of flash_decode), and the compressed rows are k_cmp[b, 0 .. rows(L_b) - 1] with rows(L) =
// num_compressed_blocks(L, cmp_block, cmp_stride) (mean pooling of the cached keys, or the user's compressor:
// row j depends on tokens [j * cmp_stride, j * cmp_stride + cmp_block) only). Rows past rows(L_b) are not read.
//
// Trusted device data: on CUDA, cache_seqlens and block_table are read on the device only (no host sync, so a call
// can be captured in a CUDA graph and replayed with new lengths and tables). The kernels clamp each length to
// [Tq, capacity] (capacity = max_pages * page_size), each page index to [0, num_pages) and each compressed row
// count to max_cmp, so no memory outside the given tensors is read whatever they hold. On the CPU the contents
// are checked (ErrorKind::value): Tq <= L_b <= capacity, the used block_table entries in [0, num_pages),
// rows(L_b) <= max_cmp.
//
// CUDA kernels: float16 and bfloat16, the head-dim pairs of sparseattn/head_dims.h, a group size Hq / Hkv of at
// most 16 (the group's query heads are the rows of one tensor-core tile and share the selection), page_size and
// sel_block multiples of 16, a capacity of at most 2^30 keys.
struct NsaDecodeParams {
  TensorView q;              // [B, Tq, Hq, Dqk], 1 <= Tq <= 16
  TensorView k_cache;        // paged [num_pages, page_size, Hkv, Dqk]
  TensorView v_cache;        // paged [num_pages, page_size, Hkv, Dv]
  TensorView block_table;    // int32 [B, max_pages]
  TensorView cache_seqlens;  // int32 [B] on q's device
  TensorView k_cmp;          // [B, max_cmp, Hkv, Dqk]: the compressed keys of each sequence, row j = block j
  TensorView v_cmp;          // [B, max_cmp, Hkv, Dv]
  std::array<TensorView, kNumBranches> gates;  // [B, Tq, Hq], dtype of q; an absent gate skips its branch
  TensorView o;              // out: [B, Tq, Hq, Dv], dtype of q
  TensorView block_indices;  // optional out: int32 [B, Tq, Hkv, num_selected], the selection (section 4's format)
  NsaConfig config;
  std::int64_t num_splits = 0;  // CUDA: splits of the compressed rows (0 = heuristic); ignored on the CPU
  void* workspace = nullptr;    // on q's device, 16-byte aligned, nsa_decode_workspace_size bytes (0 on the CPU)
  std::size_t workspace_bytes = 0;
  Stream stream = nullptr;
};

// Bytes of device scratch the call needs: the partial results of the compressed splits and of the selected and
// window pieces, the block scores and the selection. Depends on shapes, dtypes, config, num_splits and the
// device only, never on cache_seqlens or block_table (views with null data are accepted). 0 on the CPU.
std::size_t nsa_decode_workspace_size(const NsaDecodeParams& params);

void nsa_decode(const NsaDecodeParams& params);

}  // namespace sparseattn
