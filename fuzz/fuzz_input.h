// What both fuzz targets need around the reader under test: the input as a
// file (the readers take paths), a directory for files that need one, the
// seeds written on request, and a finding reported so that libFuzzer keeps
// the input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace gradkit::fuzz {

// An anonymous file in memory (memfd), named by /proc/self/fd/N and
// rewritten for each input: fuzzing touches no disk.
class MemoryFile {
 public:
  MemoryFile();
  ~MemoryFile();
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;

  void write(const uint8_t* data, size_t size);
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

// A new directory for files that must live in one (a save writes a
// temporary file beside its target and renames it), in /dev/shm where
// there is one; removed at a normal exit. One per process.
std::string make_temp_directory();

std::vector<uint8_t> read_file(const std::string& path);
void write_file(const std::string& path, const std::vector<uint8_t>& bytes);

// The directory GRADKIT_FUZZ_SEEDS names, or "" when it is unset: where a
// target writes the valid files it starts from (scripts/fuzz seeds the
// corpus with them).
std::string seed_directory();

// A defect that no sanitizer sees (a refusal that changed state, an accepted
// file that does not survive a save): printed, then a trap, which libFuzzer
// reports as a crash and saves the input of.
[[noreturn]] void finding(const std::string& what);

}  // namespace gradkit::fuzz
