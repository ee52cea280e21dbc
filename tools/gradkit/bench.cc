// gradkit bench: one row per (operation, workload) with time, bytes moved,
// GB/s and percent of the copy and of the triad bandwidth measured in the
// same run (the triad, on every core, is the floor a bandwidth-bound kernel
// can reach), and PyTorch's equivalent beside it when PyTorch is importable.
#include "bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <map>
#include <sstream>
#include <stdexcept>

#include "bench_device.h"
#include "gradkit/core/error.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/gradient.h"
#include "gradkit/ops/lamb.h"
#include "gradkit/optim/mixed_precision.h"
#include "options.h"
#include "workloads.h"

#ifndef GRADKIT_TORCH_BENCH_SCRIPT
#define GRADKIT_TORCH_BENCH_SCRIPT "bench/torch_bench.py"
#endif

namespace gradkit::tool {
namespace {

// A list of tensors carved out of one allocation at 256-byte boundaries, as a
// caching allocator would place them: separate tensors, not one flat range.
TensorList carve(BenchDevice& dev, const Workload& w, DType dtype, uint64_t seed, bool positive = false) {
  const size_t element = dtype_size(dtype);
  std::vector<size_t> offsets;
  size_t total = 0;
  for (int64_t n : w.sizes) {
    offsets.push_back(total);
    total += (static_cast<size_t>(n) * element + 255) / 256 * 256;
  }
  auto* base = static_cast<unsigned char*>(dev.allocate(total));
  if (dtype == DType::u8 || dtype == DType::i16) {
    // Storage dtypes (8-bit codes, remainders): random bits will do, and
    // fill_random knows only the floating-point ones.
    dev.fill_random(base, static_cast<int64_t>(total / 4), DType::f32, seed);
  } else {
    dev.fill_random(base, static_cast<int64_t>(total / element), dtype, seed, positive);
  }
  TensorList list;
  for (size_t i = 0; i < w.sizes.size(); ++i) list.push_back({base + offsets[i], w.sizes[i], dtype, dev.device()});
  return list;
}

// An operation the benchmark times: the bytes it must move per element, and
// how to set it up on a workload (returning the closure that runs it once).
struct BenchOp {
  std::string name;
  double bytes_per_element;
  std::function<std::function<void()>(BenchDevice&, const Workload&)> prepare;
};

// AdamW steps (weight decay 0.01, the step count advancing) over `tensors`,
// carved from `lists`, which the returned function keeps alive.
std::function<void()> adam_steps(BenchDevice& dev, std::shared_ptr<std::vector<TensorList>> lists,
                                 const AdamTensors& tensors) {
  AdamHyperparameters h;
  h.weight_decay = 0.01f;
  auto plan = std::make_shared<AdamPlan>(tensors, std::span(&h, 1));
  auto step = std::make_shared<int64_t>(0);
  return [&dev, lists, plan, step] { plan->step({.step = ++*step}, dev.stream()); };
}

std::function<void()> prepare_adam(BenchDevice& dev, const Workload& w, DType grad, DType copy) {
  auto lists = std::make_shared<std::vector<TensorList>>();
  lists->push_back(carve(dev, w, DType::f32, 1));
  lists->push_back(carve(dev, w, grad, 2));
  lists->push_back(carve(dev, w, DType::f32, 3));
  lists->push_back(carve(dev, w, DType::f32, 4, /*positive=*/true));  // second moments are >= 0
  AdamTensors tensors{(*lists)[0], (*lists)[1], (*lists)[2], (*lists)[3], {}, {}};
  if (copy != DType::f32) {
    lists->push_back(carve(dev, w, copy, 5));
    tensors.model_copy = (*lists)[4];
  }
  return adam_steps(dev, std::move(lists), tensors);
}

// f32 weights and gradients with 8- or 4-bit blockwise moments (gradkit/
// ops/low_bit.h): the lists w, g, m's codes, v's codes, m's absmax, v's absmax.
// With bf16 weights (`weights`): bf16 gradients too, and the i16 remainder
// list last.
std::shared_ptr<std::vector<TensorList>> low_bit_lists(BenchDevice& dev, const Workload& w, int32_t bits,
                                                       DType weights = DType::f32) {
  Workload codes{w.name, {}}, blocks{w.name, {}};
  for (int64_t n : w.sizes) {
    codes.sizes.push_back(bits == 4 ? quant4_bytes(n) : n);
    blocks.sizes.push_back(bits == 4 ? quant4_blocks(n) : quant_blocks(n));
  }
  auto lists = std::make_shared<std::vector<TensorList>>();
  lists->push_back(carve(dev, w, weights, 1));
  lists->push_back(carve(dev, w, weights, 2));
  lists->push_back(carve(dev, codes, DType::u8, 3));
  lists->push_back(carve(dev, codes, DType::u8, 4));
  lists->push_back(carve(dev, blocks, DType::f32, 5, /*positive=*/true));
  lists->push_back(carve(dev, blocks, DType::f32, 6, /*positive=*/true));
  if (weights == DType::bf16) lists->push_back(carve(dev, w, DType::i16, 7));
  return lists;
}

// Adam: read w 4, g 4, m and v 1 each (4-bit: 0.5); write w 4, m and v 1
// each (0.5); and each block's two absmax values, read and written (16
// bytes per block).
// With bf16 weights, their remainders and bf16 gradients: read w 2, r 2,
// g 2; write w 2, r 2 (10 bytes in place of 12).
std::function<void()> prepare_adam_low_bit(BenchDevice& dev, const Workload& w, int32_t bits,
                                           DType weights = DType::f32) {
  auto lists = low_bit_lists(dev, w, bits, weights);
  std::span<const TensorView> remainder;
  if (weights == DType::bf16) remainder = (*lists)[6];
  AdamTensors tensors{(*lists)[0], (*lists)[1], (*lists)[2], (*lists)[3], {}, {}, (*lists)[4], (*lists)[5], remainder};
  tensors.moment_bits = bits;
  return adam_steps(dev, std::move(lists), tensors);
}

// bf16 weights whose f32 master is completed by a 16-bit remainder, bf16
// gradients, f32 moments: read w 2, r 2, g 2, m 4, v 4; write w 2, r 2, m 4, v 4.
std::function<void()> prepare_adam_remainder(BenchDevice& dev, const Workload& w) {
  auto lists = std::make_shared<std::vector<TensorList>>();
  lists->push_back(carve(dev, w, DType::bf16, 1));
  lists->push_back(carve(dev, w, DType::bf16, 2));
  lists->push_back(carve(dev, w, DType::f32, 3));
  lists->push_back(carve(dev, w, DType::f32, 4, /*positive=*/true));
  lists->push_back(carve(dev, w, DType::i16, 5));
  AdamTensors tensors{(*lists)[0], (*lists)[1], (*lists)[2], (*lists)[3], {}, {}, {}, {}, (*lists)[4]};
  return adam_steps(dev, std::move(lists), tensors);
}

// LAMB steps (lambda 0.01, the step count advancing) over `tensors`, carved
// from `lists`, which the returned function keeps alive.
std::function<void()> lamb_steps(BenchDevice& dev, std::shared_ptr<std::vector<TensorList>> lists,
                                 const LambTensors& tensors) {
  LambHyperparameters h;
  h.lambda = 0.01f;
  auto plan = std::make_shared<LambPlan>(tensors, std::span(&h, 1));
  auto step = std::make_shared<int64_t>(0);
  return [&dev, lists, plan, step] { plan->step({.eta = 1e-3f, .step = ++*step}, dev.stream()); };
}

std::function<void()> prepare_lamb(BenchDevice& dev, const Workload& w) {
  auto lists = std::make_shared<std::vector<TensorList>>();
  lists->push_back(carve(dev, w, DType::f32, 1));
  lists->push_back(carve(dev, w, DType::f32, 2));
  lists->push_back(carve(dev, w, DType::f32, 3));
  lists->push_back(carve(dev, w, DType::f32, 4, /*positive=*/true));
  return lamb_steps(dev, lists, LambTensors{(*lists)[0], (*lists)[1], (*lists)[2], (*lists)[3], {}, {}});
}

// LAMB's two passes over 8- or 4-bit moments: pass 1 reads w 4, g 4, m and
// v 1 each (4-bit: 0.5) and writes m and v; pass 2 reads w, m, v and writes
// w; pass 1 reads and writes both absmax (16 bytes per block), pass 2 reads
// them (8).
std::function<void()> prepare_lamb_low_bit(BenchDevice& dev, const Workload& w, int32_t bits) {
  auto lists = low_bit_lists(dev, w, bits);
  return lamb_steps(dev, lists, LambTensors{(*lists)[0], (*lists)[1], (*lists)[2], (*lists)[3], {}, {},
                                            (*lists)[4], (*lists)[5], {}, bits});
}

// The whole mixed-precision step: check f16 gradients, Adam on f32 masters
// writing the f16 model weights, the loss scaler's update.
std::function<void()> prepare_fp16_adam(BenchDevice& dev, const Workload& w) {
  AdamGroup group;
  group.params = carve(dev, w, DType::f16, 1);
  group.grads = carve(dev, w, DType::f16, 2);
  group.hyperparameters.weight_decay = 0.01f;
  MixedPrecisionOptions options;
  options.max_norm = 1.0f;
  auto optimizer = std::make_shared<MixedPrecisionAdam>(std::vector<AdamGroup>{group}, options);
  return [&dev, optimizer] { optimizer->step(dev.stream()); };
}

const std::vector<BenchOp>& bench_ops() {
  static const std::vector<BenchOp> ops = {
      {"zero", 4,
       [](BenchDevice& dev, const Workload& w) {
         auto plan = std::make_shared<ZeroPlan>(carve(dev, w, DType::f32, 1));
         return std::function<void()>([&dev, plan] { plan->run(dev.stream()); });
       }},
      {"accumulate", 12,
       [](BenchDevice& dev, const Workload& w) {
         auto plan = std::make_shared<AccumulatePlan>(carve(dev, w, DType::f32, 1), carve(dev, w, DType::f32, 2));
         return std::function<void()>([&dev, plan] { plan->accumulate(Flag::none(), dev.stream()); });
       }},
      // f32 Adam: read w, g, m, v; write w, m, v.
      {"adam", 28, [](BenchDevice& dev, const Workload& w) { return prepare_adam(dev, w, DType::f32, DType::f32); }},
      // f32 master weights, bf16 gradients, bf16 model copy: read w 4, g 2,
      // m 4, v 4; write w 4, m 4, v 4, copy 2.
      {"adam-mixed", 28,
       [](BenchDevice& dev, const Workload& w) { return prepare_adam(dev, w, DType::bf16, DType::bf16); }},
      {"adam-8bit", 16 + 16.0 / kQuantBlock,
       [](BenchDevice& dev, const Workload& w) { return prepare_adam_low_bit(dev, w, 8); }},
      {"adam-4bit", 14 + 16.0 / kQuant4Block,
       [](BenchDevice& dev, const Workload& w) { return prepare_adam_low_bit(dev, w, 4); }},
      {"adam-8bit-bf16", 14 + 16.0 / kQuantBlock,
       [](BenchDevice& dev, const Workload& w) { return prepare_adam_low_bit(dev, w, 8, DType::bf16); }},
      {"adam-4bit-bf16", 12 + 16.0 / kQuant4Block,
       [](BenchDevice& dev, const Workload& w) { return prepare_adam_low_bit(dev, w, 4, DType::bf16); }},
      // bf16 weights with i16 remainders (the f32 master in 4 bytes), bf16
      // gradients, f32 moments: read w 2, r 2, g 2, m 4, v 4; write w 2, r 2,
      // m 4, v 4.
      {"adam-bf16", 26, prepare_adam_remainder},
      // f32 LAMB, two passes: read w, g, m, v and write m, v; then read w, m, v and write w.
      {"lamb", 40, prepare_lamb},
      {"lamb-8bit", 22 + 24.0 / kQuantBlock,
       [](BenchDevice& dev, const Workload& w) { return prepare_lamb_low_bit(dev, w, 8); }},
      {"lamb-4bit", 19 + 24.0 / kQuant4Block,
       [](BenchDevice& dev, const Workload& w) { return prepare_lamb_low_bit(dev, w, 4); }},
      // Mixed precision: read f16 grads in the check (2), then Adam on f32
      // masters with f16 grads writing the f16 model copy (28).
      {"fp16-adam", 30, prepare_fp16_adam},
  };
  return ops;
}

const BenchOp& find_op(const std::string& name) {
  std::string names;
  for (const BenchOp& op : bench_ops()) {
    if (op.name == name) return op;
    names += (names.empty() ? "" : ", ") + op.name;
  }
  throw Error(ErrorCode::invalid_argument, "--ops: has '" + name + "', expected one of " + names);
}

struct Row {
  std::string op;
  std::string workload;
  size_t tensors;
  int64_t elements;
  double bytes;
  double ms;
  double torch_ms = -1;
};

struct Settings {
  Device device;
  std::vector<std::string> ops;
  std::vector<std::string> workloads;
  int64_t scale;
  int reps;
  std::string torch;  // auto | on | off
  std::string csv;
  std::string script;
};

Workload make_workload(const std::string& name, int64_t scale) {
  Workload w;
  if (name == "big") w = single_tensor(int64_t{256} << 20);
  else if (name == "bert") w = bert_large();
  else if (name == "gpt2") w = gpt2_small();
  else if (name == "small") w = small_tensors(10000);
  else throw Error(ErrorCode::invalid_argument, "--workloads: has '" + name +
                                                    "', expected big, gpt2, bert or small");
  return scale > 1 ? scaled(w, scale) : w;
}

// Runs PyTorch's equivalent of every row in one python3 process; returns
// false (leaving the rows alone) when python3 or torch is missing.
bool run_torch(const Settings& s, std::vector<Row>& rows, const std::map<std::string, Workload>& workloads) {
  const std::string cases_path = "/tmp/gradkit_bench_cases_" + std::to_string(::getpid()) + ".txt";
  {
    std::ofstream cases(cases_path);
    for (const Row& r : rows) {
      cases << r.op << ' ' << r.workload;
      for (int64_t n : workloads.at(r.workload).sizes) cases << ' ' << n;
      cases << '\n';
    }
  }
  const std::string command = "python3 '" + s.script + "' --device " + to_string(s.device) + " --reps " +
                              std::to_string(s.reps) + " --cases '" + cases_path + "' 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return false;
  std::string output;
  char line[4096];
  while (std::fgets(line, sizeof line, pipe) != nullptr) output += line;
  const int status = ::pclose(pipe);
  std::remove(cases_path.c_str());
  std::istringstream in(output);
  std::string word;
  bool any = false;
  for (std::string text; std::getline(in, text);) {
    std::istringstream fields(text);
    size_t index;
    double ms;
    if (text.rfind("note ", 0) == 0) {
      std::printf("PyTorch: %s\n", text.c_str() + 5);  // which implementation each case ran
    } else if (fields >> word && word == "case" && fields >> index >> ms && index < rows.size()) {
      rows[index].torch_ms = ms;
      any = true;
    } else if (text.find("failed") != std::string::npos) {
      std::fprintf(stderr, "  PyTorch: %s\n", text.c_str());
    }
  }
  if (!any && s.torch == "on") {
    throw Error(ErrorCode::invalid_argument, "--torch on, but PyTorch did not run (status " +
                                                 std::to_string(status) + "):\n" + output);
  }
  return any;
}

void print_rows(const std::vector<Row>& rows, double copy_gbs, double triad_gbs, bool with_torch,
                const std::string& csv) {
  std::printf("\n%-14s %-12s %7s %11s %9s %9s %8s %7s %7s", "op", "workload", "tensors", "elements", "MB moved",
              "ms", "GB/s", "%copy", "%triad");
  if (with_torch) std::printf(" %9s %8s %7s %7s %8s", "torch ms", "GB/s", "%copy", "%triad", "speedup");
  std::printf("\n");
  std::ofstream out;
  if (!csv.empty()) {
    out.open(csv);
    out << "op,workload,tensors,elements,bytes,ms,gbs,pct_copy,pct_triad,torch_ms,torch_gbs,torch_pct_copy,"
           "torch_pct_triad\n";
  }
  for (const Row& r : rows) {
    const double gbs = r.bytes / (r.ms * 1e6);
    std::printf("%-14s %-12s %7zu %11lld %9.1f %9.4f %8.1f %6.1f%% %6.1f%%", r.op.c_str(), r.workload.c_str(),
                r.tensors, static_cast<long long>(r.elements), r.bytes / 1e6, r.ms, gbs, 100 * gbs / copy_gbs,
                100 * gbs / triad_gbs);
    double tgbs = 0;
    if (with_torch && r.torch_ms > 0) {
      tgbs = r.bytes / (r.torch_ms * 1e6);
      std::printf(" %9.4f %8.1f %6.1f%% %6.1f%% %7.2fx", r.torch_ms, tgbs, 100 * tgbs / copy_gbs,
                  100 * tgbs / triad_gbs, r.torch_ms / r.ms);
    }
    std::printf("\n");
    if (out) {
      out << r.op << ',' << r.workload << ',' << r.tensors << ',' << r.elements << ',' << r.bytes << ',' << r.ms
          << ',' << gbs << ',' << 100 * gbs / copy_gbs << ',' << 100 * gbs / triad_gbs << ',' << r.torch_ms << ','
          << tgbs << ',' << 100 * tgbs / copy_gbs << ',' << 100 * tgbs / triad_gbs << '\n';
    }
  }
}

// Host time of one launch of `op` on a plan of `count` tensors of 1024
// elements, averaged over a burst of launches that the GPU queues (the host
// does not wait for them).
double host_us_per_launch(BenchDevice& dev, const BenchOp& op, int count) {
  const Workload w{std::to_string(count), std::vector<int64_t>(count, 1024)};
  const std::function<void()> run = op.prepare(dev, w);
  constexpr int kBurst = 200;
  for (int i = 0; i < 20; ++i) run();
  dev.synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kBurst; ++i) run();
  const auto stop = std::chrono::steady_clock::now();
  dev.synchronize();
  return std::chrono::duration<double, std::micro>(stop - start).count() / kBurst;
}

}  // namespace

