// What the files of Offloaded<Adam or Lamb> share (offloaded.cc: making it;
// offloaded_step.cc: the step; offloaded_state.cc: its state file), and
// what differs between the two optimizers (OffloadTraits).
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

#include "gradkit/optim/offloaded.h"
#include "optim/host_worker.h"
#include "optim/offload_lanes.h"

namespace gradkit {

// The gradient check's outputs, on the device and copied to the host.
struct OffloadScalars {
  float grad_divisor;
  float global_norm;
  bool found_inf;
  float loss_scale;  // with release and a scaler: S, copied to the host for the host check
};

// With release: how many landing buffers a bucket's later hands go through
// (the hand waits for the worker only when it is this many pieces behind).
constexpr int kLandings = 4;

// Elements [offset, offset + count) of one flat tensor.
struct OffloadSlice {
  size_t tensor;
  int64_t offset, count;
};

// Per optimizer: its name in errors, its state file's kinds, its options,
// the plan a piece's CPU step runs, and how that step is given the step's
// scalars. `scalars` is null without a gradient check.
template <class Optimizer> struct OffloadTraits;

template <>
struct OffloadTraits<Adam> {
  using Plan = AdamPlan;
  static constexpr std::string_view op = "OffloadedAdam";
  static constexpr std::string_view kind = "adam";
  static constexpr std::string_view mixed_kind = "mixed_precision_adam";
  static constexpr std::string_view moment_option = "options.adam.moment_dtype";
  static constexpr bool cuts_tensors = true;
  // Its CPU step reads an element's gradient once, before writing that
  // element's model copy: the copy may overwrite the staged gradient.
  static constexpr bool copy_over_gradient = true;
  static const AdamOptions& options(const OffloadedOptions& o) { return o.adam; }
  // The counter holds the steps completed; an update uses the next.
  static int64_t* counter(const Adam& adam) { return adam.step_count_device(); }
  static constexpr int64_t counter_offset = 0;  // the counter after n steps: n + counter_offset
  static void step(const AdamPlan& plan, const Adam& adam, const OffloadScalars* scalars) {
    AdamStepInputs in;
    in.step = *adam.step_count_device() + 1;  // advanced by the step's end, when not skipped
    in.lr_device = adam.lr_device();
    if (scalars) {
      in.found_inf = &scalars->found_inf;  // a skipped step writes nothing
      in.grad_scale_device = &scalars->grad_divisor;
    }
    plan.step(in);
  }
};

template <>
struct OffloadTraits<Lamb> {
  using Plan = LambPlan;
  static constexpr std::string_view op = "OffloadedLamb";
  static constexpr std::string_view kind = "lamb";
  static constexpr std::string_view mixed_kind = "mixed_precision_lamb";
  static constexpr std::string_view moment_option = "options.lamb.moment_dtype";
  // The trust ratio needs each tensor's whole norms, summed as on the GPU.
  static constexpr bool cuts_tensors = false;
  static constexpr bool copy_over_gradient = false;  // its second pass reads the gradients again
  static const LambOptions& options(const OffloadedOptions& o) { return o.lamb; }
  // The counter holds the t of the next update (from 1).
  static int64_t* counter(const Lamb& lamb) { return lamb.next_step_device(); }
  static constexpr int64_t counter_offset = 1;
  static void step(const LambPlan& plan, const Lamb& lamb, const OffloadScalars* scalars) {
    LambStepInputs in;
    in.step = *lamb.next_step_device();  // advanced by the step's end, when not skipped
    in.eta_device = lamb.eta_device();
    if (scalars) {
      // As MixedPrecision<Lamb>: the global clipping is in the divisor.
      in.found_inf = &scalars->found_inf;
      in.loss_scale_device = &scalars->grad_divisor;
    }
    plan.step(in);
  }
};

template <class Optimizer>
struct Offloaded<Optimizer>::Bucket {
  std::vector<size_t> tensors;  // indices into the flat params, ascending
  std::vector<int> pieces;      // indices into pieces_
};

template <class Optimizer>
struct Offloaded<Optimizer>::Piece {
  std::vector<OffloadSlice> slices;
  typename OffloadTraits<Optimizer>::Plan plan;  // the CPU step over the slices of the host tensors
};

// Event slots of the lanes: one per piece (its gradients have arrived),
// then one for the check's scalars (with release: for the loss scale S).
inline int scalars_slot(int num_pieces) { return num_pieces; }

// Cuts a bucket's tensors (`numel` and gradient element size per flat
// tensor) into pieces of about `piece_bytes` of gradients, a tensor cut only
// at multiples of `align` elements, or never with `align` 0 (a tensor
// larger than `piece_bytes` is then a piece of its own). Every element lies
// in exactly one slice.
std::vector<std::vector<OffloadSlice>> cut_pieces(const std::vector<size_t>& tensors, const std::vector<TensorView>& grads,
                                                  size_t piece_bytes, int64_t align);

}  // namespace gradkit
