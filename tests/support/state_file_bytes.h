// Hand-made state files (docs/state-format.md) for the tests of what the
// readers refuse: a saved file's sections as they lie in it, to be changed,
// repeated or reordered, then written back behind a valid checksum, as a
// file from untrusted hands would come, so that the reader gets past the
// checksum to them.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace gradkit::test {

struct RawSection {
  std::string name;
  std::vector<uint8_t> bytes;
};

// A path in the test's temporary folder for a state file, unique to the
// process (CTest runs a binary's tests as processes side by side).
std::string temp_path(const std::string& name);

// The sections of the (well-formed) state file at `path`, in file order.
std::vector<RawSection> read_raw_sections(const std::string& path);
// A state file of `sections` in that order (names need not be unique or
// valid), of format `version`, closed by the right checksum.
void write_raw_state_file(const std::string& path, const std::vector<RawSection>& sections, uint32_t version = 1);
// The first section named `name`; fails the test if there is none.
RawSection& find_section(std::vector<RawSection>& sections, std::string_view name);

// Overwrites the bytes at `offset` with `value` (little-endian, as the file).
template <class T>
void put_at(std::vector<uint8_t>& bytes, size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof value);
}

}  // namespace gradkit::test
