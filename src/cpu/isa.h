// Runtime choice of the instruction set the CPU kernels' element loops are
// compiled for. Each kernel is a plain C++ loop (per-launch choices resolved
// outside it, as template parameters) that GCC vectorizes; run_kernel
// compiles it three times, for x86-64's baseline (SSE2), for x86-64-v3
// (AVX2, F16C) and for x86-64-v4 (AVX-512), and runs the best one this CPU
// has. Every copy does the same IEEE operations in the same order (host code
// is built with -ffp-contract=off, so no copy fuses a multiply-add; vector
// division and square root are correctly rounded as the scalar ones are), so
// the results are the same bits whichever runs: docs/cpu-kernels.md.
//
// Outside GCC on x86-64 (clang for the fuzz targets, other architectures)
// only the baseline copy exists, which the compiler vectorizes as it can.
#pragma once

#include <string_view>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define GRADKIT_CPU_MULTI_ISA 1
// flatten: everything the kernel calls is compiled into this copy, for its
// instruction set (an out-of-line call would run baseline code).
#define GRADKIT_CPU_TARGET(arch) __attribute__((target(arch), flatten))
#else
#define GRADKIT_CPU_MULTI_ISA 0
#endif

namespace gradkit::cpu {

enum class Isa { baseline, avx2, avx512 };

// The instruction set the kernels run with: the best this CPU has, or the
// one GRADKIT_CPU_ISA names (baseline, avx2, avx512; read once). Naming one
// this CPU lacks, or an unknown one, is an error (Error, invalid_argument)
// at the first kernel launch, naming the variable and what the CPU has.
Isa active_isa();
// Sets it for the calls that follow (tests run every copy this way); the
// same errors as for GRADKIT_CPU_ISA.
void set_isa(std::string_view name);
// Back to the default (GRADKIT_CPU_ISA or the best), chosen again at the next launch.
void reset_isa();
std::string_view isa_name(Isa isa);

#if GRADKIT_CPU_MULTI_ISA
template <class Kernel, class... Args>
GRADKIT_CPU_TARGET("arch=x86-64-v4") void run_avx512(Args... args) { Kernel::run(args...); }
template <class Kernel, class... Args>
GRADKIT_CPU_TARGET("arch=x86-64-v3") void run_avx2(Args... args) { Kernel::run(args...); }
template <class Kernel, class... Args>
__attribute__((flatten)) void run_baseline(Args... args) { Kernel::run(args...); }
#endif

// Runs Kernel::run(args...) compiled for the active instruction set.
template <class Kernel, class... Args>
void run_kernel(Isa isa, Args... args) {
#if GRADKIT_CPU_MULTI_ISA
  switch (isa) {
    case Isa::avx512: return run_avx512<Kernel>(args...);
    case Isa::avx2: return run_avx2<Kernel>(args...);
    case Isa::baseline: return run_baseline<Kernel>(args...);
  }
#else
  (void)isa;
  Kernel::run(args...);
#endif
}

}  // namespace gradkit::cpu
