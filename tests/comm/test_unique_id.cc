// The NCCL communicator made from a unique id, a rank and a size, with no
// MPI inside gradkit: MPI is used here only to hand rank 0's id to the
// others and as the reference (the MPI-bootstrapped communicators). Its
// layout, list all-reduce, checked mode, Adasum and barrier (whose host
// exchanges go over NCCL itself), a rank that never joins, and the argument
// checks made before any NCCL call (which run everywhere, GPU or not).
#include <mpi.h>

#include <gtest/gtest.h>

#include <chrono>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(GRADKIT_WITH_CUDA)
#include <cuda_runtime.h>
#endif

#include "comm/comm_test_support.h"
#include "gradkit/comm/adasum.h"
#include "gradkit/core/error.h"

namespace gradkit::test {
namespace {

// Rank 0 makes the id; MPI_Bcast hands it to the others.
std::unique_ptr<Communicator> make_unique_id_communicator(const CommunicatorOptions& options) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  NcclUniqueId id;
  if (rank == 0) id = create_nccl_unique_id();
  MPI_Bcast(id.bytes.data(), static_cast<int>(id.bytes.size()), MPI_BYTE, 0, MPI_COMM_WORLD);
  return create_nccl_communicator(id, rank, size, options);
}

// The NCCL cases skip together where the MPI-bootstrapped NCCL instances do.
class UniqueId : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = backend_unavailable_reason(Backend::nccl);
    if (!reason.empty()) GTEST_SKIP() << reason;
  }
  static void TearDownTestSuite() { shared_.reset(); }

  // One communicator for the suite, made with cuda_device -1 after this
  // thread's current device was set to the local rank's GPU.
  static Communicator& comm() {
    if (!shared_) {
      CommunicatorOptions options;
      options.timeout = std::chrono::seconds(60);
#if defined(GRADKIT_WITH_CUDA)
      EXPECT_EQ(cudaSetDevice(test_gpu()), cudaSuccess);
      options.cuda_device = -1;
#else
      options.cuda_device = test_gpu();
#endif
      shared_ = make_unique_id_communicator(options);
    }
    return *shared_;
  }

 private:
  static std::unique_ptr<Communicator> shared_;
};

std::unique_ptr<Communicator> UniqueId::shared_;

TEST_F(UniqueId, RankSizeAndLocalLayoutAreTheMpiBootstrappedOnes) {
  Communicator& c = comm();
  const Communicator& reference = shared_communicator(Backend::nccl);
  EXPECT_EQ(c.backend_name(), "nccl");
  EXPECT_EQ(c.rank(), reference.rank());
  EXPECT_EQ(c.size(), reference.size());
  EXPECT_EQ(c.local_rank(), reference.local_rank());
  EXPECT_EQ(c.local_size(), reference.local_size());
  EXPECT_EQ(c.device(), reference.device()) << "cuda_device -1 is the current device";
}

TEST_F(UniqueId, AllReduceMatchesTheFloat64Sum) {
  Communicator& c = comm();
  // Odd sizes; an empty tensor; a tensor of 1.2 MB in f32, reduced where it
  // lies (direct_tensor_bytes), between small ones.
  const std::vector<std::vector<int64_t>> lists = {{1, 7, 33, 1000, 3, 129}, {17, 0, 31}, {5, 300000, 17}};
  constexpr Placement kPlacements[] = {{Layout::back_to_back, Layout::back_to_back, true},
                                       {Layout::with_gaps, Layout::with_gaps, true},
                                       {Layout::with_gaps, Layout::back_to_back, false}};
  uint64_t seed = 12000;
  for (DType dtype : {DType::f32, DType::f16}) {
    for (size_t l = 0; l < lists.size(); ++l) {
      for (size_t p = 0; p < std::size(kPlacements); ++p) {
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
          const std::string what = std::string(dtype_name(dtype)) + " list " + std::to_string(l) + " placement " +
                                   std::to_string(p) + (op == ReduceOp::average ? " average" : " sum");
          check_all_reduce(c, dtype, lists[l], kPlacements[p], op, ++seed, what);
        }
      }
    }
  }
}

