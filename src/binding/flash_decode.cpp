// sparseattn._C's flash_decode functions, registered by bind_flash_decode (called from module.cpp's NB_MODULE).
// As in module.cpp: tensors arrive as DLPack arrays and become TensorViews, the workspace comes from the caller's
// allocate(nbytes) callback, and the operation runs with the GIL released; sparseattn::Error reaches Python
// through the exception translator module.cpp registers.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "sparseattn/error.h"
#include "sparseattn/flash_decode.h"
#include "views.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sparseattn::binding::decode {
namespace {

FlashDecodeParams params_of(const Array& q, const Array& k_cache, const Array& v_cache, const OptArray& cache_seqlens,
                            const OptArray& block_table, const OptArray& o, const OptArray& lse, bool causal,
                            std::int64_t window_left, std::int64_t window_right, std::optional<double> scale,
                            std::int64_t num_splits) {
  const OpName name("flash_decode");
  FlashDecodeParams p;
  p.q = view(q, "q");
  p.k_cache = view(k_cache, "k_cache");
  p.v_cache = view(v_cache, "v_cache");
  p.cache_seqlens = view(cache_seqlens, "cache_seqlens");
  p.block_table = view(block_table, "block_table");
  p.o = view(o, "o");
  p.lse = view(lse, "lse");
  p.causal = causal;
  p.window_left = window_left;
  p.window_right = window_right;
  p.scale = scale;
  p.num_splits = num_splits;
  return p;
}

}  // namespace
}  // namespace sparseattn::binding::decode

void bind_flash_decode(nb::module_& m) {
  using namespace sparseattn;
  using namespace sparseattn::binding;
  using namespace sparseattn::binding::decode;
  m.def(
      "flash_decode",
      [](const Array& q, const Array& k_cache, const Array& v_cache, const OptArray& cache_seqlens,
         const OptArray& block_table, const Array& o, const Array& lse, bool causal, std::int64_t window_left,
         std::int64_t window_right, std::optional<double> scale, std::int64_t num_splits, const nb::callable& allocate,
         std::uintptr_t stream) {
        FlashDecodeParams p = params_of(q, k_cache, v_cache, cache_seqlens, block_table, o, lse, causal, window_left,
                                        window_right, scale, num_splits);
        p.stream = reinterpret_cast<Stream>(stream);
        nb::object storage;
        const std::size_t bytes = flash_decode_workspace_size(p);
        if (bytes > 0) {
          // A contiguous uint8 array from torch's caching allocator, kept alive until the work is enqueued.
          storage = allocate(bytes);
          const auto buffer = nb::cast<Array>(storage);
          p.workspace = buffer.data();
          p.workspace_bytes = buffer.nbytes();
        }
        nb::gil_scoped_release release;
        flash_decode(p);
      },
      "q"_a, "k_cache"_a, "v_cache"_a, "cache_seqlens"_a.none(), "block_table"_a.none(), "o"_a, "lse"_a, "causal"_a,
      "window_left"_a, "window_right"_a, "scale"_a.none(), "num_splits"_a, "allocate"_a, "stream"_a);
  // The split count and workspace bytes a call with these tensors would use (o and lse may be None).
  m.def(
      "flash_decode_plan",
      [](const Array& q, const Array& k_cache, const Array& v_cache, const OptArray& cache_seqlens,
         const OptArray& block_table, std::int64_t num_splits) {
        const FlashDecodeParams p = params_of(q, k_cache, v_cache, cache_seqlens, block_table, std::nullopt,
                                              std::nullopt, true, -1, -1, std::nullopt, num_splits);
        return std::make_pair(flash_decode_num_splits(p), flash_decode_workspace_size(p));
      },
      "q"_a, "k_cache"_a, "v_cache"_a, "cache_seqlens"_a.none(), "block_table"_a.none(), "num_splits"_a);
}
