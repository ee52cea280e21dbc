// What happens when ranks disagree or fail: checked mode names the
// difference on every rank; invalid arguments are rejected before anything is
// written; MPI errors come back as gradkit::Error; a rank that does not join
// makes the others throw within the timeout instead of hanging.
#include <mpi.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_test_support.h"
#include "comm/mpi/mpi_check.h"
#include "gradkit/core/error.h"

namespace gradkit::test {
namespace {

using Faults = OnEachBackend;

TEST_P(Faults, CheckedModeNamesWhatDiffersOnEveryRank) {
  Communicator& c = comm();
  CheckedScope checked(c);
  const int last = c.size() - 1;
  const std::string last_name = "rank " + std::to_string(last);
  const bool odd_one = c.rank() == last;

  expect_checked_mismatches_named(c, 7000);
  {  // the settings that decide a list all-reduce's collectives differ (NCCL
     // only: the MPI communicator issues one collective whatever they are)
    const size_t before = c.direct_tensor_bytes();
    if (odd_one) c.set_direct_tensor_bytes(4096);
    TestList list(c.device(), DType::f32, {10, 2000}, Layout::with_gaps);
    const std::vector<double> mine = rank_input(7001, c.rank(), list.total(), DType::f32);
    list.write(mine);
    if (GetParam() == Backend::nccl) {
      expect_error([&] { c.all_reduce(list.views()); }, ErrorCode::invalid_argument,
                   {"direct_tensor_bytes", "differ between rank 0 and " + last_name});
      c.wait();
      expect_equal(list.read(), mine, 0, list.total(), "a rejected call wrote");
    } else {
      c.all_reduce(list.views());
      c.wait();
      expect_reduced(list.read(), 7001, c.size(), DType::f32, false, 0, list.total(), "MPI ignores the settings");
    }
    c.set_direct_tensor_bytes(before);
  }
  {  // and afterwards a matching call goes through, checked
    TestList list(c.device(), DType::f32, {10, 20, 30}, Layout::with_gaps);
    list.write(rank_input(7001, c.rank(), list.total(), DType::f32));
    c.all_reduce(list.views());
    c.wait();
    expect_reduced(list.read(), 7001, c.size(), DType::f32, false, 0, list.total(), "checked all_reduce");
  }
}

TEST_P(Faults, InvalidArgumentsAreRejectedBeforeAnythingIsWritten) {
  Communicator& c = comm();
  TestList list(c.device(), DType::f32, {8, 9}, Layout::back_to_back);
  const std::vector<double> mine = rank_input(7100, c.rank(), list.total(), DType::f32);
  list.write(mine);
  std::vector<TensorView> views(list.views().begin(), list.views().end());

  // A tensor labelled with another device than the communicator's.
  std::vector<TensorView> elsewhere = views;
  elsewhere[1].device = c.device().is_cuda() ? Device::cpu() : Device::cuda(0);
  expect_error([&] { c.all_reduce(elsewhere); }, ErrorCode::device_mismatch, {"all_reduce", "'tensors[1]'"});

  std::vector<TensorView> mixed = views;
  mixed[1].dtype = DType::f16;
  expect_error([&] { c.reduce_scatter(mixed); }, ErrorCode::invalid_argument, {"'tensors[1]'", "is f16, expected f32"});

  TestList out(c.device(), DType::f32, {8, 10}, Layout::back_to_back);
  expect_error([&] { c.all_reduce(views, out.views()); }, ErrorCode::size_mismatch,
               {"'outputs[1]'", "has 10 elements, expected 9"});

  std::vector<TensorView> overlapping = views;
  overlapping[1].data = static_cast<float*>(views[0].data) + 4;
  expect_error([&] { c.all_gather(overlapping); }, ErrorCode::aliasing, {"overlaps"});
  expect_error([&] { c.all_reduce(views, overlapping); }, ErrorCode::aliasing, {"all_reduce", "overlaps"});

  expect_error([&] { c.exchange(views[0], out.views()[0], c.rank()); }, ErrorCode::invalid_argument, {"'peer'"});
  expect_error([&] { c.all_gather_buffer(views[0], views[1]); }, ErrorCode::size_mismatch,
               {"all_gather_buffer", "'output'"});
  // Several buffers at once: a bad pair anywhere stops them all, naming it.
  TestList wholes(c.device(), DType::f32, {8 * c.size(), 9 * c.size()}, Layout::back_to_back);
  const std::vector<TensorView> good_and_bad = {wholes.views()[0], views[0]};
  expect_error([&] { c.all_gather_buffers(views, good_and_bad); }, ErrorCode::size_mismatch,
               {"all_gather_buffers", "'outputs[1]'", "'inputs[1]'"});
  expect_error([&] { c.reduce_scatter_buffers(wholes.views(), std::span<const TensorView>(views).first(1)); },
               ErrorCode::size_mismatch, {"reduce_scatter_buffers", "'outputs'", "one per input"});
  std::vector<TensorView> f16_output = views;
  f16_output[1].dtype = DType::f16;
  expect_error([&] { c.reduce_scatter_buffers(wholes.views(), f16_output, ReduceOp::average); },
               ErrorCode::invalid_argument, {"'outputs[1]'", "is f16, expected f32"});

  c.wait();
  expect_equal(list.read(), mine, 0, list.total(), "a rejected call wrote");
}

// The last rank joins 1.5 s late; the others give up after 300 ms.
// A list validated once is remembered, so repeated calls skip the per-tensor
// pointer queries; a list that differs in any view is still checked in full.
TEST_P(Faults, RememberedListsDoNotHideErrors) {
  Communicator& c = comm();
  TestList list(c.device(), DType::f32, {8, 9}, Layout::back_to_back);
  std::vector<TensorView> views(list.views().begin(), list.views().end());
  c.all_reduce(views);  // checked and remembered
  c.all_reduce(views);  // remembered
  std::vector<TensorView> longer = views;
  longer[1].numel = 1 << 30;  // same pointers, another count: checked again
  longer[1].device = c.device().is_cuda() ? Device::cpu() : Device::cuda(0);
  expect_error([&] { c.all_reduce(longer); }, ErrorCode::device_mismatch, {"'tensors[1]'"});
  TestList out(c.device(), DType::f32, {8, 10}, Layout::back_to_back);
  expect_error([&] { c.all_reduce(views, out.views()); }, ErrorCode::size_mismatch, {"'outputs[1]'"});
  c.wait();
}

TEST(MpiFaults, ARankThatDoesNotJoinMakesTheOthersThrowWithinTheTimeout) {
  CommunicatorOptions options;
  options.timeout = std::chrono::milliseconds(300);
  std::unique_ptr<Communicator> c = make_communicator(Backend::mpi, options);
  const bool late = c->rank() == c->size() - 1;
  TestList list(c->device(), DType::f64, {100}, Layout::back_to_back);
  list.write(rank_input(7200, c->rank(), 100, DType::f64));
  if (late) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    c->all_reduce(list.views());  // everyone has contributed by now
    expect_reduced(list.read(), 7200, c->size(), DType::f64, false, 0, 100, "the late rank's all_reduce");
  } else {
    const auto start = std::chrono::steady_clock::now();
    expect_error([&] { c->all_reduce(list.views()); }, ErrorCode::mpi_error,
                 {"MPI_Iallreduce", "did not complete within 300 ms"});
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1400)) << "the timeout did not hold";
    expect_error([&] { c->barrier(); }, ErrorCode::invalid_argument, {"unusable"});
  }
  // Lets the abandoned collective complete everywhere before MPI_Finalize.
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiFaults, MpiErrorsComeBackAsErrors) {
  // A communicator with MPI_ERRORS_RETURN, as gradkit's own are: a bad call
  // returns a code, which the check turns into an Error naming the call.
  MPI_Comm comm = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &comm), MPI_SUCCESS);
  ASSERT_EQ(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), MPI_SUCCESS);
  int size = 0;
  MPI_Comm_size(comm, &size);
  int value = 1;
  expect_error([&] { GRADKIT_MPI_CHECK(MPI_Send(&value, 1, MPI_INT, size + 3, 0, comm)); }, ErrorCode::mpi_error,
               {"MPI_Send", "failed", "test_faults.cc"});
  MPI_Comm_free(&comm);

  // gradkit's own MPI calls are checked: an invalid communicator handle is
  // an mpi_error from MPI_Comm_dup, not an abort (the error is raised on
  // MPI_COMM_WORLD's handler, so that one returns too for this test).
  ASSERT_EQ(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), MPI_SUCCESS);
  expect_error([&] { create_mpi_communicator({}, mpi_comm_handle(MPI_COMM_NULL)); }, ErrorCode::mpi_error,
               {"MPI_Comm_dup"});
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_ARE_FATAL);
}

