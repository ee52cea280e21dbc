#include "comm/comm_test_support.h"

#include <cstdlib>
#include <string_view>

#include <cstring>
#include <map>
#include <optional>

#include "support/test_tensor.h"

namespace gradkit::test {

namespace {

std::map<Backend, std::unique_ptr<Communicator>>& shared() {
  static std::map<Backend, std::unique_ptr<Communicator>> communicators;
  return communicators;
}

// Generous: a test that hangs should fail, not wait for CTest's timeout.
constexpr std::chrono::seconds kTestTimeout{60};

}  // namespace

std::optional<int> shared_test_gpu() {
  const char* v = std::getenv("GRADKIT_TEST_CUDA_DEVICE");
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::stoi(v);
}

int test_gpu() { return shared_test_gpu().value_or(shared_communicator(Backend::mpi).local_rank()); }

bool test_blocking_calls() {
  const char* v = std::getenv("GRADKIT_TEST_BLOCKING_CALLS");
  if (v == nullptr || *v == '\0') return CommunicatorOptions{}.blocking_calls;
  return std::string_view(v) != "0";
}

std::string backend_unavailable_reason(Backend backend) {
  if (backend == Backend::mpi) return {};
  if (!has_nccl_communicator()) return "gradkit was built without NCCL";
  const int visible = cuda_device_count();
  if (const std::optional<int> shared = shared_test_gpu()) {
    if (*shared >= visible) {
      return "GRADKIT_TEST_CUDA_DEVICE=" + std::to_string(*shared) + ", but " + std::to_string(visible) +
             " CUDA device(s) are visible";
    }
    return {};
  }
  const int needed = shared_communicator(Backend::mpi).local_size();
  if (visible < needed) {
    return std::to_string(needed) + " local ranks need " + std::to_string(needed) + " GPUs, " +
           std::to_string(visible) + " visible";
  }
  return {};
}

std::unique_ptr<Communicator> make_communicator(Backend backend, CommunicatorOptions options, MpiCommHandle over) {
  if (options.timeout == CommunicatorOptions{}.timeout) options.timeout = kTestTimeout;
  // GRADKIT_TEST_BLOCKING_CALLS=0 or 1: every NCCL communicator of the
  // tests issues its calls that way (scripts/gpu comm test runs the
  // communication tests both ways).
  options.blocking_calls = test_blocking_calls();
  if (backend == Backend::nccl && options.cuda_device == -1) options.cuda_device = test_gpu();
  return backend == Backend::mpi ? create_mpi_communicator(options, over) : create_nccl_communicator(options, over);
}

Communicator& shared_communicator(Backend backend) {
  std::unique_ptr<Communicator>& c = shared()[backend];
  if (!c) c = make_communicator(backend);
  return *c;
}

void release_shared_communicators() { shared().clear(); }

TestList::TestList(Device device, DType dtype, std::vector<int64_t> sizes, Layout layout) : dtype_(dtype) {
  const size_t gap = layout == Layout::with_gaps ? 40 : 0;
  std::vector<size_t> offsets;
  size_t end = 0;
  for (int64_t n : sizes) {
    if (!offsets.empty()) end += gap;
    offsets.push_back(end);
    end += static_cast<size_t>(n) * dtype_size(dtype);
  }
  buffer_ = Buffer(device, end);
  for (size_t i = 0; i < sizes.size(); ++i) views_.push_back(buffer_.view(dtype, offsets[i], sizes[i]));
}

int64_t TestList::total() const {
  int64_t n = 0;
  for (const TensorView& v : views_) n += v.numel;
  return n;
}

void TestList::write(const std::vector<double>& values) {
  int64_t at = 0;
  for (const TensorView& v : views_) {
    std::vector<uint8_t> host(v.bytes());
    dispatch_dtype(dtype_, [&]<class T>() {
      for (int64_t i = 0; i < v.numel; ++i) {
        const double x = values[static_cast<size_t>(at + i)];
        T t;
        if constexpr (std::is_same_v<T, double>) t = x;
        else t = T(static_cast<float>(x));
        std::memcpy(host.data() + i * sizeof(T), &t, sizeof(T));
      }
    });
    copy_from_host(v.data, v.device, host.data(), host.size());
    at += v.numel;
  }
}

std::vector<double> TestList::read() const {
  std::vector<double> out;
  for (const TensorView& v : views_) {
    std::vector<uint8_t> host(v.bytes());
    copy_to_host(host.data(), v.data, host.size(), v.device);
    dispatch_dtype(dtype_, [&]<class T>() {
      for (int64_t i = 0; i < v.numel; ++i) {
        T t;
        std::memcpy(&t, host.data() + i * sizeof(T), sizeof(T));
        if constexpr (std::is_same_v<T, double>) out.push_back(t);
        else out.push_back(static_cast<float>(t));
      }
    });
  }
  return out;
}

std::vector<double> rank_input(uint64_t seed, int rank, int64_t n, DType dtype) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(rank));
  return round_to(dtype, random_values(rng, n));
}

