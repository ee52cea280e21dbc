// Tests that run once per instruction-set copy of the CPU kernels
// (src/cpu/isa.h); a copy this CPU cannot run skips, saying so.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "cpu/isa.h"
#include "gradkit/core/error.h"

namespace gradkit::test {

class EachCpuIsa : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    try {
      cpu::set_isa(GetParam());
    } catch (const Error& e) {
      GTEST_SKIP() << e.what();
    }
  }
  void TearDown() override { cpu::reset_isa(); }
};

}  // namespace gradkit::test

#define GRADKIT_INSTANTIATE_EACH_CPU_ISA(Suite)                                                       \
  INSTANTIATE_TEST_SUITE_P(Isa, Suite, ::testing::Values("baseline", "avx2", "avx512"),              \
                           [](const ::testing::TestParamInfo<const char*>& info) { return std::string(info.param); })
