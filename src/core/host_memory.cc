#include "core/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace gradkit::detail {
namespace {

constexpr size_t kAlignment = 256;              // Buffer's allocation unit (memory.cc)
constexpr size_t kHugePage = size_t{2} << 20;   // a transparent huge page (x86-64; arm64 with 4 KiB pages)
// Smaller allocations (counters, scalars, a small model's state) come from
// malloc and one memset: three system calls and a team of threads would
// cost more than they save.
constexpr size_t kLarge = size_t{32} << 20;

// Writes one byte in every page, so that each page is mapped (and zeroed
// by the kernel) now, by many threads at once, instead of one page fault
// at a time in whichever thread first writes it. Each thread takes whole
// huge pages, so that a huge page is one fault in one thread.
void touch_pages(unsigned char* p, size_t bytes) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const auto blocks = static_cast<int64_t>((bytes + kHugePage - 1) / kHugePage);
  // Every core, whatever the caller's OpenMP team size (a torch process may
  // run with OMP_NUM_THREADS=1): the optimizer is being made, nothing else
  // is running yet, and page faults are what one thread does slowest.
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(omp_get_num_procs()) if (blocks > 1)
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const size_t begin = static_cast<size_t>(b) * kHugePage, end = std::min(bytes, begin + kHugePage);
    for (size_t at = begin; at < end; at += page) static_cast<volatile unsigned char*>(p)[at] = 0;
  }
}

}  // namespace

// Starting on a huge-page boundary (a huge page backs only an aligned 2 MiB
// range): mapped a huge page longer than needed, then trimmed at both ends.
std::shared_ptr<void> map_host(size_t bytes, bool huge_pages) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (bytes > SIZE_MAX - kHugePage - page) return {};
  const size_t length = (bytes + page - 1) / page * page, span = length + kHugePage;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return {};
  const auto base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = (base + kHugePage - 1) / kHugePage * kHugePage;
  if (start > base) munmap(raw, start - base);
  munmap(reinterpret_cast<void*>(start + length), base + span - (start + length));  // at least a page
  auto* p = reinterpret_cast<unsigned char*>(start);
  // Advice: without transparent huge pages in the kernel it fails, harmlessly.
  if (huge_pages) (void)madvise(p, length, MADV_HUGEPAGE);
  touch_pages(p, length);
  return std::shared_ptr<void>(p, [length](void* q) { munmap(q, length); });
}

std::shared_ptr<void> allocate_host(size_t bytes, bool huge_pages) {
  if (bytes >= kLarge) return map_host(bytes, huge_pages);
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;  // aligned_alloc's rule
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) return {};
  std::memset(p, 0, rounded);
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

}  // namespace gradkit::detail