TEST(MpiFaults, OptionsAreValidated) {
  CommunicatorOptions options;
  options.timeout = std::chrono::milliseconds(0);
  expect_error([&] { create_mpi_communicator(options); }, ErrorCode::invalid_argument, {"'options.timeout'"});
  expect_error([&] { create_nccl_communicator(options); },
               has_nccl_communicator() ? ErrorCode::invalid_argument : ErrorCode::backend_unavailable, {});
}

// NCCL: the last rank never joins; the others' wait() gives up, aborts the
// communicator and throws.
// The NCCL cases: each makes its own communicator with a 2 s timeout, and
// a list of 4096 f32 elements holding this rank's input for a seed.
class NcclFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = backend_unavailable_reason(Backend::nccl);
    if (!reason.empty()) GTEST_SKIP() << reason;
    CommunicatorOptions options;
    options.timeout = std::chrono::milliseconds(2000);
    c = make_communicator(Backend::nccl, options);
    list = std::make_unique<TestList>(c->device(), DType::f32, std::vector<int64_t>{kCount}, Layout::back_to_back);
  }
  void write_input(uint64_t seed) { list->write(rank_input(seed, c->rank(), kCount, DType::f32)); }

  static constexpr int64_t kCount = 4096;
  std::unique_ptr<Communicator> c;
  std::unique_ptr<TestList> list;
};

