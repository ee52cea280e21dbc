// gradkit train's pieces: the data files' checks, gradient accumulation,
// exact resumption from a checkpoint, the CSV log, and the checks made before
// any work. Runs as one MPI rank (singleton).
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdio>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "gradkit/comm/communicator.h"
#include "gradkit/core/device.h"
#include "gradkit/core/error.h"
#include "gradkit/optim/state_file.h"
#include "cli.h"
#include "train/fashion_mnist.h"
#include "train/idx_file.h"
#include "train/trainer.h"

namespace gradkit::train {
namespace {

std::string temp(const std::string& name) { return ::testing::TempDir() + "gradkit_train_" + name; }

void write_gz(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  gzclose(f);
}

std::vector<uint8_t> idx_header(uint8_t type, std::vector<uint32_t> dims) {
  std::vector<uint8_t> h = {0, 0, type, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift : {24, 16, 8, 0}) h.push_back(static_cast<uint8_t>(d >> shift));
  }
  return h;
}

// Runs `call`, expects an Error of `code` whose message contains every one
// of `parts`.
void expect_error(const std::function<void()>& call, ErrorCode code, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "expected an error mentioning " << parts.front();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

void expect_io_error(const std::string& path, int rank, const std::string& fragment) {
  expect_error([&] { read_idx(path, rank); }, ErrorCode::io_error, {fragment, path});
}

TEST(IdxFile, ReadsAValidFile) {
  std::vector<uint8_t> bytes = idx_header(0x08, {2, 3});
  for (uint8_t v : {1, 2, 3, 4, 5, 6}) bytes.push_back(v);
  write_gz(temp("ok.gz"), bytes);
  const IdxArray a = read_idx(temp("ok.gz"), 2);
  EXPECT_EQ(a.dims, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.data, (std::vector<uint8_t>{1, 2, 3, 4, 5, 6}));
}

TEST(IdxFile, RejectsBadFiles) {
  std::vector<uint8_t> good = idx_header(0x08, {2, 3});
  good.resize(good.size() + 6, 7);
  std::vector<uint8_t> truncated(good.begin(), good.end() - 2);
  write_gz(temp("truncated.gz"), truncated);
  expect_io_error(temp("truncated.gz"), 2, "truncated");
  std::vector<uint8_t> magic = good;
  magic[0] = 0x1f;
  write_gz(temp("magic.gz"), magic);
  expect_io_error(temp("magic.gz"), 2, "bad magic");
  write_gz(temp("rank.gz"), good);
  expect_io_error(temp("rank.gz"), 3, "has 2 dimensions, expected 3");
  std::vector<uint8_t> type = good;
  type[2] = 0x0d;
  write_gz(temp("type.gz"), type);
  expect_io_error(temp("type.gz"), 2, "holds elements of type 0x0d, expected unsigned bytes (0x08)");
  std::vector<uint8_t> extra = good;
  extra.push_back(9);
  write_gz(temp("extra.gz"), extra);
  expect_io_error(temp("extra.gz"), 2, "past the");
  expect_io_error(temp("missing.gz"), 2, "cannot be opened");
  // Not gzip at all, and a gzip stream cut short.
  std::ofstream(temp("corrupt.gz"), std::ios::binary) << std::string("\x1f\x8b\x08\x00garbage", 11);
  expect_io_error(temp("corrupt.gz"), 2, "");
}

// Limits the process's address space to what it maps now plus `headroom`
// bytes, until the end of the scope.
class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(size_t headroom) {
    size_t pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    ::getrlimit(RLIMIT_AS, &old_);
    rlimit tight = old_;
    tight.rlim_cur = pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE)) + headroom;
    ::setrlimit(RLIMIT_AS, &tight);
  }
  ~AddressSpaceLimit() { ::setrlimit(RLIMIT_AS, &old_); }

 private:
  rlimit old_{};
};

