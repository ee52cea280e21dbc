// The checksum that closes a state file (docs/state-format.md): FNV-1a
// (64-bit) of every byte before it. Internal: StateFile uses it, and so do
// the fuzz target (which repairs it over mutated bytes, so that the fuzzer
// reaches the sections behind it) and the tests' hand-made files.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gradkit {

uint64_t state_file_checksum(const uint8_t* data, size_t n);

}  // namespace gradkit
