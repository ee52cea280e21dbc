// Ranks of a data-parallel job and the collectives between them: all-reduce,
// all-gather and reduce-scatter over lists of tensors (ONNX Runtime's
// NcclAllReduce, NcclAllGather, NcclReduceScatter), over flat buffers, and
// the small pieces Adasum builds on. docs/ops.md ("Collectives") states
// exactly what each computes.
//
// Two implementations: MPI (host memory, device() is the CPU; calls complete
// before they return) and NCCL (memory on device(), the GPU of this rank;
// calls are enqueued on a CUDA stream and return at once). Neither this header
// nor any other gradkit header needs mpi.h or nccl.h. A build may have
// either, both or neither (has_mpi_communicator, has_nccl_communicator);
// everything else in the layer needs neither.
//
// Every rank must make the same calls in the same order with the same list
// shapes (count, element counts, dtype). `checked` mode verifies that before
// each collective and throws on every rank, naming what differs.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/core/tensor.h"

namespace gradkit {

namespace comm {
class ListCheckCache;  // src/comm/tensor_list.h
}

enum class ReduceOp : uint8_t {
  sum,
  average,  // the sum divided by size(), in f32 (f64 for f64), rounded once
};

struct CommunicatorOptions {
  // How long a call may wait for the other ranks before it gives up with an
  // Error (mpi_error or nccl_error) instead of hanging. A communicator that
  // timed out is unusable afterwards (NCCL: aborted; MPI: a collective cannot
  // be cancelled), and every later call on it throws.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  // Compare each call's fingerprint (operation, tensor count, element counts,
  // dtype, and for a list all-reduce the two NCCL settings below) across
  // ranks before the collective; costs one small host exchange.
  bool checked = false;
  // NCCL only: the CUDA ordinal this rank uses; -1 means local_rank() (for
  // a communicator made from a unique id: the calling thread's current device).
  int cuda_device = -1;
  // NCCL only: a list with no tensor of direct_tensor_bytes and more than
  // twice this many bytes is all-reduced in pieces of about this size, so
  // that packing piece i + 1 and unpacking piece i - 1 overlap the collective
  // on piece i (a back-to-back list goes in the same pieces, uncopied). 0
  // means one piece (pack, collective, unpack in turn). 256 MiB: the best of
  // 64, 128, 256 MiB and one piece for the BERT-large list all packed on
  // 2x H200 (measured: bench/log/2026-11-22.md).
  size_t fusion_pipeline_bytes = size_t{256} << 20;
  // NCCL only: in a list, each tensor of at least this many bytes is
  // all-reduced where it lies (one collective each, all
  // in one NCCL group) instead of going through the fusion buffer; the
  // smaller ones are still packed. 0 packs everything. 1 MiB: the BERT-large
  // list then takes about the flat buffer's time on 2x H200 (measured:
  // bench/log/2026-11-22.md, "large tensors reduced where they lie").
  // This and fusion_pipeline_bytes decide which collectives an all-reduce
  // issues: every rank must use the same values (checked mode compares them).
  size_t direct_tensor_bytes = size_t{1} << 20;
  // NCCL only: once the ranks have started (on a non-blocking NCCL
  // communicator, so that start-up times out), every call goes to a
  // blocking NCCL communicator made from a new unique id, and a watchdog
  // thread keeps the timeout: when a call stays inside NCCL, or the work it
  // enqueued stays unfinished, for longer than the timeout, or NCCL reports
  // a failed peer or network, it ends the communicator's work
  // (ncclCommRevoke where NCCL has it, 2.28.7 and later; else
  // ncclCommAbort), and the next call or wait() throws. Each call costs
  // the raw NCCL call's host time plus a few microseconds (an event
  // recorded for the watchdog). false: the non-blocking communicator
  // carries everything; NCCL hands each of its calls to a new thread and
  // answers "in progress" (NCCL 2.28's ncclGroupEndInternal), which the
  // call polls: 150-300 us more host time per call with 4 ranks (measured:
  // bench/log/2026-11-23.md, "Ranks sharing one H100"), and a stuck call's
  // work is found only by wait().
  bool blocking_calls = true;
};

// An MPI communicator passed through gradkit's API without mpi.h: wrap one
// with mpi_comm_handle(comm). The default (value 0) means MPI_COMM_WORLD.
// gradkit duplicates the communicator it is given, so its traffic never
// mixes with the caller's.
struct MpiCommHandle {
  std::uintptr_t value = 0;
  bool is_world() const { return value == 0; }
};

// MPI_Comm is a pointer in Open MPI and an int in MPICH; both fit.
template <class MpiComm>
MpiCommHandle mpi_comm_handle(MpiComm comm) {
  if constexpr (std::is_pointer_v<MpiComm>) return {reinterpret_cast<std::uintptr_t>(comm)};
  else return {static_cast<std::uintptr_t>(comm)};
}

// Starts MPI for the lifetime of the object (MPI_Init_thread, then
// MPI_Finalize), unless MPI is already initialized, in which case it does
// nothing. Destroy every communicator before it. Throws
// backend_unavailable when gradkit was built without MPI.
class MpiEnvironment {
 public:
  MpiEnvironment(int* argc, char*** argv);
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

