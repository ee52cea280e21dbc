// zero, accumulate and accumulate_v2 on every backend, against the float64
// reference, on seeded random inputs.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/ops/gradient.h"
#include "support/device_param.h"
#include "support/reference.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

// Sizes: empty, one, odd, not a multiple of any vector width, straddling a
// chunk boundary, and several chunks.
const int64_t kSizes[] = {0, 1, 3, 7, 13, 1023, 65536 + 5, 3 * 65536 - 1, (1 << 20) + 3};

void expect_close(const std::vector<double>& got, const std::vector<double>& want, DType dtype,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const Tolerance tol = elementwise_tolerance(dtype);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(within(got[i], want[i], tol)) << what << " element " << i << ": got " << got[i] << ", want " << want[i];
  }
}

std::string pair_name(DTypePair p) {
  return std::string(dtype_name(p.first)) + "/" + std::string(dtype_name(p.second));
}

using Gradient = OnEachDevice;

TEST_P(Gradient, ZeroWritesPositiveZeroInEveryDtype) {
  std::mt19937_64 rng(1);
  for (DType dtype : kAllDTypes) {
    for (int64_t n : kSizes) {
      TestTensor t(device(), dtype, random_values(rng, n));
      zero(t.view());
      synchronize(device());
      for (uint8_t byte : t.bytes()) ASSERT_EQ(byte, 0) << dtype_name(dtype) << " n=" << n;
    }
  }
}

TEST_P(Gradient, AccumulateEveryPairMatchesReference) {
  std::mt19937_64 rng(2);
  for (DTypePair pair : accumulate_dtype_pairs()) {
    for (int64_t n : kSizes) {
      const auto b0 = round_to(pair.first, random_values(rng, n));
      const auto v0 = round_to(pair.second, random_values(rng, n, 0.5));
      TestTensor buffer(device(), pair.first, b0);
      TestTensor value(device(), pair.second, v0);
      accumulate(buffer.view(), value.view());
      synchronize(device());
      expect_close(buffer.read(), reference_accumulate(b0, v0, false), pair.first,
                   pair_name(pair) + " n=" + std::to_string(n));
      EXPECT_EQ(value.read(), v0) << "the value must not be written";
    }
  }
}

TEST_P(Gradient, AccumulateV2OverwriteCastsEveryPair) {
  std::mt19937_64 rng(3);
  for (DTypePair pair : accumulate_dtype_pairs()) {
    const int64_t n = 65536 + 17;
    const auto b0 = round_to(pair.first, random_values(rng, n));
    const auto v0 = round_to(pair.second, random_values(rng, n));
    TestTensor buffer(device(), pair.first, b0);
    TestTensor value(device(), pair.second, v0);
    accumulate_v2(buffer.view(), value.view(), Flag::host(true));
    synchronize(device());
    EXPECT_EQ(buffer.read(), round_to(pair.first, v0)) << pair_name(pair);
  }
}

// Lists of 1 to 10,000 tensors of uneven sizes, some empty, in one call.
TEST_P(Gradient, AccumulateListsOfManyTensors) {
  std::mt19937_64 rng(4);
  for (int count : {1, 2, 10, 1000, 10000}) {
    std::vector<TestTensor> buffers, values;
    std::vector<std::vector<double>> expected;
    std::uniform_int_distribution<int64_t> size(0, count > 1000 ? 300 : 5000);
    for (int i = 0; i < count; ++i) {
      const int64_t n = size(rng);
      const auto b0 = round_to(DType::f32, random_values(rng, n));
      const auto v0 = round_to(DType::f16, random_values(rng, n));
      buffers.emplace_back(device(), DType::f32, b0);
      values.emplace_back(device(), DType::f16, v0);
      expected.push_back(reference_accumulate(b0, v0, false));
    }
    std::vector<TensorView> bv, vv;
    for (int i = 0; i < count; ++i) {
      bv.push_back(buffers[i].view());
      vv.push_back(values[i].view());
    }
    accumulate(bv, vv);
    synchronize(device());
    for (int i = 0; i < count; ++i) {
      expect_close(buffers[i].read(), expected[i], DType::f32,
                   "tensor " + std::to_string(i) + " of " + std::to_string(count));
    }
  }
}

