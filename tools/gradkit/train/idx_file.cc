#include "train/idx_file.h"

#include <zlib.h>

#include <cstdio>
#include <memory>

#include "gradkit/core/error.h"

namespace gradkit::train {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error(ErrorCode::io_error, "data file '" + path + "': " + what);
}

struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};

// Reads up to n bytes; fewer only at the end of the file.
size_t read_some(gzFile file, void* out, size_t n, const std::string& path) {
  size_t got = 0;
  while (got < n) {
    const int r = gzread(file, static_cast<char*>(out) + got, static_cast<unsigned>(std::min<size_t>(n - got, 1 << 30)));
    if (r < 0) {
      int code = 0;
      fail(path, std::string("cannot be decompressed: ") + gzerror(file, &code));
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return got;
}

// Reads exactly n bytes; false at a clean end of file before the first byte.
bool read_exact(gzFile file, void* out, size_t n, const std::string& path) {
  const size_t got = read_some(file, out, n, path);
  if (got == 0 && n > 0) return false;
  if (got < n) fail(path, "is truncated (" + std::to_string(got) + " of " + std::to_string(n) + " bytes of a record)");
  return true;
}

// The data: `total` bytes, read a chunk at a time, so that a header that
// announces more than the file holds costs no more memory than the file's
// contents (a 50-byte file may announce 4 GiB).
std::vector<uint8_t> read_data(gzFile file, size_t total, const std::string& path) {
  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<uint8_t> data;
  while (data.size() < total) {
    const size_t at = data.size(), n = std::min(kChunk, total - at);
    data.resize(at + n);
    const size_t got = read_some(file, data.data() + at, n, path);
    if (got < n) {
      if (at + got == 0) fail(path, "has a header but no data");
      fail(path, "is truncated (" + std::to_string(at + got) + " of the " + std::to_string(total) +
                     " bytes its header announces)");
    }
  }
  return data;
}

uint32_t big_endian(const uint8_t b[4]) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

}  // namespace

IdxArray read_idx(const std::string& path, int rank) {
  std::unique_ptr<gzFile_s, GzCloser> file(gzopen(path.c_str(), "rb"));
  if (!file) fail(path, "cannot be opened");
  uint8_t header[4];
  if (!read_exact(file.get(), header, 4, path)) fail(path, "is empty");
  // Magic: two zero bytes, the element type (0x08: unsigned byte), the rank.
  if (header[0] != 0 || header[1] != 0) fail(path, "is not an IDX file (bad magic number)");
  if (header[2] != 0x08) {
    char type[8];
    std::snprintf(type, sizeof type, "0x%02x", header[2]);
    fail(path, std::string("holds elements of type ") + type + ", expected unsigned bytes (0x08)");
  }
  if (header[3] != rank) {
    fail(path, "has " + std::to_string(header[3]) + " dimensions, expected " + std::to_string(rank));
  }
  IdxArray array;
  size_t total = 1;
  for (int d = 0; d < rank; ++d) {
    uint8_t b[4];
    if (!read_exact(file.get(), b, 4, path)) fail(path, "is truncated in its header");
    const uint32_t n = big_endian(b);
    if (n == 0 || n > (1u << 28)) fail(path, "has dimension " + std::to_string(d) + " of size " + std::to_string(n));
    array.dims.push_back(n);
    total *= n;
    if (total > (size_t{1} << 32)) fail(path, "announces more than 2^32 bytes of data");
  }
  array.data = read_data(file.get(), total, path);
  uint8_t extra;
  if (read_exact(file.get(), &extra, 1, path)) fail(path, "has bytes past the " + std::to_string(total) + " its header announces");
  return array;
}

}  // namespace gradkit::train
