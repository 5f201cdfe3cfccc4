// sparseattn._C: the nanobind binding of the C++ API. No torch headers: tensors of any framework arrive as
// DLPack arrays (nb::ndarray), become TensorViews, and the C++ operation runs with the GIL released on the
// stream the caller passes (a cudaStream_t as an integer, 0 on the CPU). Outputs and workspaces are
// allocated by the caller (python/sparseattn/_ops.py) and passed in; this layer never allocates tensors.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "sparseattn/sparseattn.h"
#include "views.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sparseattn::binding {
namespace {

// flash_attention's gate settings (both entry points); an unknown gate name reaches the C++ validation as an
// invalid GateMode, which rejects it naming 'gate'.
FlashGateOptions flash_gates(const OptArray& alpha, const OptArray& delta, const std::string& gate,
                             std::optional<double> gate_threshold, std::optional<double> softmax_threshold,
                             std::int64_t block_q, std::int64_t block_k) {
  FlashGateOptions g;
  g.alpha = view(alpha, "alpha");
  g.delta = view(delta, "delta");
  g.gate = gate == "logsigmoid" ? GateMode::logsigmoid
           : gate == "product"  ? GateMode::product
                                : static_cast<GateMode>(-1);
  g.gate_threshold = gate_threshold;
  g.softmax_threshold = softmax_threshold;
  g.threshold_block_q = block_q;
  g.threshold_block_k = block_k;
  return g;
}

// flash_attention's block-sparse mask and per-head windows (both entry points).
FlashBlockMask flash_blocks(const OptArray& block_mask, const OptArray& kv_num_blocks, const OptArray& kv_indices,
                            const OptArray& full_kv_num_blocks, const OptArray& full_kv_indices, std::int64_t block_q,
                            std::int64_t block_k) {
  FlashBlockMask b;
  b.block_mask = view(block_mask, "block_mask");
  b.kv_num_blocks = view(kv_num_blocks, "kv_num_blocks");
  b.kv_indices = view(kv_indices, "kv_indices");
  b.full_kv_num_blocks = view(full_kv_num_blocks, "full_kv_num_blocks");
  b.full_kv_indices = view(full_kv_indices, "full_kv_indices");
  b.block_q = block_q;
  b.block_k = block_k;
  return b;
}

FlashHeadWindows head_windows(const OptArray& left, const OptArray& right) {
  return {view(left, "window_left"), view(right, "window_right")};
}

Stream as_stream(std::uintptr_t stream) { return reinterpret_cast<Stream>(stream); }

Sequences seqs(const OptArray& cu_seqlens, std::int64_t max_seqlen, const char* arg = "cu_seqlens") {
  return Sequences{view(cu_seqlens, arg), max_seqlen};
}

// A workspace passed as a contiguous byte array: returns its data pointer and size in bytes.
std::pair<void*, std::size_t> bytes(const OptArray& a, const char* arg) {
  if (!a || a->size() == 0) return {nullptr, 0};
  std::int64_t expected = 1;
  for (std::size_t i = a->ndim(); i-- > 0;) {
    if (a->shape(i) != 1 && a->stride(i) != expected) fail(ErrorKind::layout, arg, "must be contiguous");
    expected *= static_cast<std::int64_t>(a->shape(i));
  }
  return {a->data(), a->nbytes()};
}

// ---- Shape-only descriptions for fake/meta implementations: None or (dtype name, shape). ----
// The views have null data; only the size queries accept them.
TensorView spec_view(const nb::handle& spec, const char* arg, DeviceType device, int device_index) {
  TensorView t;
  if (spec.is_none()) return t;
  auto tuple = nb::cast<nb::tuple>(spec);
  if (tuple.size() != 2) fail(ErrorKind::shape, arg, "expected a (dtype name, shape) pair");
  t.dtype = dtype_from_name(nb::cast<std::string>(tuple[0]), arg);
  auto shape = nb::cast<std::vector<std::int64_t>>(tuple[1]);
  if (shape.empty() || shape.size() > static_cast<std::size_t>(kMaxRank)) {
    fail(ErrorKind::shape, arg, "expected 1 to 4 dimensions, got " + std::to_string(shape.size()));
  }
  t.device = device;
  t.device_index = device_index;
  t.rank = static_cast<int>(shape.size());
  std::int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.stride[i] = stride;
    stride *= shape[i];
  }
  return t;
}

DeviceType device_from_name(const std::string& name) {
  if (name == "cpu") return DeviceType::cpu;
  if (name == "cuda") return DeviceType::cuda;
  fail(ErrorKind::device, "device", "unsupported device type '" + name + "'");
}

NsaConfig nsa_config(int cmp_block, int cmp_stride, int sel_block, int num_selected, int num_init, int num_local,
                     std::int64_t window, std::optional<double> scale) {
  NsaConfig c;
  c.cmp_block = cmp_block;
  c.cmp_stride = cmp_stride;
  c.sel_block = sel_block;
  c.num_selected = num_selected;
  c.num_init = num_init;
  c.num_local = num_local;
  c.window = window;
  c.scale = scale;
  return c;
}

// The recompute mode of nsa_attention by name ("none", "branches" or "selected_and_window").
NsaRecompute nsa_recompute(const std::string& name) {
  if (name == "none") return NsaRecompute::none;
  if (name == "branches") return NsaRecompute::branches;
  if (name == "selected_and_window") return NsaRecompute::selected_and_window;
  fail(ErrorKind::config, "recompute",
       "expected \"none\", \"branches\" or \"selected_and_window\", got \"" + name + "\"");
}

