#include "cpu/isa.h"

#include <cstdlib>
#include <mutex>
#include <string>

#include "gradkit/core/error.h"

namespace gradkit::cpu {
namespace {

// What this CPU can run: AVX-512 as x86-64-v4 defines it (F, BW, CD, DQ,
// VL), AVX2 as x86-64-v3 does (with FMA, F16C, BMI1/2, MOVBE, LZCNT; FMA is
// there only because the level names it: no kernel fuses).
bool supports(Isa isa) {
#if GRADKIT_CPU_MULTI_ISA
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
                  __builtin_cpu_supports("f16c") && __builtin_cpu_supports("movbe") &&
                  __builtin_cpu_supports("lzcnt") && __builtin_cpu_supports("avx");
  if (isa == Isa::avx2) return v3;
  if (isa == Isa::avx512) {
    return v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl");
  }
  return true;
#else
  return isa == Isa::baseline;
#endif
}

Isa best() {
  if (supports(Isa::avx512)) return Isa::avx512;
  if (supports(Isa::avx2)) return Isa::avx2;
  return Isa::baseline;
}

std::string available() {
  std::string names;
  for (Isa isa : {Isa::baseline, Isa::avx2, Isa::avx512}) {
    if (supports(isa)) names += (names.empty() ? "" : ", ") + std::string(isa_name(isa));
  }
  return names;
}

Isa parse(std::string_view what, std::string_view name) {
  for (Isa isa : {Isa::baseline, Isa::avx2, Isa::avx512}) {
    if (name != isa_name(isa)) continue;
    if (!supports(isa)) {
      throw Error(ErrorCode::invalid_argument, std::string(what) + ": '" + std::string(name) +
                                                   "' is not available on this CPU (it has: " + available() + ")");
    }
    return isa;
  }
  throw Error(ErrorCode::invalid_argument, std::string(what) + ": has '" + std::string(name) +
                                               "', expected baseline, avx2 or avx512");
}

std::mutex mutex;
bool chosen = false;
Isa current = Isa::baseline;

}  // namespace

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    case Isa::baseline: break;
  }
  return "baseline";
}

Isa active_isa() {
  std::lock_guard lock(mutex);
  if (!chosen) {
    const char* env = std::getenv("GRADKIT_CPU_ISA");
    current = env != nullptr && *env != '\0' ? parse("GRADKIT_CPU_ISA", env) : best();
    chosen = true;
  }
  return current;
}

void set_isa(std::string_view name) {
  const Isa isa = parse("set_isa", name);
  std::lock_guard lock(mutex);
  current = isa;
  chosen = true;
}

void reset_isa() {
  std::lock_guard lock(mutex);
  chosen = false;
}

}  // namespace gradkit::cpu