TEST_P(Gradient, PlanReplaysWithTheSameResultAsSeparateCalls) {
  std::mt19937_64 rng(5);
  const auto b0 = round_to(DType::f32, random_values(rng, 5000));
  const auto v0 = round_to(DType::bf16, random_values(rng, 5000));
  TestTensor planned(device(), DType::f32, b0), separate(device(), DType::f32, b0);
  TestTensor value(device(), DType::bf16, v0);
  const TensorView pv[] = {planned.view()}, vv[] = {value.view()};
  AccumulatePlan plan(pv, vv);
  for (int step = 0; step < 3; ++step) {
    plan.accumulate();
    accumulate(separate.view(), value.view());
  }
  synchronize(device());
  EXPECT_EQ(planned.bytes(), separate.bytes());
  std::vector<double> want = b0;
  for (int step = 0; step < 3; ++step) want = round_to(DType::f32, reference_accumulate(want, v0, false));
  expect_close(planned.read(), want, DType::f32, "3 steps");
}

TEST_P(Gradient, InPlaceIdenticalTensorDoubles) {
  std::mt19937_64 rng(6);
  const auto b0 = round_to(DType::f16, random_values(rng, 999));
  TestTensor buffer(device(), DType::f16, b0);
  accumulate(buffer.view(), buffer.view());
  synchronize(device());
  expect_close(buffer.read(), reference_accumulate(b0, b0, false), DType::f16, "b += b");
}

TEST_P(Gradient, DoUpdateFalseWritesNothing) {
  std::mt19937_64 rng(7);
  const auto b0 = round_to(DType::f32, random_values(rng, 4097));
  const auto v0 = round_to(DType::f32, random_values(rng, 4097));
  TestTensor buffer(device(), DType::f32, b0), value(device(), DType::f32, v0);
  const auto before = buffer.bytes();

  accumulate(buffer.view(), value.view(), Flag::host(false));
  synchronize(device());
  EXPECT_EQ(buffer.bytes(), before) << "host do_update=false";

  TestFlag off(device(), false);
  accumulate(buffer.view(), value.view(), Flag::device(off.pointer()));
  synchronize(device());
  EXPECT_EQ(buffer.bytes(), before) << "device do_update=false";

  TestFlag on(device(), true);
  accumulate(buffer.view(), value.view(), Flag::device(on.pointer()));
  synchronize(device());
  expect_close(buffer.read(), reference_accumulate(b0, v0, false), DType::f32, "device do_update=true");

  const auto after_one = buffer.read();
  accumulate(buffer.view(), value.view(), Flag::host(true));
  synchronize(device());
  expect_close(buffer.read(), reference_accumulate(after_one, v0, false), DType::f32, "host do_update=true");
}

TEST_P(Gradient, AccumulateV2FlagsOnHostAndDevice) {
  std::mt19937_64 rng(8);
  const auto b0 = round_to(DType::bf16, random_values(rng, 3000));
  const auto v0 = round_to(DType::f32, random_values(rng, 3000));
  for (bool on_device : {false, true}) {
    for (bool overwrite : {false, true}) {
      TestTensor buffer(device(), DType::bf16, b0), value(device(), DType::f32, v0);
      TestFlag overwrite_flag(device(), overwrite);
      TestFlag updated_flag(device(), false);
      bool updated_host = false;
      accumulate_v2(buffer.view(), value.view(),
                    on_device ? Flag::device(overwrite_flag.pointer()) : Flag::host(overwrite),
                    on_device ? Flag::device(updated_flag.pointer()) : Flag::host_output(&updated_host));
      synchronize(device());
      const std::string what = std::string(on_device ? "device" : "host") + " overwrite=" + (overwrite ? "1" : "0");
      expect_close(buffer.read(), reference_accumulate(b0, v0, overwrite), DType::bf16, what);
      EXPECT_TRUE(on_device ? updated_flag.read() : updated_host) << what;
    }
  }
}

TEST_P(Gradient, NonFiniteValuesPropagate) {
  const double inf = std::numeric_limits<double>::infinity();
  TestTensor buffer(device(), DType::f16, {1.0, 2.0, 60000.0, -3.0});
  TestTensor value(device(), DType::f32, {inf, std::nan(""), 60000.0, 1.0});
  accumulate(buffer.view(), value.view());
  synchronize(device());
  const auto got = buffer.read();
  EXPECT_EQ(got[0], inf);
  EXPECT_TRUE(std::isnan(got[1]));
  EXPECT_EQ(got[2], inf) << "f16 overflow rounds to Inf";
  EXPECT_EQ(got[3], -2.0);
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(Gradient);

}  // namespace
}  // namespace gradkit::test
