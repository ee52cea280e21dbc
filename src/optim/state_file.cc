#include "gradkit/optim/state_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>

#include "gradkit/core/error.h"
#include "optim/state_file_checksum.h"

namespace gradkit {
namespace {

constexpr char kMagic[8] = {'G', 'R', 'A', 'D', 'K', 'I', 'T', '\0'};
constexpr size_t kMaxNameLength = 64;

bool is_section_name(std::string_view name) {
  if (name.empty() || name.size() > kMaxNameLength) return false;
  for (char c : name) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

template <class T>
void append(std::vector<uint8_t>& out, const T& v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error(ErrorCode::io_error, "state file '" + path + "': " + what);
}

}  // namespace

uint64_t state_file_checksum(const uint8_t* data, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, 64-bit
  for (size_t i = 0; i < n; ++i) {
    h ^= data[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

void StateFile::add(std::string name, std::vector<uint8_t> bytes) {
  // Nothing is added that read() would refuse.
  if (!is_section_name(name)) {
    throw Error(ErrorCode::invalid_argument, "StateFile::add: section name '" + name + "' is not 1 to " +
                                                 std::to_string(kMaxNameLength) + " printable ASCII characters");
  }
  if (has(name)) {
    throw Error(ErrorCode::invalid_argument, "StateFile::add: section '" + name + "' is already in the file");
  }
  sections_.emplace_back(std::move(name), std::move(bytes));
}

bool StateFile::has(std::string_view name) const {
  for (const auto& [n, b] : sections_) {
    if (n == name) return true;
  }
  return false;
}

std::vector<std::string> StateFile::names() const {
  std::vector<std::string> out;
  for (const auto& [n, b] : sections_) out.push_back(n);
  return out;
}

const std::vector<uint8_t>& StateFile::get(std::string_view name) const {
  for (const auto& [n, b] : sections_) {
    if (n == name) return b;
  }
  fail(source_, "has no section '" + std::string(name) + "'");
}

void StateFile::write(const std::string& path) const {
  std::vector<uint8_t> out(kMagic, kMagic + sizeof kMagic);
  append(out, kVersion);
  append(out, static_cast<uint32_t>(sections_.size()));
  for (const auto& [name, bytes] : sections_) {
    append(out, static_cast<uint32_t>(name.size()));
    out.insert(out.end(), name.begin(), name.end());
    append(out, static_cast<uint64_t>(bytes.size()));
    out.insert(out.end(), bytes.begin(), bytes.end());
  }
  append(out, state_file_checksum(out.data(), out.size()));

  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail(path, std::string("cannot create '") + temporary + "': " + std::strerror(errno));
  size_t written = 0;
  while (written < out.size()) {
    const ssize_t n = ::write(fd, out.data() + written, out.size() - written);
    if (n <= 0) {
      ::close(fd);
      ::unlink(temporary.c_str());
      fail(path, std::string("write failed: ") + std::strerror(errno));
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(temporary.c_str());
    fail(path, std::string("flush failed: ") + std::strerror(errno));
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    ::unlink(temporary.c_str());
    fail(path, std::string("rename failed: ") + std::strerror(errno));
  }
}

StateFile StateFile::read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot be opened");
  const std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (data.size() < sizeof kMagic + 16) fail(path, "is truncated (" + std::to_string(data.size()) + " bytes)");
  if (std::memcmp(data.data(), kMagic, sizeof kMagic) != 0) fail(path, "is not a gradkit state file (bad magic)");
  uint64_t stored;
  std::memcpy(&stored, data.data() + data.size() - 8, 8);
  uint32_t version;
  std::memcpy(&version, data.data() + 8, 4);
  if (version < 1 || version > kVersion) {  // older versions' files read as they are (docs/state-format.md)
    fail(path, "has format version " + std::to_string(version) + ", expected 1 to " + std::to_string(kVersion));
  }
  if (state_file_checksum(data.data(), data.size() - 8) != stored) fail(path, "is corrupt (checksum mismatch)");

  StateFile file;
  file.source_ = path;
  size_t at = 12;
  const size_t end = data.size() - 8;
  auto take = [&](void* out, size_t n) {
    if (n > end - at) fail(path, "is truncated inside a section");
    std::memcpy(out, data.data() + at, n);
    at += n;
  };
  uint32_t count;
  take(&count, 4);
  // Which copy of a repeated section a reader would take is an accident of
  // its code: a file that repeats one is refused. (A set, not has(): a file
  // of many empty sections must not cost time quadratic in its size.)
  std::set<std::string, std::less<>> names;
  for (uint32_t s = 0; s < count; ++s) {
    uint32_t name_length;
    take(&name_length, 4);
    if (name_length > end - at) fail(path, "is truncated in a section name");
    std::string name(name_length, '\0');
    take(name.data(), name_length);
    // Names go into error messages: no control bytes or screenfuls from a
    // file of unknown origin.
    if (!is_section_name(name)) {
      fail(path, "has a section name that is not 1 to " + std::to_string(kMaxNameLength) +
                     " printable ASCII characters (" + std::to_string(name_length) + " bytes)");
    }
    uint64_t size;
    take(&size, 8);
    if (size > end - at) fail(path, "is truncated in section '" + name + "'");
    if (!names.insert(name).second) fail(path, "has section '" + name + "' more than once");
    file.sections_.emplace_back(name, std::vector<uint8_t>(data.begin() + at, data.begin() + at + size));
    at += size;
  }
  if (at != end) fail(path, "has " + std::to_string(end - at) + " unexpected bytes after its sections");
  return file;
}

void SectionReader::read(void* out, size_t n) {
  if (n > bytes_.size() - at_) {
    throw Error(ErrorCode::io_error, "state file section '" + name_ + "' is shorter than its contents need");
  }
  std::memcpy(out, bytes_.data() + at_, n);
  at_ += n;
}

}  // namespace gradkit
