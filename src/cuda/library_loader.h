// A shared library that gradkit loads at first use instead of linking:
// cuBLASLt (cuda/cublaslt_library.h) and NCCL (comm/nccl/nccl_library.h).
// libgradkit then lists neither as DT_NEEDED, so it loads, and its CPU
// steps run, where neither is installed (a CPU-only torch, no driver); the
// first call that needs one of them loads it, or refuses with
// backend_unavailable naming the library, what needs it and how to get it.
//
// The library is opened by its soname (dlopen, RTLD_LOCAL), so a copy that
// the process already holds is the one found: torch's, or the one
// gradkit/_shared_libraries.py loaded by path before the module (docs/
// python.md). Where the library's variable (GRADKIT_CUBLASLT_LIBRARY,
// GRADKIT_NCCL_LIBRARY) is set and not empty, its value is the file opened
// instead. It is never closed.
#pragma once

#include <string>
#include <string_view>

namespace gradkit::cuda {

struct LibrarySpec {
  const char* name;      // "cuBLASLt"
  const char* soname;    // "libcublasLt.so.13"
  const char* variable;  // the environment variable naming another file to open
  const char* remedy;    // how to get it, a sentence
};

// Opens the library when constructed; then each symbol is looked up by
// name. A failure (the file, or a required symbol) is kept: the first one
// is what failure() says, and what throw_unavailable reports.
class LibraryLoader {
 public:
  explicit LibraryLoader(const LibrarySpec& spec);

  // The function named `name`, or null with the failure recorded.
  template <class Function>
  void require(const char* name, Function*& slot) {
    slot = reinterpret_cast<Function*>(find(name, true));
  }
  // The function named `name`, or null where this version has none.
  template <class Function>
  void optional(const char* name, Function*& slot) {
    slot = reinterpret_cast<Function*>(find(name, false));
  }

  bool loaded() const { return failure_.empty(); }
  const std::string& failure() const { return failure_; }

  // backend_unavailable: "`user` needs <name> (<soname>), which could not
  // be loaded: <failure>. <remedy>."
  [[noreturn]] void throw_unavailable(std::string_view user) const;

 private:
  void* find(const char* name, bool required);

  LibrarySpec spec_;
  std::string file_;  // what dlopen was given
  void* handle_ = nullptr;
  std::string failure_;
};

}  // namespace gradkit::cuda
