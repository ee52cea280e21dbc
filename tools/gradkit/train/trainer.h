// Data-parallel training of an MLP on Fashion-MNIST with gradkit doing
// everything after backward: the gradient arena, micro-batch accumulation,
// the all-reduce, and the optimizer.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace gradkit::train {

struct FashionMnist;  // train/fashion_mnist.h

struct TrainOptions {
  std::string data_dir;
  std::string device = "cpu";  // cpu | cuda (one GPU per rank, f16 with dynamic loss scaling)
  std::vector<int> widths = {784, 256, 128, 10};
  int epochs = 12;
  int stop_after = 0;      // stop after this epoch (0: run all); the schedule still spans `epochs`
  int batch = 64;          // images per micro-batch per rank
  int accumulate = 1;      // micro-batches per step
  // adam | lamb | muon (Muon for the weight matrices but the output layer's,
  // Adam for the rest: train/muon_adam.h; cpu only, unsharded, f32 weights)
  std::string optimizer = "adam";
  std::string moments = "f32";      // f32 | bf16 | int8 | int4 (8- or 4-bit blockwise moments)
  // f32 | remainder: bf16 weights whose f32 master is the weight plus an
  // i16 remainder (the CPU backend then trains bf16 weights through
  // MixedPrecision<Adam or Lamb>); unsharded, LAMB with f32/bf16 moments
  // only, not on cuda (f16 weights).
  std::string master = "f32";
  float lr = 1e-3f;
  float weight_decay = 0.0f;
  std::string reduce = "allreduce";  // allreduce | adasum
  // ZeRO stage: 0 unsharded; 1 the optimizer state split across ranks
  // (Sharded<Adam or Lamb>); 2 also each bucket reduce-scattered once its gradients
  // are final (mark_ready).
  int shard = 0;
  // The optimizer state in host memory and the Adam or LAMB step on the CPU
  // (gradkit::OffloadedAdam, OffloadedLamb); needs --device cuda.
  bool offload = false;
  uint64_t seed = 1;
  int64_t limit = 0;       // use only the first `limit` training images (0: all)
  std::string save;        // checkpoint after every epoch (atomic)
  std::string resume;      // start from this checkpoint
  std::string log = "gradkit-train.csv";
  std::string plot;        // PNG of the loss and accuracy curves (needs `log`)
  bool progress = true;    // rank 0 draws a progress bar (the caller decides: a terminal's)
  // How long a rank waits for the others in a collective before it fails
  // (the communicators' timeout): a rank that stops without dying ends the run.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

struct EpochResult {
  int epoch;
  double train_loss;
  double test_accuracy;
  double samples_per_second;
  double seconds;
};

// Throws gradkit::Error naming the option unless the options fit together
// and, where `writes` (the rank that writes them), the files of --save, --log
// and --plot can be written: what can be known before any work.
void check_train_options(const TrainOptions& options, bool writes);

// Runs the training in this process, one rank of the MPI job (MPI must be
// initialized). Checks the options first (check_train_options). Returns
// every epoch's result (the same on every rank).
std::vector<EpochResult> run_training(const TrainOptions& options);

// The same training on `data` (load_fashion_mnist's) instead of the files in
// options.data_dir: a caller that trains many times in one process (the
// tests) reads and converts the dataset once.
std::vector<EpochResult> run_training(const TrainOptions& options, const FashionMnist& data);

}  // namespace gradkit::train
