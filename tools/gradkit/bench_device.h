// What the benchmark needs of a device: memory, random fill, a median timer
// and the measured bandwidths (copy, and the STREAM-like triad that every
// row is compared with).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "gradkit/core/tensor.h"

namespace gradkit::tool {

class BenchDevice {
 public:
  virtual ~BenchDevice() = default;
  virtual Device device() const = 0;
  virtual std::string description() const = 0;
  // Memory owned by this object until it is destroyed.
  virtual void* allocate(size_t bytes) = 0;
  // Uniform values in [-1, 1) (in [0, 1) if `positive`) from `seed`.
  virtual void fill_random(void* data, int64_t numel, DType dtype, uint64_t seed, bool positive = false) = 0;
  // Frees everything allocate() returned.
  virtual void release_all() = 0;
  // Median time of `reps` runs of fn after `warmup` runs, in milliseconds
  // (device events around each run on CUDA).
  virtual double median_ms(const std::function<void()>& fn, int warmup, int reps) = 0;
  // Copy bandwidth in GB/s counting bytes read plus bytes written, measured
  // now over `bytes`-sized buffers.
  virtual double copy_bandwidth_gbs(size_t bytes, int reps) = 0;
  // STREAM's triad a[i] = b[i] + s * c[i] over three f32 arrays of `bytes`
  // each, on every core (CPU) or the whole GPU: the best of `reps` runs, in
  // GB/s counting 3 * bytes per run (two read, one written), as STREAM does.
  // The floor a bandwidth-bound kernel is measured against.
  virtual double triad_bandwidth_gbs(size_t bytes, int reps) = 0;
  virtual Stream stream() const = 0;
  virtual void synchronize() = 0;
};

std::unique_ptr<BenchDevice> make_cpu_bench_device();
// Throws gradkit::Error if CUDA is unavailable.
std::unique_ptr<BenchDevice> make_cuda_bench_device(int index);

}  // namespace gradkit::tool
