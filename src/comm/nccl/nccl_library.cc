#include "comm/nccl/nccl_library.h"

#include "cuda/library_loader.h"

namespace gradkit::comm {

namespace {

constexpr cuda::LibrarySpec kNccl{
    "NCCL", "libnccl.so.2", "GRADKIT_NCCL_LIBRARY",
    "Install torch with CUDA (its nvidia-nccl-cu13 wheel), or the nvidia-nccl-cu13 wheel, or NCCL where the dynamic "
    "loader finds it (ldconfig, LD_LIBRARY_PATH), or set GRADKIT_NCCL_LIBRARY to the path of libnccl.so.2"};

struct Loaded {
  cuda::LibraryLoader loader{kNccl};
  NcclLibrary table;
  Loaded() {
#define GRADKIT_NCCL_RESOLVE(name) loader.require(#name, table.name);
    GRADKIT_NCCL_FUNCTIONS(GRADKIT_NCCL_RESOLVE)
#undef GRADKIT_NCCL_RESOLVE
    loader.optional("ncclCommRevoke", table.ncclCommRevoke);
  }
};

}  // namespace

const NcclLibrary& nccl_library(std::string_view user) {
  static const Loaded loaded;  // C++ runs this once, whichever thread comes first
  if (!loaded.loader.loaded()) loaded.loader.throw_unavailable(user);
  return loaded.table;
}

}  // namespace gradkit::comm
