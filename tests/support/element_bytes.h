// Elements of a tensor's raw bytes (TestTensor::bytes()), read and written
// as a given type: for references that work on the same bits as the library.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace gradkit::test {

template <class T>
T get(const std::vector<uint8_t>& bytes, int64_t i) {
  T x;
  std::memcpy(&x, bytes.data() + i * sizeof(T), sizeof(T));
  return x;
}

template <class T>
void put(std::vector<uint8_t>& bytes, int64_t i, T x) {
  std::memcpy(bytes.data() + i * sizeof(T), &x, sizeof(T));
}

}  // namespace gradkit::test
