// gradkit-bench-sharded: the sharded Adam (or LAMB) step (ZeRO stage 1) on
// the BERT-large list (389 tensors, 334,092,288 elements) against its parts
// and against the unsharded step, in the same run, on the same communicator
// and stream:
//   - reduce-scatter of the gradients and all-gather of the weights (the
//     whole padded buffers, one collective each), and the optimizer over the
//     whole list on one rank: the series sum RS + AG + update / P is what a
//     sharded step with no overlap and no overhead would cost;
//   - the sharded step (reduce-scatter, check, update of the shard, all-gather);
//   - the unsharded step: all-reduce, then the optimizer over the whole list.
// Each row prints the median time, the bytes the row moves per rank and
// their rate. The optimizer state each rank holds is printed against 12
// (f16/bf16 model) or 8 (f32) bytes per parameter / P.
//
//   mpiexec -n N build/tools/gradkit/gradkit-bench-sharded [--backend nccl|mpi]
//       [--optimizer adam|lamb] [--model f32|f16|bf16] [--bucket-mib 64] [--update-parts 8]
//       [--non-blocking-calls] [--warmup 3] [--reps 20] [--scale D]
//
// The NCCL backend (the default where built) needs a GPU per local rank; the
// MPI backend runs on host memory, by default with every size divided by 16.
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_device.h"
#include "cli.h"
#include "gradkit/comm/gradient_arena.h"
#include "gradkit/core/error.h"
#include "gradkit/optim/sharded.h"
#include "options.h"
#include "rank_main.h"
#include "torch_results.h"
#include "workloads.h"

