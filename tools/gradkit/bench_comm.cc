// gradkit-bench-comm: the collectives of gradkit's NCCL communicator beside a
// single raw NCCL call on one flat buffer of the same bytes (made here, on the
// same NCCL, in the same run), and beside torch.distributed when its results
// are given (bench/torch_dist_bench.py, run under the same launcher first;
// scripts/gpu comm bench does both). Run as
//   mpiexec -n N gradkit-bench-comm [--sizes 1,16,256,1024] [--reps 20]
// Rank 0 prints; every time is the median over reps of the slowest rank's
// time in that rep (CUDA events, after warm-up, ranks synchronized before
// each rep).
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_device.h"
#include "gradkit/comm/communicator.h"
#include "gradkit/comm/gradient_arena.h"
#include "gradkit/core/error.h"
#include "options.h"
#include "rank_main.h"
#include "torch_results.h"
#include "workloads.h"

namespace gradkit::tool {
namespace {

void check_cuda(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw Error(ErrorCode::cuda_error, std::string(call) + " failed: " + cudaGetErrorString(status));
  }
}
void check_nccl(ncclResult_t status, const char* call) {
  if (status != ncclSuccess) {
    throw Error(ErrorCode::nccl_error, std::string(call) + " failed: " + ncclGetErrorString(status));
  }
}
#define BENCH_CUDA(call) check_cuda((call), #call)
#define BENCH_NCCL(call) check_nccl((call), #call)

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

struct Timing {
  double ms = 0;       // median over reps of the slowest rank's device time
  double host_us = 0;  // median over reps of the slowest rank's time in the call itself
};

class Timer {
 public:
  Timer(cudaStream_t stream, int warmup, int reps) : stream_(stream), warmup_(warmup), reps_(reps) {
    BENCH_CUDA(cudaEventCreate(&start_));
    BENCH_CUDA(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }

  Timing time(const std::function<void()>& fn) {
    for (int i = 0; i < warmup_; ++i) fn();
    BENCH_CUDA(cudaStreamSynchronize(stream_));
    std::vector<double> ms(static_cast<size_t>(reps_)), host(static_cast<size_t>(reps_));
    for (int i = 0; i < reps_; ++i) {
      BENCH_CUDA(cudaStreamSynchronize(stream_));
      MPI_Barrier(MPI_COMM_WORLD);
      BENCH_CUDA(cudaEventRecord(start_, stream_));
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      const auto t1 = std::chrono::steady_clock::now();
      BENCH_CUDA(cudaEventRecord(stop_, stream_));
      BENCH_CUDA(cudaEventSynchronize(stop_));
      float elapsed = 0;
      BENCH_CUDA(cudaEventElapsedTime(&elapsed, start_, stop_));
      ms[static_cast<size_t>(i)] = elapsed;
      host[static_cast<size_t>(i)] = std::chrono::duration<double, std::micro>(t1 - t0).count();
    }
    MPI_Allreduce(MPI_IN_PLACE, ms.data(), reps_, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, host.data(), reps_, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return {median(ms), median(host)};
  }

 private:
  cudaStream_t stream_;
  int warmup_, reps_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

std::string size_name(size_t bytes) {
  if (bytes < (size_t{1} << 20)) return std::to_string(bytes >> 10) + " KiB";
  if (bytes >= (size_t{1} << 30) && bytes % (size_t{1} << 30) == 0) return std::to_string(bytes >> 30) + " GiB";
  return std::to_string(bytes >> 20) + " MiB";
}

double bus_gbs(size_t bytes, double ms, double factor) { return ms > 0 ? bytes * factor / (ms * 1e6) : 0; }

struct Settings {
  std::vector<size_t> sizes;  // bytes
  std::vector<std::string> collectives;
  std::vector<std::string> lists;  // "bert", "small"
  std::vector<size_t> directs;    // direct_tensor_bytes to try on the scattered list
  std::vector<size_t> pipelines;  // fusion_pipeline_bytes to try with everything packed
  int warmup;
  int reps;
  std::map<std::string, double> torch;
};

class CommBench {
 public:
  CommBench(const Settings& s, Communicator& comm, BenchDevice& dev, ncclComm_t raw)
      : s_(s), comm_(comm), dev_(dev), raw_(raw), stream_(static_cast<cudaStream_t>(dev.stream().handle)),
        timer_(stream_, s.warmup, s.reps), n_(comm.size()), root_(comm.rank() == 0) {}

  void flat_rows() {
    if (root_) {
      std::printf("\n%-15s %8s | %10s %10s %9s | %10s %10s %9s | %7s | %10s %10s\n", "collective", "size",
                  "gradkit ms", "busbw GB/s", "host us", "NCCL ms", "busbw GB/s", "host us", "vs NCCL", "torch ms",
                  "busbw GB/s");
    }
    for (const std::string& c : s_.collectives) {
      for (size_t bytes : s_.sizes) flat_row(c, bytes);
    }
  }

  // The list `w` all-reduced every way: one flat buffer, the arena, the
  // scattered tensors with each direct threshold and each pipeline; the
  // issue's targets (and torch's rows) for BERT-large.
  void list_rows(const Workload& w, bool bert) {
    const int64_t total = w.total();
    const size_t bytes = static_cast<size_t>(total) * sizeof(float);
    const double factor = 2.0 * (n_ - 1) / n_;
    if (root_) {
      std::printf("\nall-reduce of the %s list: %zu f32 tensors, %lld elements (%.1f MiB)\n", w.name.c_str(),
                  w.sizes.size(), static_cast<long long>(total), bytes / 1048576.0);
      std::printf("  %-44s %10s %10s %8s %10s\n", "way", "ms", "busbw GB/s", "x flat", "host us");
    }
    auto print = [&](const std::string& way, const Timing& t, double flat_ms) {
      if (!root_) return;
      std::printf("  %-44s %10.3f %10.1f %8.3f", way.c_str(), t.ms, bus_gbs(bytes, t.ms, factor), t.ms / flat_ms);
      if (t.host_us > 0) std::printf(" %10.1f", t.host_us);
      std::printf("\n");
    };

    // One flat buffer through one raw NCCL call: the reference.
    auto* flat = static_cast<float*>(dev_.allocate(bytes));
    dev_.fill_random(flat, total, DType::f32, 11 + static_cast<uint64_t>(comm_.rank()));
    const Timing raw = timer_.time([&] { nccl_all_reduce(flat, flat, total); });
    print("raw NCCL, one flat buffer (1 call)", raw, raw.ms);

    {
      const GradientArena arena(comm_.device(), DType::f32, w.sizes);
      const TensorView range = arena.flat();
      dev_.fill_random(range.data, range.numel, DType::f32, 21 + static_cast<uint64_t>(comm_.rank()));
      const Timing t = timer_.time([&] { arena.all_reduce(comm_, ReduceOp::sum, dev_.stream()); });
      print("gradkit GradientArena (contiguous, 1 call)", t, raw.ms);
      if (root_) {
        std::printf("    (the arena's range, 256-byte gaps included, is %.1f MiB)\n", range.bytes() / 1048576.0);
        if (bert) {
          std::printf("    target <= 1.03x flat: %s (%.3fx)\n", t.ms <= 1.03 * raw.ms ? "met" : "NOT met",
                      t.ms / raw.ms);
        }
      }
    }

    // Separate tensors, 256 bytes apart: the fusion-buffer path.
    std::vector<size_t> offsets;
    size_t extent = 0;
    for (int64_t n : w.sizes) {
      offsets.push_back(extent);
      extent += (static_cast<size_t>(n) * sizeof(float) + 255) / 256 * 256 + 256;
    }
    auto* base = static_cast<unsigned char*>(dev_.allocate(extent));
    dev_.fill_random(base, static_cast<int64_t>(extent / sizeof(float)), DType::f32,
                     31 + static_cast<uint64_t>(comm_.rank()));
    std::vector<TensorView> list;
    for (size_t i = 0; i < w.sizes.size(); ++i) list.push_back({base + offsets[i], w.sizes[i], DType::f32, comm_.device()});

    // Each (direct threshold, pipeline piece) pair: large tensors where they
    // lie with the rest packed; then, with no direct tensors, everything
    // through the fusion buffer in pieces.
    std::vector<std::pair<size_t, size_t>> ways;
    for (size_t direct : s_.directs) {
      if (direct > 0) ways.emplace_back(direct, CommunicatorOptions{}.fusion_pipeline_bytes);
    }
    for (size_t pipeline : s_.pipelines) ways.emplace_back(0, pipeline);
    double best = 0;
    for (const auto& [direct, pipeline] : ways) {
      comm_.set_direct_tensor_bytes(direct);
      comm_.set_fusion_pipeline_bytes(pipeline);
      comm_.all_reduce(list, ReduceOp::sum, dev_.stream());  // the list's first call plans it
      BENCH_CUDA(cudaStreamSynchronize(stream_));
      const size_t plans_before = comm_.fusion_plans_built();
      const Timing t = timer_.time([&] { comm_.all_reduce(list, ReduceOp::sum, dev_.stream()); });
      const size_t new_plans = comm_.fusion_plans_built() - plans_before;
      const std::string way =
          direct > 0 ? "gradkit scattered, tensors >= " + size_name(direct) + " direct"
                     : "gradkit scattered, all packed, " +
                           (pipeline == 0 ? std::string("1 piece") : "pieces of " + size_name(pipeline));
      print(way, t, raw.ms);
      const double error = check_scattered(list, flat, total);
      if (root_) {
        std::printf("    plans built during the timed calls: %zu; fusion buffer %.1f MiB; result vs the raw flat "
                    "all-reduce of the same inputs: max |diff| / max |x| = %.2e %s\n",
                    new_plans, comm_.fusion_buffer_bytes() / 1048576.0, error, error <= 1e-5 ? "(ok)" : "(WRONG)");
      }
      if (best == 0 || t.ms < best) best = t.ms;
    }
    comm_.set_direct_tensor_bytes(CommunicatorOptions{}.direct_tensor_bytes);
    comm_.set_fusion_pipeline_bytes(CommunicatorOptions{}.fusion_pipeline_bytes);
    if (root_ && bert && best > 0) {
      std::printf("    target <= 1.10x flat (best of the above): %s (%.3fx)\n", best <= 1.10 * raw.ms ? "met" : "NOT met",
                  best / raw.ms);
    }

    for (const auto& [key, way] : bert ? std::vector<std::pair<std::string, std::string>>{
             {"bert-flat", "torch all_reduce, one flat buffer"},
             {"bert-coalesced", "torch all_reduce_coalesced"},
             {"bert-per-tensor", "torch all_reduce, tensor by tensor"}}
                                      : std::vector<std::pair<std::string, std::string>>{}) {
      const auto it = s_.torch.find(key);
      if (it != s_.torch.end()) print(way, Timing{it->second, 0}, raw.ms);
    }
    dev_.release_all();
  }

 private:
  void nccl_all_reduce(const void* in, void* out, int64_t count) {
    BENCH_NCCL(ncclAllReduce(in, out, static_cast<size_t>(count), ncclFloat32, ncclSum, raw_, stream_));
  }

  void flat_row(const std::string& collective, size_t bytes) {
    const auto count = static_cast<int64_t>(bytes / sizeof(float));
    auto* buffer = static_cast<float*>(dev_.allocate(bytes));
    dev_.fill_random(buffer, count, DType::f32, 1 + static_cast<uint64_t>(comm_.rank()));
    const TensorView view{buffer, count, DType::f32, comm_.device()};
    const std::span<const TensorView> list(&view, 1);
    const int64_t shard = count / n_;
    float* mine = buffer + comm_.rank() * shard;
    Timing ours, raw;
    double factor = static_cast<double>(n_ - 1) / n_;
    if (collective == "all-reduce") {
      factor *= 2;
      ours = timer_.time([&] { comm_.all_reduce(list, ReduceOp::sum, dev_.stream()); });
      raw = timer_.time([&] { nccl_all_reduce(buffer, buffer, count); });
    } else if (collective == "all-gather") {
      ours = timer_.time([&] { comm_.all_gather(list, dev_.stream()); });
      raw = timer_.time([&] {
        BENCH_NCCL(ncclAllGather(mine, buffer, static_cast<size_t>(shard), ncclFloat32, raw_, stream_));
      });
    } else {
      ours = timer_.time([&] { comm_.reduce_scatter(list, ReduceOp::sum, dev_.stream()); });
      raw = timer_.time([&] {
        BENCH_NCCL(ncclReduceScatter(buffer, mine, static_cast<size_t>(shard), ncclFloat32, ncclSum, raw_, stream_));
      });
    }
    dev_.release_all();
    if (!root_) return;
    std::printf("%-15s %8s | %10.4f %10.1f %9.1f | %10.4f %10.1f %9.1f | %6.1f%%", collective.c_str(),
                size_name(bytes).c_str(), ours.ms, bus_gbs(bytes, ours.ms, factor), ours.host_us, raw.ms,
                bus_gbs(bytes, raw.ms, factor), raw.host_us, 100 * raw.ms / ours.ms);
    const auto it = s_.torch.find(collective + "-" + std::to_string(bytes));
    if (it != s_.torch.end()) std::printf(" | %10.4f %10.1f", it->second, bus_gbs(bytes, it->second, factor));
    std::printf("\n");
  }

  // Fresh inputs in the scattered list, the same values packed by hand into
  // the flat buffer; one raw NCCL all-reduce of the flat buffer and one
  // gradkit all-reduce of the list; returns the largest difference over the
  // largest magnitude, the worst over ranks.
  double check_scattered(std::span<const TensorView> list, float* flat, int64_t total) {
    int64_t at = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      dev_.fill_random(list[i].data, list[i].numel, DType::f32, 1000 * (i + 1) + static_cast<uint64_t>(comm_.rank()));
      BENCH_CUDA(cudaMemcpyAsync(flat + at, list[i].data, list[i].bytes(), cudaMemcpyDeviceToDevice, stream_));
      at += list[i].numel;
    }
    nccl_all_reduce(flat, flat, total);
    comm_.all_reduce(list, ReduceOp::sum, dev_.stream());
    BENCH_CUDA(cudaStreamSynchronize(stream_));
    std::vector<float> want(static_cast<size_t>(total)), got(static_cast<size_t>(total));
    BENCH_CUDA(cudaMemcpy(want.data(), flat, want.size() * sizeof(float), cudaMemcpyDeviceToHost));
    at = 0;
    for (const TensorView& t : list) {
      BENCH_CUDA(cudaMemcpy(got.data() + at, t.data, t.bytes(), cudaMemcpyDeviceToHost));
      at += t.numel;
    }
    double diff = 0, scale = 0;
    for (size_t k = 0; k < got.size(); ++k) {
      diff = std::max(diff, static_cast<double>(std::fabs(got[k] - want[k])));
      scale = std::max(scale, static_cast<double>(std::fabs(want[k])));
    }
    double error = scale > 0 ? diff / scale : diff;
    if (!std::isfinite(error)) error = INFINITY;
    MPI_Allreduce(MPI_IN_PLACE, &error, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return error;
  }

  const Settings& s_;
  Communicator& comm_;
  BenchDevice& dev_;
  ncclComm_t raw_;
  cudaStream_t stream_;
  Timer timer_;
  int n_;
  bool root_;
};

// A comma-separated list of whole numbers (validated), each times 2^shift.
std::vector<size_t> shifted(const std::string& list, int shift) {
  std::vector<size_t> out;
  for (const std::string& item : split_list(list)) out.push_back(static_cast<size_t>(std::stoll(item)) << shift);
  return out;
}

int run(int argc, char** argv, bool report) {
  std::string sizes = "1,16,256,1024", collectives = "all-reduce,all-gather,reduce-scatter", lists = "bert,small",
              directs = "1024,64,4096", pipelines = "256,128,0", torch_results;
  Settings s;
  s.warmup = 5;
  s.reps = 20;
  Command command("gradkit-bench-comm",
                  "Time gradkit's NCCL collectives beside raw NCCL and torch.distributed (run under mpiexec).");
  CLI::App& app = command.app();
  app.add_option("--sizes", sizes, "flat buffer sizes in MiB (f32)")->check(list_of(integer(1, 1 << 20)));
  app.add_option("--collectives", collectives, "comma-separated")
      ->check(list_of(one_of({"all-reduce", "all-gather", "reduce-scatter"})));
  app.add_option("--lists", lists,
                 "tensor lists to all-reduce in several ways: bert (BERT-large, 389 tensors, 1274 MiB f32), small "
                 "(10,000 tensors of 1K-64K elements); none for neither")
      ->check(list_of(one_of({"bert", "small", "none"})));
  app.add_option("--direct-kib", directs,
                 "direct_tensor_bytes (KiB) to time the scattered list with: tensors this large are reduced where "
                 "they lie")
      ->check(list_of(integer(1, 1 << 20)));
  app.add_option("--pipeline-mib", pipelines,
                 "fusion_pipeline_bytes (MiB) to time the scattered list with when everything is packed; 0 = one piece")
      ->check(list_of(integer(0, 1 << 20)));
  app.add_option("--warmup", s.warmup, "untimed calls before each row")->check(integer(0, 1000));
  app.add_option("--reps", s.reps, "timed calls per row (the median is reported)")->check(integer(1, 100000));
  app.add_option("--torch-results", torch_results, "results of bench/torch_dist_bench.py to print beside (optional)");
  CommunicatorOptions options;
  app.add_flag("--blocking-calls,!--non-blocking-calls", options.blocking_calls,
               "gradkit's calls on a blocking NCCL communicator with a watchdog (the default) or on a non-blocking "
               "one, polled (CommunicatorOptions::blocking_calls)");
  app.add_option("--cuda-device", options.cuda_device,
                 "the GPU of every rank (default: one per local rank); with scripts/ranks-on-one-gpu, several ranks "
                 "share GPU 0: host times hold, device times do not")
      ->check(integer(0, 1 << 10));
  if (std::optional<int> status = command.parse(std::vector<std::string>(argv + 1, argv + argc), report)) {
    return *status;
  }

  s.sizes = shifted(sizes, 20);
  s.collectives = split_list(collectives);
  for (const std::string& l : split_list(lists)) {
    if (l != "none") s.lists.push_back(l);
  }
  s.directs = shifted(directs, 10);
  s.pipelines = shifted(pipelines, 20);
  s.torch = read_torch_results(torch_results, "gradkit-bench-comm");

  std::unique_ptr<Communicator> comm = create_nccl_communicator(options);
  const int device = comm->device().index;
  std::unique_ptr<BenchDevice> dev = make_cuda_bench_device(device);

  // The reference: a plain NCCL communicator over the same ranks.
  ncclUniqueId id{};
  if (comm->rank() == 0) BENCH_NCCL(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  BENCH_CUDA(cudaSetDevice(device));
  ncclComm_t raw = nullptr;
  BENCH_NCCL(ncclCommInitRank(&raw, comm->size(), id, comm->rank()));

  if (comm->rank() == 0) {
    int version = 0;
    ncclGetVersion(&version);
    const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
    std::printf("gradkit-bench-comm: %d ranks, rank 0 on %s; NCCL %d; NCCL_NVLS_ENABLE=%s; gradkit's calls %s\n",
                comm->size(), dev->description().c_str(), version, nvls != nullptr ? nvls : "(unset)",
                options.blocking_calls ? "blocking, with a watchdog" : "non-blocking, polled (--non-blocking-calls)");
    std::printf("time: median of %d reps (each rep: the slowest rank), after %d warm-up calls; busbw: all-reduce "
                "bytes*2(n-1)/n/time, all-gather and reduce-scatter bytes*(n-1)/n/time (bytes: the whole "
                "buffer)\n",
                s.reps, s.warmup);
    if (s.torch.empty()) std::printf("torch.distributed: not run (no --torch-results)\n");
  }
  {
    CommBench bench(s, *comm, *dev, raw);
    bench.flat_rows();
    for (const std::string& l : s.lists) bench.list_rows(l == "bert" ? bert_large() : small_tensors(10000), l == "bert");
  }
  BENCH_CUDA(cudaDeviceSynchronize());
  ncclCommDestroy(raw);
  dev.reset();
  comm.reset();
  return 0;
}

}  // namespace
}  // namespace gradkit::tool

int main(int argc, char** argv) {
  return gradkit::tool::rank_main("gradkit-bench-comm", argc, argv, gradkit::tool::run);
}
