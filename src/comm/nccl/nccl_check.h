// Every NCCL call is checked; a failure throws with the call, NCCL's own
// description and the place, like GRADKIT_CUDA_CHECK.
#pragma once

#include <nccl.h>

#include <string>

#include "comm/nccl/nccl_library.h"
#include "gradkit/core/error.h"

namespace gradkit::comm {

[[noreturn]] inline void throw_nccl_error(ncclResult_t status, const char* call, const char* file, int line,
                                          const std::string& detail = {}) {
  std::string message = std::string(call) + " failed: " + nccl().ncclGetErrorString(status) + " (ncclResult_t " +
                        std::to_string(static_cast<int>(status)) + ")";
  if (!detail.empty()) message += ": " + detail;
  throw Error(ErrorCode::nccl_error, message + " at " + file + ":" + std::to_string(line));
}

}  // namespace gradkit::comm

#define GRADKIT_NCCL_CHECK(call)                                                      \
  do {                                                                                \
    const ncclResult_t gradkit_nccl_status_ = (call);                                 \
    if (gradkit_nccl_status_ != ncclSuccess)                                          \
      ::gradkit::comm::throw_nccl_error(gradkit_nccl_status_, #call, __FILE__, __LINE__); \
  } while (0)
