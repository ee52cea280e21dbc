// The tests that drive the CUDA runtime themselves: a runtime call that
// fails ends the test (a fatal GoogleTest failure) and names the call.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#define CHECK_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call