TEST_F(UniqueId, CheckedModeNamesWhatDiffersOnEveryRank) {
  Communicator& c = comm();
  CheckedScope checked(c);
  // Each exchange of fingerprints (and of the element counts, for the
  // size mismatch) goes over NCCL.
  expect_checked_mismatches_named(c, 12100);
  {  // and afterwards a matching call goes through, checked
    TestList list(c.device(), DType::f32, {10, 20, 30}, Layout::with_gaps);
    list.write(rank_input(12101, c.rank(), list.total(), DType::f32));
    c.all_reduce(list.views());
    c.wait();
    expect_reduced(list.read(), 12101, c.size(), DType::f32, false, 0, list.total(), "checked all_reduce");
  }
}

// Adasum moves data with ncclSend / ncclRecv and combines it with gradkit's
// own kernels: the same inputs give bitwise the same result whichever way
// the communicator was made. Hierarchical with ranks_per_node 0 also
// checks every rank's local layout (a host exchange over NCCL).
TEST_F(UniqueId, AdasumIsBitwiseTheMpiBootstrappedResult) {
  Communicator& c = comm();
  Communicator& reference = shared_communicator(Backend::nccl);
  const std::vector<int64_t> sizes = {5, 3001, 17, 2, 640};
  const int L = c.local_size();
  const bool nodes_fit = (L & (L - 1)) == 0 && c.size() % L == 0;
  uint64_t seed = 12200;
  for (DType dtype : {DType::f32, DType::f16}) {
    for (bool hierarchical : {false, true}) {
      if (hierarchical && !nodes_fit) continue;
      const std::string what = std::string(dtype_name(dtype)) + (hierarchical ? " hierarchical" : "");
      AdasumOptions options;
      options.hierarchical = hierarchical;
      TestList got(c.device(), dtype, sizes, Layout::with_gaps);
      TestList want(reference.device(), dtype, sizes, Layout::with_gaps);
      const std::vector<double> mine = rank_input(++seed, c.rank(), got.total(), dtype);
      got.write(mine);
      want.write(mine);
      AdasumPlan plan(c, got.views(), options);
      plan.run();
      c.wait();
      AdasumPlan reference_plan(reference, want.views(), options);
      reference_plan.run();
      reference.wait();
      const std::vector<double> result = want.read();
      EXPECT_NE(result, mine) << what << ": Adasum left the input as it was";
      expect_equal(got.read(), result, 0, got.total(), what);
    }
  }
}

TEST_F(UniqueId, BarrierWaitsForEveryRank) {
  Communicator& c = comm();
  c.barrier();
  c.barrier();
  // A barrier after a collective enqueued on another stream, before waiting for it.
  TestList list(c.device(), DType::f32, {4096}, Layout::back_to_back);
  list.write(rank_input(12300, c.rank(), 4096, DType::f32));
  c.all_reduce(list.views());
  c.barrier();
  c.wait();
  expect_reduced(list.read(), 12300, c.size(), DType::f32, false, 0, 4096, "all_reduce before a barrier");

  // The last rank arrives 500 ms late; the others must wait for it.
  MPI_Barrier(MPI_COMM_WORLD);
  const bool late = c.rank() == c.size() - 1;
  const auto start = std::chrono::steady_clock::now();
  if (late) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  c.barrier();
  if (!late) {
    EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(300))
        << "the barrier returned before the last rank had joined";
  }
}

