#include "cuda/library_loader.h"

#include <dlfcn.h>

#include <cstdlib>

#include "gradkit/core/error.h"

namespace gradkit::cuda {

namespace {

std::string last_dl_error() {
  const char* text = dlerror();
  return text != nullptr ? text : "no reason given";
}

}  // namespace

LibraryLoader::LibraryLoader(const LibrarySpec& spec) : spec_(spec) {
  const char* chosen = std::getenv(spec.variable);
  const bool overridden = chosen != nullptr && chosen[0] != '\0';
  file_ = overridden ? chosen : spec.soname;
  dlerror();  // clear a failure left by an earlier call
  handle_ = dlopen(file_.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle_ == nullptr) {
    failure_ = "dlopen(\"" + file_ + "\")" + (overridden ? std::string(" (from ") + spec.variable + ")" : "") +
               " failed: " + last_dl_error();
  }
}

void* LibraryLoader::find(const char* name, bool required) {
  if (handle_ == nullptr) return nullptr;
  dlerror();
  void* symbol = dlsym(handle_, name);
  if (symbol == nullptr && required && failure_.empty()) {
    failure_ = file_ + " has no " + name + " (" + last_dl_error() + ")";
  }
  return symbol;
}

void LibraryLoader::throw_unavailable(std::string_view user) const {
  throw Error(ErrorCode::backend_unavailable, std::string(user) + " needs " + spec_.name + " (" + spec_.soname +
                                                  "), which could not be loaded: " + failure_ + ". " + spec_.remedy);
}

}  // namespace gradkit::cuda