// Found by fuzz/idx_fuzzer.cc: a 51-byte file whose header announced 150 MB
// made the reader allocate them all before it found the data missing. A
// header may announce up to 4 GiB; with 1 GiB to spare that allocation
// failed with std::bad_alloc, and a 40-byte file must cost no more than it
// holds. The fuzzer's input itself is in fuzz/regressions/idx/.
TEST(IdxFile, AllocatesNoMoreThanTheFileHolds) {
  std::vector<uint8_t> bytes = idx_header(0x08, {65536, 65536, 1});
  bytes.resize(bytes.size() + 40, 7);
  const std::string plain = temp("announces_4gib"), gzipped = temp("announces_4gib.gz");
  std::ofstream(plain, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                               static_cast<std::streamsize>(bytes.size()));
  write_gz(gzipped, bytes);
  const AddressSpaceLimit limit(size_t{1} << 30);
  for (const std::string& path : {plain, gzipped}) {
    expect_io_error(path, 3, "is truncated (40 of the 4294967296 bytes its header announces)");
  }
}

TEST(FashionMnist, ChecksTheDatasetsShape) {
  const std::string dir = temp("dataset");
  std::remove((dir + "/train-images-idx3-ubyte.gz").c_str());
  ::mkdir(dir.c_str(), 0755);
  std::vector<uint8_t> images = idx_header(0x08, {5, 28, 28});
  images.resize(images.size() + 5 * 784, 1);
  std::vector<uint8_t> labels = idx_header(0x08, {5});
  labels.resize(labels.size() + 5, 3);
  write_gz(dir + "/train-images-idx3-ubyte.gz", images);
  write_gz(dir + "/train-labels-idx1-ubyte.gz", labels);
  try {
    load_fashion_mnist(dir);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds 5 images, expected 60000"), std::string::npos) << e.what();
  }
}

std::vector<float> checkpoint_floats(const std::string& path, const std::string& section) {
  const StateFile file = StateFile::read(path);
  const std::vector<uint8_t>& bytes = file.get(section);
  std::vector<float> w(bytes.size() / 4);
  std::memcpy(w.data(), bytes.data(), bytes.size());
  return w;
}

// The dataset's folder: $GRADKIT_FASHION_MNIST (a GPU machine gets it
// carried in .data/fashion-mnist), or Debian's.
std::string data_dir() {
  const char* dir = std::getenv("GRADKIT_FASHION_MNIST");
  return dir != nullptr ? dir : kDefaultDataDir;
}

bool have_dataset() { return std::ifstream(data_dir() + "/train-images-idx3-ubyte.gz").good(); }

// Trains on the dataset read once per process: reading and converting the
// files costs a short run several times over. AccumulationMatchesOneLargerBatch
// trains from the files (run_training(o)), as the tool does.
std::vector<EpochResult> run_on_dataset(const TrainOptions& o) {
  static const FashionMnist data = load_fashion_mnist(data_dir());
  return run_training(o, data);
}

// A file's bytes, for checkpoints that must be equal byte for byte.
std::string bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

TrainOptions small_run() {
  TrainOptions o;
  o.data_dir = data_dir();
  o.epochs = 2;
  o.limit = 2048;
  o.log = "";
  o.progress = false;
  return o;
}

// One batch of 128 and four accumulated micro-batches of 32 see the same
// images: after one step the gradient, which Adam's first moment holds as
// (1 - beta1) g, agrees to f32 rounding. (The weights are no witness: Adam
// turns a gradient of 1e-12 and one of exactly 0 into steps of +-lr and 0.)
TEST(Training, AccumulationMatchesOneLargerBatch) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TrainOptions big = small_run(), micro = small_run();
  big.epochs = micro.epochs = 1;
  big.limit = micro.limit = 128;  // one step
  big.batch = 128;
  big.save = temp("big.ckpt");
  micro.batch = 32;
  micro.accumulate = 4;
  micro.save = temp("micro.ckpt");
  run_training(big);
  run_training(micro);
  const auto a = checkpoint_floats(big.save, "exp_avg"), b = checkpoint_floats(micro.save, "exp_avg");
  ASSERT_EQ(a.size(), b.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * double(a[i] - b[i]);
    norm += a[i] * double(a[i]);
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-5);
  EXPECT_NE(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "the two runs must really differ in how they sum";
}

