#include "train/trainer.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>

#include "gradkit/comm/adasum.h"
#include "gradkit/comm/communicator.h"
#include "gradkit/comm/gradient_arena.h"
#include "gradkit/core/error.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/gradient.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/lamb.h"
#include "gradkit/optim/state_file.h"
#include "cli.h"
#include "train/backend.h"
#include "train/fashion_mnist.h"
#include "train/mlp.h"
#include "train/progress.h"

namespace gradkit::train {
namespace {

constexpr std::string_view kCheckpointKind = "gradkit-train";
// --shard's buckets: the first layer's weights (200,704 for the default
// widths) are a bucket alone, the later layers share one.
constexpr int64_t kShardBucketElements = int64_t{1} << 16;

// The order of the training images in `epoch`: the same on every rank and in
// every run with the same seed, so a resumed run sees the same batches.
std::vector<int64_t> epoch_order(uint64_t seed, int epoch, int64_t count) {
  std::vector<int64_t> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(epoch));
  for (int64_t i = count - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

std::vector<uint8_t> bytes_of(const GradientArena& arena) {
  const TensorView flat = arena.flat();
  std::vector<uint8_t> out(flat.bytes());
  copy_to_host(out.data(), flat.data, out.size(), flat.device);
  return out;
}

struct CheckpointHeader {
  int32_t completed_epochs;
  int32_t epochs;  // the schedule's length: a resumed run must keep it
  int32_t ranks;
  int32_t batch;
  int32_t accumulate;
  uint64_t seed;
};

// Every rank calls it (the sharded optimizer gathers its state to rank 0);
// `write`: the rank that writes the file.
void save_checkpoint(const std::string& path, const CheckpointHeader& header, const TrainOptions& o,
                     const GradientArena& params, Optimizer& optimizer, bool write) {
  StateFile file;
  file.add("kind", std::vector<uint8_t>(kCheckpointKind.begin(), kCheckpointKind.end()));
  SectionWriter train;
  train.put(header);
  file.add("train", train.take());
  file.add("optimizer_name", std::vector<uint8_t>(o.optimizer.begin(), o.optimizer.end()));
  std::vector<uint8_t> widths(reinterpret_cast<const uint8_t*>(o.widths.data()),
                              reinterpret_cast<const uint8_t*>(o.widths.data() + o.widths.size()));
  file.add("widths", widths);
  file.add("weights", bytes_of(params));
  optimizer.save_to(file);
  if (write) file.write(path);
}

// Checks the whole checkpoint against this run, then loads it; returns the
// number of completed epochs.
int load_checkpoint(const std::string& path, const CheckpointHeader& expected, const TrainOptions& o,
                    const GradientArena& params, Optimizer& optimizer) {
  const StateFile file = StateFile::read(path);
  auto mismatch = [&](const std::string& what) {
    throw Error(ErrorCode::io_error, "checkpoint '" + path + "' does not fit this run: " + what);
  };
  const std::vector<uint8_t>& kind = file.get("kind");
  if (std::string(kind.begin(), kind.end()) != kCheckpointKind) mismatch("it is not a gradkit train checkpoint");
  SectionReader reader(file.get("train"), "train");
  const auto h = reader.get<CheckpointHeader>();
  if (h.ranks != expected.ranks) {
    mismatch("it was written by " + std::to_string(h.ranks) + " ranks, this run has " + std::to_string(expected.ranks));
  }
  if (h.batch != expected.batch || h.accumulate != expected.accumulate || h.seed != expected.seed) {
    mismatch("its batch, accumulation or seed differ from this run's");
  }
  if (h.epochs != expected.epochs) {
    mismatch("it was written by a run of " + std::to_string(h.epochs) + " epochs (the learning-rate schedule's length), " +
             "this run has " + std::to_string(expected.epochs));
  }
  if (h.completed_epochs < 1 || h.completed_epochs > h.epochs) mismatch("its epoch count is out of range");
  const std::vector<uint8_t>& name = file.get("optimizer_name");
  if (std::string(name.begin(), name.end()) != o.optimizer) mismatch("it holds another optimizer's state");
  const std::vector<uint8_t>& widths = file.get("widths");
  if (widths.size() != o.widths.size() * sizeof(int) ||
      std::memcmp(widths.data(), o.widths.data(), widths.size()) != 0) {
    mismatch("its model has other layer widths");
  }
  if (file.get("weights").size() != params.flat().bytes()) mismatch("its weights have another size");
  optimizer.check_state(path, file);
  // Everything checked: load.
  const TensorView flat = params.flat();
  copy_from_host(flat.data, flat.device, file.get("weights").data(), flat.bytes());
  optimizer.apply_state(file);
  return h.completed_epochs;
}

// The CSV log, one line per epoch. A fresh run starts the file anew with the
// header; a resumed run appends, and writes the header first only where the
// file does not exist yet or is empty.
constexpr const char* kLogHeader = "epoch,train_loss,test_accuracy,samples_per_second,seconds\n";

void write_log(const std::string& path, const std::string& text, bool replace) {
  std::ofstream out(path, replace ? std::ios::trunc : std::ios::app);
  out << text;
  if (!out) throw Error(ErrorCode::io_error, "--log: cannot write '" + path + "'");
}

void start_log(const std::string& path, bool resumed) {
  std::error_code ec;
  const bool has_lines = std::filesystem::file_size(path, ec) > 0 && !ec;
  if (!resumed || !has_lines) write_log(path, kLogHeader, /*replace=*/true);
}

void log_epoch(const std::string& path, const EpochResult& r) {
  std::ostringstream line;
  line << r.epoch << ',' << r.train_loss << ',' << r.test_accuracy << ',' << r.samples_per_second << ','
       << r.seconds << '\n';
  write_log(path, line.str(), /*replace=*/false);
}

void write_plot(const std::string& png, const std::string& csv) {
  FILE* gnuplot = ::popen("gnuplot 2>&1", "w");
  if (gnuplot == nullptr) throw Error(ErrorCode::io_error, "--plot: cannot start gnuplot (install gnuplot-nox)");
  std::fprintf(gnuplot,
               "set terminal pngcairo size 900,420 font ',10'\n"
               "set output '%s'\n"
               "set datafile separator ','\n"
               "set multiplot layout 1,2 title 'gradkit train: MLP on Fashion-MNIST'\n"
               "set xlabel 'epoch'; set grid\n"
               "set ylabel 'train loss'; plot '%s' using 1:2 every ::1 with linespoints title 'train loss'\n"
               "set ylabel 'test accuracy'; plot '%s' using 1:3 every ::1 with linespoints title 'test accuracy'\n"
               "unset multiplot\n",
               png.c_str(), csv.c_str(), csv.c_str());
  if (::pclose(gnuplot) != 0) {
    throw Error(ErrorCode::io_error, "--plot: gnuplot failed to write '" + png + "' (is gnuplot installed?)");
  }
}

}  // namespace

void check_train_options(const TrainOptions& o, bool writes) {
  if (o.stop_after < 0 || o.stop_after > o.epochs) {
    throw Error(ErrorCode::invalid_argument, "--stop-after: expected an epoch from 0 to --epochs (" +
                                                 std::to_string(o.epochs) + "), not '" +
                                                 std::to_string(o.stop_after) + "'");
  }
  if (o.moments != "f32" && o.moments != "bf16" && o.moments != "int8" && o.moments != "int4") {
    throw Error(ErrorCode::invalid_argument, "--moments: expected f32, bf16, int8 or int4, not '" + o.moments + "'");
  }
  if (o.optimizer != "adam" && o.optimizer != "lamb" && o.optimizer != "muon") {
    throw Error(ErrorCode::invalid_argument, "--optimizer: expected adam, lamb or muon, not '" + o.optimizer + "'");
  }
  if (o.optimizer == "muon") {
    // Muon's step (gradkit::Muon) over the f32 weights of one unsharded CPU
    // model; its momentum is f32 or bf16, and a hidden matrix must exist.
    const char* why = o.device != "cpu"        ? "--device cuda (its f16 weights have f32 masters, which Muon does not keep)"
                      : o.shard > 0            ? "--shard (Muon's sharded step is not in the train command)"
                      : o.master != "f32"      ? "--master remainder (Muon steps f32 or bf16 weights, without masters)"
                      : o.moments != "f32" && o.moments != "bf16" ? "--moments int8 or int4 (Muon's momentum is f32 or bf16)"
                      : o.widths.size() < 3    ? "a model without a weight matrix before its output layer"
                                               : nullptr;
    if (why != nullptr) throw Error(ErrorCode::invalid_argument, std::string("--optimizer muon: cannot be used with ") + why);
  }
  if (o.master != "f32" && o.master != "remainder") {
    throw Error(ErrorCode::invalid_argument, "--master: expected f32 or remainder, not '" + o.master + "'");
  }
  if (o.master == "remainder") {
    // A remainder completes a bf16 weight to its f32 master (docs/ops.md).
    if (o.device == "cuda") {
      throw Error(ErrorCode::invalid_argument,
                  "--master remainder: needs bf16 weights, and --device cuda trains f16 ones (16 bits cannot hold "
                  "what rounding an f32 master to f16 loses); use --device cpu, which then trains bf16 weights");
    }
    if (o.optimizer == "lamb" && (o.moments == "int8" || o.moments == "int4")) {
      throw Error(ErrorCode::invalid_argument,
                  "--master remainder: --optimizer lamb needs --moments f32 or bf16 (LAMB's 8- and 4-bit passes "
                  "have no remainder form)");
    }
  }
  if (o.shard > 0 && o.reduce != "allreduce") {
    throw Error(ErrorCode::invalid_argument, "--shard: needs --reduce allreduce (the sharded step reduce-scatters)");
  }
  if (o.offload && o.device != "cuda") {
    throw Error(ErrorCode::invalid_argument, "--offload: needs --device cuda (the model stays on the GPU, the "
                                             "optimizer state goes to the host); a CPU run keeps it there already");
  }
  if (o.offload && o.shard > 0) {
    throw Error(ErrorCode::invalid_argument, "--offload: cannot be combined with --shard (each rank offloads "
                                             "the whole state)");
  }
  if (!o.plot.empty() && o.log.empty()) {
    throw Error(ErrorCode::invalid_argument, "--plot: needs --log (the curves are drawn from the log)");
  }
  // A directory, a device or a file of another kind is named now, not after
  // the data and the model are loaded.
  if (!o.resume.empty()) {
    try {
      StateFile::check_readable(o.resume);
    } catch (const Error& e) {
      throw Error(ErrorCode::io_error, std::string("--resume: ") + e.what());
    }
  }
  if (!writes) return;
  // The checkpoint replaces its file by a rename; the log and the plot are
  // written where they are.
  if (!o.save.empty()) tool::check_writable("--save", o.save, /*in_place=*/false);
  if (!o.log.empty()) tool::check_writable("--log", o.log, /*in_place=*/true);
  if (!o.plot.empty()) tool::check_writable("--plot", o.plot, /*in_place=*/true);
}

namespace {

// run_training's body: `data` is the caller's dataset, or null to read
// o.data_dir's files (after the options' checks, which come before any work).
std::vector<EpochResult> train_on(const TrainOptions& o, const FashionMnist* data_given) {
  openblas_set_num_threads(1);  // one core per rank: ranks are the parallelism
  const bool cuda = o.device == "cuda";
  CommunicatorOptions comm_options;
  comm_options.timeout = o.timeout;
  std::unique_ptr<Communicator> comm =
      cuda ? create_nccl_communicator(comm_options) : create_mpi_communicator(comm_options);
  const int rank = comm->rank(), ranks = comm->size();
  const bool lead = rank == 0;
  check_train_options(o, /*writes=*/lead);

  const FashionMnist loaded = data_given != nullptr ? FashionMnist{} : load_fashion_mnist(o.data_dir);
  const FashionMnist& data = data_given != nullptr ? *data_given : loaded;
  const int64_t train_count = o.limit > 0 ? std::min<int64_t>(o.limit, data.train.count) : data.train.count;
  const int64_t per_step = int64_t{ranks} * o.batch * o.accumulate;
  const int64_t steps = train_count / per_step;
  if (steps == 0) {
    throw Error(ErrorCode::invalid_argument, "--batch: times --accumulate times the rank count (" +
                                                 std::to_string(per_step) + ") exceeds the training images (" +
                                                 std::to_string(train_count) + ")");
  }

  std::unique_ptr<TrainBackend> backend =
      cuda ? make_cuda_backend(o, data, comm->device()) : make_cpu_backend(o, data);
  const Device device = backend->device();
  const std::vector<int64_t> sizes = Mlp(o.widths).parameter_sizes();
  // Parameters, the step's gradients (f32, all-reduced in one call, or
  // reduce-scattered bucket by bucket when sharded: then both are laid out
  // for the ranks' shards), and one micro-batch's gradients, each in one
  // allocation.
  // 8-bit moments: shards of whole quantization blocks (docs/ops.md).
  const ShardedLayout layout =
      ShardedLayout::make(sizes, ranks, kShardBucketElements,
                          o.moments == "int8" || o.moments == "int4" ? kQuantBlock : 64);
  auto arena = [&](DType dtype) {
    return o.shard > 0 ? GradientArena(device, dtype, layout) : GradientArena(device, dtype, sizes);
  };
  const GradientArena params = arena(backend->parameter_dtype()), grads = arena(DType::f32),
                      micro(device, backend->micro_gradient_dtype(), sizes);
  backend->initialize(params.gradients(), o.seed);
  const AccumulatePlan accumulate(grads.gradients(), micro.gradients());
  const ShardContext shard{*comm, layout};
  std::unique_ptr<Optimizer> optimizer =
      backend->make_optimizer(o, params.gradients(), grads.gradients(), o.shard > 0 ? &shard : nullptr);
  Buffer totals_buffer(device, 2 * sizeof(double));
  // How the ranks combine their gradients: the average, or Adasum (which
  // keeps a gradient's size where ranks agree and adds where they are
  // orthogonal). Both planned once for the arena.
  std::unique_ptr<AdasumPlan> adasum;
  if (o.reduce == "adasum") adasum = std::make_unique<AdasumPlan>(*comm, grads.gradients());

  const CheckpointHeader header{0, o.epochs, ranks, o.batch, o.accumulate, o.seed};
  int first_epoch = 1;
  if (!o.resume.empty()) {
    first_epoch = load_checkpoint(o.resume, header, o, params, *optimizer) + 1;
    if (lead) std::printf("resumed from %s after epoch %d\n", o.resume.c_str(), first_epoch - 1);
  }
  if (lead) {
    std::string widths;
    for (int w : o.widths) widths += (widths.empty() ? "" : "-") + std::to_string(w);
    const std::string sharding =
        o.shard > 0 ? ", sharded (ZeRO stage " + std::to_string(o.shard) + ", " +
                          std::to_string(layout.shard_elements()) + " of " + std::to_string(layout.total) +
                          " elements per rank)"
                    : "";
    const std::string weights = cuda ? " (f16, dynamic loss scaling)"
                                : o.master == "remainder" ? " (bf16 weights, remainder masters)"
                                                          : "";
    std::printf("gradkit train: MLP %s on Fashion-MNIST, %d rank(s) on %s%s, %s with %s moments%s, %s, batch %d x %d "
                "micro-batch(es) per rank, %lld steps per epoch\n",
                widths.c_str(), ranks, cuda ? "cuda" : "cpu", weights.c_str(), o.optimizer.c_str(), o.moments.c_str(),
                sharding.c_str(), o.reduce.c_str(), o.batch, o.accumulate, static_cast<long long>(steps));
  }
  if (lead && !o.log.empty()) start_log(o.log, /*resumed=*/!o.resume.empty());

  std::vector<EpochResult> results;
  const float micro_scale = 1.0f / static_cast<float>(o.accumulate);
  const int last_epoch = o.stop_after > 0 ? std::min(o.stop_after, o.epochs) : o.epochs;
  for (int epoch = first_epoch; epoch <= last_epoch; ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    backend->start_epoch(epoch_order(o.seed, epoch, train_count));
    // Cosine decay over the epochs: large steps first, fine ones at the end
    // (the final accuracy then depends little on where the last step lands).
    optimizer->set_lr(static_cast<float>(o.lr * 0.5 * (1 + std::cos(M_PI * (epoch - 1) / o.epochs))));
    Progress progress(lead, o.progress, epoch, o.epochs, steps);
    double loss_sum = 0;
    for (int64_t step = 0; step < steps; ++step) {
      for (int m = 0; m < o.accumulate; ++m) {
        const int64_t offset = ((step * o.accumulate + m) * ranks + rank) * o.batch;
        backend->forward_backward(offset, o.batch, micro_scale, params.gradients(), micro.gradients());
        accumulate.accumulate_v2(Flag::host(m == 0));  // the first micro-batch overwrites
      }
      if (adasum) adasum->run();
      else if (o.shard == 0) grads.all_reduce(*comm, ReduceOp::average);
      // Stage 2: the gradients as backward finishes them, last layer first.
      if (o.shard == 2) {
        for (size_t i = sizes.size(); i-- > 0;) optimizer->mark_ready(i);
      }
      optimizer->step();
      // The running loss costs a synchronization on a GPU: read it now and then.
      if (lead && (step % 50 == 49 || step + 1 == steps)) {
        loss_sum += backend->take_loss_sum();
        progress.update(step + 1, loss_sum / static_cast<double>((step + 1) * o.batch * o.accumulate));
      }
    }
    loss_sum += backend->take_loss_sum();
    // Test accuracy: each rank evaluates every ranks-th image; the counts add up.
    const int64_t correct = backend->count_correct(rank, ranks, params.gradients());
    double totals[2] = {loss_sum, static_cast<double>(correct)};
    copy_from_host(totals_buffer.data(), device, totals, sizeof totals);
    const TensorView totals_view = totals_buffer.view(DType::f64, 0, 2);
    comm->all_reduce_buffer(totals_view, totals_view, ReduceOp::sum);
    copy_to_host(totals, totals_buffer.data(), sizeof totals, device);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const EpochResult result{epoch, totals[0] / static_cast<double>(steps * per_step),
                             totals[1] / static_cast<double>(data.test.count),
                             static_cast<double>(steps * per_step) / seconds, seconds};
    results.push_back(result);
    char summary[240];
    const std::string note = optimizer->note();
    std::snprintf(summary, sizeof summary,
                  "epoch %d/%d: train loss %.4f, test accuracy %.4f, %.0f samples/s, %.1f s%s%s", epoch, o.epochs,
                  result.train_loss, result.test_accuracy, result.samples_per_second, seconds,
                  note.empty() ? "" : ", ", note.c_str());
    // The checkpoint first, then the epoch's lines: a run stopped between
    // the two resumes after this epoch and logs it never, rather than
    // resuming before it and logging it twice.
    if (!o.save.empty()) {
      CheckpointHeader h = header;
      h.completed_epochs = epoch;
      save_checkpoint(o.save, h, o, params, *optimizer, /*write=*/lead);
    }
    progress.finish(summary);
    if (lead && !o.log.empty()) log_epoch(o.log, result);
  }
  if (lead && !o.plot.empty()) {
    write_plot(o.plot, o.log);
    std::printf("wrote %s\n", o.plot.c_str());
  }
  return results;
}

}  // namespace

std::vector<EpochResult> run_training(const TrainOptions& o) { return train_on(o, nullptr); }

std::vector<EpochResult> run_training(const TrainOptions& o, const FashionMnist& data) { return train_on(o, &data); }

}  // namespace gradkit::train