NsaParams nsa_spec_params(const std::string& device, int device_index, nb::handle q, nb::handle k, nb::handle v,
                          nb::handle k_cmp, nb::handle v_cmp, nb::handle block_indices, nb::handle g_cmp,
                          nb::handle g_slc, nb::handle g_swa, nb::handle o, nb::handle cu_seqlens,
                          nb::handle cu_seqlens_cmp, std::int64_t max_seqlen, int cmp_block, int cmp_stride,
                          int sel_block, int num_selected, int num_init, int num_local, std::int64_t window,
                          std::optional<double> scale, nb::handle cu_seqlens_k, std::int64_t max_seqlen_k,
                          const std::string& recompute) {
  const DeviceType dev = device_from_name(device);
  auto sv = [&](nb::handle h, const char* arg) { return spec_view(h, arg, dev, device_index); };
  NsaParams p;
  p.q = sv(q, "q");
  p.k = sv(k, "k");
  p.v = sv(v, "v");
  p.k_cmp = sv(k_cmp, "k_cmp");
  p.v_cmp = sv(v_cmp, "v_cmp");
  p.block_indices = sv(block_indices, "block_indices");
  p.gates = {sv(g_cmp, "g_cmp"), sv(g_slc, "g_slc"), sv(g_swa, "g_swa")};
  p.o = sv(o, "o");
  p.seqs = Sequences{sv(cu_seqlens, "cu_seqlens"), max_seqlen};
  p.seqs_k = Sequences{sv(cu_seqlens_k, "cu_seqlens_k"), max_seqlen_k};
  p.cu_seqlens_cmp = sv(cu_seqlens_cmp, "cu_seqlens_cmp");
  p.config = nsa_config(cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, window, scale);
  p.recompute = nsa_recompute(recompute);
  return p;
}

// The same error reported under another operation's name (the message's "sparseattn.<op>: " prefix too).
Error renamed(const Error& e, const std::string& op) {
  const std::string prefix = "sparseattn." + e.op() + ": argument '" + e.argument() + "': ";
  std::string message = e.what();
  if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
  return Error(e.kind(), op, e.argument(), message);
}

// ---- Exceptions: sparseattn::Error -> the package's exception classes (registered at import). ----
PyObject* g_error_types[3] = {nullptr, nullptr, nullptr};  // base, dtype, unsupported (strong refs, leaked)

void set_error_types(nb::handle base, nb::handle dtype, nb::handle unsupported) {
  nb::handle types[3] = {base, dtype, unsupported};
  for (int i = 0; i < 3; ++i) {
    if (!PyType_Check(types[i].ptr()) || !PyType_IsSubtype((PyTypeObject*)types[i].ptr(),
                                                            (PyTypeObject*)PyExc_ValueError)) {
      throw nb::type_error("_set_error_types: expected subclasses of ValueError");
    }
    Py_XDECREF(g_error_types[i]);
    g_error_types[i] = types[i].inc_ref().ptr();
  }
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    const int slot = e.kind() == ErrorKind::dtype ? 1 : e.kind() == ErrorKind::unsupported ? 2 : 0;
    PyObject* fallback = slot == 1 ? PyExc_TypeError : slot == 2 ? PyExc_NotImplementedError : PyExc_ValueError;
    PyObject* type = g_error_types[slot] ? g_error_types[slot] : fallback;
    PyObject* instance = PyObject_CallFunction(type, "s", e.what());
    if (!instance) return;  // the constructor raised; that error stands
    if (PyObject_SetAttrString(instance, "kind", nb::str(error_kind_name(e.kind())).ptr()) != 0 ||
        PyObject_SetAttrString(instance, "argument", nb::str(e.argument().c_str()).ptr()) != 0 ||
        PyObject_SetAttrString(instance, "op", nb::str(e.op().c_str()).ptr()) != 0) {
      PyErr_Clear();
    }
    PyErr_SetObject(type, instance);
    Py_DECREF(instance);
  }
}

// Runs an operation with the GIL released (the CPU reference is multi-threaded; CUDA launches are async).
template <class Params>
void run(void (*op)(const Params&), const Params& params) {
  nb::gil_scoped_release release;
  op(params);
}

// Runs an operation whose params carry a scratch workspace: sizes it with `size_of`, asks the caller's
// `allocate(nbytes)` for a uint8 array on the tensors' device (torch's caching allocator from Python), then
// runs without the GIL. The array is kept alive until the operation has been enqueued.
template <class Params>
void run_with_workspace(void (*op)(const Params&), std::size_t (*size_of)(const Params&), Params& params,
                        const nb::callable& allocate) {
  const std::size_t bytes = size_of(params);
  nb::object storage;
  if (bytes > 0) {
    storage = allocate(bytes);
    // A byte array: read with bytes() (view() takes only the typed dtypes of the API's tensors).
    std::tie(params.workspace, params.workspace_bytes) = sparseattn::binding::bytes(nb::cast<Array>(storage), "workspace");
  }
  run(op, params);
}

}  // namespace
}  // namespace sparseattn::binding