 private:
  bool owns_ = false;
};

class Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }  // rank among the ranks of this host
  int local_size() const { return local_size_; }
  Device device() const { return device_; }       // where every tensor passed must be
  virtual std::string_view backend_name() const = 0;  // "mpi" or "nccl"

  bool checked() const { return checked_; }
  void set_checked(bool on) { checked_ = on; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // ---- Tensor lists. Each list has one dtype; every tensor is on device().
  // When the tensors lie back to back in one allocation (each starting where
  // the previous ended), one collective covers the whole range, with no
  // copies; otherwise they are packed into this communicator's fusion buffer
  // (kept between calls, grown when needed), reduced in one collective, and
  // unpacked. The second form is out of place: outputs[i] has the size and
  // dtype of inputs[i], and no output overlaps any input.

  // Every element of every tensor becomes the sum (or average) over ranks.
  void all_reduce(std::span<const TensorView> tensors, ReduceOp op = ReduceOp::sum, Stream stream = {});
  void all_reduce(std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                  ReduceOp op = ReduceOp::sum, Stream stream = {});

  // The list is the whole model on every rank, and rank r owns the elements
  // [shard_begin(r), shard_end(r)) of the list's concatenation (see
  // ShardLayout). All-gather: each element of the outputs becomes the value
  // its owner holds in its inputs; the inputs outside a rank's shard are
  // not read. Reduce-scatter: the elements of rank r's shard become the sum
  // (or average) over ranks; the other elements of the outputs are not
  // written.
  void all_gather(std::span<const TensorView> tensors, Stream stream = {});
  void all_gather(std::span<const TensorView> inputs, std::span<const TensorView> outputs, Stream stream = {});
  void reduce_scatter(std::span<const TensorView> tensors, ReduceOp op = ReduceOp::sum, Stream stream = {});
  void reduce_scatter(std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                      ReduceOp op = ReduceOp::sum, Stream stream = {});

  // ---- Flat buffers (the building blocks; also what Adasum uses).
  // input and output have the same size; output == input is in place.
  // A small f64 buffer reduced this way is how Adasum sums its dot products.
  void all_reduce_buffer(const TensorView& input, const TensorView& output, ReduceOp op = ReduceOp::sum,
                         Stream stream = {});
  // output has size() * input.numel elements; rank r's input lands at
  // r * input.numel. In place when input is that slice of output.
  void all_gather_buffer(const TensorView& input, const TensorView& output, Stream stream = {});
  // input has size() * output.numel elements; rank r gets the reduced slice
  // r. In place when output is that slice of input.
  void reduce_scatter_buffer(const TensorView& input, const TensorView& output, ReduceOp op = ReduceOp::sum,
                             Stream stream = {});
  // Several of the above at once: inputs[i] into outputs[i], each pair as
  // the single call takes it (dtypes may differ between pairs). Every pair
  // is validated before any is issued; NCCL issues them as one group (one
  // host round trip and one launch where NCCL can fuse them) rather than
  // one call each: a sharded step gathers many buckets at a time.
  void all_gather_buffers(std::span<const TensorView> inputs, std::span<const TensorView> outputs, Stream stream = {});
  void reduce_scatter_buffers(std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                              ReduceOp op = ReduceOp::sum, Stream stream = {});
  // Sends `send` to rank `peer` and receives the same number of bytes from it
  // into `receive` (the peer calls exchange with this rank). Not in place.
  void exchange(const TensorView& send, const TensorView& receive, int peer, Stream stream = {});
  // MPI_Alltoallv's meaning: `send` holds one section per rank in rank
  // order (send_counts[r] elements for rank r), `receive` likewise
  // (receive_counts[r] elements from rank r); rank s's section for this
  // rank lands in this rank's section s. Counts are elements of send's
  // dtype, which receive shares; each rank's send_counts[r] must be rank
  // r's receive_counts[this rank] (not checked across ranks: a mismatch is
  // the backend's error or a hang, as with MPI). Not in place.
  // MuonShardedPlan's exchanges (gradkit/optim/muon_sharded_step.h).
  void all_to_all(const TensorView& send, std::span<const int64_t> send_counts, const TensorView& receive,
                  std::span<const int64_t> receive_counts, Stream stream = {});
  // One-way transfers: `data` goes to rank `peer`, which calls receive() from
  // this rank with a buffer of the same number of bytes (Adasum's fold of the
  // ranks past a power of two, and the result's way back).
  void send(const TensorView& data, int peer, Stream stream = {});
  void receive(const TensorView& data, int peer, Stream stream = {});
  // Returns when every rank has called it (host-side; waits for nothing on a stream).
  void barrier();
  // Throws Error naming `op` if an earlier timeout or failure made this
  // communicator unusable (what a step made of several calls checks before
  // its first write).
  void require_usable(std::string_view op) const;
  // Returns when the work this communicator enqueued on `stream` has
  // finished, or throws once `timeout` has passed or a peer has failed
  // (NCCL: the communicator is then aborted). Use it rather than
  // cudaStreamSynchronize to get the timeout. MPI: returns at once.
  virtual void wait(Stream stream = {}) = 0;

  // Bytes currently held by the fusion buffer (for tests and for sizing).
  size_t fusion_buffer_bytes() const { return fusion_.bytes(); }
  // How many copy plans the fusion-buffer path has built (NCCL: one per
  // distinct list, kept for the next calls with the same list; MPI: none).
  // A count that grows every step means the lists move between steps.
  virtual size_t fusion_plans_built() const { return 0; }
  size_t fusion_pipeline_bytes() const { return fusion_pipeline_bytes_; }
  void set_fusion_pipeline_bytes(size_t bytes) { fusion_pipeline_bytes_ = bytes; }
  size_t direct_tensor_bytes() const { return direct_tensor_bytes_; }
  void set_direct_tensor_bytes(size_t bytes) { direct_tensor_bytes_ = bytes; }

 protected:
  Communicator(int rank, int size, int local_rank, int local_size, Device device,
               const CommunicatorOptions& options);

  // The engine's primitives, called after validation. Counts are elements;
  // in-place forms follow NCCL's conventions (see the public functions).
  virtual void do_all_reduce(const void* input, void* output, int64_t count, DType dtype, Stream stream) = 0;
  virtual void do_all_gather(const void* input, void* output, int64_t count_per_rank, DType dtype,
                             Stream stream) = 0;
  virtual void do_reduce_scatter(const void* input, void* output, int64_t count_per_rank, DType dtype,
                                 Stream stream) = 0;
  // One all-gather (or reduce-scatter) per call, issued together (NCCL: in
  // one group); by default one after another.
  struct BufferCall {
    const void* input;
    void* output;
    int64_t count_per_rank;
    DType dtype;
  };
  virtual void do_all_gathers(std::span<const BufferCall> calls, Stream stream);
  virtual void do_reduce_scatters(std::span<const BufferCall> calls, Stream stream);
  virtual void do_exchange(const void* send, void* receive, size_t bytes, int peer, Stream stream) = 0;
  // Bytes to and from each rank, at their offsets (validated, in bounds).
  struct Sections {
    std::span<const size_t> bytes;
    std::span<const size_t> offsets;
  };
  virtual void do_all_to_all(const void* send, const Sections& to, void* receive, const Sections& from,
                             Stream stream) = 0;
  virtual void do_send(const void* data, size_t bytes, int peer, Stream stream) = 0;
  virtual void do_receive(void* data, size_t bytes, int peer, Stream stream) = 0;
  virtual void do_barrier() = 0;
  // A blocking all-gather of `bytes` host bytes from each rank, for the
  // fingerprints of checked mode; bounded by the timeout.
  virtual void host_all_gather(const void* input, void* output, size_t bytes) = 0;

  // Memory operations on device() memory, ordered on `stream`.
  virtual void copy(void* destination, const void* source, size_t bytes, Stream stream) = 0;
  virtual void fill_zero(void* destination, size_t bytes, Stream stream) = 0;
  // data[i] = round(float(data[i]) / divisor) (f64 arithmetic for f64).
  virtual void divide(void* data, int64_t count, DType dtype, int divisor, Stream stream) = 0;
  // Brackets a use of the fusion buffer on `stream`, so that uses on
  // different streams do not overlap (NCCL orders them with an event).
  virtual void fusion_begin(Stream) {}
  virtual void fusion_end(Stream) {}
  // The elements [begin, end) of the list's concatenation into the fusion
  // buffer (element k at fusion + k * dtype size), and back. The defaults
  // copy piece by piece with copy(); NCCL copies with one kernel.
  virtual void pack(std::span<const TensorView> inputs, unsigned char* fusion, int64_t begin, int64_t end,
                    Stream stream);
  virtual void unpack(const unsigned char* fusion, std::span<const TensorView> outputs, int64_t begin, int64_t end,
                      Stream stream);
  // The all-reduce of a list, after validation: `source` is the contiguous
  // input, or null to pack `inputs` into the fusion buffer; `destination`
  // the contiguous output, or null to reduce into the fusion buffer and
  // unpack into `outputs`. Which collectives an engine issues must depend
  // only on the list's shape (counts, dtype) and the communicator's
  // settings, never on where the tensors lie: ranks whose lists are laid out
  // differently must still make matching calls. The default packs, reduces,
  // divides and unpacks in turn on `stream`, one collective over the whole
  // list; NCCL reduces large tensors where they lie and the rest in pieces
  // (direct_tensor_bytes, fusion_pipeline_bytes). Whatever uses the fusion
  // buffer brackets that use with fusion_begin / fusion_end.
  struct ListReduce {
    std::span<const TensorView> inputs;
    std::span<const TensorView> outputs;
    const unsigned char* source;
    unsigned char* destination;
    int64_t total;
    DType dtype;
    ReduceOp reduce;
  };
  virtual void list_all_reduce(const ListReduce& r, Stream stream);
  // What else decides the collectives list_all_reduce issues (0 when
  // nothing does); checked mode compares it across ranks.
  virtual uint32_t list_settings() const { return 0; }
  // The fusion buffer, at least `bytes` long (grow-only: reallocated only
  // when a call needs more).
  unsigned char* fusion_bytes(size_t bytes);

  // For an engine that learns the host layout only once it has joined the
  // other ranks (NCCL from a unique id: the ranks' host names).
  void set_local_layout(int local_rank, int local_size) {
    local_rank_ = local_rank;
    local_size_ = local_size;
  }

  void mark_unusable(const std::string& why) { failure_ = why; }

 private:
  // Adasum (adasum.h) checks its calls' fingerprints and the node layout
  // through the same host exchanges as the collectives.
  friend class AdasumPlan;

  void check_fingerprint(std::string_view op, int kind, ReduceOp reduce, std::span<const TensorView> tensors);
  // `variant` is the call's reduction, or what else tells two calls of one kind apart.
  void check_fingerprint(std::string_view op, int kind, uint32_t variant, std::span<const TensorView> tensors);
  void reduce_list(std::string_view op, std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                   ReduceOp reduce, Stream stream);
  void gather_list(std::string_view op, std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                   Stream stream);
  void scatter_list(std::string_view op, std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                    ReduceOp reduce, Stream stream);
  // The flat-buffer all-gathers and reduce-scatters, one pair or several
  // (`listed`: the arguments are named inputs[i] / outputs[i]).
  void gather_buffers(std::string_view op, int kind, std::span<const TensorView> inputs,
                      std::span<const TensorView> outputs, bool listed, Stream stream);
  void scatter_buffers(std::string_view op, int kind, std::span<const TensorView> inputs,
                       std::span<const TensorView> outputs, ReduceOp reduce, bool listed, Stream stream);
  // Validates every pair (all before anything is issued) and returns the
  // non-empty ones as calls; `gather`: outputs are the whole buffers.
  std::vector<BufferCall> check_buffer_pairs(std::string_view op, std::span<const TensorView> inputs,
                                             std::span<const TensorView> outputs, bool listed, bool gather) const;

  int rank_;
  int size_;
  int local_rank_;
  int local_size_;
  Device device_;
  bool checked_;
  std::chrono::milliseconds timeout_;
  std::string failure_;
  Buffer fusion_;  // grow-only: reallocated only when a call needs more
  size_t fusion_pipeline_bytes_;
  size_t direct_tensor_bytes_;
  std::unique_ptr<comm::ListCheckCache> list_checks_;  // lists already validated
};

