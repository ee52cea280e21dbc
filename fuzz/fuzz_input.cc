#include "fuzz_input.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace gradkit::fuzz {

MemoryFile::MemoryFile() : fd_(::memfd_create("gradkit-fuzz-input", 0)) {
  if (fd_ < 0) throw std::runtime_error(std::string("memfd_create: ") + std::strerror(errno));
  path_ = "/proc/self/fd/" + std::to_string(fd_);
}

MemoryFile::~MemoryFile() { ::close(fd_); }

void MemoryFile::write(const uint8_t* data, size_t size) {
  if (::ftruncate(fd_, 0) != 0) throw std::runtime_error(std::string("ftruncate: ") + std::strerror(errno));
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pwrite(fd_, data + done, size - done, static_cast<off_t>(done));
    if (n <= 0) throw std::runtime_error(std::string("pwrite: ") + std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

namespace {

std::string temp_directory;  // removed at a normal exit

void remove_temp_directory() { std::filesystem::remove_all(temp_directory); }

}  // namespace

std::string make_temp_directory() {
  const char* base = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : std::getenv("TMPDIR");
  std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/gradkit-fuzz-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error(std::string("mkdtemp: ") + std::strerror(errno));
  temp_directory = pattern;
  std::atexit(remove_temp_directory);
  return pattern;
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::string seed_directory() {
  const char* dir = std::getenv("GRADKIT_FUZZ_SEEDS");
  return dir != nullptr ? dir : "";
}

void finding(const std::string& what) {
  std::fprintf(stderr, "gradkit fuzz finding: %s\n", what.c_str());
  std::fflush(stderr);
  __builtin_trap();
}

}  // namespace gradkit::fuzz
