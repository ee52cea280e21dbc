// Runs a call that must fail: an Error of the expected code whose message
// names every one of the given parts (the argument, the expected value).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gradkit/core/error.h"

namespace gradkit::test {

template <class Call>
void expect_error(Call&& call, ErrorCode code, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "expected an Error(" << error_code_name(code) << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

}  // namespace gradkit::test
