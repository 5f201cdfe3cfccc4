// Validation shared by every operation: each check throws sparseattn::Error naming the operation and the
// argument, before any work is started or any output written.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "core/token_layout.h"
#include "sparseattn/error.h"
#include "sparseattn/sequences.h"
#include "sparseattn/tensor.h"

namespace sparseattn::detail {

// The shape of `t` as a vector (for Check::shape against another tensor's).
inline std::vector<std::int64_t> shape_of(const TensorView& t) { return {t.shape.begin(), t.shape.begin() + t.rank}; }

class Check {
 public:
  explicit Check(std::string op) : op_(std::move(op)) {}

  [[noreturn]] void fail(ErrorKind kind, const std::string& arg, const std::string& message) const;
  void require(bool ok, ErrorKind kind, const std::string& arg, const std::string& message) const {
    if (!ok) fail(kind, arg, message);
  }

  void present(const TensorView& t, const std::string& arg) const;
  void absent(const TensorView& t, const std::string& arg, const std::string& why) const;
  void dtype(const TensorView& t, const std::string& arg, DType expected) const;
  // dtype `expected`, which the caller derived from `anchor`: where it is the anchor's own dtype the message
  // blames `arg` and names both ("bfloat16 does not match q's float16").
  void dtype(const TensorView& t, const std::string& arg, DType expected, const TensorView& anchor,
             const std::string& anchor_arg) const;
  // float16, bfloat16, float32 or float64.
  void floating(const TensorView& t, const std::string& arg) const;
  void shape(const TensorView& t, const std::string& arg, const std::vector<std::int64_t>& expected) const;
  // Same device type and index as `anchor`.
  void same_device(const TensorView& t, const std::string& arg, const TensorView& anchor,
                   const std::string& anchor_arg) const;
  // The innermost dimension has stride 1 (every tensor of the API needs this; other strides are free).
  void inner_contiguous(const TensorView& t, const std::string& arg) const;
  // present + dtype + same device + inner stride in one call, the common case for inputs and outputs.
  void tensor(const TensorView& t, const std::string& arg, DType dtype, const TensorView& anchor,
              const std::string& anchor_arg) const;
  void positive(std::int64_t value, const std::string& arg) const;

  // A packed token tensor has 3 dimensions [N, H, D] (the message hints at squeezing fla's [1, N, H, D]).
  void packed_rank(const TensorView& tokens, const std::string& arg, const std::string& cu_arg) const;
  // Resolves batched vs packed from the rank of `tokens` (4 or 3) and the presence of cu_seqlens, checks
  // cu_seqlens (int32 [B+1], device of `tokens`, and on the CPU its contents) and returns the layout.
  TokenLayout layout(const TensorView& tokens, const std::string& arg, const Sequences& seqs,
                     const std::string& cu_arg) const;
  // Checks a packed compressed layout: cu_seqlens_cmp int32 [B+1] whose differences are
  // num_compressed_blocks of the token sequences (contents checked on the CPU), last value <= rows.
  void compressed_layout(const TokenLayout& tokens, const Sequences& seqs, const TensorView& cu_seqlens_cmp,
                         std::int64_t cmp_rows, std::int64_t block, std::int64_t stride) const;

  // A caller-supplied scratch buffer: at least `needed` bytes (as `size_query` reports), 16-byte aligned,
  // not null unless nothing is needed.
  void buffer(const void* data, std::size_t bytes, std::size_t needed, const std::string& arg,
              const std::string& size_query) const;

  // The sparse index convention on a CPU index tensor [B, T, Hkv, n] (packed [N, Hkv, n]) laid out like the
  // queries (`layout`, `seqs`), row by row: entries strictly ascending in [0, num_selection_blocks(S_b, block))
  // with S_b the keys of the sequence (`key_layout`, `key_seqs`: batched rows S, packed cu_seqlens), -1 only as
  // tail padding. Packed rows past cu_seqlens[B] are ignored.
  void index_contents(const TensorView& indices, const std::string& arg, const TokenLayout& layout,
                      const Sequences& seqs, const TokenLayout& key_layout, const Sequences& key_seqs,
                      std::int64_t block) const;

  const std::string& op() const { return op_; }

 private:
  std::string op_;
};

// float32 for 16- and 32-bit inputs, float64 for float64 inputs.
DType lse_dtype(DType input);

// Element `index` (row-major over t's shape) of a CPU int32 tensor of any strides.
std::int32_t int32_at(const TensorView& t, std::initializer_list<std::int64_t> index);

// A paged cache's block table on the CPU: the entries that sequence b's `length` keys use (the first
// ceil(length / page_size) of row b) name pages in [0, num_pages).
void check_block_table_pages(const Check& check, const TensorView& block_table, std::int64_t b, std::int64_t length,
                             std::int64_t page_size, std::int64_t num_pages);

// 1/sqrt(dim) unless the caller chose a scale (which must be finite and positive).
double resolve_scale(const Check& check, const std::optional<double>& scale, std::int64_t dim);

// Whether this build compiled the CUDA backend (src/cuda).
#ifdef SPARSEATTN_WITH_CUDA
inline constexpr bool kCudaBuilt = true;
#else
inline constexpr bool kCudaBuilt = false;
#endif

// The backend an operation runs on, from the device of its anchor tensor. CUDA tensors raise
// ErrorKind::unsupported unless the operation has CUDA kernels in this build (pass kCudaBuilt for an op
// that has them, false otherwise); the CUDA kernels take float16, bfloat16 and float32, not float64.
enum class Backend { cpu, cuda };
Backend backend(const Check& check, const TensorView& anchor, const std::string& arg, bool has_cuda_kernels);

}  // namespace sparseattn::detail
