// sparseattn._C's nsa_decode functions, registered by bind_nsa_decode (called from module.cpp's NB_MODULE). As in
// flash_decode.cpp: DLPack arrays become TensorViews, the workspace comes from the caller's allocate(nbytes)
// callback, and the operation runs with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>

#include "sparseattn/error.h"
#include "sparseattn/nsa_decode.h"
#include "views.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sparseattn::binding::nsa_dec {
namespace {

NsaDecodeParams params_of(const Array& q, const Array& k_cache, const Array& v_cache, const Array& block_table,
                          const Array& cache_seqlens, const OptArray& k_cmp, const OptArray& v_cmp,
                          const OptArray& g_cmp, const OptArray& g_slc, const OptArray& g_swa, const OptArray& o,
                          const OptArray& block_indices, int cmp_block, int cmp_stride, int sel_block,
                          int num_selected, int num_init, int num_local, std::int64_t window,
                          std::optional<double> scale, std::int64_t num_splits) {
  const OpName name("nsa_decode");
  NsaDecodeParams p;
  p.q = view(q, "q");
  p.k_cache = view(k_cache, "k_cache");
  p.v_cache = view(v_cache, "v_cache");
  p.block_table = view(block_table, "block_table");
  p.cache_seqlens = view(cache_seqlens, "cache_seqlens");
  p.k_cmp = view(k_cmp, "k_cmp");
  p.v_cmp = view(v_cmp, "v_cmp");
  p.gates[0] = view(g_cmp, "g_cmp");
  p.gates[1] = view(g_slc, "g_slc");
  p.gates[2] = view(g_swa, "g_swa");
  p.o = view(o, "o");
  p.block_indices = view(block_indices, "block_indices");
  p.config.cmp_block = cmp_block;
  p.config.cmp_stride = cmp_stride;
  p.config.sel_block = sel_block;
  p.config.num_selected = num_selected;
  p.config.num_init = num_init;
  p.config.num_local = num_local;
  p.config.window = window;
  p.config.scale = scale;
  p.num_splits = num_splits;
  return p;
}

}  // namespace
}  // namespace sparseattn::binding::nsa_dec

void bind_nsa_decode(nb::module_& m) {
  using namespace sparseattn;
  using namespace sparseattn::binding;
  using namespace sparseattn::binding::nsa_dec;
  m.def(
      "nsa_decode",
      [](const Array& q, const Array& k_cache, const Array& v_cache, const Array& block_table,
         const Array& cache_seqlens, const OptArray& k_cmp, const OptArray& v_cmp, const OptArray& g_cmp,
         const OptArray& g_slc, const OptArray& g_swa, const Array& o, const OptArray& block_indices, int cmp_block,
         int cmp_stride, int sel_block, int num_selected, int num_init, int num_local, std::int64_t window,
         std::optional<double> scale, std::int64_t num_splits, const nb::callable& allocate, std::uintptr_t stream) {
        NsaDecodeParams p = params_of(q, k_cache, v_cache, block_table, cache_seqlens, k_cmp, v_cmp, g_cmp, g_slc,
                                      g_swa, o, block_indices, cmp_block, cmp_stride, sel_block, num_selected,
                                      num_init, num_local, window, scale, num_splits);
        p.stream = reinterpret_cast<Stream>(stream);
        nb::object storage;
        const std::size_t bytes = nsa_decode_workspace_size(p);
        if (bytes > 0) {
          storage = allocate(bytes);
          const auto buffer = nb::cast<Array>(storage);
          p.workspace = buffer.data();
          p.workspace_bytes = buffer.nbytes();
        }
        nb::gil_scoped_release release;
        nsa_decode(p);
      },
      "q"_a, "k_cache"_a, "v_cache"_a, "block_table"_a, "cache_seqlens"_a, "k_cmp"_a.none(), "v_cmp"_a.none(),
      "g_cmp"_a.none(), "g_slc"_a.none(), "g_swa"_a.none(), "o"_a, "block_indices"_a.none(), "cmp_block"_a,
      "cmp_stride"_a, "sel_block"_a, "num_selected"_a, "num_init"_a, "num_local"_a, "window"_a, "scale"_a.none(),
      "num_splits"_a, "allocate"_a, "stream"_a);
}