int expect_reduced(const std::vector<double>& got, uint64_t seed, int ranks, DType dtype, bool average,
                   int64_t begin, int64_t end, const std::string& what) {
  std::vector<double> sum(got.size(), 0.0), magnitude(got.size(), 0.0);
  for (int r = 0; r < ranks; ++r) {
    const std::vector<double> x = rank_input(seed, r, static_cast<int64_t>(got.size()), dtype);
    for (size_t i = 0; i < x.size(); ++i) {
      sum[i] += x[i];
      magnitude[i] += std::abs(x[i]);
    }
  }
  const CollectiveTolerance tolerance = collective_tolerance(dtype, ranks, average);
  int failures = 0;
  for (int64_t i = begin; i < end; ++i) {
    const auto k = static_cast<size_t>(i);
    const double want = average ? sum[k] / ranks : sum[k];
    const double scale = average ? magnitude[k] / ranks : magnitude[k];
    if (!within_collective(got[k], want, scale, tolerance) && ++failures <= 5) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[k] << ", expected " << want << " (sum |x| "
                    << scale << ", " << dtype_name(dtype) << ", " << ranks << " ranks)";
    }
  }
  return failures;
}

int expect_equal(const std::vector<double>& got, const std::vector<double>& want, int64_t begin, int64_t end,
                 const std::string& what) {
  int failures = 0;
  for (int64_t i = begin; i < end; ++i) {
    const auto k = static_cast<size_t>(i);
    if (got[k] != want[k] && ++failures <= 5) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[k] << ", expected exactly " << want[k];
    }
  }
  return failures;
}

void expect_checked_mismatches_named(Communicator& c, uint64_t seed) {
  const int last = c.size() - 1;
  const std::string last_name = "rank " + std::to_string(last);
  const bool odd_one = c.rank() == last;
  {  // one element count differs
    TestList list(c.device(), DType::f32, {10, 20, odd_one ? int64_t{31} : int64_t{30}}, Layout::with_gaps);
    const std::vector<double> mine = rank_input(seed, c.rank(), list.total(), DType::f32);
    list.write(mine);
    expect_error([&] { c.all_reduce(list.views()); }, ErrorCode::size_mismatch,
                 {"all_reduce", "'tensors'", "tensor 2 has 30 elements on rank 0 and 31 on " + last_name});
    c.wait();
    expect_equal(list.read(), mine, 0, list.total(), "a rejected call wrote");
  }
  {  // the tensor count differs
    std::vector<int64_t> sizes = {10, 20, 30};
    if (odd_one) sizes.push_back(5);
    TestList list(c.device(), DType::f32, sizes, Layout::back_to_back);
    expect_error([&] { c.all_reduce(list.views()); }, ErrorCode::invalid_argument,
                 {"rank 0 passes 3 tensors, " + last_name + " passes 4"});
  }
  {  // the dtype differs
    TestList list(c.device(), odd_one ? DType::f64 : DType::f32, {10, 20}, Layout::back_to_back);
    expect_error([&] { c.all_reduce(list.views()); }, ErrorCode::invalid_argument,
                 {"the dtype is f32 on rank 0 and f64 on " + last_name});
  }
  {  // the collective differs
    TestList list(c.device(), DType::f32, {64}, Layout::back_to_back);
    expect_error(
        [&] {
          if (odd_one) c.all_gather(list.views());
          else c.all_reduce(list.views(), ReduceOp::average);
        },
        ErrorCode::invalid_argument, {"rank 0 calls all_reduce(average), " + last_name + " calls all_gather"});
  }
}

void check_all_reduce(Communicator& c, DType dtype, const std::vector<int64_t>& sizes, const Placement& p,
                      ReduceOp op, uint64_t seed, const std::string& what) {
  TestList in(c.device(), dtype, sizes, p.in);
  const std::vector<double> mine = rank_input(seed, c.rank(), in.total(), dtype);
  in.write(mine);
  const bool average = op == ReduceOp::average;
  if (p.in_place) {
    c.all_reduce(in.views(), op);
    c.wait();
    expect_reduced(in.read(), seed, c.size(), dtype, average, 0, in.total(), what);
    return;
  }
  TestList out(c.device(), dtype, sizes, p.out);
  out.write(rank_input(seed + 77777, c.rank(), in.total(), dtype));
  c.all_reduce(in.views(), out.views(), op);
  c.wait();
  expect_reduced(out.read(), seed, c.size(), dtype, average, 0, in.total(), what);
  expect_equal(in.read(), mine, 0, in.total(), what + " (input untouched)");
}

}  // namespace gradkit::test