// The last rank never joins: the others' collective (waited for with
// wait()) or barrier (a host exchange over NCCL) gives up after the
// timeout, aborts the communicator and throws; it is unusable afterwards.
TEST_F(UniqueId, ARankThatDoesNotJoinMakesTheOthersAbortWithinTheTimeout) {
  CommunicatorOptions options;
  options.timeout = std::chrono::milliseconds(2000);
  options.cuda_device = test_gpu();
  for (const bool barrier : {false, true}) {
    SCOPED_TRACE(barrier ? "barrier" : "all_reduce");
    std::unique_ptr<Communicator> c = make_unique_id_communicator(options);
    const bool absent = c->rank() == c->size() - 1;
    TestList list(c->device(), DType::f32, {4096}, Layout::back_to_back);
    list.write(rank_input(12400, c->rank(), 4096, DType::f32));
    if (!absent) {
      const auto start = std::chrono::steady_clock::now();
      if (barrier) {
        expect_error([&] { c->barrier(); }, ErrorCode::nccl_error, {"within 2000 ms", "aborted"});
      } else {
        expect_error(
            [&] {
              c->all_reduce(list.views());
              c->wait();
            },
            ErrorCode::nccl_error, {"aborted"});
      }
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(6000))
          << "the timeout did not hold";
      expect_error([&] { c->all_reduce(list.views()); }, ErrorCode::invalid_argument, {"unusable"});
      expect_error([&] { c->barrier(); }, ErrorCode::invalid_argument, {"unusable"});
    }
    MPI_Barrier(MPI_COMM_WORLD);
    c.reset();  // the absent rank's communicator finalizes or aborts within its timeout
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// Checked before any NCCL call (the id is all zeros and never reaches NCCL),
// so these run on every machine, GPU or not.
TEST(UniqueIdArguments, BadRankSizeTimeoutOrDeviceIsRejectedNamingTheArgument) {
  const NcclUniqueId id{};
  constexpr const char* op = "create_nccl_communicator";
  if (!has_nccl_communicator()) {
    expect_error([] { create_nccl_unique_id(); }, ErrorCode::backend_unavailable,
                 {"create_nccl_unique_id", "without NCCL"});
    expect_error([&] { create_nccl_communicator(id, 0, 1); }, ErrorCode::backend_unavailable, {op, "without NCCL"});
    return;
  }
  expect_error([&] { create_nccl_communicator(id, 0, 0); }, ErrorCode::invalid_argument,
               {op, "argument 'size'", "is 0, expected >= 1"});
  expect_error([&] { create_nccl_communicator(id, 0, -3); }, ErrorCode::invalid_argument,
               {op, "argument 'size'", "is -3"});
  expect_error([&] { create_nccl_communicator(id, 5, 4); }, ErrorCode::invalid_argument,
               {op, "argument 'rank'", "is 5, expected 0 <= rank < size (4)"});
  expect_error([&] { create_nccl_communicator(id, 4, 4); }, ErrorCode::invalid_argument,
               {op, "argument 'rank'", "is 4, expected 0 <= rank < size (4)"});
  expect_error([&] { create_nccl_communicator(id, -1, 4); }, ErrorCode::invalid_argument,
               {op, "argument 'rank'", "is -1"});

  CommunicatorOptions options;
  options.timeout = std::chrono::milliseconds(0);
  expect_error([&] { create_nccl_communicator(id, 0, 2, options); }, ErrorCode::invalid_argument,
               {op, "argument 'options.timeout'", "is 0 ms, expected > 0"});
  options.timeout = std::chrono::milliseconds(-5);
  expect_error([&] { create_nccl_communicator(id, 0, 2, options); }, ErrorCode::invalid_argument,
               {op, "argument 'options.timeout'", "is -5 ms"});

  options = CommunicatorOptions{};
  options.cuda_device = -2;
  expect_error([&] { create_nccl_communicator(id, 0, 2, options); }, ErrorCode::invalid_argument,
               {op, "argument 'options.cuda_device'", "is -2"});
  const int visible = cuda_device_count();
  options.cuda_device = visible;
  if (visible == 0) {
    expect_error([&] { create_nccl_communicator(id, 0, 2, options); }, ErrorCode::backend_unavailable,
                 {op, "no CUDA device"});
  } else {
    expect_error([&] { create_nccl_communicator(id, 0, 2, options); }, ErrorCode::invalid_argument,
                 {op, "argument 'options.cuda_device'", "is " + std::to_string(visible)});
  }
}

}  // namespace
}  // namespace gradkit::test