// Two epochs in one run, and one epoch then a resume for the second: the
// same checkpoint, byte for byte (weights, moments, step count).
TEST(Training, ResumeContinuesExactly) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  for (const char* optimizer : {"adam", "lamb"}) {
    TrainOptions straight = small_run();
    straight.optimizer = optimizer;
    straight.save = temp(std::string(optimizer) + "_straight.ckpt");
    run_on_dataset(straight);
    TrainOptions first = small_run();  // 2 epochs' schedule, stopped after the first
    first.optimizer = optimizer;
    first.stop_after = 1;
    first.save = temp(std::string(optimizer) + "_first.ckpt");
    TrainOptions second = small_run();
    second.optimizer = optimizer;
    second.resume = first.save;
    second.save = temp(std::string(optimizer) + "_second.ckpt");
    run_on_dataset(first);
    run_on_dataset(second);
    std::ifstream a(straight.save, std::ios::binary), b(second.save, std::ios::binary);
    const std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
    EXPECT_FALSE(sa.empty());
    EXPECT_EQ(sa, sb) << optimizer;
  }
}

// One rank, sharded (stage 1 and 2) and not: the same checkpoint byte for
// byte (the sharded optimizer writes the unsharded format, and one rank's
// layout puts every tensor where the arena does), with f32 weights and with
// bf16 weights and remainder masters; a sharded run resumes.
TEST(Training, ShardedRunWritesTheUnshardedCheckpoint) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  for (const char* optimizer : {"adam", "lamb"}) {
    for (const char* master : {"f32", "remainder"}) {
      TrainOptions plain = small_run();
      plain.optimizer = optimizer;
      plain.master = master;
      plain.save = temp("plain.ckpt");
      run_on_dataset(plain);
      for (int stage : {1, 2}) {
        TrainOptions sharded = small_run();
        sharded.optimizer = optimizer;
        sharded.master = master;
        sharded.shard = stage;
        sharded.save = temp("sharded.ckpt");
        run_on_dataset(sharded);
        EXPECT_EQ(bytes(sharded.save), bytes(plain.save)) << optimizer << " " << master << " master, stage " << stage;
      }
    }
    TrainOptions plain = small_run();
    plain.optimizer = optimizer;
    plain.save = temp("plain.ckpt");
    run_on_dataset(plain);
    TrainOptions first = small_run(), second = small_run();
    first.optimizer = second.optimizer = optimizer;
    first.shard = second.shard = 1;
    first.stop_after = 1;
    first.save = temp("sharded_first.ckpt");
    second.resume = first.save;
    second.save = temp("sharded_second.ckpt");
    run_on_dataset(first);
    run_on_dataset(second);
    EXPECT_EQ(bytes(second.save), bytes(plain.save)) << optimizer;
  }
}

// 8- and 4-bit moments and remainder masters: a short run ends within 5% of
// the f32 run's training loss (measured: within 0.4%), for Adam and LAMB;
// with 4-bit moments within 10% (measured: Adam 2.4% above with f32 masters,
// 3.4% with remainders, LAMB 3.9%; on the linear map before state format 4,
// Adam's were 6.3% and 7.1%: docs/ops.md "4-bit moments"). Two epochs of
// 2048 images are short of issue 38's 300-step comparison (python/tests).
TEST(Training, EightBitMomentsAndRemainderMastersEndNearTheF32Loss) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  for (const char* optimizer : {"adam", "lamb"}) {
    TrainOptions f32 = small_run();
    f32.optimizer = optimizer;
    const double want = run_on_dataset(f32).back().train_loss;
    std::vector<std::pair<std::string, std::string>> variants = {{"int8", "f32"}, {"bf16", "f32"}, {"int4", "f32"}};
    if (std::string(optimizer) == "adam") {
      variants.push_back({"int8", "remainder"});
      variants.push_back({"int4", "remainder"});
    }
    for (const auto& [moments, master] : variants) {
      TrainOptions o = small_run();
      o.optimizer = optimizer;
      o.moments = moments;
      o.master = master;
      const double got = run_on_dataset(o).back().train_loss;
      const double bound = moments == "int4" ? 0.10 : 0.05;
      EXPECT_LT(std::abs(got - want), bound * want) << optimizer << " " << moments << " moments, " << master << " master";
      EXPECT_NE(got, want) << "the storage must change something";
    }
  }
}

