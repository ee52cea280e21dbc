// Buffer's host memory (src/core/memory.cc, src/core/host_memory.cc): zero
// to the end of its last 256-byte block and aligned, whether it comes from
// malloc (small) or from pages mapped by every core (large), and writable.
// (Pinned buffers need a GPU: test_offloaded.cc's GPU cases use them.)
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>

#include "core/host_memory.h"
#include "gradkit/core/memory.h"
#include "support/expect_error.h"

namespace gradkit::test {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Every byte of [p, p + bytes) is zero; then it takes a value written to it.
void expect_zero_and_writable(void* p, size_t bytes) {
  const auto* bytes_in = static_cast<const unsigned char*>(p);
  size_t nonzero = 0;
  for (size_t i = 0; i < bytes; ++i) nonzero += bytes_in[i] != 0;
  EXPECT_EQ(nonzero, 0u) << "of " << bytes << " bytes";
  std::memset(p, 0xA5, bytes);
  EXPECT_EQ(static_cast<unsigned char*>(p)[bytes - 1], 0xA5);
}

TEST(HostBuffer, ZeroToItsLastBlockAndAligned) {
  // Either side of the size where the mapped pages take over (32 MiB), and
  // sizes that end inside a page and inside a huge page.
  for (size_t bytes : {size_t{1}, size_t{255}, size_t{257}, size_t{4097}, 32 * kMiB - 1, 32 * kMiB + 1000,
                       65 * kMiB + 3}) {
    Buffer b(Device::cpu(), bytes);
    EXPECT_EQ(b.bytes(), bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 256, 0u) << bytes;
    expect_zero_and_writable(b.data(), (bytes + 255) / 256 * 256);
  }
}

// map_host: what large Buffers and every pinned one (cudaHostRegister pins
// whole pages, so a pinned buffer shares its pages with nothing) are made of.
TEST(HostBuffer, MappedPagesStartOnAHugePage) {
  for (bool huge_pages : {true, false}) {
    for (size_t bytes : {size_t{256}, 3 * kMiB + 256, 40 * kMiB + 256}) {
      std::shared_ptr<void> p = detail::map_host(bytes, huge_pages);
      ASSERT_TRUE(p);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p.get()) % (2 * kMiB), 0u);
      expect_zero_and_writable(p.get(), bytes);
    }
  }
}

TEST(HostBuffer, MoreThanTheHostHasIsAClearError) {
  expect_error([] { Buffer(Device::cpu(), size_t{1} << 52); }, ErrorCode::invalid_argument,
               {"Buffer", "cannot allocate", std::to_string(size_t{1} << 52) + " bytes"});
  EXPECT_FALSE(detail::allocate_host(size_t{1} << 52));
  EXPECT_FALSE(detail::allocate_host(~size_t{0}));
  EXPECT_FALSE(detail::map_host(~size_t{0} - 4096));
}

}  // namespace
}  // namespace gradkit::test
