// Adasum all-reduce over a tensor list (ONNX Runtime's AdasumAllReduce, but
// on the GPU without host staging): every tensor becomes the adaptive sum of
// that tensor over all ranks, where two vectors combine as
//
//     adasum(a, b) = (1 - a·b / (2 |a|²)) a + (1 - a·b / (2 |b|²)) b
//
// per tensor (a coefficient whose vector's norm is zero is 1), so that
// orthogonal gradients add and parallel ones average. docs/ops.md ("Adasum")
// states the exact math, the combination order for any number of ranks, the
// hierarchical mode and what happens with zero norms, Inf and NaN.
//
// It runs as vector halving, distance doubling (VHDD) over the
// communicator's point-to-point exchanges: on an NCCL communicator entirely
// on the GPU (ncclSend/ncclRecv and CUDA kernels, enqueued on the stream,
// nothing copied through host memory, nothing that waits on the host); on an
// MPI communicator on host memory.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "gradkit/comm/communicator.h"

namespace gradkit {

struct AdasumOptions {
  // Sum inside each node first (a reduce-scatter over the node's ranks),
  // run Adasum across nodes only, then all-gather inside the node: the
  // bulk of the bytes moves over the fast links within a node.
  bool hierarchical = false;
  // Hierarchical only: the ranks of one node, a power of two dividing
  // size(); node n is the ranks [n * ranks_per_node, (n + 1) * ranks_per_node).
  // 0 means local_size() (the ranks of each host must then be consecutive,
  // as mpiexec places them by default). A smaller value declares smaller
  // "nodes", e.g. to test the mode on one host.
  int ranks_per_node = 0;
};

// Adasum of one list, planned once and run many times. Every rank makes the
// plan (the constructor is collective when options.hierarchical and
// ranks_per_node is 0: the ranks check the node layout together) and then
// calls run() in the same order. The plan validates the list (one dtype,
// every tensor on comm.device(), no nulls, no overlaps) and the options,
// throwing before anything is written; it keeps the tensors' pointers, a
// working copy of the list (padded to a multiple of the ranks) and a half
// of it for receiving, on the communicator's device. Runs of one plan must
// be ordered (one stream, or the caller orders them).
class AdasumPlan {
 public:
  AdasumPlan(Communicator& comm, std::span<const TensorView> tensors, AdasumOptions options = {});
  ~AdasumPlan();
  AdasumPlan(AdasumPlan&&) noexcept;
  AdasumPlan& operator=(AdasumPlan&&) noexcept;

  // Every tensor becomes the Adasum over ranks, in place. NCCL: enqueued on
  // `stream` (wait with comm.wait(stream)); MPI: complete when it returns.
  // In checked mode, first compares the call (list shape, dtype, options)
  // across ranks and throws on every rank if they differ.
  void run(Stream stream = {});

  // Bytes this rank sends in one run (the fold, the halvings and the
  // all-gather), for bandwidth figures.
  int64_t bytes_sent() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Plans and runs once. The plan's buffers are freed on return, which on the
// GPU waits for the run to finish: in a loop, keep an AdasumPlan instead.
void adasum_all_reduce(Communicator& comm, std::span<const TensorView> tensors, AdasumOptions options = {},
                       Stream stream = {});

}  // namespace gradkit