// Runs `o` straight through, and again stopped after epoch 1 (checkpoint
// <name>_first.ckpt) then resumed from it: both final checkpoints must be
// the same bytes (`what` labels a failure). Returns the straight run's.
std::string expect_resumed_run_equals_straight(TrainOptions o, const std::string& name, const std::string& what) {
  TrainOptions straight = o, first = o, second = o;
  straight.save = temp(name + "_straight.ckpt");
  first.save = temp(name + "_first.ckpt");
  second.save = temp(name + "_second.ckpt");
  first.stop_after = 1;
  second.resume = first.save;
  run_on_dataset(straight);
  run_on_dataset(first);
  run_on_dataset(second);
  std::ifstream a(straight.save, std::ios::binary), b(second.save, std::ios::binary);
  const std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_FALSE(sa.empty()) << what;
  EXPECT_TRUE(sa == sb) << what;
  return straight.save;
}

// Resumed runs with 8- and 4-bit moments (Adam and LAMB), remainder masters
// and sharded 8- and 4-bit runs: the checkpoint of the straight run, byte for byte.
TEST(Training, ResumesWithEightBitMomentsAndRemainderMasters) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  struct Variant {
    const char* optimizer;
    const char* moments;
    const char* master;
    int shard;
  };
  for (const Variant& v : {Variant{"adam", "int8", "f32", 0}, Variant{"adam", "int8", "remainder", 0},
                           Variant{"adam", "int4", "f32", 0}, Variant{"adam", "int4", "remainder", 0},
                           Variant{"lamb", "int8", "f32", 0}, Variant{"lamb", "int4", "f32", 0},
                           Variant{"adam", "int8", "f32", 1}, Variant{"adam", "int4", "f32", 1},
                           Variant{"lamb", "int8", "f32", 2}, Variant{"lamb", "int4", "f32", 2}}) {
    TrainOptions o = small_run();
    o.optimizer = v.optimizer;
    o.moments = v.moments;
    o.master = v.master;
    o.shard = v.shard;
    const std::string what = std::string(v.optimizer) + " " + v.moments + " " + v.master + " shard " + std::to_string(v.shard);
    // The checkpoint holds the 8- or 4-bit state: u8 codes and their absmax.
    const StateFile file = StateFile::read(expect_resumed_run_equals_straight(o, "v", what));
    EXPECT_FALSE(file.get("exp_avg_absmax").empty()) << what;
    if (std::string(v.master) == "remainder") EXPECT_FALSE(file.get("masters").empty()) << what;
  }
  // A checkpoint of f32 moments does not resume an 8-bit run, and says why.
  TrainOptions f32 = small_run();
  f32.stop_after = 1;
  f32.save = temp("v_f32.ckpt");
  run_on_dataset(f32);
  TrainOptions eight = small_run();
  eight.moments = "int8";
  eight.resume = f32.save;
  expect_error([&] { run_on_dataset(eight); }, ErrorCode::io_error, {"moments of dtype f32, expected u8"});
}

