#include "train/fashion_mnist.h"

#include "gradkit/core/error.h"
#include "train/idx_file.h"

namespace gradkit::train {
namespace {

Split load_split(const std::string& directory, const std::string& prefix, int64_t expected) {
  const std::string image_path = directory + "/" + prefix + "-images-idx3-ubyte.gz";
  const std::string label_path = directory + "/" + prefix + "-labels-idx1-ubyte.gz";
  const IdxArray images = read_idx(image_path, 3);
  const IdxArray labels = read_idx(label_path, 1);
  auto fail = [](const std::string& path, const std::string& what) {
    throw Error(ErrorCode::io_error, "data file '" + path + "': " + what);
  };
  if (images.dims[1] != 28 || images.dims[2] != 28) {
    fail(image_path, "holds " + std::to_string(images.dims[1]) + "x" + std::to_string(images.dims[2]) +
                         " images, expected 28x28");
  }
  if (images.dims[0] != expected) {
    fail(image_path, "holds " + std::to_string(images.dims[0]) + " images, expected " + std::to_string(expected));
  }
  if (labels.dims[0] != images.dims[0]) {
    fail(label_path, "holds " + std::to_string(labels.dims[0]) + " labels, expected one per image (" +
                         std::to_string(images.dims[0]) + ")");
  }
  Split split;
  split.count = images.dims[0];
  split.images.resize(images.data.size());
  for (size_t i = 0; i < images.data.size(); ++i) split.images[i] = static_cast<float>(images.data[i]) / 255.0f;
  split.labels = labels.data;
  for (size_t i = 0; i < split.labels.size(); ++i) {
    if (split.labels[i] >= 10) fail(label_path, "label " + std::to_string(i) + " is " + std::to_string(split.labels[i]) + ", expected 0-9");
  }
  return split;
}

}  // namespace

FashionMnist load_fashion_mnist(const std::string& directory) {
  return FashionMnist{load_split(directory, "train", 60000), load_split(directory, "t10k", 10000)};
}

}  // namespace gradkit::train
