// Every rejected call names the argument and what was expected, and writes nothing.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/ops/gradient.h"
#include "support/device_param.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

// Runs `call`, expects an Error with `code` whose message contains each of
// `fragments`, and checks that `watched` kept its bytes.
template <class Call>
void expect_rejected(Call&& call, ErrorCode code, std::vector<std::string> fragments,
                     const std::vector<const TestTensor*>& watched) {
  std::vector<std::vector<uint8_t>> before;
  for (const TestTensor* t : watched) before.push_back(t->bytes());
  try {
    call();
    FAIL() << "expected an error of code " << error_code_name(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
  for (size_t i = 0; i < watched.size(); ++i) EXPECT_EQ(watched[i]->bytes(), before[i]) << "tensor " << i << " was written";
}

using Validation = OnEachDevice;

TEST_P(Validation, SizeMismatchNamesTheValue) {
  std::mt19937_64 rng(11);
  TestTensor b(device(), DType::f32, random_values(rng, 100)), v(device(), DType::f32, random_values(rng, 99));
  expect_rejected([&] { accumulate(b.view(), v.view()); }, ErrorCode::size_mismatch,
                  {"accumulate", "'values[0]'", "99 elements", "expected 100"}, {&b});
}

TEST_P(Validation, SizeMismatchInTheMiddleOfAListWritesNothing) {
  std::mt19937_64 rng(12);
  std::vector<TestTensor> bs, vs;
  for (int i = 0; i < 5; ++i) {
    bs.emplace_back(device(), DType::f32, random_values(rng, 50));
    vs.emplace_back(device(), DType::f32, random_values(rng, i == 3 ? 49 : 50));
  }
  std::vector<TensorView> bv, vv;
  for (int i = 0; i < 5; ++i) bv.push_back(bs[i].view()), vv.push_back(vs[i].view());
  expect_rejected([&] { accumulate(bv, vv); }, ErrorCode::size_mismatch, {"'values[3]'"},
                  {&bs[0], &bs[1], &bs[2], &bs[3], &bs[4]});
}

TEST_P(Validation, ListLengthMismatch) {
  std::mt19937_64 rng(13);
  TestTensor b(device(), DType::f32, random_values(rng, 10));
  const TensorView bv[] = {b.view(), b.view()};
  const TensorView vv[] = {b.view()};
  expect_rejected([&] { accumulate(std::span<const TensorView>(vv), std::span<const TensorView>(bv)); },
                  ErrorCode::size_mismatch, {"'values'", "has 2 tensors, expected 1"}, {&b});
}

TEST_P(Validation, UnsupportedDtypePair) {
  std::mt19937_64 rng(14);
  TestTensor b(device(), DType::f32, random_values(rng, 10)), v(device(), DType::f64, random_values(rng, 10));
  expect_rejected([&] { accumulate(b.view(), v.view()); }, ErrorCode::dtype_unsupported,
                  {"'values'", "f64", "f32", "expected any pair of f32/f16/bf16, or f64 with f64"}, {&b});
  expect_rejected([&] { accumulate_v2(v.view(), b.view()); }, ErrorCode::dtype_unsupported,
                  {"accumulate_v2", "'values'"}, {&v});
}

TEST_P(Validation, MixedDtypesInOneList) {
  std::mt19937_64 rng(15);
  TestTensor b0(device(), DType::f32, random_values(rng, 10)), b1(device(), DType::f16, random_values(rng, 10));
  TestTensor v0(device(), DType::f32, random_values(rng, 10)), v1(device(), DType::f32, random_values(rng, 10));
  const TensorView bv[] = {b0.view(), b1.view()}, vv[] = {v0.view(), v1.view()};
  expect_rejected([&] { accumulate(bv, vv); }, ErrorCode::dtype_unsupported,
                  {"'buffers[1]'", "dtype f16, expected f32"}, {&b0, &b1});
}

TEST_P(Validation, NullPointerWithElements) {
  std::mt19937_64 rng(16);
  TestTensor v(device(), DType::f32, random_values(rng, 10));
  const TensorView null_buffer{nullptr, 10, DType::f32, device()};
  expect_rejected([&] { accumulate(null_buffer, v.view()); }, ErrorCode::null_pointer,
                  {"'buffers[0]'", "null", "10 elements"}, {&v});
  const TensorView null_empty{nullptr, 0, DType::f32, device()};
  EXPECT_NO_THROW(zero(null_empty));
  EXPECT_NO_THROW(accumulate(null_empty, null_empty));
}

TEST_P(Validation, PartialOverlapIsRejectedIdenticalIsAllowed) {
  std::mt19937_64 rng(17);
  TestTensor whole(device(), DType::f32, random_values(rng, 200));
  const TensorView first{whole.view().as<float>(), 100, DType::f32, device()};
  const TensorView shifted{whole.view().as<float>() + 50, 100, DType::f32, device()};
  expect_rejected([&] { accumulate(first, shifted); }, ErrorCode::aliasing,
                  {"'buffers[0]'", "overlaps 'values[0]'"}, {&whole});
  // Two buffers of one list that overlap would race.
  const TensorView bv[] = {first, shifted};
  TestTensor v(device(), DType::f32, random_values(rng, 100));
  const TensorView vv[] = {v.view(), v.view()};
  expect_rejected([&] { accumulate(bv, vv); }, ErrorCode::aliasing, {"overlaps 'buffers["}, {&whole});
  expect_rejected([&] { zero(std::span<const TensorView>(bv)); }, ErrorCode::aliasing, {"zero", "overlaps"}, {&whole});
}

TEST_P(Validation, NegativeCount) {
  TestTensor b(device(), DType::f32, {1.0, 2.0});
  const TensorView bad{b.view().data, -1, DType::f32, device()};
  expect_rejected([&] { zero(bad); }, ErrorCode::invalid_argument, {"'buffers[0]'", "-1 elements"}, {&b});
}

TEST_P(Validation, DevicesMustAgree) {
  if (!device().is_cuda()) GTEST_SKIP() << "needs a second backend";
  std::mt19937_64 rng(18);
  TestTensor on_gpu(device(), DType::f32, random_values(rng, 10));
  TestTensor on_cpu(Device::cpu(), DType::f32, random_values(rng, 10));
  expect_rejected([&] { accumulate(on_gpu.view(), on_cpu.view()); }, ErrorCode::device_mismatch,
                  {"'values[0]'", "is on cpu, expected cuda:0"}, {&on_gpu});
}

// Host memory that claims to be on the GPU, and GPU memory that claims to be
// host memory, are caught before a kernel dereferences them.
TEST_P(Validation, MemoryMustBeWhereTheViewSays) {
  std::mt19937_64 rng(19);
  if (device().is_cuda()) {
    TestTensor host(Device::cpu(), DType::f32, random_values(rng, 10));
    TestTensor gpu(device(), DType::f32, random_values(rng, 10));
    TensorView lying_host = host.view();
    lying_host.device = device();
    expect_rejected([&] { accumulate(lying_host, gpu.view()); }, ErrorCode::device_mismatch,
                    {"'buffers[0]'", "is host memory, expected memory on cuda:0"}, {&host, &gpu});
    TensorView lying_gpu = gpu.view();
    lying_gpu.device = Device::cpu();
    expect_rejected([&] { accumulate(host.view(), lying_gpu); }, ErrorCode::device_mismatch,
                    {"'values[0]'", "expected host memory"}, {&host, &gpu});
  } else if (!cuda_available()) {
    TestTensor host(Device::cpu(), DType::f32, random_values(rng, 10));
    TensorView claims_gpu = host.view();
    claims_gpu.device = Device::cuda(0);
    expect_rejected([&] { zero(claims_gpu); }, ErrorCode::backend_unavailable, {"cuda:0"}, {&host});
  }
}

TEST_P(Validation, NullDeviceFlag) {
  std::mt19937_64 rng(20);
  TestTensor b(device(), DType::f32, random_values(rng, 10)), v(device(), DType::f32, random_values(rng, 10));
  expect_rejected([&] { accumulate(b.view(), v.view(), Flag::device(nullptr)); }, ErrorCode::null_pointer,
                  {"'do_update'"}, {&b});
  expect_rejected([&] { accumulate_v2(b.view(), v.view(), Flag::none(), Flag::host_output(nullptr)); },
                  ErrorCode::null_pointer, {"'updated'"}, {&b});
}

TEST_P(Validation, MisalignedOrHugeViewsAreRejected) {
  std::mt19937_64 rng(21);
  TestTensor b(device(), DType::f32, random_values(rng, 64)), v(device(), DType::f32, random_values(rng, 64));
  const TensorView misaligned{static_cast<char*>(b.view().data) + 2, 10, DType::f32, device()};
  expect_rejected([&] { zero(misaligned); }, ErrorCode::invalid_argument, {"'buffers[0]'", "4-byte elements"}, {&b});
  const TensorView huge{b.view().data, int64_t{1} << 61, DType::f64, device()};
  expect_rejected([&] { zero(huge); }, ErrorCode::invalid_argument, {"'buffers[0]'", "2^60"}, {&b});
  EXPECT_THROW(Buffer(Device::cpu(), 16).view(DType::f32, 0, int64_t{1} << 62), Error);
}

TEST(ParseDevice, AcceptsAndRejects) {
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(parse_device("cuda"), Device::cuda(0));
  EXPECT_EQ(parse_device("cuda:3"), Device::cuda(3));
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:1x", ""}) {
    try {
      parse_device(bad, "--device");
      ADD_FAILURE() << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'--device'"), std::string::npos) << e.what();
    }
  }
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(Validation);

}  // namespace
}  // namespace gradkit::test