// --optimizer muon: Muon for W1 and W2, Adam for the output layer and the
// biases (train/muon_adam.h). Over 2 epochs of 8192 images (128 steps) it
// ends level with Adam, as the Muon papers report at small scale ("at or
// below"): measured on a 2-core AMD EPYC VM, Muon 0.4672 against Adam
// 0.4668 with the sgemm kernels OpenBLAS picks there (Cooperlake), 0.4670
// with SkylakeX's, below Adam with Haswell's and Zen's (OPENBLAS_CORETYPE);
// test accuracy 0.833 against 0.825. Which of the two ends lower is decided
// by the kernels' rounding, so the test asks for Muon's loss within 1% of
// Adam's, below its own first epoch's, and an accuracy above 0.8. Over
// small_run's 32 steps Muon is still behind, 1.22 against 0.63: its update
// RMS matches AdamW's settled one, 0.2 lr, not Adam's first steps'. Its
// momentum is in the checkpoint beside Adam's moments under their prefixes,
// and a resumed run writes the straight run's checkpoint byte for byte,
// with f32 and bf16 momentum.
TEST(Training, MuonTrainsAndResumes) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TrainOptions adam = small_run(), muon = small_run();
  adam.limit = muon.limit = 8192;
  muon.optimizer = "muon";
  const double adam_loss = run_on_dataset(adam).back().train_loss;
  const std::vector<EpochResult> muon_results = run_on_dataset(muon);
  EXPECT_LT(muon_results.back().train_loss, 1.01 * adam_loss) << "Muon " << muon_results.back().train_loss
                                                               << " against Adam " << adam_loss;
  EXPECT_LT(muon_results.back().train_loss, muon_results.front().train_loss);
  EXPECT_GT(muon_results.back().test_accuracy, 0.8);
  for (const char* moments : {"f32", "bf16"}) {
    TrainOptions o = small_run();
    o.optimizer = "muon";
    o.moments = moments;
    const StateFile file = StateFile::read(expect_resumed_run_equals_straight(o, "muon", moments));
    // W1 (256 x 784) and W2 (128 x 256) in Muon's momentum; Adam's moments
    // over W3 (10 x 128) and the three biases.
    const size_t width = std::string(moments) == "f32" ? 4 : 2;
    EXPECT_EQ(file.get("muon.momentum_buffer").size(), (256 * 784 + 128 * 256) * width) << moments;
    EXPECT_EQ(file.get("adam.exp_avg").size(), (10 * 128 + 256 + 128 + 10) * width) << moments;
  }
  // A Muon checkpoint does not resume an Adam run.
  TrainOptions plain = small_run();
  plain.resume = temp("muon_first.ckpt");  // the bf16 Muon run's, stopped after epoch 1
  expect_error([&] { run_on_dataset(plain); }, ErrorCode::io_error, {"another optimizer"});
  // One without one of Muon's sections is refused naming the file, the prefix and the section.
  const StateFile whole = StateFile::read(plain.resume);
  StateFile cut;
  for (const std::string& name : whole.names()) {
    if (name != "muon.meta") cut.add(name, whole.get(name));
  }
  const std::string cut_path = temp("muon_cut.ckpt");
  cut.write(cut_path);
  TrainOptions resume_cut = small_run();
  resume_cut.optimizer = "muon";
  resume_cut.moments = "bf16";
  resume_cut.resume = cut_path;
  expect_error([&] { run_on_dataset(resume_cut); }, ErrorCode::io_error,
               {"checkpoint '" + cut_path + "'", "its 'muon.' sections", "'meta'"});
}

TEST(Training, RefusesACheckpointOfAnotherRun) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TrainOptions adam = small_run();
  adam.stop_after = 1;
  adam.save = temp("adam.ckpt");
  run_on_dataset(adam);
  auto expect_refused = [&](TrainOptions o, const std::string& fragment) {
    o.resume = adam.save;
    try {
      run_on_dataset(o);
      ADD_FAILURE() << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  TrainOptions lamb = small_run();
  lamb.optimizer = "lamb";
  expect_refused(lamb, "another optimizer");
  TrainOptions longer = small_run();
  longer.epochs = 3;
  expect_refused(longer, "schedule");
  TrainOptions other_batch = small_run();
  other_batch.batch = 32;
  expect_refused(other_batch, "batch");
}

std::vector<std::string> lines_of(const std::string& path) {
  std::vector<std::string> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

constexpr const char* kLogHeader = "epoch,train_loss,test_accuracy,samples_per_second,seconds";

// A resumed run that logs to a new (or empty) file starts it with the
// header; one that logs to the earlier run's file appends to it.
TEST(Training, ResumedRunWritesTheLogsHeaderToANewFile) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TrainOptions first = small_run();
  first.stop_after = 1;
  first.save = temp("log.ckpt");
  first.log = temp("log_first.csv");
  run_on_dataset(first);
  TrainOptions second = small_run();
  second.resume = first.save;
  second.log = temp("log_new.csv");
  std::remove(second.log.c_str());
  for (int empty = 0; empty < 2; ++empty) {
    if (empty) std::ofstream(second.log, std::ios::trunc).close();
    run_on_dataset(second);
    const std::vector<std::string> lines = lines_of(second.log);
    ASSERT_EQ(lines.size(), 2u) << (empty ? "empty file" : "new file");
    EXPECT_EQ(lines[0], kLogHeader);
    EXPECT_TRUE(lines[1].starts_with("2,")) << lines[1];
  }
  second.log = first.log;
  run_on_dataset(second);
  const std::vector<std::string> lines = lines_of(first.log);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], kLogHeader);
  EXPECT_TRUE(lines[1].starts_with("1,")) << lines[1];
  EXPECT_TRUE(lines[2].starts_with("2,")) << lines[2];
}

