// The libraries gradkit loads at first use (src/cuda/library_loader.h):
// where one cannot be loaded, every call that needs it is refused with
// backend_unavailable naming the library, what needs it and how to get it.
// Every test first points GRADKIT_CUBLASLT_LIBRARY and GRADKIT_NCCL_LIBRARY
// at files that do not exist, before anything in the process has loaded
// either library (a process loads each once, and keeps a failure), so the
// tests run alone or together, with or without the libraries installed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda/cublaslt_library.h"
#include "cuda/library_loader.h"
#include "gradkit/comm/communicator.h"
#include "gradkit/core/error.h"
#include "gradkit/ops/muon.h"
#include "support/expect_error.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

constexpr const char* kMissingCublasLt = "/nonexistent/gradkit-test/libcublasLt.so.13";
constexpr const char* kMissingNccl = "/nonexistent/gradkit-test/libnccl.so.2";

class LibraryLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("GRADKIT_CUBLASLT_LIBRARY", kMissingCublasLt, 1);
    setenv("GRADKIT_NCCL_LIBRARY", kMissingNccl, 1);
  }
};

TEST_F(LibraryLoaderTest, MissingCublasLtIsRefusedNamingTheLibraryItsUserAndTheRemedy) {
  for (int call = 0; call < 2; ++call) {  // the kept failure says the same the second time
    expect_error([] { cuda::cublaslt_library("the test's products"); }, ErrorCode::backend_unavailable,
                 {"the test's products needs cuBLASLt (libcublasLt.so.13)", kMissingCublasLt,
                  "(from GRADKIT_CUBLASLT_LIBRARY)", "nvidia-cublas", "set GRADKIT_CUBLASLT_LIBRARY"});
  }
}

TEST_F(LibraryLoaderTest, MuonOnCudaWithoutCublasLtIsRefusedWhenThePlanIsMade) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  std::mt19937_64 rng(20261201);
  const TestTensor w(Device::cuda(0), DType::f32, random_values(rng, 64));
  const TestTensor g(Device::cuda(0), DType::f32, random_values(rng, 64));
  const TestTensor m(Device::cuda(0), DType::f32, random_values(rng, 64, 0.1));
  const std::vector<TensorView> wv{w.view()}, gv{g.view()}, mv{m.view()};
  const std::vector<MatrixShape> shapes{{1, 8, 8}};
  const MuonHyperparameters h;
  expect_error([&] { MuonPlan(MuonTensors{wv, gv, mv, shapes}, std::span(&h, 1)); },
               ErrorCode::backend_unavailable,
               {"Muon on cuda:0 (its Newton-Schulz products) needs cuBLASLt (libcublasLt.so.13)", kMissingCublasLt});
}

#if GRADKIT_WITH_NCCL
TEST_F(LibraryLoaderTest, MissingNcclIsRefusedByEveryEntryPointThatNeedsIt) {
  expect_error([] { create_nccl_unique_id(); }, ErrorCode::backend_unavailable,
               {"create_nccl_unique_id needs NCCL (libnccl.so.2)", kMissingNccl, "(from GRADKIT_NCCL_LIBRARY)",
                "nvidia-nccl-cu13", "set GRADKIT_NCCL_LIBRARY"});
  // Valid arguments, so that what refuses is the library, before any device is looked for.
  expect_error([] { create_nccl_communicator(NcclUniqueId{}, 0, 1); }, ErrorCode::backend_unavailable,
               {"create_nccl_communicator needs NCCL (libnccl.so.2)", kMissingNccl});
  // The arguments are still checked first.
  expect_error([] { create_nccl_communicator(NcclUniqueId{}, 2, 1); }, ErrorCode::invalid_argument, {"rank"});
}
#endif

// The mechanism itself, on libraries of its own choosing.
constexpr cuda::LibrarySpec kTestLibrary{"a test library", "libgradkit-test-absent.so.1",
                                         "GRADKIT_TEST_LIBRARY_LOADER", "Get it from the test."};

TEST_F(LibraryLoaderTest, AnAbsentSonameIsAFailureNamingIt) {
  unsetenv(kTestLibrary.variable);
  const cuda::LibraryLoader loader(kTestLibrary);
  EXPECT_FALSE(loader.loaded());
  EXPECT_NE(loader.failure().find("dlopen(\"libgradkit-test-absent.so.1\") failed"), std::string::npos)
      << loader.failure();
  expect_error([&] { loader.throw_unavailable("the test"); }, ErrorCode::backend_unavailable,
               {"the test needs a test library (libgradkit-test-absent.so.1), which could not be loaded: ",
                "Get it from the test."});
}

TEST_F(LibraryLoaderTest, TheVariableNamesTheFileAndAMissingFunctionIsAFailure) {
  // The C library stands in for a library that is present: what it has
  // is found, what it lacks is the failure; an optional function it lacks
  // is null and no failure.
  setenv(kTestLibrary.variable, "libc.so.6", 1);
  cuda::LibraryLoader loader(kTestLibrary);
  unsetenv(kTestLibrary.variable);
  EXPECT_TRUE(loader.loaded()) << loader.failure();
  size_t (*length)(const char*) = nullptr;
  loader.require("strlen", length);
  ASSERT_NE(length, nullptr);
  EXPECT_EQ(length("four"), 4u);
  void (*absent)() = &std::abort;
  loader.optional("gradkit_test_no_such_function", absent);
  EXPECT_EQ(absent, nullptr);
  EXPECT_TRUE(loader.loaded()) << loader.failure();
  loader.require("cublasLtCreate", absent);
  EXPECT_EQ(absent, nullptr);
  EXPECT_FALSE(loader.loaded());
  EXPECT_NE(loader.failure().find("libc.so.6 has no cublasLtCreate"), std::string::npos) << loader.failure();
}

}  // namespace
}  // namespace gradkit::test
