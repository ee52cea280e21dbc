// gradkit's Adam/AdamW against torch.optim on the same gradient sequence, on
// the GPU (skipped where no GPU is visible or PyTorch is not importable).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gradkit/optim/adam.h"
#include "support/test_tensor.h"

#ifndef GRADKIT_SOURCE_DIR
#define GRADKIT_SOURCE_DIR "."
#endif

namespace gradkit::test {
namespace {

bool torch_importable() { return std::system("python3 -c 'import torch' > /dev/null 2>&1") == 0; }

template <class T>
void write_file(const std::string& path, const std::vector<T>& values) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(T)));
}

struct Case {
  const char* optimizer;  // adam | adamw
  const char* impl;       // fused | foreach
  AdamHyperparameters h;
};

// Max over elements of |gradkit - torch| / |torch|, over elements whose
// magnitude is at least 1e-3 (relative error is meaningless near zero;
// those are covered by the absolute error bound below).
void compare(const Case& c, int steps) {
  const Device device = Device::cuda(0);
  std::mt19937_64 rng(2026);
  const std::vector<int64_t> sizes = {4096, 33, 65536 + 7, 1000};
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  std::vector<float> w0(total), grads(static_cast<size_t>(total) * steps);
  std::normal_distribution<float> normal;
  for (float& x : w0) x = normal(rng);
  for (float& x : grads) x = normal(rng);

  const std::string dir = ::testing::TempDir() + "gradkit_torch_" + c.optimizer + "_" + c.impl;
  std::filesystem::create_directories(dir);
  write_file(dir + "/w0.bin", w0);
  write_file(dir + "/grads.bin", grads);
  {
    std::ofstream config(dir + "/config.txt");
    config.precision(9);
    config << c.optimizer << ' ' << c.impl << " cuda " << steps << ' ' << c.h.lr << ' ' << c.h.beta1 << ' '
           << c.h.beta2 << ' ' << c.h.eps << ' ' << c.h.weight_decay << ' ' << (c.h.amsgrad ? 1 : 0);
    for (int64_t n : sizes) config << ' ' << n;
  }
  const std::string script = std::string(GRADKIT_SOURCE_DIR) + "/tests/torch/adam_sequence.py";
  ASSERT_EQ(std::system(("python3 '" + script + "' '" + dir + "'").c_str()), 0);
  std::vector<float> torch_w(total);
  std::ifstream(dir + "/w_torch.bin", std::ios::binary)
      .read(reinterpret_cast<char*>(torch_w.data()), static_cast<std::streamsize>(total * sizeof(float)));

  std::vector<Buffer> params, grad_buffers;
  AdamGroup group;
  group.hyperparameters = c.h;
  int64_t offset = 0;
  for (int64_t n : sizes) {
    params.emplace_back(device, n * sizeof(float));
    grad_buffers.emplace_back(device, n * sizeof(float));
    copy_from_host(params.back().data(), device, w0.data() + offset, n * sizeof(float));
    group.params.push_back(params.back().view(DType::f32, 0, n));
    group.grads.push_back(grad_buffers.back().view(DType::f32, 0, n));
    offset += n;
  }
  Adam adam({group});
  for (int s = 0; s < steps; ++s) {
    offset = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      copy_from_host(grad_buffers[i].data(), device, grads.data() + static_cast<size_t>(s) * total + offset,
                     sizes[i] * sizeof(float));
      offset += sizes[i];
    }
    adam.step();
  }
  std::vector<float> ours(total);
  offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    copy_to_host(ours.data() + offset, params[i].data(), sizes[i] * sizeof(float), device);
    offset += sizes[i];
  }
  double max_relative = 0, max_absolute = 0;
  for (int64_t i = 0; i < total; ++i) {
    const double diff = std::abs(static_cast<double>(ours[i]) - torch_w[i]);
    max_absolute = std::max(max_absolute, diff);
    if (std::abs(torch_w[i]) >= 1e-3) max_relative = std::max(max_relative, diff / std::abs(torch_w[i]));
  }
  std::printf("%s (%s), %d steps: max relative error %.3g, max absolute error %.3g\n", c.optimizer, c.impl, steps,
              max_relative, max_absolute);
  EXPECT_LT(max_relative, 1e-6) << c.optimizer << " " << c.impl;
  EXPECT_LT(max_absolute, 1e-6) << c.optimizer << " " << c.impl;
  std::filesystem::remove_all(dir);
}

TEST(AdamAgainstTorch, HundredStepsAgree) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  if (!torch_importable()) GTEST_SKIP() << "PyTorch is not importable";
  AdamHyperparameters adamw;
  adamw.lr = 1e-3f;
  adamw.weight_decay = 0.01f;
  AdamHyperparameters adam = adamw;
  adam.decay = WeightDecay::l2;
  AdamHyperparameters ams = adamw;
  ams.amsgrad = true;
  for (const Case& c : {Case{"adamw", "fused", adamw}, Case{"adamw", "foreach", adamw}, Case{"adam", "fused", adam},
                        Case{"adam", "foreach", adam}, Case{"adamw", "fused", ams}}) {
    compare(c, 100);
  }
}

}  // namespace
}  // namespace gradkit::test
