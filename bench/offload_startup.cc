// How long making an OffloadedAdam takes, phase by phase (issue 37: 74 s
// for a 6.74B-parameter bf16 model, where torchao's CPUOffloadOptimizer
// took 16 s). For each size (GiB of bf16 weights, in transformer-shaped
// tensors of width 4096 on cuda:0) it times, each alone and then freed
// (the allocations twice: the first may pay for reclaiming page cache):
//   - a pinned buffer of the gradient staging's size (2 B/param), from
//     cudaHostAlloc (as before) and from host memory + cudaHostRegister
//     (Buffer::pinned now), the latter with and without huge pages;
//   - a plain host buffer of the masters' size (4 B/param), zero-filled by
//     one thread (aligned_alloc + memset, as before) and by Buffer now;
//   - the weights to pinned staging: a synchronous copy per tensor (as
//     before) and every copy queued on one stream, waited for once (now);
//   - the bf16 -> f32 cast of the staged weights into the masters (cast_into);
// then the whole constructor (f32 moments), refresh_masters (its copy and
// cast), the first and second step (every bucket handed by finish), and the
// destructor. One row per phase: seconds, GB, GB/s.
//
// Usage (on a GPU machine; scripts/gpu offload startup builds it):
//   build/bench/offload_startup [GiB ...]      default: 2 8
// Host memory needed: about 7x the weights' size (masters 2x, moments 4x,
// the staging 1x; the phases alone need 3x, before); GPU memory 2x
// (weights and gradients).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/host_memory.h"
#include "core/pinned.h"
#include "gradkit/core/memory.h"
#include "gradkit/optim/offloaded.h"
#include "optim/moment_storage.h"
#include "optim/offload_lanes.h"

using namespace gradkit;

namespace {

constexpr int64_t kWidth = 4096;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double timed(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return seconds_since(start);
}

// One table row; `freed_s` < 0: not freed here.
void row(double gib, const std::string& phase, size_t bytes, double s, double freed_s = -1) {
  const double gb = static_cast<double>(bytes) / 1e9;
  char freed[32] = "";
  if (freed_s >= 0) std::snprintf(freed, sizeof freed, "%.3f", freed_s);
  std::printf("| %g | %s | %.2f | %.3f | %.1f | %s |\n", gib, phase.c_str(), gb, s, s > 0 ? gb / s : 0.0, freed);
  std::fflush(stdout);
}

// Times making an owner (allocation and zero fill) and dropping it.
template <class Make>
void time_allocation(double gib, const std::string& phase, size_t bytes, const Make& make) {
  auto start = std::chrono::steady_clock::now();
  auto owner = make();
  const double made = seconds_since(start);
  start = std::chrono::steady_clock::now();
  owner = {};
  row(gib, phase, bytes, made, seconds_since(start));
}

std::string first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line.empty() ? "(unknown)" : line;
}

uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// A model's tensors of `gib` GiB of bf16 in all: layers of a width-4096
// transformer (qkv, its bias, the projection, two norms, the MLP's two
// matrices and its bias), the rest in one embedding-like tensor.
std::vector<int64_t> model_shapes(double gib) {
  const auto total = static_cast<int64_t>(gib * double(int64_t{1} << 30) / 2);
  const int64_t d = kWidth;
  const std::vector<int64_t> layer = {3 * d * d, 3 * d, d * d, d, d, 4 * d * d, 4 * d, 4 * d * d};
  int64_t per_layer = 0;
  for (int64_t n : layer) per_layer += n;
  std::vector<int64_t> shapes;
  int64_t used = 0;
  while (used + per_layer <= total) {
    shapes.insert(shapes.end(), layer.begin(), layer.end());
    used += per_layer;
  }
  if (total > used) shapes.push_back(total - used);
  return shapes;
}

// Device tensors of those sizes, filled from a block of random bf16 values.
std::vector<TensorView> device_tensors(const std::vector<int64_t>& shapes, std::vector<Buffer>& owners,
                                       const std::vector<uint16_t>& block) {
  std::vector<TensorView> views;
  for (int64_t n : shapes) {
    owners.emplace_back(Device::cuda(0), static_cast<size_t>(n) * 2);
    TensorView v = owners.back().view(DType::bf16, 0, n);
    for (int64_t at = 0; at < n; at += static_cast<int64_t>(block.size())) {
      const int64_t count = std::min<int64_t>(n - at, static_cast<int64_t>(block.size()));
      copy_from_host(static_cast<uint16_t*>(v.data) + at, v.device, block.data(), static_cast<size_t>(count) * 2);
    }
    views.push_back(v);
  }
  return views;
}

