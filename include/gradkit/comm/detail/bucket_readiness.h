// Which buckets of consecutive gradients are complete within a step: each
// gradient is marked ready once per step, and a bucket completes when its
// last pending gradient is marked. What BucketedAllReduce and the sharded
// optimizer's bucketed reduce-scatter both track.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>
#include <vector>

namespace gradkit::detail {

class BucketReadiness {
 public:
  // Buckets of gradients [first, last), in order, covering 0 .. n - 1.
  void add_bucket(size_t first, size_t last);

  size_t num_buckets() const { return buckets_.size(); }
  size_t bucket_of(size_t gradient) const { return bucket_of_.at(gradient); }
  size_t first(size_t bucket) const { return buckets_.at(bucket).first; }  // gradients [first, last)
  size_t last(size_t bucket) const { return buckets_.at(bucket).last; }
  bool started(size_t bucket) const { return buckets_[bucket].started; }
  void set_started(size_t bucket) { buckets_[bucket].started = true; }

  // Marks `gradient` ready; returns the bucket it completes, if any. Throws
  // invalid_argument, naming `op` and 'gradient', for an index out of range
  // or one already marked in this step (nothing changes then).
  std::optional<size_t> mark(std::string_view op, size_t gradient);
  // Every bucket pending again, none started: the next step.
  void reset();

 private:
  struct Bucket {
    size_t first = 0;
    size_t last = 0;
    size_t pending = 0;
    bool started = false;
  };
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<bool> ready_;
};

}  // namespace gradkit::detail
