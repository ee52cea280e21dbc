// One function per layer of the public API, each adding its classes to the
// module (python/src/bind_*.cc).
#pragma once

#include <nanobind/nanobind.h>

namespace gradkit::python {

void bind_core(nanobind::module_& m);   // dtypes, devices, errors, synchronize
void bind_ops(nanobind::module_& m);    // zero/accumulate, Adam/LAMB plans, gradient check
void bind_state(nanobind::module_& m);  // 8-bit moments and remainder masters, to and from float32
void bind_optim(nanobind::module_& m);  // Adam, Lamb, LossScaler, MixedPrecision
void bind_comm(nanobind::module_& m);   // communicators, GradientArena, Adasum
void bind_offload(nanobind::module_& m);  // OffloadedAdam, OffloadedLamb
void bind_muon(nanobind::module_& m);     // MuonPlan and its hyperparameters

}  // namespace gradkit::python