TEST_F(NcclFaults, ARankThatDoesNotJoinMakesTheOthersAbortWithinTheTimeout) {
  const bool absent = c->rank() == c->size() - 1;
  write_input(7300);
  if (!absent) {
    const auto start = std::chrono::steady_clock::now();
    expect_error(
        [&] {
          c->all_reduce(list->views());
          c->wait();
        },
        ErrorCode::nccl_error, {"aborted"});
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(6000)) << "the timeout did not hold";
    expect_error([&] { c->all_reduce(list->views()); }, ErrorCode::invalid_argument, {"unusable"});
  }
  MPI_Barrier(MPI_COMM_WORLD);
  c.reset();  // the absent rank's communicator finalizes or aborts within its timeout
  MPI_Barrier(MPI_COMM_WORLD);
}

// NCCL: the ranks have made their connections; then the last rank stops
// calling. The others' next all-reduce is enqueued and its work never
// finishes. With blocking calls the watchdog revokes the communicator
// within the timeout, so that even a plain device-wide synchronize returns
// (which without it would hang); either way the next gradkit call throws,
// naming the cause, and the communicator is aborted.
TEST_F(NcclFaults, ARankThatStopsCallingMakesTheOthersAbortWithinTheTimeout) {
  write_input(7400);
  c->all_reduce(list->views());  // every rank: the connections are made
  c->wait();
  expect_reduced(list->read(), 7400, c->size(), DType::f32, false, 0, kCount, "the all-reduce before the stop");
  MPI_Barrier(MPI_COMM_WORLD);
  const bool stops = c->rank() == c->size() - 1;
  if (!stops) {
    const auto start = std::chrono::steady_clock::now();
    c->all_reduce(list->views());  // enqueued; the stopped rank never joins
    if (test_blocking_calls()) {
      synchronize(c->device());
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(6000))
          << "the watchdog did not end the stuck work in time";
    }
    expect_error([&] { c->wait(); }, ErrorCode::nccl_error, {"within 2000 ms", "aborted"});
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(6000)) << "the timeout did not hold";
    expect_error([&] { c->all_reduce(list->views()); }, ErrorCode::invalid_argument, {"unusable"});
  }
  MPI_Barrier(MPI_COMM_WORLD);
  c.reset();
  MPI_Barrier(MPI_COMM_WORLD);
}

GRADKIT_INSTANTIATE_ON_EACH_BACKEND(Faults);

}  // namespace
}  // namespace gradkit::test
