#include "api/check.h"

#include <cmath>
#include <sstream>

namespace sparseattn::detail {

namespace {

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

std::string device_string(const TensorView& t) {
  return t.device == DeviceType::cpu ? "cpu" : "cuda:" + std::to_string(t.device_index);
}

}  // namespace

void Check::fail(ErrorKind kind, const std::string& arg, const std::string& message) const {
  throw Error(kind, op_, arg, message);
}

void Check::present(const TensorView& t, const std::string& arg) const {
  require(t.present(), ErrorKind::shape, arg, "is required but was not given");
  require(t.data != nullptr || t.numel() == 0, ErrorKind::value, arg, "has elements but a null data pointer");
  for (int i = 0; i < t.rank; ++i) {
    require(t.shape[i] >= 0, ErrorKind::shape, arg, "has a negative size " + t.shape_string());
  }
}

void Check::absent(const TensorView& t, const std::string& arg, const std::string& why) const {
  require(!t.present(), ErrorKind::config, arg, "must not be given " + why);
}

void Check::dtype(const TensorView& t, const std::string& arg, DType expected) const {
  require(t.dtype == expected, ErrorKind::dtype, arg,
          std::string("expected dtype ") + dtype_name(expected) + ", got " + dtype_name(t.dtype));
}

void Check::dtype(const TensorView& t, const std::string& arg, DType expected, const TensorView& anchor,
                  const std::string& anchor_arg) const {
  if (t.dtype == expected) return;
  if (expected != anchor.dtype || arg == anchor_arg) return dtype(t, arg, expected);
  fail(ErrorKind::dtype, arg,
       std::string(dtype_name(t.dtype)) + " does not match " + anchor_arg + "'s " + dtype_name(expected));
}

void Check::floating(const TensorView& t, const std::string& arg) const {
  const bool ok = t.dtype == DType::float16 || t.dtype == DType::bfloat16 || t.dtype == DType::float32 ||
                  t.dtype == DType::float64;
  require(ok, ErrorKind::dtype, arg,
          std::string("expected float16, bfloat16, float32 or float64, got ") + dtype_name(t.dtype));
}

void Check::shape(const TensorView& t, const std::string& arg, const std::vector<std::int64_t>& expected) const {
  bool ok = t.rank == static_cast<int>(expected.size());
  for (int i = 0; ok && i < t.rank; ++i) ok = t.shape[i] == expected[i];
  require(ok, ErrorKind::shape, arg, "expected shape " + shape_string(expected) + ", got " + t.shape_string());
}

void Check::same_device(const TensorView& t, const std::string& arg, const TensorView& anchor,
                        const std::string& anchor_arg) const {
  require(t.device == anchor.device && t.device_index == anchor.device_index, ErrorKind::device, arg,
          "is on " + device_string(t) + " but '" + anchor_arg + "' is on " + device_string(anchor));
}

void Check::inner_contiguous(const TensorView& t, const std::string& arg) const {
  require(t.rank == 0 || t.shape[t.rank - 1] <= 1 || t.stride[t.rank - 1] == 1, ErrorKind::layout, arg,
          "expected a contiguous last dimension (stride 1), got stride " +
              std::to_string(t.stride[t.rank - 1]));
}

void Check::tensor(const TensorView& t, const std::string& arg, DType dtype_expected, const TensorView& anchor,
                   const std::string& anchor_arg) const {
  present(t, arg);
  dtype(t, arg, dtype_expected, anchor, anchor_arg);
  same_device(t, arg, anchor, anchor_arg);
  inner_contiguous(t, arg);
}

void Check::positive(std::int64_t value, const std::string& arg) const {
  require(value > 0, ErrorKind::config, arg, "expected a positive value, got " + std::to_string(value));
}

namespace {

// Reads cu_seqlens[i] of a CPU int32 tensor of rank 1.
std::int32_t cu_at(const TensorView& cu, std::int64_t i) {
  return static_cast<const std::int32_t*>(cu.data)[i * cu.stride[0]];
}

}  // namespace

void Check::packed_rank(const TensorView& tokens, const std::string& arg, const std::string& cu_arg) const {
  if (tokens.rank == 3) return;
  // fla and flash-attn's varlen calls keep a batch dimension of 1: [1, N, H, D].
  const std::string hint = tokens.rank == 4 && tokens.shape[0] == 1
                               ? " (for the [1, N, H, D] packed layout of fla, squeeze the batch dimension: pass "
                                 "[N, H, D] with " + cu_arg + ")"
                               : "";
  fail(ErrorKind::shape, arg,
       "expected 3 dimensions [N, H, D] because " + cu_arg + " is given, got " + tokens.shape_string() + hint);
}

TokenLayout Check::layout(const TensorView& tokens, const std::string& arg, const Sequences& seqs,
                          const std::string& cu_arg) const {
  present(tokens, arg);
  TokenLayout layout;
  layout.packed = seqs.cu_seqlens.present();
  if (!layout.packed) {
    require(tokens.rank == 4, ErrorKind::shape, arg,
            "expected 4 dimensions [B, T, H, D] (or 3 dimensions [N, H, D] with " + cu_arg + "), got " +
                tokens.shape_string());
    layout.batch = tokens.shape[0];
    layout.rows = tokens.shape[1];
    return layout;
  }
  packed_rank(tokens, arg, cu_arg);
  const TensorView& cu = seqs.cu_seqlens;
  present(cu, cu_arg);
  dtype(cu, cu_arg, DType::int32);
  same_device(cu, cu_arg, tokens, arg);
  require(cu.rank == 1 && cu.shape[0] >= 1, ErrorKind::shape, cu_arg,
          "expected shape [B+1], got " + cu.shape_string());
  inner_contiguous(cu, cu_arg);
  layout.batch = cu.shape[0] - 1;
  layout.rows = tokens.shape[0];
  require(seqs.max_seqlen >= 0, ErrorKind::config, cu_arg + " max_seqlen",
          "expected >= 0, got " + std::to_string(seqs.max_seqlen));
  if (cu.device == DeviceType::cpu) {
    require(cu_at(cu, 0) == 0, ErrorKind::value, cu_arg, "must start at 0, got " + std::to_string(cu_at(cu, 0)));
    for (std::int64_t b = 0; b < layout.batch; ++b) {
      const std::int64_t length = std::int64_t{cu_at(cu, b + 1)} - cu_at(cu, b);
      require(length >= 0, ErrorKind::value, cu_arg, "must be non-decreasing (entry " + std::to_string(b + 1) + ")");
      require(seqs.max_seqlen == 0 || length <= seqs.max_seqlen, ErrorKind::value, cu_arg,
              "sequence " + std::to_string(b) + " has " + std::to_string(length) + " tokens, more than max_seqlen " +
                  std::to_string(seqs.max_seqlen));
    }
    require(cu_at(cu, layout.batch) <= layout.rows, ErrorKind::value, cu_arg,
            "last entry " + std::to_string(cu_at(cu, layout.batch)) + " exceeds the " +
                std::to_string(layout.rows) + " rows of '" + arg + "'");
  }
  return layout;
}

void Check::compressed_layout(const TokenLayout& tokens, const Sequences& seqs, const TensorView& cu_cmp,
                              std::int64_t cmp_rows, std::int64_t block, std::int64_t stride) const {
  const std::string arg = "cu_seqlens_cmp";
  if (!tokens.packed) {
    absent(cu_cmp, arg, "with the batched layout");
    return;
  }
  present(cu_cmp, arg);
  dtype(cu_cmp, arg, DType::int32);
  same_device(cu_cmp, arg, seqs.cu_seqlens, "cu_seqlens");
  shape(cu_cmp, arg, {tokens.batch + 1});
  inner_contiguous(cu_cmp, arg);
  if (cu_cmp.device != DeviceType::cpu) return;
  require(cu_at(cu_cmp, 0) == 0, ErrorKind::value, arg, "must start at 0");
  for (std::int64_t b = 0; b < tokens.batch; ++b) {
    const std::int64_t length = std::int64_t{cu_at(seqs.cu_seqlens, b + 1)} - cu_at(seqs.cu_seqlens, b);
    const std::int64_t expected = num_compressed_blocks(length, block, stride);
    const std::int64_t got = std::int64_t{cu_at(cu_cmp, b + 1)} - cu_at(cu_cmp, b);
    require(got == expected, ErrorKind::value, arg,
            "sequence " + std::to_string(b) + " of " + std::to_string(length) + " tokens has " +
                std::to_string(expected) + " compressed blocks, but cu_seqlens_cmp gives it " + std::to_string(got));
  }
  require(cu_at(cu_cmp, tokens.batch) <= cmp_rows, ErrorKind::value, arg,
          "last entry exceeds the " + std::to_string(cmp_rows) + " rows of the compressed tensors");
}

void Check::index_contents(const TensorView& indices, const std::string& arg, const TokenLayout& layout,
                           const Sequences& seqs, const TokenLayout& key_layout, const Sequences& key_seqs,
                           std::int64_t block) const {
  const auto* data = static_cast<const std::int32_t*>(indices.data);
  const auto cu = [&](std::int64_t i) { return std::int64_t{cu_at(seqs.cu_seqlens, i)}; };
  const auto cu_k = [&](std::int64_t i) { return std::int64_t{cu_at(key_seqs.cu_seqlens, i)}; };
  const int r = indices.rank;
  const std::int64_t kv_heads = indices.shape[r - 2], count = indices.shape[r - 1];
  for (std::int64_t b = 0; b < layout.batch; ++b) {
    const std::int64_t begin = layout.packed ? cu(b) : 0;
    const std::int64_t length = layout.packed ? cu(b + 1) - begin : layout.rows;
    const std::int64_t keys = key_layout.packed ? cu_k(b + 1) - cu_k(b) : key_layout.rows;
    const std::int64_t blocks = num_selection_blocks(keys, block);
    for (std::int64_t t = 0; t < length; ++t) {
      for (std::int64_t h = 0; h < kv_heads; ++h) {
        const std::int64_t base = layout.packed ? (begin + t) * indices.stride[0] + h * indices.stride[1]
                                                : b * indices.stride[0] + t * indices.stride[1] + h * indices.stride[2];
        const auto where = [&](std::int64_t j) {
          return "row (sequence " + std::to_string(b) + ", token " + std::to_string(t) + ", KV head " +
                 std::to_string(h) + "), entry " + std::to_string(j) + ": ";
        };
        std::int64_t previous = -1;
        bool padding = false;
        for (std::int64_t j = 0; j < count; ++j) {
          const std::int64_t index = data[base + j * indices.stride[r - 1]];
          if (index == -1) {
            padding = true;
            continue;
          }
          require(index >= 0, ErrorKind::value, arg,
                        where(j) + std::to_string(index) + " is negative (only -1 pads)");
          require(!padding, ErrorKind::value, arg,
                        where(j) + std::to_string(index) + " follows a -1 (padding must be at the tail)");
          require(index > previous, ErrorKind::value, arg,
                        where(j) + std::to_string(index) + " is not above the previous entry " +
                            std::to_string(previous) + " (entries must be strictly ascending)");
          require(index < blocks, ErrorKind::value, arg,
                        where(j) + std::to_string(index) + " is out of range: a sequence of " +
                            std::to_string(keys) + " keys has " + std::to_string(blocks) +
                            " selection blocks of " + std::to_string(block));
          previous = index;
        }
      }
    }
  }
}

void Check::buffer(const void* data, std::size_t bytes, std::size_t needed, const std::string& arg,
                   const std::string& size_query) const {
  require(bytes >= needed, ErrorKind::config, arg,
          "has " + std::to_string(bytes) + " bytes, but this call needs " + std::to_string(needed) + " (" +
              size_query + ")");
  if (needed == 0) return;
  require(data != nullptr, ErrorKind::value, arg, "is null");
  // Every allocator (new, malloc, cudaMalloc, torch) returns at least 16-byte aligned memory; 16 bytes
  // lets kernels use vector loads on every slice.
  require(reinterpret_cast<std::uintptr_t>(data) % 16 == 0, ErrorKind::layout, arg, "must be 16-byte aligned");
}

DType lse_dtype(DType input) { return input == DType::float64 ? DType::float64 : DType::float32; }

std::int32_t int32_at(const TensorView& t, std::initializer_list<std::int64_t> index) {
  std::int64_t offset = 0;
  int d = 0;
  for (std::int64_t i : index) offset += i * t.stride[d++];
  return static_cast<const std::int32_t*>(t.data)[offset];
}

void check_block_table_pages(const Check& check, const TensorView& block_table, std::int64_t b, std::int64_t length,
                             std::int64_t page_size, std::int64_t num_pages) {
  const std::int64_t used = (length + page_size - 1) / page_size;
  for (std::int64_t j = 0; j < used; ++j) {
    const std::int64_t page = int32_at(block_table, {b, j});
    check.require(page >= 0 && page < num_pages, ErrorKind::value, "block_table",
                  "entry [" + std::to_string(b) + ", " + std::to_string(j) + "] is " + std::to_string(page) +
                      ", outside the " + std::to_string(num_pages) + " pages of k_cache (sequence " +
                      std::to_string(b) + " reads its first " + std::to_string(used) + " entries)");
  }
}

double resolve_scale(const Check& check, const std::optional<double>& scale, std::int64_t dim) {
  if (!scale) return softmax_scale(scale, dim);
  check.require(std::isfinite(*scale) && *scale > 0, ErrorKind::config, "scale",
                "expected a finite positive value, got " + std::to_string(*scale));
  return *scale;
}

Backend backend(const Check& check, const TensorView& anchor, const std::string& arg, bool has_cuda_kernels) {
  if (anchor.device == DeviceType::cpu) return Backend::cpu;
  check.require(has_cuda_kernels, ErrorKind::unsupported, arg,
                "is a CUDA tensor, but this build of sparseattn has no CUDA kernels for " + check.op() +
                    " yet; use CPU tensors (the reference backend)");
  check.require(anchor.dtype != DType::float64, ErrorKind::unsupported, arg,
                "float64 runs on the CPU reference only; the CUDA kernels take float16, bfloat16 or float32");
  return Backend::cuda;
}

}  // namespace sparseattn::detail
