#include "gradkit/optim/state_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include "gradkit/core/error.h"
#include "optim/state_file_checksum.h"

namespace gradkit {
namespace {

constexpr char kMagic[8] = {'G', 'R', 'A', 'D', 'K', 'I', 'T', '\0'};
constexpr size_t kMaxNameLength = 64;
constexpr size_t kHeaderBytes = sizeof kMagic + 8;     // magic, version, section count
constexpr size_t kSmallestFile = kHeaderBytes + 8;     // ... and the checksum
constexpr const char* kTemporaryInfix = ".tmp.";
constexpr size_t kPidDigits = 10;                      // the most a pid_t has

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

std::string errno_text() { return std::strerror(errno); }

// A state file being read. It is opened without blocking (a FIFO would wait
// for a writer) and refused unless it is a regular file, whose size then
// bounds every read: a device such as /dev/zero has no end to read to.
// Small reads (the framing) go through a window, so that walking the
// sections costs few system calls.
class Input {
 public:
  explicit Input(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0) fail(path, "cannot be opened (" + errno_text() + ")");
    struct stat st {};
    const char* refusal = ::fstat(fd_, &st) != 0 ? "cannot be examined"
                          : S_ISDIR(st.st_mode)  ? "is a directory, not a state file"
                          : !S_ISREG(st.st_mode) ? "is not a regular file (a device, FIFO or socket has no size "
                                                   "to check a state file's against)"
                                                 : nullptr;
    if (refusal != nullptr) {
      ::close(fd_);
      fail(path, refusal);
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~Input() { ::close(fd_); }
  Input(const Input&) = delete;
  Input& operator=(const Input&) = delete;

  uint64_t size() const { return size_; }

  // `n` bytes at `offset`, which the caller has checked lie within size().
  void read(uint64_t offset, void* out, size_t n) {
    if (n == 0) return;
    if (n <= kWindow) {
      if (offset < window_start_ || offset + n > window_start_ + window_.size()) {
        window_.resize(static_cast<size_t>(std::min<uint64_t>(kWindow, size_ - offset)));
        read_direct(offset, window_.data(), window_.size());
        window_start_ = offset;
      }
      std::memcpy(out, window_.data() + (offset - window_start_), n);
      return;
    }
    read_direct(offset, out, n);
  }

 private:
  static constexpr size_t kWindow = size_t{1} << 16;

  void read_direct(uint64_t offset, void* out, size_t n) {
    auto* p = static_cast<uint8_t*>(out);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) fail(path_, "cannot be read (" + errno_text() + ")");
      if (got == 0) fail(path_, "became shorter while it was read");
      p += got;
      offset += static_cast<uint64_t>(got);
      n -= static_cast<size_t>(got);
    }
  }

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  std::vector<uint8_t> window_;
  uint64_t window_start_ = 0;
};

// Checks the size, magic and version of an opened state file.
// (The magic first: a short file of another kind is named as that.)
void check_header(Input& in, const std::string& path) {
  char magic[sizeof kMagic];
  const size_t head = static_cast<size_t>(std::min<uint64_t>(in.size(), sizeof magic));
  in.read(0, magic, head);
  if (std::memcmp(magic, kMagic, head) != 0) fail(path, "is not a gradkit state file (bad magic)");
  if (in.size() < kSmallestFile) fail(path, "is truncated (" + std::to_string(in.size()) + " bytes)");
  uint32_t version;
  in.read(sizeof kMagic, &version, 4);
  if (version < 1 || version > StateFile::kVersion) {  // older versions' files read as they are (docs/state-format.md)
    fail(path, "has format version " + std::to_string(version) + ", expected 1 to " +
                   std::to_string(StateFile::kVersion));
  }
}

// Where a section's payload lies in the file.
struct Extent {
  std::string name;
  uint64_t offset, size;
};

// Walks the sections' framing (names and sizes, not payloads) and checks
// that it accounts for the file's every byte up to the checksum.
std::vector<Extent> read_framing(Input& in, const std::string& path) {
  const uint64_t end = in.size() - 8;
  uint64_t at = sizeof kMagic + 4;
  auto take = [&](void* out, size_t n) {
    if (n > end - at) fail(path, "is truncated inside a section");
    in.read(at, out, n);
    at += n;
  };
  uint32_t count;
  take(&count, 4);
  // Which copy of a repeated section a reader would take is an accident of
  // its code: a file that repeats one is refused. (A set, not has(): a file
  // of many empty sections must not cost time quadratic in its size.)
  std::set<std::string, std::less<>> names;
  std::vector<Extent> extents;
  for (uint32_t s = 0; s < count; ++s) {
    uint32_t name_length;
    take(&name_length, 4);
    if (name_length > end - at) fail(path, "is truncated in a section name");
    // Names go into error messages: no control bytes or screenfuls from a
    // file of unknown origin.
    std::string name(std::min<size_t>(name_length, kMaxNameLength + 1), '\0');
    take(name.data(), name.size());
    if (name.size() != name_length || !is_section_name(name)) {
      fail(path, "has a section name that is not 1 to " + std::to_string(kMaxNameLength) +
                     " printable ASCII characters (" + std::to_string(name_length) + " bytes)");
    }
    uint64_t size;
    take(&size, 8);
    if (size > end - at) fail(path, "is truncated in section '" + name + "'");
    if (!names.insert(name).second) fail(path, "has section '" + name + "' more than once");
    extents.push_back({std::move(name), at, size});
    at += size;
  }
  if (at != end) fail(path, "has " + std::to_string(end - at) + " unexpected bytes after its sections");
  return extents;
}

// The directory that holds `path`, for opendir() and open().
std::string directory_of(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? "." : parent.string();
}

// Removes the temporaries that writes of `path` by processes now gone left
// behind (a save killed mid-write): `path`.tmp.<pid> where no process has
// that pid. A live process's is kept, since it may be writing now (another
// process saving the same file). Best effort: what cannot be removed stays.
void remove_stale_temporaries(const std::string& path) {
  const std::string prefix = std::filesystem::path(path).filename().string() + kTemporaryInfix;
  DIR* directory = ::opendir(directory_of(path).c_str());
  if (directory == nullptr) return;
  while (const dirent* entry = ::readdir(directory)) {
    const std::string_view name = entry->d_name;
    if (!name.starts_with(prefix)) continue;
    const std::string_view digits = name.substr(prefix.size());
    const bool a_pid = !digits.empty() && digits.size() <= kPidDigits &&
                       digits.find_first_not_of("0123456789") == std::string_view::npos;
    if (!a_pid) continue;
    const long long pid = std::stoll(std::string(digits));
    if (pid <= 0 || pid > INT_MAX || pid == ::getpid()) continue;
    // ESRCH: no such process. EPERM means one lives (another user's).
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    ::unlinkat(::dirfd(directory), entry->d_name, 0);
  }
  ::closedir(directory);
}

}  // namespace

