#include "sparseattn/error.h"

namespace sparseattn {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::shape: return "shape";
    case ErrorKind::dtype: return "dtype";
    case ErrorKind::device: return "device";
    case ErrorKind::layout: return "layout";
    case ErrorKind::config: return "config";
    case ErrorKind::value: return "value";
    case ErrorKind::unsupported: return "unsupported";
  }
  return "?";
}

Error::Error(ErrorKind kind, std::string op, std::string argument, const std::string& message)
    : std::invalid_argument("sparseattn." + op + ": argument '" + argument + "': " + message),
      kind_(kind),
      op_(std::move(op)),
      argument_(std::move(argument)) {}

}  // namespace sparseattn
