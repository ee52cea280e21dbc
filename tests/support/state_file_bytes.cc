#include "support/state_file_bytes.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <iterator>

#include "optim/state_file_checksum.h"

namespace gradkit::test {
namespace {

constexpr char kMagic[8] = {'G', 'R', 'A', 'D', 'K', 'I', 'T', '\0'};

template <class T>
T take(const std::vector<uint8_t>& data, size_t& at) {
  T value;
  std::memcpy(&value, data.data() + at, sizeof value);
  at += sizeof value;
  return value;
}

template <class T>
void append(std::vector<uint8_t>& out, T value) {
  const auto* p = reinterpret_cast<const uint8_t*>(&value);
  out.insert(out.end(), p, p + sizeof value);
}

}  // namespace

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "gradkit_" + name + "_" + std::to_string(::getpid());
}

std::vector<RawSection> read_raw_sections(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<RawSection> sections;
  if (data.size() < 24 || std::memcmp(data.data(), kMagic, 8) != 0) {
    ADD_FAILURE() << path << " is not a state file";
    return sections;
  }
  size_t at = 12;
  const auto count = take<uint32_t>(data, at);
  for (uint32_t s = 0; s < count; ++s) {
    RawSection section;
    const auto name_length = take<uint32_t>(data, at);
    section.name.assign(data.begin() + static_cast<ptrdiff_t>(at), data.begin() + static_cast<ptrdiff_t>(at + name_length));
    at += name_length;
    const auto size = take<uint64_t>(data, at);
    section.bytes.assign(data.begin() + static_cast<ptrdiff_t>(at), data.begin() + static_cast<ptrdiff_t>(at + size));
    at += size;
    sections.push_back(std::move(section));
  }
  return sections;
}

void write_raw_state_file(const std::string& path, const std::vector<RawSection>& sections, uint32_t version) {
  std::vector<uint8_t> out(kMagic, kMagic + sizeof kMagic);
  append<uint32_t>(out, version);
  append<uint32_t>(out, static_cast<uint32_t>(sections.size()));
  for (const RawSection& s : sections) {
    append<uint32_t>(out, static_cast<uint32_t>(s.name.size()));
    out.insert(out.end(), s.name.begin(), s.name.end());
    append<uint64_t>(out, s.bytes.size());
    out.insert(out.end(), s.bytes.begin(), s.bytes.end());
  }
  append<uint64_t>(out, state_file_checksum(out.data(), out.size()));
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(out.data()),
                                              static_cast<std::streamsize>(out.size()));
}

RawSection& find_section(std::vector<RawSection>& sections, std::string_view name) {
  for (RawSection& s : sections) {
    if (s.name == name) return s;
  }
  ADD_FAILURE() << "no section " << name;
  static RawSection none;
  return none;
}

}  // namespace gradkit::test