uint64_t state_file_checksum(const uint8_t* data, size_t n, uint64_t h) {
  for (size_t i = 0; i < n; ++i) {  // FNV-1a, 64-bit
    h ^= data[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string StateFile::temporary_path(const std::string& path, long pid) {
  return path + kTemporaryInfix + std::to_string(pid);
}

std::string StateFile::temporary_template(const std::string& path) {
  return path + kTemporaryInfix + std::string(kPidDigits, 'X');
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

  // A file replaced keeps its permissions (fchmod: the umask applies only
  // to a new file's).
  struct stat existing {};
  const bool replaces = ::stat(path.c_str(), &existing) == 0 && S_ISREG(existing.st_mode);
  const std::string temporary = temporary_path(path, ::getpid());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, "cannot create '" + temporary + "': " + errno_text());
  auto give_up = [&](const std::string& what) {
    const std::string why = what + errno_text();
    ::close(fd);
    ::unlink(temporary.c_str());
    fail(path, why);
  };
  if (replaces && ::fchmod(fd, existing.st_mode & 07777) != 0) give_up("cannot keep the file's mode: ");
  size_t written = 0;
  while (written < out.size()) {
    const ssize_t n = ::write(fd, out.data() + written, out.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) give_up("write failed: ");
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) give_up("flush failed: ");
  if (::close(fd) != 0) {
    const std::string why = "flush failed: " + errno_text();
    ::unlink(temporary.c_str());
    fail(path, why);
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string why = "rename failed: " + errno_text();
    ::unlink(temporary.c_str());
    fail(path, why);
  }
  remove_stale_temporaries(path);
  // The rename lives in the directory: until it is flushed, a power loss may
  // bring the old file back. (EINVAL: a file system that does not flush
  // directories.)
  const std::string directory = directory_of(path);
  const int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0 || (::fsync(dir_fd) != 0 && errno != EINVAL)) {
    const std::string why = errno_text();
    if (dir_fd >= 0) ::close(dir_fd);
    fail(path, "is written, but its directory '" + directory + "' cannot be flushed: " + why);
  }
  ::close(dir_fd);
}

void StateFile::check_readable(const std::string& path) {
  Input in(path);
  check_header(in, path);
}

StateFile StateFile::read(const std::string& path) {
  Input in(path);
  check_header(in, path);
  const std::vector<Extent> extents = read_framing(in, path);
  // The framing holds: read the payloads, summing every byte in file order.
  StateFile file;
  file.source_ = path;
  uint64_t sum = kStateFileChecksumStart, at = 0;
  std::vector<uint8_t> framing;
  auto sum_up_to = [&](uint64_t offset) {
    framing.resize(static_cast<size_t>(offset - at));
    in.read(at, framing.data(), framing.size());
    sum = state_file_checksum(framing.data(), framing.size(), sum);
    at = offset;
  };
  for (const Extent& e : extents) {
    sum_up_to(e.offset);
    std::vector<uint8_t> bytes(static_cast<size_t>(e.size));
    in.read(e.offset, bytes.data(), bytes.size());
    sum = state_file_checksum(bytes.data(), bytes.size(), sum);
    at += e.size;
    file.sections_.emplace_back(e.name, std::move(bytes));
  }
  const uint64_t end = in.size() - 8;
  sum_up_to(end);
  uint64_t stored;
  in.read(end, &stored, 8);
  if (sum != stored) fail(path, "is corrupt (checksum mismatch)");
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
