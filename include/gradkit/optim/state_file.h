// The versioned file format every owning optimizer saves its state in
// (docs/state-format.md): named sections of bytes behind a magic number and
// a version, closed by a checksum of everything before it.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gradkit {

class StateFile {
 public:
  // 2: 8-bit moments (u8 moment dtype, absmax sections); 3: 4-bit moments
  // (code 5, the linear map); 4: 4-bit moments on DE-0 (code 6; code 5 is
  // refused). Older files have the same layout and read as they are
  // (docs/state-format.md).
  static constexpr uint32_t kVersion = 4;

  // Section names are 1 to 64 printable ASCII characters, each used once;
  // throws Error(invalid_argument) otherwise.
  void add(std::string name, std::vector<uint8_t> bytes);
  // The section's bytes; throws Error(io_error) naming the file and section if absent.
  const std::vector<uint8_t>& get(std::string_view name) const;
  bool has(std::string_view name) const;
  // The sections' names, in the order they were added (or read).
  std::vector<std::string> names() const;

  // Writes atomically: to a temporary file beside `path`
  // (temporary_path), flushed to disk, then renamed over `path` and the
  // directory flushed, so a crash mid-write leaves the old file whole and a
  // finished write survives a power loss. A file replaced keeps its mode.
  // Then removes the temporaries of `path` that writers now gone (killed
  // mid-write) left behind; a live writer's is kept.
  void write(const std::string& path) const;
  // Reads and checks magic, version, the sections' framing against the
  // file's size, then the sections and the checksum, reading no byte the
  // framing does not account for; throws Error(io_error) saying what is
  // wrong (missing, a directory or not a regular file, truncated, corrupt,
  // newer version, a section repeated or badly named).
  static StateFile read(const std::string& path);
  // What read() checks first, without reading the sections: `path` is a
  // regular file with the magic and a version this reader takes. For a
  // caller that names a wrong file before any work.
  static void check_readable(const std::string& path);

  // The temporary file write() makes beside `path`: `path`.tmp.<pid>.
  static std::string temporary_path(const std::string& path, long pid);
  // A mkstemp() template of the longest temporary name of `path` (a pid's
  // ten digits as X's, so that no writer's temporary has it): made and
  // removed, it tells a caller before any work that write() can make its
  // temporary there (a directory that takes files, a name not too long).
  static std::string temporary_template(const std::string& path);

 private:
  std::string source_;  // the path it was read from, for messages
  std::vector<std::pair<std::string, std::vector<uint8_t>>> sections_;
};

// Little-endian packing of plain values into a section and back; reading
// past the end is an io_error naming the section.
class SectionWriter {
 public:
  template <class T>
  SectionWriter& put(const T& value) {
    const size_t at = bytes_.size();
    bytes_.resize(at + sizeof(T));
    std::memcpy(bytes_.data() + at, &value, sizeof(T));
    return *this;
  }
  std::vector<uint8_t> take() { return std::move(bytes_); }

 private:
  std::vector<uint8_t> bytes_;
};

class SectionReader {
 public:
  SectionReader(const std::vector<uint8_t>& bytes, std::string name) : bytes_(bytes), name_(std::move(name)) {}
  template <class T>
  T get() {
    T value;
    read(&value, sizeof(T));
    return value;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  void read(void* out, size_t n);
  const std::vector<uint8_t>& bytes_;
  std::string name_;
  size_t at_ = 0;
};

}  // namespace gradkit
