#include "sparseattn/tensor.h"

#include <sstream>

#include "sparseattn/error.h"
#include "sparseattn/version.h"

namespace sparseattn {

std::size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::float16:
    case DType::bfloat16: return 2;
    case DType::float32:
    case DType::int32: return 4;
    case DType::float64:
    case DType::int64: return 8;
    case DType::boolean:
    case DType::uint8: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::float16: return "float16";
    case DType::bfloat16: return "bfloat16";
    case DType::float32: return "float32";
    case DType::float64: return "float64";
    case DType::int32: return "int32";
    case DType::boolean: return "bool";
    case DType::uint8: return "uint8";
    case DType::int64: return "int64";
  }
  return "?";
}

const char* device_name(DeviceType device) { return device == DeviceType::cpu ? "cpu" : "cuda"; }

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t expected = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::ostringstream out;
  out << '[';
  for (int i = 0; i < rank; ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                  DeviceType device, int device_index) {
  if (shape.size() == 0 || shape.size() > kMaxRank) {
    throw Error(ErrorKind::shape, "TensorView::contiguous", "shape", "expected 1 to 4 dimensions");
  }
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.device = device;
  view.device_index = device_index;
  view.rank = static_cast<int>(shape.size());
  int i = 0;
  for (std::int64_t extent : shape) view.shape[i++] = extent;
  std::int64_t stride = 1;
  for (i = view.rank - 1; i >= 0; --i) {
    view.stride[i] = stride;
    stride *= view.shape[i];
  }
  return view;
}

bool built_with_cuda() {
#ifdef SPARSEATTN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace sparseattn