// How all-gather and reduce-scatter split a list among ranks (ONNX Runtime's
// rule): the concatenation's element count is padded up so that each rank's
// share is a multiple of 32 bytes and the padded total divides by the world
// size. Rank r owns [r * shard, (r + 1) * shard) of the padded
// concatenation; the part of it past `total` is padding.
struct ShardLayout {
  int64_t total = 0;         // elements in the list
  int64_t padded_total = 0;  // world_size * shard
  int64_t shard = 0;         // elements per rank

  static ShardLayout of(int64_t total, DType dtype, int world_size);
  int64_t begin(int rank) const { return std::min(total, rank * shard); }
  int64_t end(int rank) const { return std::min(total, (rank + 1) * shard); }
};

// An MPI communicator over `comm` (duplicated) for host memory. Throws
// backend_unavailable when gradkit was built without MPI.
std::unique_ptr<Communicator> create_mpi_communicator(const CommunicatorOptions& options = {},
                                                      MpiCommHandle comm = {});
// Whether this build of gradkit has MPI (found when it was built, and not
// left out with GRADKIT_MPI=OFF): the MPI communicator, MpiEnvironment and
// the NCCL communicator bootstrapped over MPI.
bool has_mpi_communicator();
// An NCCL communicator over the ranks of `comm`, bootstrapped through MPI
// (rank 0 makes the unique id, MPI_Bcast shares it), one GPU per local rank.
// Throws backend_unavailable when gradkit was built without MPI or without
// NCCL, when some rank cannot load the NCCL library (libnccl.so.2, loaded
// at first use), or when this host has fewer GPUs than the GPU index this
// rank needs.
std::unique_ptr<Communicator> create_nccl_communicator(const CommunicatorOptions& options = {},
                                                       MpiCommHandle comm = {});
