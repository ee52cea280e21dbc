// The checksum that closes a state file (docs/state-format.md): FNV-1a
// (64-bit) of every byte before it. Internal: StateFile uses it, and so do
// the fuzz target (which repairs it over mutated bytes, so that the fuzzer
// reaches the sections behind it) and the tests' hand-made files.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gradkit {

inline constexpr uint64_t kStateFileChecksumStart = 0xcbf29ce484222325ull;  // FNV-1a's offset basis

// The checksum of `data` continued from `h`, the checksum of the bytes
// before it: a file is summed piece by piece as it is read.
uint64_t state_file_checksum(const uint8_t* data, size_t n, uint64_t h = kStateFileChecksumStart);

}  // namespace gradkit
