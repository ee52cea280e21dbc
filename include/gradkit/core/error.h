// The one error type of gradkit: a code and a message that names the argument.
#pragma once

#include <stdexcept>
#include <string>

namespace gradkit {

enum class ErrorCode {
  invalid_argument,   // a value out of its range, a list of the wrong length
  size_mismatch,      // element counts that must agree do not
  dtype_unsupported,  // an element type (or pair) the operation does not take
  device_mismatch,    // memory on another device than the call expects
  null_pointer,       // a null data pointer with a non-zero element count
  aliasing,           // buffers that overlap where they must not
  backend_unavailable,// CUDA asked for in a build or on a machine without it
  cuda_error,         // a CUDA runtime call failed
  nccl_error,
  mpi_error,
  io_error,           // a file that cannot be read, written, or is malformed
};

std::string_view error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// Throws Error(code, "<op>: argument '<arg>' <what>") — the form every
// validation message takes, so users can grep for the argument name.
[[noreturn]] void throw_argument_error(ErrorCode code, std::string_view op, std::string_view arg,
                                       const std::string& what);

// Unless `ok`: throws Error(invalid_argument, "<op>: argument '<arg>' is
// <value>, expected <expected>"), the value printed with %.9g.
void check_value(bool ok, std::string_view op, std::string_view arg, double value, const std::string& expected);

}  // namespace gradkit
