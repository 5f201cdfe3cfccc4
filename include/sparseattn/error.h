// The one exception type of the C++ API. Every validation failure throws it before any work starts and
// before any output is written; the message names the operation, the argument and what was expected.
#pragma once

#include <stdexcept>
#include <string>

namespace sparseattn {

enum class ErrorKind {
  shape,        // wrong rank or size
  dtype,        // wrong element type
  device,       // wrong or mixed devices
  layout,       // unsupported strides (e.g. the last dimension not contiguous)
  config,       // inconsistent options (block sizes, window, counts)
  value,        // bad contents of an index tensor (cu_seqlens, block indices) checked where that is free
  unsupported,  // valid request this build or backend does not implement (head dim, CUDA kernels ...)
};

const char* error_kind_name(ErrorKind kind);

class Error : public std::invalid_argument {
 public:
  Error(ErrorKind kind, std::string op, std::string argument, const std::string& message);

  ErrorKind kind() const noexcept { return kind_; }
  const std::string& op() const noexcept { return op_; }
  const std::string& argument() const noexcept { return argument_; }

 private:
  ErrorKind kind_;
  std::string op_;
  std::string argument_;
};

}  // namespace sparseattn