int run_bench(const std::vector<std::string>& args) {
  std::string device = "cpu", ops = "zero,accumulate,adam,adam-mixed,adam-8bit,adam-bf16,lamb,fp16-adam", workload_names = "big,bert,small",
              scale = "auto", reps = "auto";
  Settings s;
  s.torch = "auto";
  s.script = GRADKIT_TORCH_BENCH_SCRIPT;
  std::vector<std::string> op_names;
  for (const BenchOp& op : bench_ops()) op_names.push_back(op.name);
  Command command("gradkit bench",
                  "Time gradkit's operations against the copy and triad bandwidths (and PyTorch).");
  CLI::App& app = command.app();
  app.add_option("--device", device, "cpu or cuda[:N]")
      ->check(CLI::Validator(
          [](std::string& text) {
            try {
              parse_device(text, "--device");
              return std::string();
            } catch (const Error&) {
              return "expected cpu, cuda or cuda:N with N >= 0, not '" + text + "'";
            }
          },
          ""));
  std::string op_list;
  for (const std::string& name : op_names) op_list += (op_list.empty() ? "" : ", ") + name;
  app.add_option("--ops", ops, "comma-separated: " + op_list)
      ->check(list_of(one_of(op_names)));
  app.add_option("--workloads", workload_names,
                 "comma-separated: big (256M elements), gpt2 (GPT-2 small, 148 tensors), bert (BERT-large, 389 "
                 "tensors), small (10,000 tensors of "
                 "1K-64K)")
      ->check(list_of(one_of({"big", "gpt2", "bert", "small"})));
  app.add_option("--scale", scale, "divide every tensor size by this (auto: 1 on CUDA, 8 on the CPU)")
      ->type_name("INT|auto")
      ->check(integer(1, 1 << 20, /*allow_auto=*/true));
  app.add_option("--reps", reps, "timed repetitions per row (median reported; auto: 20 on CUDA, 3 on the CPU)")
      ->type_name("INT|auto")
      ->check(integer(1, 100000, /*allow_auto=*/true));
  app.add_option("--torch", s.torch, "run PyTorch's equivalent: auto (if importable), on, off")
      ->check(one_of({"auto", "on", "off"}));
  app.add_option("--csv", s.csv, "also write the rows to this CSV file")->type_name("FILE");
  app.add_option("--torch-script", s.script, "the PyTorch side of the benchmark")->type_name("FILE");
  app.callback([&] {
    if (!s.csv.empty()) check_writable("--csv", s.csv, /*in_place=*/true);
  });
  if (std::optional<int> status = command.parse(args)) return *status;

  s.device = parse_device(device, "--device");
  s.ops = split_list(ops);
  s.workloads = split_list(workload_names);
  s.scale = scale == "auto" ? (s.device.is_cuda() ? 1 : 8) : std::stoll(scale);
  s.reps = reps == "auto" ? (s.device.is_cuda() ? 20 : 3) : std::stoi(reps);

  std::unique_ptr<BenchDevice> dev =
      s.device.is_cuda() ? make_cuda_bench_device(s.device.index) : make_cpu_bench_device();
  const size_t copy_bytes = s.device.is_cuda() ? (size_t{1} << 30) : (size_t{256} << 20);
  const double copy_gbs = dev->copy_bandwidth_gbs(copy_bytes, s.device.is_cuda() ? 20 : 3);
  constexpr int kTriadRuns = 10;
  const double triad_gbs = dev->triad_bandwidth_gbs(copy_bytes, kTriadRuns);
  std::printf("gradkit bench on %s; copy bandwidth %.1f GB/s (read + write, %zu MiB buffers); triad %.1f GB/s "
              "(a = b + s * c, three %zu MiB f32 arrays, every core, best of %d); median of %d; tensor sizes "
              "divided by %lld\n",
              dev->description().c_str(), copy_gbs, copy_bytes >> 20, triad_gbs, copy_bytes >> 20, kTriadRuns, s.reps,
              static_cast<long long>(s.scale));

  std::vector<Row> rows;
  std::map<std::string, Workload> workloads;
  for (const std::string& name : s.workloads) {
    const Workload w = make_workload(name, s.scale);
    workloads[w.name] = w;
    for (const std::string& op_name : s.ops) {
      const BenchOp& op = find_op(op_name);
      Row r{op.name, w.name, w.sizes.size(), w.total(), op.bytes_per_element * static_cast<double>(w.total()), 0};
      {
        const std::function<void()> run = op.prepare(*dev, w);
        r.ms = dev->median_ms(run, 3, s.reps);
      }
      dev->release_all();
      rows.push_back(r);
      std::fprintf(stderr, "  measured %s on %s\n", op.name.c_str(), w.name.c_str());
    }
  }

  bool with_torch = false;
  if (s.torch != "off") with_torch = run_torch(s, rows, workloads);
  print_rows(rows, copy_gbs, triad_gbs, with_torch, s.csv);
  if (!with_torch) std::printf("(PyTorch not run: %s)\n", s.torch == "off" ? "--torch off" : "not importable");

  if (s.device.is_cuda()) {
    std::printf("\nhost time per launch on a plan of 1024-element tensors:\n");
    for (const std::string& op_name : s.ops) {
      const BenchOp& op = find_op(op_name);
      const double at_100 = host_us_per_launch(*dev, op, 100);
      const double at_10000 = host_us_per_launch(*dev, op, 10000);
      dev->release_all();
      std::printf("  %-14s 100 tensors %6.2f us, 10000 tensors %6.2f us\n", op.name.c_str(), at_100, at_10000);
    }
  }
  return 0;
}

}  // namespace gradkit::tool
