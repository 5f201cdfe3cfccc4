// The binding's DLPack → TensorView conversion (views.h).
#include "views.h"

#include <cstdint>

namespace nb = nanobind;

namespace sparseattn::binding {

// The operation whose arguments are being converted, for error messages.
namespace {
thread_local const char* g_op = "binding";
}  // namespace

[[noreturn]] void fail(ErrorKind kind, const std::string& arg, const std::string& message) {
  throw Error(kind, g_op, arg, message);
}

OpName::OpName(const char* op) : previous(g_op) { g_op = op; }
OpName::~OpName() { g_op = previous; }

DType to_dtype(nb::dlpack::dtype dt, const char* arg) {
  using Code = nb::dlpack::dtype_code;
  if (dt.lanes == 1) {
    const auto code = static_cast<Code>(dt.code);
    if (code == Code::Float && dt.bits == 16) return DType::float16;
    if (code == Code::Float && dt.bits == 32) return DType::float32;
    if (code == Code::Float && dt.bits == 64) return DType::float64;
    if (code == Code::Bfloat && dt.bits == 16) return DType::bfloat16;
    if (code == Code::Int && dt.bits == 32) return DType::int32;
    if (code == Code::Bool && dt.bits == 8) return DType::boolean;
    if (code == Code::UInt && dt.bits == 8) return DType::uint8;
    if (code == Code::Int && dt.bits == 64) return DType::int64;
  }
  const auto code = static_cast<Code>(dt.code);
  std::string name;
  if (code == Code::Int) name = "int" + std::to_string(dt.bits);
  else if (code == Code::UInt) name = "uint" + std::to_string(dt.bits);
  else if (code == Code::Float) name = "float" + std::to_string(dt.bits);
  else if (code == Code::Complex) name = "complex" + std::to_string(dt.bits);
  else name = "DLPack dtype code " + std::to_string(dt.code) + " of " + std::to_string(dt.bits) + " bits";
  if (dt.lanes != 1) name += " x" + std::to_string(dt.lanes);
  // Index tensors (cu_seqlens, block indices) are int32; torch makes int64 by default.
  const std::string hint = code == Code::Int || code == Code::UInt
                               ? " (index tensors and cu_seqlens are int32: convert with .int())"
                               : "";
  fail(ErrorKind::dtype, arg,
       "unsupported dtype " + name + "; expected float16, bfloat16, float32, float64, int32, int64, uint8 or bool" +
           hint);
}

DType dtype_from_name(const std::string& name, const char* arg) {
  for (DType d : {DType::float16, DType::bfloat16, DType::float32, DType::float64, DType::int32, DType::boolean,
                  DType::uint8, DType::int64}) {
    if (name == dtype_name(d)) return d;
  }
  fail(ErrorKind::dtype, arg, "unknown dtype name '" + name + "'");
}

TensorView view(const Array& a, const char* arg) {
  TensorView t;
  if (a.ndim() < 1 || a.ndim() > static_cast<std::size_t>(kMaxRank)) {
    fail(ErrorKind::shape, arg, "expected 1 to 4 dimensions, got " + std::to_string(a.ndim()));
  }
  t.dtype = to_dtype(a.dtype(), arg);
  switch (a.device_type()) {
    case nb::device::cpu::value: t.device = DeviceType::cpu; break;
    case nb::device::cuda::value: t.device = DeviceType::cuda; break;
    default: fail(ErrorKind::device, arg, "unsupported DLPack device type " + std::to_string(a.device_type()));
  }
  t.device_index = a.device_id();
  t.rank = static_cast<int>(a.ndim());
  for (int i = 0; i < t.rank; ++i) {
    t.shape[i] = static_cast<std::int64_t>(a.shape(i));
    t.stride[i] = a.stride(i);
  }
  t.data = a.size() == 0 ? nullptr : a.data();
  return t;
}

TensorView view(const OptArray& a, const char* arg) { return a ? view(*a, arg) : TensorView{}; }

}  // namespace sparseattn::binding
