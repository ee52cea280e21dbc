// Plans made from tensor lists, kept for the next call with the same lists.
// A training loop passes the same gradients every step: their plan (device
// tables, a split of the list) is made once, and a later call pays one pass
// over the views' pointers and counts, with no CUDA call and no allocation.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <list>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "gradkit/core/tensor.h"

namespace gradkit::comm {

// The plans of the last few layouts seen, most recently used first. A layout
// is one or more tensor lists (each tensor's data pointer and element count,
// in order) and a few other values the plan depends on (a buffer's address,
// the dtype, a size threshold): a plan is reused only when all of them are
// equal, so that its tables are exactly what a new plan would hold.
// How many layouts a communicator remembers. A loop passes one list per
// step, but DDP calls a hook once per bucket: a model of a few GB in 25 MB
// buckets has a few hundred lists, each passed every step, and a cache
// smaller than that would make every plan anew on every call (with a table
// upload each).
inline constexpr size_t kLayoutsKept = 256;

template <class Plan>
class LayoutCache {
 public:
  using Lists = std::initializer_list<std::span<const TensorView>>;
  using Values = std::initializer_list<uint64_t>;

  explicit LayoutCache(size_t capacity) : capacity_(capacity) {}

  // The cached plan for (lists, values), or make() (which returns a
  // std::shared_ptr<const Plan>) when there is none, dropping the least
  // recently used plan past the capacity. A dropped plan is freed with its
  // last owner, so a caller may still hold one.
  template <class Make>
  std::shared_ptr<const Plan> get(Lists lists, Values values, Make&& make) {
    const uint64_t hash = hash_of(lists, values);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->hash != hash || !matches(*it, lists, values)) continue;
      if (it != entries_.begin()) entries_.splice(entries_.begin(), entries_, it);
      return entries_.front().plan;
    }
    Entry entry{hash, {values.begin(), values.end()}, {}, {}, make()};
    ++built_;
    for (std::span<const TensorView> list : lists) {
      entry.list_sizes.push_back(list.size());
      for (const TensorView& t : list) entry.layout.emplace_back(t.data, t.numel);
    }
    entries_.push_front(std::move(entry));
    while (entries_.size() > capacity_) entries_.pop_back();
    return entries_.front().plan;
  }

  size_t built() const { return built_; }
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    uint64_t hash;
    std::vector<uint64_t> values;
    std::vector<size_t> list_sizes;
    std::vector<std::pair<const void*, int64_t>> layout;  // the lists' views, one after another
    std::shared_ptr<const Plan> plan;
  };

  static uint64_t mix(uint64_t h, uint64_t x) { return h ^ (x + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2)); }

  static uint64_t hash_of(Lists lists, Values values) {
    uint64_t h = mix(lists.size(), values.size());
    for (uint64_t v : values) h = mix(h, v);
    for (std::span<const TensorView> list : lists) {
      h = mix(h, list.size());
      for (const TensorView& t : list) h = mix(mix(h, reinterpret_cast<uintptr_t>(t.data)), static_cast<uint64_t>(t.numel));
    }
    return h;
  }

  static bool matches(const Entry& e, Lists lists, Values values) {
    if (e.list_sizes.size() != lists.size() || !std::equal(values.begin(), values.end(), e.values.begin(), e.values.end())) {
      return false;
    }
    size_t at = 0, l = 0;
    for (std::span<const TensorView> list : lists) {
      if (e.list_sizes[l++] != list.size()) return false;
      for (const TensorView& t : list) {
        if (e.layout[at].first != t.data || e.layout[at].second != t.numel) return false;
        ++at;
      }
    }
    return true;
  }

  size_t capacity_;
  size_t built_ = 0;
  std::list<Entry> entries_;
};

}  // namespace gradkit::comm
