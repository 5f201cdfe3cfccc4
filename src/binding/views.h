// The DLPack → TensorView conversion of the binding's entry points (module.cpp, flash_decode.cpp), with errors
// that name the operation being converted (OpName) and the argument.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>
#include <string>

#include "sparseattn/error.h"
#include "sparseattn/tensor.h"

namespace sparseattn::binding {

using Array = nanobind::ndarray<>;
using OptArray = std::optional<Array>;

// Throws sparseattn::Error naming the operation of the innermost OpName and `arg`.
[[noreturn]] void fail(ErrorKind kind, const std::string& arg, const std::string& message);

// Names the operation in conversion errors for the rest of the enclosing scope.
struct OpName {
  explicit OpName(const char* op);
  ~OpName();
  OpName(const OpName&) = delete;
  OpName& operator=(const OpName&) = delete;
  const char* previous;
};

DType to_dtype(nanobind::dlpack::dtype dt, const char* arg);
DType dtype_from_name(const std::string& name, const char* arg);
TensorView view(const Array& a, const char* arg);
TensorView view(const OptArray& a, const char* arg);

}  // namespace sparseattn::binding
