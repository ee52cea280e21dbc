// gradkit-bench-adasum: Adasum of the BERT-large gradient list (389
// tensors, 334,092,288 elements) against a flat all-reduce of the same
// bytes, in the same run, on the same communicator and stream. Prints, for
// each, the median time, the bytes each rank sends and the bus bandwidth
// (bytes sent per rank / time, which for a ring all-reduce is NCCL's
// "busbw": 2 (P - 1) / P of the buffer per rank).
//
//   mpiexec -n 2 build/tools/gradkit/gradkit-bench-adasum
//       [--backend nccl|mpi] [--dtype f32|f16|bf16|f64] [--warmup 3] [--reps 20]
//       [--hierarchical] [--ranks-per-node L] [--scale D] [--non-blocking-calls]
//
// The NCCL backend (the default where built) needs a GPU per local rank; the
// MPI backend runs on host memory, by default with every size divided by 16.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench_device.h"
#include "gradkit/comm/adasum.h"
#include "gradkit/comm/communicator.h"
#include "gradkit/core/error.h"
#include "workloads.h"

namespace gradkit::tool {
namespace {

struct Settings {
  std::string backend = has_nccl_communicator() && cuda_device_count() > 0 ? "nccl" : "mpi";
  DType dtype = DType::f32;
  int warmup = 3;
  int reps = 20;
  AdasumOptions adasum;
  int64_t scale = 0;  // 0: 1 on the GPU, 16 on the host
  CommunicatorOptions options;  // --non-blocking-calls: options.blocking_calls = false
};

[[noreturn]] void usage(const std::string& why) {
  throw Error(ErrorCode::invalid_argument,
              "gradkit-bench-adasum: " + why +
                  " (usage: [--backend nccl|mpi] [--dtype f32|f16|bf16|f64] [--warmup N] [--reps N] "
                  "[--hierarchical] [--ranks-per-node L] [--scale D] [--non-blocking-calls])");
}

Settings parse(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(arg + " needs a value");
      return argv[++i];
    };
    auto number = [&](long long minimum) {
      const std::string text = value();
      char* end = nullptr;
      const long long n = std::strtoll(text.c_str(), &end, 10);
      if (end == text.c_str() || *end != '\0' || n < minimum) {
        usage(arg + " is '" + text + "', expected an integer >= " + std::to_string(minimum));
      }
      return n;
    };
    if (arg == "--backend") {
      s.backend = value();
      if (s.backend != "nccl" && s.backend != "mpi") usage("--backend is '" + s.backend + "', expected nccl or mpi");
    } else if (arg == "--dtype") {
      const std::string name = value();
      bool found = false;
      for (DType d : kAllDTypes) {
        if (dtype_name(d) == name) s.dtype = d, found = true;
      }
      if (!found) usage("--dtype is '" + name + "', expected f32, f16, bf16 or f64");
    } else if (arg == "--warmup") {
      s.warmup = static_cast<int>(number(0));
    } else if (arg == "--reps") {
      s.reps = static_cast<int>(number(1));
    } else if (arg == "--hierarchical") {
      s.adasum.hierarchical = true;
    } else if (arg == "--ranks-per-node") {
      s.adasum.ranks_per_node = static_cast<int>(number(1));
    } else if (arg == "--scale") {
      s.scale = number(1);
    } else if (arg == "--blocking-calls" || arg == "--non-blocking-calls") {
      s.options.blocking_calls = arg == "--blocking-calls";
    } else {
      usage("unknown argument '" + arg + "'");
    }
  }
  return s;
}

struct Row {
  std::string op;
  double ms;
  double bytes_sent;  // per rank
};

int run(int argc, char** argv) {
  const Settings s = parse(argc, argv);
  std::unique_ptr<Communicator> comm =
      s.backend == "nccl" ? create_nccl_communicator(s.options) : create_mpi_communicator(s.options);
  std::unique_ptr<BenchDevice> device =
      comm->device().is_cuda() ? make_cuda_bench_device(comm->device().index) : make_cpu_bench_device();
  const int64_t scale = s.scale > 0 ? s.scale : (comm->device().is_cuda() ? 1 : 16);
  const Workload workload = scale == 1 ? bert_large() : scaled(bert_large(), scale);
  const int64_t total = workload.total();
  const size_t element = dtype_size(s.dtype);
  const size_t bytes = static_cast<size_t>(total) * element;

  // The list back to back in one allocation (as a gradient arena lays it
  // out), and a separate flat buffer of the same bytes for the all-reduce.
  auto* base = static_cast<unsigned char*>(device->allocate(bytes));
  std::vector<TensorView> list;
  size_t offset = 0;
  for (int64_t n : workload.sizes) {
    list.push_back(TensorView{base + offset, n, s.dtype, comm->device()});
    offset += static_cast<size_t>(n) * element;
  }
  const TensorView flat{device->allocate(bytes), total, s.dtype, comm->device()};
  device->fill_random(base, total, s.dtype, 1000 + static_cast<uint64_t>(comm->rank()));
  device->fill_random(flat.data, total, s.dtype, 2000 + static_cast<uint64_t>(comm->rank()));

  const Stream stream = device->stream();
  AdasumPlan plan(*comm, list, s.adasum);
  std::vector<Row> rows;
  comm->barrier();
  rows.push_back({s.adasum.hierarchical ? "adasum-hier" : "adasum",
                  device->median_ms([&] { plan.run(stream); }, s.warmup, s.reps),
                  static_cast<double>(plan.bytes_sent())});
  comm->wait(stream);
  comm->barrier();
  // Each rank of a ring all-reduce sends 2 (P - 1) / P of the buffer.
  const double ring_bytes = 2.0 * (comm->size() - 1) / comm->size() * static_cast<double>(bytes);
  rows.push_back({"all-reduce", device->median_ms([&] { comm->all_reduce_buffer(flat, flat, ReduceOp::sum, stream); },
                                                  s.warmup, s.reps),
                  ring_bytes});
  comm->wait(stream);

  if (comm->rank() == 0) {
    std::printf("gradkit-bench-adasum: %s%s, %d ranks (%d per host), %s; %s: %zu tensors, %lld elements, %.1f MiB; "
                "median of %d after %d warm-up\n",
                std::string(comm->backend_name()).c_str(), s.options.blocking_calls ? " (blocking calls)" : " (non-blocking calls)",
                comm->size(), comm->local_size(),
                device->description().c_str(), workload.name.c_str(), workload.sizes.size(),
                static_cast<long long>(total), static_cast<double>(bytes) / (1 << 20), s.reps, s.warmup);
    std::printf("%-12s %10s %14s %10s %12s\n", "op", "ms", "MB sent/rank", "bus GB/s", "vs all-reduce");
    for (const Row& r : rows) {
      std::printf("%-12s %10.3f %14.1f %10.1f %11.2fx\n", r.op.c_str(), r.ms, r.bytes_sent / 1e6,
                  r.bytes_sent / (r.ms * 1e6), r.ms / rows.back().ms);
    }
  }
  device->release_all();
  return 0;
}

}  // namespace
}  // namespace gradkit::tool

int main(int argc, char** argv) {
  gradkit::MpiEnvironment mpi(&argc, &argv);
  try {
    return gradkit::tool::run(argc, argv);
  } catch (const gradkit::Error& e) {
    std::fprintf(stderr, "gradkit-bench-adasum: %s\n", e.what());
    return 1;
  }
}
