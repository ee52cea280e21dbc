// Fashion-MNIST from Debian's dataset-fashion-mnist (gzip'd IDX files).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gradkit::train {

inline constexpr const char* kDefaultDataDir = "/usr/share/datasets/fashion-mnist";

struct Split {
  int64_t count = 0;
  std::vector<float> images;    // count x 784, scaled to [0, 1]
  std::vector<uint8_t> labels;  // count, each in [0, 10)
};

struct FashionMnist {
  Split train, test;
};

// Reads and checks the four files: magic numbers, 28x28 images, as many
// labels as images, labels below 10, the published counts (60,000 and
// 10,000). Throws gradkit::Error(io_error) naming the file.
FashionMnist load_fashion_mnist(const std::string& directory);

}  // namespace gradkit::train