NB_MODULE(_C, m) {
  using namespace sparseattn;
  using namespace sparseattn::binding;
  m.doc() = "sparseattn C++ API binding (torch-free; tensors via DLPack). Use the `sparseattn` package.";
  m.attr("__version__") = kVersion;
  m.def("built_with_cuda", &sparseattn::built_with_cuda);
  m.def("cuda_head_dims", [] {
    std::vector<std::pair<int, int>> pairs;
    for (const HeadDims& d : kCudaHeadDims) pairs.emplace_back(d.qk, d.v);
    return pairs;
  });
  m.def("_set_error_types", &set_error_types, "base"_a, "dtype"_a, "unsupported"_a);
  nb::register_exception_translator(&translate);

  m.def("num_compressed_blocks", &num_compressed_blocks, "length"_a, "block"_a, "stride"_a);

  // ---- compress_kv ----
  m.def(
      "compress_kv",
      [](const Array& k, const Array& v, const Array& k_cmp, const Array& v_cmp, const OptArray& cu_seqlens,
         const OptArray& cu_seqlens_cmp, std::int64_t max_seqlen, int block, int stride, std::uintptr_t stream) {
        const OpName op_name("compress_kv");
        CompressKvParams p;
        p.k = view(k, "k");
        p.v = view(v, "v");
        p.k_cmp = view(k_cmp, "k_cmp");
        p.v_cmp = view(v_cmp, "v_cmp");
        p.seqs = seqs(cu_seqlens, max_seqlen);
        p.cu_seqlens_cmp = view(cu_seqlens_cmp, "cu_seqlens_cmp");
        p.block = block;
        p.stride = stride;
        p.stream = as_stream(stream);
        run(compress_kv, p);
      },
      "k"_a, "v"_a, "k_cmp"_a, "v_cmp"_a, "cu_seqlens"_a.none(), "cu_seqlens_cmp"_a.none(), "max_seqlen"_a,
      "block"_a, "stride"_a, "stream"_a);
  m.def(
      "compress_kv_backward",
      [](const Array& dk_cmp, const Array& dv_cmp, const Array& dk, const Array& dv, const OptArray& cu_seqlens,
         const OptArray& cu_seqlens_cmp, std::int64_t max_seqlen, int block, int stride, std::uintptr_t stream) {
        const OpName op_name("compress_kv_backward");
        CompressKvBackwardParams p;
        p.dk_cmp = view(dk_cmp, "dk_cmp");
        p.dv_cmp = view(dv_cmp, "dv_cmp");
        p.dk = view(dk, "dk");
        p.dv = view(dv, "dv");
        p.seqs = seqs(cu_seqlens, max_seqlen);
        p.cu_seqlens_cmp = view(cu_seqlens_cmp, "cu_seqlens_cmp");
        p.block = block;
        p.stride = stride;
        p.stream = as_stream(stream);
        run(compress_kv_backward, p);
      },
      "dk_cmp"_a, "dv_cmp"_a, "dk"_a, "dv"_a, "cu_seqlens"_a.none(), "cu_seqlens_cmp"_a.none(), "max_seqlen"_a,
      "block"_a, "stride"_a, "stream"_a);

  // ---- compressed_attention ----
  m.def(
      "compressed_attention",
      [](const Array& q, const Array& k_cmp, const Array& v_cmp, const Array& o, const Array& lse,
         const OptArray& cu_seqlens, const OptArray& cu_seqlens_cmp, std::int64_t max_seqlen, int block,
         int stride, std::optional<double> scale, std::uintptr_t stream, const OptArray& cu_seqlens_k,
         std::int64_t max_seqlen_k, std::int64_t seqlen_k) {
        const OpName op_name("compressed_attention");
        CompressedAttentionParams p;
        p.q = view(q, "q");
        p.k_cmp = view(k_cmp, "k_cmp");
        p.v_cmp = view(v_cmp, "v_cmp");
        p.o = view(o, "o");
        p.lse = view(lse, "lse");
        p.seqs = seqs(cu_seqlens, max_seqlen);
        p.seqs_k = seqs(cu_seqlens_k, max_seqlen_k, "cu_seqlens_k");
        p.seqlen_k = seqlen_k;
        p.cu_seqlens_cmp = view(cu_seqlens_cmp, "cu_seqlens_cmp");
        p.block = block;
        p.stride = stride;
        p.scale = scale;
        p.stream = as_stream(stream);
        run(compressed_attention, p);
      },
      "q"_a, "k_cmp"_a, "v_cmp"_a, "o"_a, "lse"_a, "cu_seqlens"_a.none(), "cu_seqlens_cmp"_a.none(),
      "max_seqlen"_a, "block"_a, "stride"_a, "scale"_a.none(), "stream"_a, "cu_seqlens_k"_a.none() = nb::none(),
      "max_seqlen_k"_a = 0, "seqlen_k"_a = 0);
  m.def(
      "compressed_attention_backward",
      [](const Array& q, const Array& k_cmp, const Array& v_cmp, const Array& o, const Array& lse,
         const Array& d_o, const Array& dq, const Array& dk_cmp, const Array& dv_cmp, const OptArray& cu_seqlens,
         const OptArray& cu_seqlens_cmp, std::int64_t max_seqlen, int block, int stride,
         std::optional<double> scale, const nb::callable& allocate, std::uintptr_t stream,
         const OptArray& cu_seqlens_k, std::int64_t max_seqlen_k, std::int64_t seqlen_k) {
        const OpName op_name("compressed_attention_backward");
        CompressedAttentionBackwardParams p;
        p.q = view(q, "q");
        p.k_cmp = view(k_cmp, "k_cmp");
        p.v_cmp = view(v_cmp, "v_cmp");
        p.o = view(o, "o");
        p.lse = view(lse, "lse");
        p.d_o = view(d_o, "d_o");
        p.dq = view(dq, "dq");
        p.dk_cmp = view(dk_cmp, "dk_cmp");
        p.dv_cmp = view(dv_cmp, "dv_cmp");
        p.seqs = seqs(cu_seqlens, max_seqlen);
        p.seqs_k = seqs(cu_seqlens_k, max_seqlen_k, "cu_seqlens_k");
        p.seqlen_k = seqlen_k;
        p.cu_seqlens_cmp = view(cu_seqlens_cmp, "cu_seqlens_cmp");
        p.block = block;
        p.stride = stride;
        p.scale = scale;
        p.stream = as_stream(stream);
        run_with_workspace(compressed_attention_backward, compressed_attention_backward_workspace_size, p, allocate);
      },
      "q"_a, "k_cmp"_a, "v_cmp"_a, "o"_a, "lse"_a, "d_o"_a, "dq"_a, "dk_cmp"_a, "dv_cmp"_a,
      "cu_seqlens"_a.none(), "cu_seqlens_cmp"_a.none(), "max_seqlen"_a, "block"_a, "stride"_a,
      "scale"_a.none(), "allocate"_a, "stream"_a, "cu_seqlens_k"_a.none() = nb::none(), "max_seqlen_k"_a = 0,
      "seqlen_k"_a = 0);

  // ---- select_blocks (no backward) ----
  m.def(
      "select_blocks",
      [](const Array& q, const Array& k_cmp, const Array& lse_cmp, const Array& indices, const OptArray& cu_seqlens,
         const OptArray& cu_seqlens_cmp, std::int64_t max_seqlen, int cmp_block, int cmp_stride, int sel_block,
         int num_selected, int num_init, int num_local, std::optional<double> scale, const nb::callable& allocate,
         std::uintptr_t stream, const OptArray& cu_seqlens_k, std::int64_t max_seqlen_k, std::int64_t seqlen_k) {
        const OpName op_name("select_blocks");
        SelectBlocksParams p;
        p.q = view(q, "q");
        p.k_cmp = view(k_cmp, "k_cmp");
        p.lse_cmp = view(lse_cmp, "lse_cmp");
        p.indices = view(indices, "indices");
        p.seqs = seqs(cu_seqlens, max_seqlen);
        p.seqs_k = seqs(cu_seqlens_k, max_seqlen_k, "cu_seqlens_k");
        p.seqlen_k = seqlen_k;
        p.cu_seqlens_cmp = view(cu_seqlens_cmp, "cu_seqlens_cmp");
        p.cmp_block = cmp_block;
        p.cmp_stride = cmp_stride;
        p.sel_block = sel_block;
        p.num_selected = num_selected;
        p.num_init = num_init;
        p.num_local = num_local;
        p.scale = scale;
        p.stream = as_stream(stream);
        run_with_workspace(select_blocks, select_blocks_workspace_size, p, allocate);
      },
      "q"_a, "k_cmp"_a, "lse_cmp"_a, "indices"_a, "cu_seqlens"_a.none(), "cu_seqlens_cmp"_a.none(),
      "max_seqlen"_a, "cmp_block"_a, "cmp_stride"_a, "sel_block"_a, "num_selected"_a, "num_init"_a,
      "num_local"_a, "scale"_a.none(), "allocate"_a, "stream"_a, "cu_seqlens_k"_a.none() = nb::none(),
      "max_seqlen_k"_a = 0, "seqlen_k"_a = 0);

  // ---- selected_attention ----
  m.def(
      "selected_attention",
      [](const Array& q, const Array& k, const Array& v, const Array& indices, const Array& o, const Array& lse,
         const OptArray& cu_seqlens, std::int64_t max_seqlen, int block, std::optional<double> scale,
         const nb::callable& allocate, std::uintptr_t stream, const OptArray& cu_seqlens_k,
         std::int64_t max_seqlen_k) {
        const OpName op_name("selected_attention");
        SelectedAttentionParams p;
        p.q = view(q, "q");
        p.k = view(k, "k");
        p.v = view(v, "v");
        p.indices = view(indices, "indices");
        p.o = view(o, "o");
        p.lse = view(lse, "lse");
        p.seqs = seqs(cu_seqlens, max_seqlen);
        p.seqs_k = seqs(cu_seqlens_k, max_seqlen_k, "cu_seqlens_k");
        p.block = block;
        p.scale = scale;
        p.stream = as_stream(stream);
        run_with_workspace(selected_attention, selected_attention_workspace_size, p, allocate);
      },
      "q"_a, "k"_a, "v"_a, "indices"_a, "o"_a, "lse"_a, "cu_seqlens"_a.none(), "max_seqlen"_a, "block"_a,
      "scale"_a.none(), "allocate"_a, "stream"_a, "cu_seqlens_k"_a.none() = nb::none(), "max_seqlen_k"_a = 0);
  m.def(
      "selected_attention_backward",
      [](const Array& q, const Array& k, const Array& v, const Array& indices, const Array& o, const Array& lse,
         const Array& d_o, const Array& dq, const Array& dk, const Array& dv, const OptArray& cu_seqlens,
         std::int64_t max_seqlen, int block, std::optional<double> scale, const nb::callable& allocate,
         std::uintptr_t stream, const OptArray& cu_seqlens_k, std::int64_t max_seqlen_k) {
        const OpName op_name("selected_attention_backward");
        SelectedAttentionBackwardParams p;
        p.q = view(q, "q");
        p.k = view(k, "k");
        p.v = view(v, "v");
        p.indices = view(indices, "indices");
        p.o = view(o, "o");
        p.lse = view(lse, "lse");
        p.d_o = view(d_o, "d_o");
        p.dq = view(dq, "dq");
        p.dk = view(dk, "dk");
        p.dv = view(dv, "dv");
        p.seqs = seqs(cu_seqlens, max_seqlen);
        p.seqs_k = seqs(cu_seqlens_k, max_seqlen_k, "cu_seqlens_k");
        p.block = block;
        p.scale = scale;
        p.stream = as_stream(stream);
        run_with_workspace(selected_attention_backward, selected_attention_backward_workspace_size, p, allocate);
      },
      "q"_a, "k"_a, "v"_a, "indices"_a, "o"_a, "lse"_a, "d_o"_a, "dq"_a, "dk"_a, "dv"_a, "cu_seqlens"_a.none(),
      "max_seqlen"_a, "block"_a, "scale"_a.none(), "allocate"_a, "stream"_a, "cu_seqlens_k"_a.none() = nb::none(),
      "max_seqlen_k"_a = 0);

  // ---- flash_attention ----
  m.def(
      "flash_attention",
      [](const Array& q, const Array& k, const Array& v, const OptArray& mask, const OptArray& bias,
         const Array& o, const Array& lse, const OptArray& cu_seqlens_q, const OptArray& cu_seqlens_k,
         std::int64_t max_seqlen_q, std::int64_t max_seqlen_k, bool causal, std::int64_t window_left,
         std::int64_t window_right, std::optional<double> scale, const OptArray& alpha, const OptArray& delta,
         const std::string& gate, std::optional<double> gate_threshold, std::optional<double> softmax_threshold,
         std::int64_t threshold_block_q, std::int64_t threshold_block_k, const OptArray& block_mask,
         const OptArray& kv_num_blocks, const OptArray& kv_indices, const OptArray& full_kv_num_blocks,
         const OptArray& full_kv_indices, std::int64_t block_q, std::int64_t block_k,
         const OptArray& window_left_heads, const OptArray& window_right_heads, std::uintptr_t stream,
         const OptArray& work_counter, const OptArray& threshold_tiles) {
        const OpName op_name("flash_attention");
        FlashAttentionParams p;
        p.blocks = flash_blocks(block_mask, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, block_q,
                                block_k);
        p.head_windows = head_windows(window_left_heads, window_right_heads);
        p.gates = flash_gates(alpha, delta, gate, gate_threshold, softmax_threshold, threshold_block_q,
                              threshold_block_k);
        p.q = view(q, "q");
        p.k = view(k, "k");
        p.v = view(v, "v");
        p.mask = view(mask, "mask");
        p.bias = view(bias, "bias");
        p.o = view(o, "o");
        p.lse = view(lse, "lse");
        p.seqs_q = seqs(cu_seqlens_q, max_seqlen_q, "cu_seqlens_q");
        p.seqs_k = seqs(cu_seqlens_k, max_seqlen_k, "cu_seqlens_k");
        p.causal = causal;
        p.window_left = window_left;
        p.window_right = window_right;
        p.scale = scale;
        p.work_counter = view(work_counter, "work_counter");
        p.threshold_tiles = view(threshold_tiles, "threshold_tiles");
        p.stream = as_stream(stream);
        run(flash_attention, p);
      },
      "q"_a, "k"_a, "v"_a, "mask"_a.none(), "bias"_a.none(), "o"_a, "lse"_a, "cu_seqlens_q"_a.none(),
      "cu_seqlens_k"_a.none(), "max_seqlen_q"_a, "max_seqlen_k"_a, "causal"_a, "window_left"_a,
      "window_right"_a, "scale"_a.none(), "alpha"_a.none(), "delta"_a.none(), "gate"_a, "gate_threshold"_a.none(),
      "softmax_threshold"_a.none(), "threshold_block_q"_a, "threshold_block_k"_a, "block_mask"_a.none(),
      "kv_num_blocks"_a.none(), "kv_indices"_a.none(), "full_kv_num_blocks"_a.none(), "full_kv_indices"_a.none(),
      "block_q"_a, "block_k"_a, "window_left_heads"_a.none(), "window_right_heads"_a.none(), "stream"_a,
      "work_counter"_a.none() = nb::none(), "threshold_tiles"_a.none() = nb::none());
  m.def(
      "flash_attention_threshold_tiles",
      [](const Array& q, const Array& v) {
        const OpName op_name("flash_attention");
        FlashAttentionParams p;
        p.q = view(q, "q");
        p.v = view(v, "v");
        const FlashThresholdTiles tiles = flash_attention_threshold_tiles(p);
        return std::make_pair(tiles.block_q, tiles.block_k);
      },
      "q"_a, "v"_a,
      "The (block_q, block_k) that softmax_threshold's threshold_block must be on CUDA for q's dtype, device and "
      "head dims and v's head dim; (0, 0) where the CUDA forward does not run them.");
  m.def(
      "flash_attention_backward",
      [](const Array& q, const Array& k, const Array& v, const OptArray& mask, const OptArray& bias,
         const Array& o, const Array& lse, const Array& d_o, const Array& dq, const Array& dk, const Array& dv,
         const OptArray& dbias, const OptArray& cu_seqlens_q, const OptArray& cu_seqlens_k,
         std::int64_t max_seqlen_q, std::int64_t max_seqlen_k, bool causal, std::int64_t window_left,
         std::int64_t window_right, std::optional<double> scale, const OptArray& alpha, const OptArray& delta,
         const OptArray& dalpha, const OptArray& ddelta, const std::string& gate, std::optional<double> gate_threshold,
         std::optional<double> softmax_threshold, std::int64_t threshold_block_q, std::int64_t threshold_block_k,
         const OptArray& block_mask, const OptArray& kv_num_blocks, const OptArray& kv_indices,
         const OptArray& full_kv_num_blocks, const OptArray& full_kv_indices, std::int64_t block_q,
         std::int64_t block_k, const OptArray& window_left_heads, const OptArray& window_right_heads,
         const nb::callable& allocate, std::uintptr_t stream, const OptArray& work_counter) {
        const OpName op_name("flash_attention_backward");
        FlashAttentionBackwardParams p;
        p.blocks = flash_blocks(block_mask, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, block_q,
                                block_k);
        p.head_windows = head_windows(window_left_heads, window_right_heads);
        p.gates = flash_gates(alpha, delta, gate, gate_threshold, softmax_threshold, threshold_block_q,
                              threshold_block_k);
        p.dalpha = view(dalpha, "dalpha");
        p.ddelta = view(ddelta, "ddelta");
        p.q = view(q, "q");
        p.k = view(k, "k");
        p.v = view(v, "v");
        p.mask = view(mask, "mask");
        p.bias = view(bias, "bias");
        p.o = view(o, "o");
        p.lse = view(lse, "lse");
        p.d_o = view(d_o, "d_o");
        p.dq = view(dq, "dq");
        p.dk = view(dk, "dk");
        p.dv = view(dv, "dv");
        p.dbias = view(dbias, "dbias");
        p.seqs_q = seqs(cu_seqlens_q, max_seqlen_q, "cu_seqlens_q");
        p.seqs_k = seqs(cu_seqlens_k, max_seqlen_k, "cu_seqlens_k");
        p.causal = causal;
        p.window_left = window_left;
        p.window_right = window_right;
        p.scale = scale;
        p.work_counter = view(work_counter, "work_counter");
        p.stream = as_stream(stream);
        run_with_workspace(flash_attention_backward, flash_attention_backward_workspace_size, p, allocate);
      },
      "q"_a, "k"_a, "v"_a, "mask"_a.none(), "bias"_a.none(), "o"_a, "lse"_a, "d_o"_a, "dq"_a, "dk"_a, "dv"_a,
      "dbias"_a.none(), "cu_seqlens_q"_a.none(), "cu_seqlens_k"_a.none(), "max_seqlen_q"_a, "max_seqlen_k"_a,
      "causal"_a, "window_left"_a, "window_right"_a, "scale"_a.none(), "alpha"_a.none(), "delta"_a.none(),
      "dalpha"_a.none(), "ddelta"_a.none(), "gate"_a, "gate_threshold"_a.none(), "softmax_threshold"_a.none(),
      "threshold_block_q"_a, "threshold_block_k"_a, "block_mask"_a.none(), "kv_num_blocks"_a.none(),
      "kv_indices"_a.none(), "full_kv_num_blocks"_a.none(), "full_kv_indices"_a.none(), "block_q"_a, "block_k"_a,
      "window_left_heads"_a.none(), "window_right_heads"_a.none(), "allocate"_a, "stream"_a,
      "work_counter"_a.none() = nb::none());

  // ---- combine ----
  m.def(
      "combine",
      [](const OptArray& o_cmp, const OptArray& o_slc, const OptArray& o_swa, const OptArray& g_cmp,
         const OptArray& g_slc, const OptArray& g_swa, const Array& o, std::uintptr_t stream) {
        const OpName op_name("combine");
        CombineParams p;
        p.outputs = {view(o_cmp, "o_cmp"), view(o_slc, "o_slc"), view(o_swa, "o_swa")};
        p.gates = {view(g_cmp, "g_cmp"), view(g_slc, "g_slc"), view(g_swa, "g_swa")};
        p.o = view(o, "o");
        p.stream = as_stream(stream);
        run(combine, p);
      },
      "o_cmp"_a.none(), "o_slc"_a.none(), "o_swa"_a.none(), "g_cmp"_a.none(), "g_slc"_a.none(),
      "g_swa"_a.none(), "o"_a, "stream"_a);
  m.def(
      "combine_backward",
      [](const OptArray& o_cmp, const OptArray& o_slc, const OptArray& o_swa, const OptArray& g_cmp,
         const OptArray& g_slc, const OptArray& g_swa, const Array& d_o, const OptArray& d_o_cmp,
         const OptArray& d_o_slc, const OptArray& d_o_swa, const OptArray& d_g_cmp, const OptArray& d_g_slc,
         const OptArray& d_g_swa, std::uintptr_t stream) {
        const OpName op_name("combine_backward");
        CombineBackwardParams p;
        p.outputs = {view(o_cmp, "o_cmp"), view(o_slc, "o_slc"), view(o_swa, "o_swa")};
        p.gates = {view(g_cmp, "g_cmp"), view(g_slc, "g_slc"), view(g_swa, "g_swa")};
        p.d_o = view(d_o, "d_o");
        p.d_outputs = {view(d_o_cmp, "d_o_cmp"), view(d_o_slc, "d_o_slc"), view(d_o_swa, "d_o_swa")};
        p.d_gates = {view(d_g_cmp, "d_g_cmp"), view(d_g_slc, "d_g_slc"), view(d_g_swa, "d_g_swa")};
        p.stream = as_stream(stream);
        run(combine_backward, p);
      },
      "o_cmp"_a.none(), "o_slc"_a.none(), "o_swa"_a.none(), "g_cmp"_a.none(), "g_slc"_a.none(),
      "g_swa"_a.none(), "d_o"_a, "d_o_cmp"_a.none(), "d_o_slc"_a.none(), "d_o_swa"_a.none(),
      "d_g_cmp"_a.none(), "d_g_slc"_a.none(), "d_g_swa"_a.none(), "stream"_a);

  // ---- nsa_attention ----
  // Sizes from shapes only (usable from fake/meta implementations): every tensor is None or a
  // (dtype name, shape) pair; `device` is "cpu" or "cuda".
  // `op`: the operation the caller is preparing (nsa_attention or nsa_attention_backward), which errors name
  // instead of the size query, so that a bad call to nsa_attention reports nsa_attention.
  const auto def_nsa_size = [&m](const char* name, std::size_t (*size_of)(const NsaParams&)) {
    m.def(
        name,
        [name, size_of](const std::string& device, int device_index, nb::handle q, nb::handle k, nb::handle v,
                        nb::handle k_cmp, nb::handle v_cmp, nb::handle block_indices, nb::handle g_cmp,
                        nb::handle g_slc, nb::handle g_swa, nb::handle o, nb::handle cu_seqlens,
                        nb::handle cu_seqlens_cmp, std::int64_t max_seqlen, int cmp_block, int cmp_stride,
                        int sel_block, int num_selected, int num_init, int num_local, std::int64_t window,
                        std::optional<double> scale, const std::optional<std::string>& op, nb::handle cu_seqlens_k,
                        std::int64_t max_seqlen_k, const std::string& recompute) {
          const std::string op_name_text = op ? *op : std::string(name);
          const OpName op_name(op_name_text.c_str());
          try {
            return size_of(nsa_spec_params(device, device_index, q, k, v, k_cmp, v_cmp, block_indices, g_cmp,
                                           g_slc, g_swa, o, cu_seqlens, cu_seqlens_cmp, max_seqlen, cmp_block,
                                           cmp_stride, sel_block, num_selected, num_init, num_local, window, scale,
                                           cu_seqlens_k, max_seqlen_k, recompute));
          } catch (const Error& e) {
            throw renamed(e, op_name_text);
          }
        },
        "device"_a, "device_index"_a, "q"_a, "k"_a, "v"_a, "k_cmp"_a.none(), "v_cmp"_a.none(),
        "block_indices"_a.none(), "g_cmp"_a.none(), "g_slc"_a.none(), "g_swa"_a.none(), "o"_a,
        "cu_seqlens"_a.none(), "cu_seqlens_cmp"_a.none(), "max_seqlen"_a, "cmp_block"_a, "cmp_stride"_a,
        "sel_block"_a, "num_selected"_a, "num_init"_a, "num_local"_a, "window"_a, "scale"_a.none(),
        "op"_a.none() = nb::none(), "cu_seqlens_k"_a.none() = nb::none(), "max_seqlen_k"_a = 0,
        "recompute"_a = "none");
  };
  def_nsa_size("nsa_workspace_size", nsa_workspace_size);
  def_nsa_size("nsa_forward_scratch_size", nsa_forward_scratch_size);
  def_nsa_size("nsa_backward_scratch_size", nsa_backward_scratch_size);

  m.def(
      "nsa_attention",
      [](const Array& q, const Array& k, const Array& v, const OptArray& k_cmp, const OptArray& v_cmp,
         const OptArray& block_indices, const OptArray& g_cmp, const OptArray& g_slc, const OptArray& g_swa,
         const Array& o, const OptArray& cu_seqlens, const OptArray& cu_seqlens_cmp, std::int64_t max_seqlen,
         int cmp_block, int cmp_stride, int sel_block, int num_selected, int num_init, int num_local,
         std::int64_t window, std::optional<double> scale, const OptArray& workspace, const OptArray& scratch,
         std::uintptr_t stream, const OptArray& cu_seqlens_k, std::int64_t max_seqlen_k,
         const std::string& recompute) {
        const OpName op_name("nsa_attention");
        NsaParams p;
        p.q = view(q, "q");
        p.k = view(k, "k");
        p.v = view(v, "v");
        p.k_cmp = view(k_cmp, "k_cmp");
        p.v_cmp = view(v_cmp, "v_cmp");
        p.block_indices = view(block_indices, "block_indices");
        p.gates = {view(g_cmp, "g_cmp"), view(g_slc, "g_slc"), view(g_swa, "g_swa")};
        p.o = view(o, "o");
        p.seqs = seqs(cu_seqlens, max_seqlen);
        p.seqs_k = seqs(cu_seqlens_k, max_seqlen_k, "cu_seqlens_k");
        p.cu_seqlens_cmp = view(cu_seqlens_cmp, "cu_seqlens_cmp");
        p.config = nsa_config(cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, window, scale);
        std::tie(p.workspace, p.workspace_bytes) = bytes(workspace, "workspace");
        p.recompute = nsa_recompute(recompute);
        std::tie(p.scratch, p.scratch_bytes) = bytes(scratch, "scratch");
        p.stream = as_stream(stream);
        run(nsa_attention, p);
      },
      "q"_a, "k"_a, "v"_a, "k_cmp"_a.none(), "v_cmp"_a.none(), "block_indices"_a.none(), "g_cmp"_a.none(),
      "g_slc"_a.none(), "g_swa"_a.none(), "o"_a, "cu_seqlens"_a.none(), "cu_seqlens_cmp"_a.none(),
      "max_seqlen"_a, "cmp_block"_a, "cmp_stride"_a, "sel_block"_a, "num_selected"_a, "num_init"_a,
      "num_local"_a, "window"_a, "scale"_a.none(), "workspace"_a.none(), "scratch"_a.none(), "stream"_a,
      "cu_seqlens_k"_a.none() = nb::none(), "max_seqlen_k"_a = 0, "recompute"_a = "none");
  m.def(
      "nsa_attention_backward",
      [](const Array& q, const Array& k, const Array& v, const OptArray& k_cmp, const OptArray& v_cmp,
         const OptArray& block_indices, const OptArray& g_cmp, const OptArray& g_slc, const OptArray& g_swa,
         const Array& o, const OptArray& cu_seqlens, const OptArray& cu_seqlens_cmp, std::int64_t max_seqlen,
         int cmp_block, int cmp_stride, int sel_block, int num_selected, int num_init, int num_local,
         std::int64_t window, std::optional<double> scale, const OptArray& workspace, const Array& d_o,
         const Array& dq, const Array& dk, const Array& dv, const OptArray& dk_cmp, const OptArray& dv_cmp,
         const OptArray& d_g_cmp, const OptArray& d_g_slc, const OptArray& d_g_swa, const OptArray& scratch,
         std::uintptr_t stream, const OptArray& cu_seqlens_k, std::int64_t max_seqlen_k,
         const std::string& recompute) {
        const OpName op_name("nsa_attention_backward");
        NsaBackwardParams p;
        NsaParams& f = p.forward;
        f.q = view(q, "q");
        f.k = view(k, "k");
        f.v = view(v, "v");
        f.k_cmp = view(k_cmp, "k_cmp");
        f.v_cmp = view(v_cmp, "v_cmp");
        f.block_indices = view(block_indices, "block_indices");
        f.gates = {view(g_cmp, "g_cmp"), view(g_slc, "g_slc"), view(g_swa, "g_swa")};
        f.o = view(o, "o");
        f.seqs = seqs(cu_seqlens, max_seqlen);
        f.seqs_k = seqs(cu_seqlens_k, max_seqlen_k, "cu_seqlens_k");
        f.cu_seqlens_cmp = view(cu_seqlens_cmp, "cu_seqlens_cmp");
        f.config = nsa_config(cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, window, scale);
        f.recompute = nsa_recompute(recompute);
        std::tie(f.workspace, f.workspace_bytes) = bytes(workspace, "workspace");
        f.stream = as_stream(stream);
        p.d_o = view(d_o, "d_o");
        p.dq = view(dq, "dq");
        p.dk = view(dk, "dk");
        p.dv = view(dv, "dv");
        p.dk_cmp = view(dk_cmp, "dk_cmp");
        p.dv_cmp = view(dv_cmp, "dv_cmp");
        p.d_gates = {view(d_g_cmp, "d_g_cmp"), view(d_g_slc, "d_g_slc"), view(d_g_swa, "d_g_swa")};
        std::tie(p.scratch, p.scratch_bytes) = bytes(scratch, "scratch");
        run(nsa_attention_backward, p);
      },
      "q"_a, "k"_a, "v"_a, "k_cmp"_a.none(), "v_cmp"_a.none(), "block_indices"_a.none(), "g_cmp"_a.none(),
      "g_slc"_a.none(), "g_swa"_a.none(), "o"_a, "cu_seqlens"_a.none(), "cu_seqlens_cmp"_a.none(),
      "max_seqlen"_a, "cmp_block"_a, "cmp_stride"_a, "sel_block"_a, "num_selected"_a, "num_init"_a,
      "num_local"_a, "window"_a, "scale"_a.none(), "workspace"_a.none(), "d_o"_a, "dq"_a, "dk"_a, "dv"_a,
      "dk_cmp"_a.none(), "dv_cmp"_a.none(), "d_g_cmp"_a.none(), "d_g_slc"_a.none(), "d_g_swa"_a.none(),
      "scratch"_a.none(), "stream"_a, "cu_seqlens_k"_a.none() = nb::none(), "max_seqlen_k"_a = 0,
      "recompute"_a = "none");

  // ---- create_mask ----
  m.def(
      "create_mask",
      [](const Array& bias, const OptArray& key_padding_mask, const Array& mask, std::int64_t keep, bool causal,
         std::int64_t window_left, std::int64_t window_right, std::uintptr_t stream) {
        const OpName op_name("create_mask");
        CreateMaskParams p;
        p.bias = view(bias, "bias");
        p.key_padding_mask = view(key_padding_mask, "key_padding_mask");
        p.mask = view(mask, "mask");
        p.keep = keep;
        p.causal = causal;
        p.window_left = window_left;
        p.window_right = window_right;
        p.stream = as_stream(stream);
        run(create_mask, p);
      },
      "bias"_a, "key_padding_mask"_a.none(), "mask"_a, "keep"_a, "causal"_a, "window_left"_a, "window_right"_a,
      "stream"_a);
  { void bind_flash_decode(nb::module_&); bind_flash_decode(m); }  // src/binding/flash_decode.cpp
  { void bind_nsa_decode(nb::module_&); bind_nsa_decode(m); }  // src/binding/nsa_decode.cpp
}