// An NCCL unique id (NCCL's ncclUniqueId, 128 bytes): made by one rank with
// create_nccl_unique_id and handed to every rank by any means (a launcher's
// store, a torch.distributed broadcast, a file).
struct NcclUniqueId {
  std::array<unsigned char, 128> bytes{};
};
NcclUniqueId create_nccl_unique_id();
// An NCCL communicator without MPI: this process is `rank` of `size`, and
// every rank passes the same id. options.cuda_device is this rank's GPU (-1:
// the calling thread's current CUDA device). What the MPI-bootstrapped
// communicator exchanges on the host (checked mode's fingerprints, Adasum's
// layout check, barrier) goes over NCCL itself, with the same timeout and
// abort; local_rank() and local_size() come from the ranks' host names.
// Throws invalid_argument for a bad rank, size, timeout or cuda_device before
// any NCCL call, and backend_unavailable when gradkit was built without
// NCCL, the NCCL library (libnccl.so.2, loaded at first use) cannot be
// loaded, or no CUDA device is visible. Needs no MPI.
std::unique_ptr<Communicator> create_nccl_communicator(const NcclUniqueId& id, int rank, int size,
                                                       const CommunicatorOptions& options = {});
// Whether this build of gradkit has the NCCL communicator (CUDA and NCCL found).
bool has_nccl_communicator();

}  // namespace gradkit