namespace gradkit::tool {
namespace {

struct Row {
  std::string what;
  double ms;
  double bytes;  // moved per rank: sent for collectives, read + written for Adam
};

int run(int argc, char** argv, bool report) {
  std::string backend = has_nccl_communicator() && cuda_device_count() > 0 ? "nccl" : "mpi", model = "f32",
              optimizer = "adam", torch_results;
  int warmup = 3, reps = 20, update_parts = ShardedOptions{}.update_parts;
  int64_t scale = 0, bucket_mib = 64;
  Command command("gradkit-bench-sharded",
                  "Time the sharded Adam step on BERT-large against its parts and the unsharded step (under mpiexec).");
  CLI::App& app = command.app();
  app.add_option("--backend", backend, "nccl (a GPU per rank) or mpi (host memory)")->check(one_of({"nccl", "mpi"}));
  app.add_option("--optimizer", optimizer, "adam or lamb")->check(one_of({"adam", "lamb"}));
  app.add_option("--model", model, "the weights' dtype (f16/bf16: f32 masters, f32 gradients)")
      ->check(one_of({"f32", "f16", "bf16"}));
  app.add_option("--bucket-mib", bucket_mib,
                 "bucket size in MiB of f32 gradients (0: one bucket; each bucket's all-gather overlaps the next "
                 "bucket's update)")
      ->check(integer(0, 1 << 20));
  app.add_option("--update-parts", update_parts,
                 "the shard's update in at most this many launches (each part's buckets all-gathered while the "
                 "next is updated)")
      ->check(integer(1, 1 << 20));
  app.add_option("--warmup", warmup, "untimed runs before each row")->check(integer(0, 1000));
  app.add_option("--reps", reps, "timed runs per row (the median is reported)")->check(integer(1, 100000));
  app.add_option("--scale", scale, "divide every tensor size by this (0: 1 on the GPU, 16 on the host)")
      ->check(integer(0, 1 << 20));
  CommunicatorOptions comm_options;
  app.add_flag("--blocking-calls,!--non-blocking-calls", comm_options.blocking_calls,
               "the calls on a blocking NCCL communicator with a watchdog (the default) or on a non-blocking one, "
               "polled (CommunicatorOptions::blocking_calls)");
  app.add_option("--torch-results", torch_results,
                 "bench/torch_dist_bench.py --zero on's results (ZeroRedundancyOptimizer and its parts), printed beside");
  if (std::optional<int> status = command.parse(std::vector<std::string>(argv + 1, argv + argc), report)) {
    return *status;
  }

  std::unique_ptr<Communicator> comm =
      backend == "nccl" ? create_nccl_communicator(comm_options) : create_mpi_communicator(comm_options);
  std::unique_ptr<BenchDevice> device =
      comm->device().is_cuda() ? make_cuda_bench_device(comm->device().index) : make_cpu_bench_device();
  const Device where = comm->device();
  const Stream stream = device->stream();
  // A second stream for the sharded step's all-gathers (a second device
  // object owns it; nothing else of it is used).
  const std::unique_ptr<BenchDevice> side =
      comm->device().is_cuda() ? make_cuda_bench_device(comm->device().index) : nullptr;
  const Stream communication = side ? side->stream() : Stream{};
  const int ranks = comm->size();
  const int64_t divisor = scale > 0 ? scale : (where.is_cuda() ? 1 : 16);
  const Workload workload = divisor == 1 ? bert_large() : scaled(bert_large(), divisor);
  const DType weight_dtype = model == "f16" ? DType::f16 : model == "bf16" ? DType::bf16 : DType::f32;
  const ShardedLayout layout = ShardedLayout::make(workload.sizes, ranks, (bucket_mib << 20) / 4);
  const GradientArena weights(where, weight_dtype, layout), grads(where, DType::f32, layout);
  device->fill_random(weights.buffer().data(), layout.total, weight_dtype, 7);  // the same on every rank
  device->fill_random(grads.buffer().data(), layout.total, DType::f32, 100 + static_cast<uint64_t>(comm->rank()));
  const double n = static_cast<double>(workload.total());
  const double gbytes = 4 * static_cast<double>(layout.total), wbytes = static_cast<double>(dtype_size(weight_dtype)) *
                                                                           static_cast<double>(layout.total);
  const double share = static_cast<double>(ranks - 1) / ranks;
  std::vector<Row> rows;
  auto time = [&](const std::string& what, double bytes, const std::function<void()>& fn) {
    comm->barrier();
    rows.push_back({what, device->median_ms(fn, warmup, reps), bytes});
    comm->wait(stream);
  };

  // The parts: whole-buffer collectives, and Adam over every tensor (what
  // one rank would do unsharded; a sharded rank does 1/P of it).
  const int64_t slice = layout.total / ranks;  // every bucket splits evenly, so the whole buffer does
  const TensorView all_grads = grads.buffer().view(DType::f32, 0, layout.total);
  const TensorView all_weights = weights.buffer().view(weight_dtype, 0, layout.total);
  auto mine = [&](const TensorView& t) {
    return TensorView{static_cast<unsigned char*>(t.data) + static_cast<size_t>(slice * comm->rank()) * dtype_size(t.dtype),
                      slice, t.dtype, t.device};
  };
  time("reduce-scatter (gradients)", share * gbytes,
       [&] { comm->reduce_scatter_buffer(all_grads, mine(all_grads), ReduceOp::average, stream); });
  time("all-gather (weights)", share * wbytes, [&] { comm->all_gather_buffer(mine(all_weights), all_weights, stream); });
  // Per parameter, Adam: the gradient read, the f32 weight (or master) and
  // both moments read and written, the f16/bf16 copy written. LAMB: pass 1
  // as Adam's without the weight's write, pass 2 reads w, m, v, writes w.
  const double copy_bytes = weight_dtype == DType::f32 ? 0.0 : dtype_size(weight_dtype);
  const double update_bytes = n * ((optimizer == "adam" ? 4 + 8 + 16 : 4 + 4 + 16 + 4 + 8 + 4) + copy_bytes);
  auto sharded_rows = [&]<class Optimizer>() {
    using Group = typename Optimizer::Group;
    // Unsharded on one rank's whole model (f32 masters for f16/bf16).
    std::vector<Group> groups(1);
    Buffer master_storage;
    if (weight_dtype != DType::f32) master_storage = Buffer(where, static_cast<size_t>(layout.total) * 4);
    for (size_t i = 0; i < workload.sizes.size(); ++i) {
      groups[0].grads.push_back(grads[i]);
      if (weight_dtype == DType::f32) {
        groups[0].params.push_back(weights[i]);
      } else {
        groups[0].params.push_back(master_storage.view(DType::f32, static_cast<size_t>(layout.offsets[i]) * 4, workload.sizes[i]));
        groups[0].model_copy.push_back(weights[i]);
      }
    }
    {
      Optimizer unsharded(groups);
      time(optimizer + ", whole model (unsharded)", update_bytes, [&] { unsharded.step(stream); });
      time("unsharded step: all-reduce + " + optimizer, 2 * share * gbytes + update_bytes, [&] {
        comm->all_reduce_buffer(all_grads, all_grads, ReduceOp::average, stream);
        unsharded.step(stream);
      });
    }
    groups[0].params = {weights.gradients().begin(), weights.gradients().end()};
    groups[0].grads = {grads.gradients().begin(), grads.gradients().end()};
    groups[0].model_copy.clear();
    ShardedOptions options;
    options.communication_stream = communication;  // the all-gathers overlap the updates
    options.update_parts = update_parts;
    options.scaler.mode = weight_dtype == DType::f16 ? LossScaling::dynamic : LossScaling::none;
    options.scaler.initial_scale = 1.0f;  // the random gradients are not scaled
    Sharded<Optimizer> sharded(*comm, layout, std::move(groups), options);
    time("sharded step (stage 1)", share * (gbytes + wbytes) + update_bytes / ranks, [&] { sharded.step(stream); });
    return sharded.state_bytes();
  };
  const size_t state = optimizer == "adam" ? sharded_rows.template operator()<Adam>()
                                           : sharded_rows.template operator()<Lamb>();
  const double series = rows[0].ms + rows[1].ms + rows[2].ms / ranks;
  const double expected = (weight_dtype == DType::f32 ? 8.0 : 12.0) * n / ranks;
  if (comm->rank() == 0) {
    std::printf("gradkit-bench-sharded: %s, %d ranks, %s; %s on %s: %zu tensors, %.0f parameters (%s weights, f32 "
                "gradients), %zu bucket(s), update in at most %d launches%s; median of %d after %d warm-up\n",
                std::string(comm->backend_name()).c_str(), ranks, device->description().c_str(), optimizer.c_str(),
                workload.name.c_str(), workload.sizes.size(), n, model.c_str(), layout.buckets.size(), update_parts,
                comm_options.blocking_calls ? ", blocking calls" : ", non-blocking calls", reps, warmup);
    std::printf("%-36s %10s %12s %10s\n", "", "ms", "MB per rank", "GB/s");
    for (const Row& r : rows) {
      std::printf("%-36s %10.3f %12.1f %10.1f\n", r.what.c_str(), r.ms, r.bytes / 1e6, r.bytes / (r.ms * 1e6));
    }
    // PyTorch's ZeRO path and its parts on the same list (f32), when given.
    const std::map<std::string, double> torch = read_torch_results(torch_results, "gradkit-bench-sharded");
    const std::pair<const char*, const char*> torch_rows[] = {
        {"zero-reduce-scatter", "torch reduce_scatter_tensor"},
        {"zero-all-gather", "torch all_gather_into_tensor"},
        {"zero-fused-adamw", "torch AdamW(fused=True), whole model"},
        {"zero-all-reduce", "torch all_reduce"},
        {"zero-step", "torch ZeroRedundancyOptimizer(AdamW fused).step"}};
    for (const auto& [key, what] : torch_rows) {
      if (const auto it = torch.find(key); it != torch.end()) std::printf("%-36s %10.3f\n", what, it->second);
    }
    if (torch.count("zero-step") && torch.count("zero-all-reduce")) {
      const double zero = torch.at("zero-step") + torch.at("zero-all-reduce");
      std::printf("torch's ZeRO path (all-reduce + ZeroRedundancyOptimizer.step): %.3f ms; torch / gradkit's sharded "
                  "step: %.2fx (target >= 3.5x: %s)\n",
                  zero, zero / rows.back().ms, zero >= 3.5 * rows.back().ms ? "met" : "NOT met");
    }
    const double step = rows.back().ms;
    std::printf("series sum RS + AG + update / %d: %.3f ms; sharded step / series sum: %.3fx (target <= 1.0x: %s); "
                "sharded step / unsharded step: %.3fx\n",
                ranks, series, step / series, step <= series ? "met" : "NOT met", step / rows[3].ms);
    std::printf("optimizer state on rank 0: %.1f MB (%s bytes x parameters / ranks = %.1f MB; ratio %.4f)\n",
                static_cast<double>(state) / 1e6, weight_dtype == DType::f32 ? "8" : "12", expected / 1e6,
                static_cast<double>(state) / expected);
  }
  device->release_all();
  return 0;
}

}  // namespace
}  // namespace gradkit::tool

int main(int argc, char** argv) {
  return gradkit::tool::rank_main("gradkit-bench-sharded", argc, argv, gradkit::tool::run);
}
