// Backend-generic tests run once per device; the CUDA instance skips cleanly
// where no GPU is visible (or gradkit was built without CUDA).
#pragma once

#include <gtest/gtest.h>

#include "gradkit/core/device.h"
#include "support/test_tensor.h"

namespace gradkit::test {

class OnEachDevice : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override {
    if (GetParam().is_cuda() && !cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  }
  Device device() const { return GetParam(); }
};

inline std::string device_test_name(const ::testing::TestParamInfo<Device>& info) {
  return info.param.is_cuda() ? "cuda" : "cpu";
}

}  // namespace gradkit::test

#define GRADKIT_INSTANTIATE_ON_EACH_DEVICE(Suite)                                                   \
  INSTANTIATE_TEST_SUITE_P(Devices, Suite, ::testing::Values(gradkit::Device::cpu(), gradkit::Device::cuda(0)), \
                           gradkit::test::device_test_name)