// What can be known before any work is checked before any work.
TEST(Training, ChecksItsOptionsFirst) {
  TrainOptions o = small_run();
  o.stop_after = 3;
  expect_error([&] { check_train_options(o, true); }, ErrorCode::invalid_argument,
               {"--stop-after: expected an epoch from 0 to --epochs (2), not '3'"});
  o = small_run();
  o.plot = temp("curves.png");
  expect_error([&] { check_train_options(o, true); }, ErrorCode::invalid_argument, {"--plot: needs --log"});
  o = small_run();
  o.save = "/proc/nope/ck";
  check_train_options(o, /*writes=*/false);  // only the rank that writes checks its files
  expect_error([&] { check_train_options(o, true); }, ErrorCode::io_error, {"--save: cannot write '/proc/nope/ck'"});
  expect_error([&] { run_training(o); }, ErrorCode::io_error, {"--save: cannot write '/proc/nope/ck'"});
  o = small_run();
  o.shard = 2;
  o.reduce = "adasum";
  expect_error([&] { check_train_options(o, false); }, ErrorCode::invalid_argument,
               {"--shard: needs --reduce allreduce"});
  o = small_run();
  o.moments = "int2";
  expect_error([&] { check_train_options(o, false); }, ErrorCode::invalid_argument,
               {"--moments: expected f32, bf16, int8 or int4, not 'int2'"});
  o = small_run();
  o.optimizer = "sgd";
  expect_error([&] { check_train_options(o, false); }, ErrorCode::invalid_argument,
               {"--optimizer: expected adam, lamb or muon, not 'sgd'"});
  const std::pair<std::function<void(TrainOptions&)>, const char*> muon_refusals[] = {
      {[](TrainOptions& t) { t.device = "cuda"; }, "--device cuda"},
      {[](TrainOptions& t) { t.shard = 1; }, "--shard"},
      {[](TrainOptions& t) { t.master = "remainder"; }, "--master remainder"},
      {[](TrainOptions& t) { t.moments = "int8"; }, "--moments int8 or int4"},
      {[](TrainOptions& t) { t.widths = {784, 10}; }, "without a weight matrix before its output layer"}};
  for (const auto& [change, fragment] : muon_refusals) {
    o = small_run();
    o.optimizer = "muon";
    change(o);
    expect_error([&] { check_train_options(o, false); }, ErrorCode::invalid_argument,
                 {"--optimizer muon: cannot be used with", fragment});
  }
  o = small_run();
  o.master = "remainder";
  o.device = "cuda";
  expect_error([&] { check_train_options(o, false); }, ErrorCode::invalid_argument,
               {"--master remainder: needs bf16 weights", "--device cuda trains f16"});
  o.device = "cpu";
  o.optimizer = "lamb";
  for (const char* moments : {"int8", "int4"}) {
    o.moments = moments;
    expect_error([&] { check_train_options(o, false); }, ErrorCode::invalid_argument,
                 {"--master remainder: --optimizer lamb needs --moments f32 or bf16"});
  }
  o.moments = "f32";
  check_train_options(o, false);  // LAMB with float moments takes remainder masters
  o.optimizer = "adam";
  o.shard = 1;
  check_train_options(o, false);  // the sharded step keeps remainders too
  o = small_run();
  o.resume = temp("no_such.ckpt");
  expect_error([&] { check_train_options(o, false); }, ErrorCode::io_error,
               {"--resume: state file '" + o.resume + "': cannot be opened"});
  o.resume = ::testing::TempDir();  // opens, but is no file: named before any work
  expect_error([&] { check_train_options(o, false); }, ErrorCode::io_error, {"--resume:", "is a directory"});
}

