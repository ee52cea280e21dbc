// Reading gzip'd IDX files (the MNIST family's format): a big-endian header
// of magic number and dimensions, then the raw bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gradkit::train {

struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;  // unsigned bytes, row-major
};

// Reads `path` (gzip'd or plain) and checks that it holds unsigned bytes with
// `rank` dimensions and exactly as many bytes as the dimensions say. Throws
// gradkit::Error(io_error) naming the file and what is wrong.
IdxArray read_idx(const std::string& path, int rank);

}  // namespace gradkit::train
