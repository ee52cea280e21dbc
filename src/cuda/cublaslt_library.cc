#include "cuda/cublaslt_library.h"

#include "cuda/library_loader.h"

namespace gradkit::cuda {

namespace {

constexpr LibrarySpec kCublasLt{
    "cuBLASLt", "libcublasLt.so.13", "GRADKIT_CUBLASLT_LIBRARY",
    "Install torch with CUDA (its nvidia-cublas wheel), or the nvidia-cublas wheel, or the CUDA 13 toolkit's "
    "libraries where the dynamic loader finds them (ldconfig, LD_LIBRARY_PATH), or set GRADKIT_CUBLASLT_LIBRARY to "
    "the path of libcublasLt.so.13"};

struct Loaded {
  LibraryLoader loader{kCublasLt};
  CublasLtLibrary table;
  Loaded() {
#define GRADKIT_CUBLASLT_RESOLVE(name) loader.require(#name, table.name);
    GRADKIT_CUBLASLT_FUNCTIONS(GRADKIT_CUBLASLT_RESOLVE)
#undef GRADKIT_CUBLASLT_RESOLVE
  }
};

}  // namespace

const CublasLtLibrary& cublaslt_library(std::string_view user) {
  static const Loaded loaded;  // C++ runs this once, whichever thread comes first
  if (!loaded.loader.loaded()) loaded.loader.throw_unavailable(user);
  return loaded.table;
}

}  // namespace gradkit::cuda