// --offload where it cannot run: refused before any work, naming the option.
TEST(Training, RefusesOffloadWhereItCannotRun) {
  TrainOptions o = small_run();
  o.offload = true;
  expect_error([&] { check_train_options(o, false); }, ErrorCode::invalid_argument, {"--offload: needs --device cuda"});
  o.device = "cuda";
  o.shard = 1;
  expect_error([&] { check_train_options(o, false); }, ErrorCode::invalid_argument,
               {"--offload: cannot be combined with --shard"});
}

// On a GPU: the offloaded step is the GPU step bit for bit, so an offloaded
// run writes the GPU run's checkpoint byte for byte; and it resumes from a
// checkpoint of the GPU run (the formats are one). Adam, and LAMB with
// 8-bit moments (with float moments the CPU's and the GPU's LAMB round the
// norms otherwise, docs/ops.md; test_offloaded_lamb holds that case).
TEST(Training, OffloadedRunWritesTheGpuRunsCheckpoint) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  for (const std::string optimizer : {"adam", "lamb"}) {
    SCOPED_TRACE("--optimizer " + optimizer);
    TrainOptions gpu = small_run(), offloaded = small_run(), first = small_run(), resumed = small_run();
    for (TrainOptions* o : {&gpu, &offloaded, &first, &resumed}) {
      o->device = "cuda";
      o->optimizer = optimizer;
      if (optimizer == "lamb") o->moments = "int8";
    }
    offloaded.offload = resumed.offload = true;
    gpu.save = temp("gpu_" + optimizer + ".ckpt");
    offloaded.save = temp("offloaded_" + optimizer + ".ckpt");
    first.stop_after = 1;
    first.save = temp("gpu_first_" + optimizer + ".ckpt");
    resumed.resume = first.save;
    resumed.save = temp("offloaded_resumed_" + optimizer + ".ckpt");
    run_on_dataset(gpu);
    run_on_dataset(offloaded);
    EXPECT_EQ(bytes(offloaded.save), bytes(gpu.save));
    run_on_dataset(first);
    run_on_dataset(resumed);
    EXPECT_EQ(bytes(resumed.save), bytes(gpu.save));
  }
}

// check_writable makes a file to know, and leaves none behind.
TEST(CheckWritable, ProbesTheDirectoryAndLeavesNothing) {
  namespace fs = std::filesystem;
  const std::string dir = temp("writable");
  fs::remove_all(dir);
  fs::create_directory(dir);
  tool::check_writable("--save", dir + "/run.ckpt", /*in_place=*/false);
  tool::check_writable("--log", dir + "/log.csv", /*in_place=*/true);
  EXPECT_TRUE(fs::is_empty(dir));
  std::ofstream(dir + "/log.csv") << "kept";
  tool::check_writable("--log", dir + "/log.csv", /*in_place=*/true);
  EXPECT_EQ(lines_of(dir + "/log.csv"), std::vector<std::string>{"kept"});
  expect_error([&] { tool::check_writable("--save", dir + "/missing/run.ckpt", false); }, ErrorCode::io_error,
               {"--save: cannot write '" + dir + "/missing/run.ckpt': no file can be created in '" + dir +
                "/missing'"});
  expect_error([&] { tool::check_writable("--plot", dir, true); }, ErrorCode::io_error, {"it is a directory"});
}

}  // namespace
}  // namespace gradkit::train

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  gradkit::MpiEnvironment mpi(&argc, &argv);
  return RUN_ALL_TESTS();
}