void run(double gib) {
  const std::vector<int64_t> shapes = model_shapes(gib);
  int64_t params = 0;
  for (int64_t n : shapes) params += n;
  std::printf("\n%g GiB of bf16 weights: %lld parameters in %zu tensors\n\n", gib, static_cast<long long>(params),
              shapes.size());
  std::printf("| GiB | phase | GB | s | GB/s | freed in s |\n| --- | --- | --- | --- | --- | --- |\n");

  std::mt19937 rng(37);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<uint16_t> block(size_t{1} << 24);
  for (uint16_t& b : block) b = to_bf16(normal(rng));
  std::vector<Buffer> owners;
  const std::vector<TensorView> weights = device_tensors(shapes, owners, block);
  for (uint16_t& b : block) b = to_bf16(normal(rng) * 1e-3f);
  const std::vector<TensorView> grads = device_tensors(shapes, owners, block);
  const size_t weight_bytes = static_cast<size_t>(params) * 2, master_bytes = static_cast<size_t>(params) * 4;

  // Twice: the first allocations of a process may find the host's memory
  // still held by its page cache, and pay for reclaiming it.
  for (const char* round : {"", ", again"}) {
    const auto name = [round](const char* phase) { return std::string(phase) + round; };
    time_allocation(gib, name("pinned, cudaHostAlloc + memset (before)"), weight_bytes,
                    [&] { return detail::allocate_pinned(weight_bytes); });
    time_allocation(gib, name("pinned, mapped by every core + cudaHostRegister (now)"), weight_bytes,
                    [&] { return detail::allocate_registered(weight_bytes); });
    time_allocation(gib, name("pinned, the same without huge pages"), weight_bytes,
                    [&] { return detail::allocate_registered(weight_bytes, false); });
    time_allocation(gib, name("host, aligned_alloc + memset in one thread (before)"), master_bytes, [&] {
      void* p = std::aligned_alloc(256, (master_bytes + 255) / 256 * 256);
      if (p == nullptr) throw std::bad_alloc();
      std::memset(p, 0, master_bytes);
      return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
    });
    time_allocation(gib, name("host, mapped by every core (Buffer now)"), master_bytes,
                    [&] { return detail::allocate_host(master_bytes); });
    time_allocation(gib, name("host, the same without huge pages"), master_bytes,
                    [&] { return detail::allocate_host(master_bytes, false); });
  }

  {
    Buffer staging = allocate_pinned_moments(weights, DType::bf16, 1);
    const std::vector<TensorView> staged = moment_views(staging, weights, DType::bf16, 1, 0);
    Buffer masters_storage = allocate_moments(Device::cpu(), weights, DType::f32, 1);
    const std::vector<TensorView> masters = moment_views(masters_storage, weights, DType::f32, 1, 0);
    row(gib, "weights to host, a synchronous copy per tensor (before)", weight_bytes, timed([&] {
          for (size_t i = 0; i < weights.size(); ++i) {
            copy_to_host(staged[i].data, weights[i].data, weights[i].bytes(), weights[i].device);
          }
        }));
    detail::OffloadLanes lanes("offload_startup", Device::cuda(0), 1);
    row(gib, "weights to host, queued on one stream, one wait (now)", weight_bytes, timed([&] {
          synchronize(Device::cuda(0));
          for (size_t i = 0; i < weights.size(); ++i) {
            lanes.copy(detail::OffloadLanes::to_host, staged[i].data, weights[i].data, weights[i].bytes());
          }
          lanes.synchronize();
        }));
    row(gib, "bf16 -> f32 cast (cast_into, the caller's OpenMP team)", weight_bytes + master_bytes,
        timed([&] { cast_into(masters, staged); }));
  }

  std::vector<AdamGroup> groups(1);
  groups[0].params = weights;
  groups[0].grads = grads;
  groups[0].hyperparameters.lr = 1e-4f;
  std::unique_ptr<OffloadedAdam> opt;
  const double made = timed([&] { opt = std::make_unique<OffloadedAdam>(groups); });
  row(gib, "constructor (f32 moments; host bytes)", opt->host_bytes(), made);
  row(gib, "  refresh_masters (the constructor's copy and cast)", weight_bytes, timed([&] { opt->refresh_masters(); }));
  for (const char* which : {"first step (finish hands every bucket)", "second step"}) {
    // GB: what the CPU step reads and writes (f32 moments, bf16 gradients and copy: 28 B/param)
    row(gib, which, static_cast<size_t>(params) * 28, timed([&] {
          opt->finish();
          opt->synchronize();
          synchronize(Device::cuda(0));
        }));
  }
  const size_t held = opt->host_bytes();  // before the reset: the arguments' order is unspecified
  row(gib, "destructor", held, timed([&] { opt.reset(); }));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<double> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atof(argv[i]));
  if (sizes.empty()) sizes = {2, 8};
  if (cuda_device_count() == 0) {
    std::printf("offload_startup: no CUDA device visible (or gradkit built without CUDA); nothing measured\n");
    return 0;
  }
  std::printf("host: %u hardware threads; transparent huge pages: enabled %s, defrag %s\n",
              std::thread::hardware_concurrency(),
              first_line("/sys/kernel/mm/transparent_hugepage/enabled").c_str(),
              first_line("/sys/kernel/mm/transparent_hugepage/defrag").c_str());
  try {
    for (double gib : sizes) run(gib);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "offload_startup: %s\n", e.what());
    return 1;
  }
  return 0;
}
