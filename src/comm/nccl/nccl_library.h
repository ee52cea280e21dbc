// NCCL, loaded at first use (cuda/library_loader.h): the functions the
// NCCL communicator calls, each of nccl.h's type, and ncclCommRevoke where
// the library has it.
#pragma once

#include <nccl.h>

#include <string_view>

namespace gradkit::comm {

#define GRADKIT_NCCL_FUNCTIONS(X)                                                                          \
  X(ncclGetErrorString) X(ncclGetLastError) X(ncclGetUniqueId) X(ncclCommInitRankConfig) X(ncclCommFinalize) \
  X(ncclCommDestroy) X(ncclCommAbort) X(ncclCommGetAsyncError) X(ncclGroupStart) X(ncclGroupEnd)           \
  X(ncclAllReduce) X(ncclAllGather) X(ncclReduceScatter) X(ncclSend) X(ncclRecv)

struct NcclLibrary {
#define GRADKIT_NCCL_MEMBER(name) decltype(&::name) name = nullptr;
  GRADKIT_NCCL_FUNCTIONS(GRADKIT_NCCL_MEMBER)
#undef GRADKIT_NCCL_MEMBER
  // NCCL 2.28.7 and later; null in an older library, where the watchdog
  // aborts instead (watchdog.h). Its own type, so that an older nccl.h
  // compiles too.
  ncclResult_t (*ncclCommRevoke)(ncclComm_t comm, int flags) = nullptr;
};

// libnccl.so.2 (or GRADKIT_NCCL_LIBRARY's file), loaded by the first call
// in the process (thread-safe, once; a failure is kept, not retried).
// Throws backend_unavailable naming `user`, the library and how to get it
// where it could not be loaded or lacks one of the functions.
const NcclLibrary& nccl_library(std::string_view user);

// The table for code that runs only once nccl_library has returned (an
// NCCL communicator or unique id exists): it throws no more.
inline const NcclLibrary& nccl() { return nccl_library("the NCCL communicator"); }

}  // namespace gradkit::comm
