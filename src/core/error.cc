#include "gradkit/core/error.h"

#include <cstdio>
#include <string>

namespace gradkit {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::size_mismatch: return "size_mismatch";
    case ErrorCode::dtype_unsupported: return "dtype_unsupported";
    case ErrorCode::device_mismatch: return "device_mismatch";
    case ErrorCode::null_pointer: return "null_pointer";
    case ErrorCode::aliasing: return "aliasing";
    case ErrorCode::backend_unavailable: return "backend_unavailable";
    case ErrorCode::cuda_error: return "cuda_error";
    case ErrorCode::nccl_error: return "nccl_error";
    case ErrorCode::mpi_error: return "mpi_error";
    case ErrorCode::io_error: return "io_error";
  }
  return "unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(message), code_(code) {}

void throw_argument_error(ErrorCode code, std::string_view op, std::string_view arg,
                          const std::string& what) {
  std::string message(op);
  message += ": argument '";
  message += arg;
  message += "' ";
  message += what;
  throw Error(code, message);
}

void check_value(bool ok, std::string_view op, std::string_view arg, double value, const std::string& expected) {
  if (ok) return;
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", value);
  throw_argument_error(ErrorCode::invalid_argument, op, arg, std::string("is ") + text + ", expected " + expected);
}

}  // namespace gradkit
