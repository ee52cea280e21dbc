// What the communication tests share: the backends (MPI always; NCCL where
// built and where this host has a GPU per local rank), one communicator per
// backend kept for the whole run, tensor lists laid out back to back or with
// gaps, and every rank's seeded input, which every rank can regenerate to
// compute the exact expected result in float64.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gradkit/comm/communicator.h"
#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "support/expect_error.h"
#include "support/tolerance.h"

namespace gradkit::test {

enum class Backend { mpi, nccl };

inline std::string backend_test_name(const ::testing::TestParamInfo<Backend>& info) {
  return info.param == Backend::mpi ? "mpi" : "nccl";
}

// The GPU of this rank's NCCL communicators: its local rank, one GPU per
// local rank, unless GRADKIT_TEST_CUDA_DEVICE names one GPU for every rank
// (scripts/ranks-on-one-gpu: ranks that share a GPU, each posing as its own
// host to NCCL, so that the NCCL instances run where one GPU is lent; their
// results and faults are real, their timings are not).
int test_gpu();

// Whether the tests' NCCL communicators issue blocking calls: the default,
// unless GRADKIT_TEST_BLOCKING_CALLS is 0 or 1 (scripts/gpu comm test runs
// them both ways).
bool test_blocking_calls();

// Empty when the backend can run here; otherwise why not (the same on every
// rank of a host, so that all ranks skip together).
std::string backend_unavailable_reason(Backend backend);

// The communicator of `backend` shared by the tests (created on first use).
Communicator& shared_communicator(Backend backend);
void release_shared_communicators();
// A communicator of `backend` over the ranks of `over` (default: the world),
// set up as the tests' are (timeout, GPU, blocking calls).
std::unique_ptr<Communicator> make_communicator(Backend backend, CommunicatorOptions options = {},
                                                MpiCommHandle over = {});

class OnEachBackend : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    const std::string reason = backend_unavailable_reason(GetParam());
    if (!reason.empty()) GTEST_SKIP() << reason;
  }
  Communicator& comm() const { return shared_communicator(GetParam()); }
};

#define GRADKIT_INSTANTIATE_ON_EACH_BACKEND(Suite)                                                          \
  INSTANTIATE_TEST_SUITE_P(Backends, Suite, ::testing::Values(gradkit::test::Backend::mpi,                  \
                                                              gradkit::test::Backend::nccl),               \
                           gradkit::test::backend_test_name)

enum class Layout {
  back_to_back,  // one allocation, each tensor where the previous ended
  with_gaps,     // one allocation, 40 bytes between tensors: the fusion-buffer path
};

// A list of tensors of `sizes` on `device`, laid out as `layout`, in one
// Buffer: its allocation is rounded up to whole 256-byte blocks, while the
// views keep their exact counts, so that NCCL's reads of the word or
// 16-byte block holding the last element stay inside it (docs/ops.md,
// "Allocate whole 16-byte blocks").
class TestList {
 public:
  TestList(Device device, DType dtype, std::vector<int64_t> sizes, Layout layout);
  std::span<const TensorView> views() const { return views_; }
  int64_t total() const;
  void write(const std::vector<double>& concatenated);  // rounds to the dtype
  std::vector<double> read() const;                     // the concatenation, exactly

 private:
  Buffer buffer_;
  DType dtype_;
  std::vector<TensorView> views_;
};

// Rank `rank`'s input for case `seed`: `n` seeded normal values (never zero)
// rounded to `dtype`. Any rank can compute any rank's input.
std::vector<double> rank_input(uint64_t seed, int rank, int64_t n, DType dtype);

// Compares `got` with the float64 sum (or average) over `ranks` of
// rank_input(seed, r, ...) for the elements [begin, end); reports the first
// few differences and returns how many there were.
int expect_reduced(const std::vector<double>& got, uint64_t seed, int ranks, DType dtype, bool average,
                   int64_t begin, int64_t end, const std::string& what);

// Element-by-element equality of [begin, end), reporting the first few.
int expect_equal(const std::vector<double>& got, const std::vector<double>& want, int64_t begin, int64_t end,
                 const std::string& what);

// Turns checked mode on for a scope (of a shared communicator, say).
struct CheckedScope {
  explicit CheckedScope(Communicator& c) : comm(c) { comm.set_checked(true); }
  ~CheckedScope() { comm.set_checked(false); }
  Communicator& comm;
};

// Checked mode's common cases on `c` (which must be in checked mode): the
// last rank passes another element count (size_mismatch; the list is left
// as it was), another tensor count, another dtype, or makes another
// collective; every rank expects the error naming the difference. `seed`
// picks the inputs.
void expect_checked_mismatches_named(Communicator& c, uint64_t seed);

// Where an all-reduce case reads and writes: the input list's layout, and
// the output list's (none when in place).
struct Placement {
  Layout in;
  Layout out;
  bool in_place;
};

// One all-reduce case: a list of `sizes` placed as `p`, rank inputs for
// `seed`, reduced by `c` with `op`; checks the result against the float64
// reference and, out of place, that the inputs are untouched.
void check_all_reduce(Communicator& c, DType dtype, const std::vector<int64_t>& sizes, const Placement& p,
                      ReduceOp op, uint64_t seed, const std::string& what);

}  // namespace gradkit::test
