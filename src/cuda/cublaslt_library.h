// cuBLASLt, loaded at first use (cuda/library_loader.h): the functions
// Muon's products call (cuda/muon.cu), each of cublasLt.h's type.
#pragma once

#include <cublasLt.h>

#include <string_view>

namespace gradkit::cuda {

#define GRADKIT_CUBLASLT_FUNCTIONS(X)                                                             \
  X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtMatmul) X(cublasLtMatmulAlgoGetHeuristic)        \
  X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy) X(cublasLtMatmulDescSetAttribute)      \
  X(cublasLtMatmulPreferenceCreate) X(cublasLtMatmulPreferenceDestroy)                            \
  X(cublasLtMatmulPreferenceSetAttribute) X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy) \
  X(cublasLtMatrixLayoutSetAttribute)

struct CublasLtLibrary {
#define GRADKIT_CUBLASLT_MEMBER(name) decltype(&::name) name = nullptr;
  GRADKIT_CUBLASLT_FUNCTIONS(GRADKIT_CUBLASLT_MEMBER)
#undef GRADKIT_CUBLASLT_MEMBER
};

// libcublasLt.so.13 (or GRADKIT_CUBLASLT_LIBRARY's file), loaded by the
// first call in the process (thread-safe, once; a failure is kept, not
// retried). Throws backend_unavailable naming `user`, the library and how
// to get it where it could not be loaded or lacks one of the functions.
const CublasLtLibrary& cublaslt_library(std::string_view user);

// The table for code that runs only once cublaslt_library has returned
// (a handle exists): it throws no more.
inline const CublasLtLibrary& cublaslt() { return cublaslt_library("Muon's CUDA products"); }

}  // namespace gradkit::cuda
