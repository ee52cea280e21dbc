// The CPU Adam kernel's vector loops (src/cpu/adam_strip.h: one loop per
// flag combination, compiled for AVX-512, AVX2 and baseline x86-64) against
// a scalar evaluation of the same element formula (backend/adam_math.h, with
// the flags read at run time, as the CUDA kernel reads them), in a loop the
// compiler is told not to vectorize. Bit for bit, for every dtype pair the
// kernel takes, every flag combination, with and without a gradient scale,
// on lengths 0, 1, 7 and 4097 (a strip's tail, and a length no vector width
// divides). A NaN matches any NaN (an Inf and a NaN gradient are injected:
// they propagate to NaN in both, but which NaN, its sign and payload, depends
// on the operand order the compiler picks, as on CUDA, whose NaNs are
// canonical); bf16 weights with a remainder are compared as the f32 masters
// they hold, for that reason.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/adam_math.h"
#include "backend/master_math.h"
#include "cpu/types.h"
#include "gradkit/ops/adam.h"

#if defined(__clang__)
#define GRADKIT_SCALAR_LOOP
#define GRADKIT_NO_VECTORIZE _Pragma("clang loop vectorize(disable) interleave(disable)")
#elif defined(__GNUC__)
#define GRADKIT_SCALAR_LOOP __attribute__((optimize("no-tree-vectorize")))
#define GRADKIT_NO_VECTORIZE
#else
#define GRADKIT_SCALAR_LOOP
#define GRADKIT_NO_VECTORIZE
#endif

namespace gradkit::test {
namespace {

struct NoCopy {};
struct RemainderMaster {};  // bf16 weights with their i16 remainder

template <class T>
DType dtype_for() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else if constexpr (std::is_same_v<T, half>) return DType::f16;
  else if constexpr (std::is_same_v<T, bfloat16>) return DType::bf16;
  else if constexpr (std::is_same_v<T, int16_t>) return DType::i16;
  else return DType::bf16;  // uint16_t: bf16 weights' bits
}

template <class T>
bool is_nan(T x) {
  if constexpr (std::is_integral_v<T>) return false;
  else return std::isnan(static_cast<double>(static_cast<float>(x)));
}
template <>
bool is_nan(double x) {
  return std::isnan(x);
}

// Equal bits, or both NaN.
template <class T>
bool same(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0 || (is_nan(a) && is_nan(b));
}

template <class T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, double>) return x;
  else return T(static_cast<float>(x));
}

// One parameter's tensors, in the kernel's storage types.
template <class Weights, class G, class M, class Copy>
struct Param {
  static constexpr bool kRemainder = std::is_same_v<Weights, RemainderMaster>;
  using W = std::conditional_t<kRemainder, uint16_t, Weights>;
  using C = cpu::compute_t<std::conditional_t<kRemainder, float, Weights>>;
  std::vector<W> w;
  std::vector<int16_t> r;
  std::vector<G> g;
  std::vector<M> m, v, vmax;
  std::vector<std::conditional_t<std::is_same_v<Copy, NoCopy>, half, Copy>> copy;

  // The f32 masters that bf16 weights and their remainders hold.
  std::vector<float> masters() const {
    std::vector<float> out;
    for (size_t i = 0; i < w.size(); ++i) out.push_back(backend::join_master(w[i], r[i]));
    return out;
  }

  Param(std::mt19937_64& rng, int64_t n) {
    std::normal_distribution<double> normal;
    auto nonzero = [&](double scale) {
      const double x = normal(rng) * scale;
      return x == 0 ? scale * 0.5 : x;
    };
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (kRemainder) {
        uint16_t wi;
        int16_t ri;
        backend::split_master(static_cast<float>(nonzero(1.0)), wi, ri);
        w.push_back(wi);
        r.push_back(ri);
      } else {
        w.push_back(from_double<W>(nonzero(1.0)));
      }
      g.push_back(from_double<G>(nonzero(1.0)));
      m.push_back(from_double<M>(nonzero(0.1)));
      v.push_back(from_double<M>(std::abs(nonzero(0.1))));
      vmax.push_back(from_double<M>(std::abs(nonzero(0.1))));
      copy.push_back({});
    }
    if (n > 5) {  // non-finite gradients: NaN in w, m and v after the step
      g[3] = from_double<G>(std::numeric_limits<double>::infinity());
      g[5] = from_double<G>(std::numeric_limits<double>::quiet_NaN());
    }
  }
};

// The update of every element in plain scalar code: the kernel's conversions
// (cpu/types.h, master_math.h) around adam_element with the flags read from
// the coefficients at run time.
template <class Weights, class G, class M, class Copy, class P>
GRADKIT_SCALAR_LOOP void scalar_step(P& p, const AdamHyperparameters& h, int64_t step, float scale) {
  using C = typename P::C;
  const auto c = backend::adam_coefficients<C>(h, h.lr, step);
  const C s = static_cast<C>(scale);
  const auto n = static_cast<int64_t>(p.g.size());
  GRADKIT_NO_VECTORIZE
  for (int64_t i = 0; i < n; ++i) {
    C w;
    if constexpr (P::kRemainder) w = backend::join_master(p.w[i], p.r[i]);
    else w = cpu::to_compute<C>(p.w[i]);
    C g = cpu::to_compute<C>(p.g[i]);
    if (s != C(1)) g = g / s;
    C m = cpu::to_compute<C>(p.m[i]), v = cpu::to_compute<C>(p.v[i]);
    C vmax = h.amsgrad ? cpu::to_compute<C>(p.vmax[i]) : C(0);
    backend::adam_element(w, g, m, v, vmax, c);
    if constexpr (P::kRemainder) backend::split_master(w, p.w[i], p.r[i]);
    else p.w[i] = cpu::from_compute<typename P::W>(w);
    p.m[i] = cpu::from_compute<M>(m);
    p.v[i] = cpu::from_compute<M>(v);
    if (h.amsgrad) p.vmax[i] = cpu::from_compute<M>(vmax);
    if constexpr (!std::is_same_v<Copy, NoCopy>) p.copy[i] = cpu::from_compute<Copy>(w);
  }
}

template <class T>
TensorView host_view(std::vector<T>& values, DType dtype) {
  return TensorView{values.data(), static_cast<int64_t>(values.size()), dtype, Device::cpu()};
}

template <class T>
void expect_same(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!same(got[i], want[i])) {
      ADD_FAILURE() << what << ": element " << i << " of " << got.size() << " differs";
      return;
    }
  }
}

const int64_t kLengths[] = {0, 1, 7, 4097};

// Three steps of the plan against three of the scalar loop, from the same
// seeded state, for every flag combination and scale.
template <class Weights, class G, class M, class Copy>
void check_pair(const std::string& name) {
  using P = Param<Weights, G, M, Copy>;
  uint64_t seed = 1;
  for (WeightDecay decay : {WeightDecay::l2, WeightDecay::decoupled, WeightDecay::hugging_face}) {
    for (int flags = 0; flags < 8; ++flags) {
      AdamHyperparameters h;
      h.lr = 1e-2f;
      h.weight_decay = 0.05f;
      h.decay = decay;
      h.amsgrad = flags & 1;
      h.maximize = flags & 2;
      h.bias_correction = !(flags & 4);
      for (float scale : {1.0f, 1024.0f}) {
        std::mt19937_64 rng(seed++);
        std::vector<P> kernel, scalar;
        for (int64_t n : kLengths) kernel.emplace_back(rng, n);
        scalar = kernel;
        std::vector<TensorView> w, r, g, m, v, vmax, copy;
        for (P& p : kernel) {
          w.push_back(host_view(p.w, dtype_for<typename P::W>()));
          r.push_back(host_view(p.r, DType::i16));
          g.push_back(host_view(p.g, dtype_for<G>()));
          m.push_back(host_view(p.m, dtype_for<M>()));
          v.push_back(host_view(p.v, dtype_for<M>()));
          vmax.push_back(host_view(p.vmax, dtype_for<M>()));
          copy.push_back(host_view(p.copy, dtype_for<Copy>()));
        }
        AdamTensors tensors;
        tensors.weights = w;
        tensors.grads = g;
        tensors.exp_avg = m;
        tensors.exp_avg_sq = v;
        if (h.amsgrad) tensors.max_exp_avg_sq = vmax;
        if constexpr (!std::is_same_v<Copy, NoCopy>) tensors.model_copy = copy;
        if constexpr (P::kRemainder) tensors.weight_remainder = r;
        const AdamPlan plan(tensors, std::span(&h, 1));
        for (int64_t step = 1; step <= 3; ++step) {
          plan.step({.step = step, .grad_scale = scale});
          for (P& p : scalar) scalar_step<Weights, G, M, Copy>(p, h, step, scale);
        }
        const std::string what = name + " decay " + std::to_string(static_cast<int>(decay)) + " flags " +
                                 std::to_string(flags) + " scale " + std::to_string(scale);
        for (size_t t = 0; t < kernel.size(); ++t) {
          const std::string at = what + " length " + std::to_string(kLengths[t]);
          if constexpr (P::kRemainder) {  // the masters: a NaN's sign and payload are not kept
            expect_same(kernel[t].masters(), scalar[t].masters(), at + " masters");
          } else {
            expect_same(kernel[t].w, scalar[t].w, at + " weights");
          }
          expect_same(kernel[t].m, scalar[t].m, at + " exp_avg");
          expect_same(kernel[t].v, scalar[t].v, at + " exp_avg_sq");
          expect_same(kernel[t].vmax, scalar[t].vmax, at + " max_exp_avg_sq");
          expect_same(kernel[t].copy, scalar[t].copy, at + " model copy");
        }
      }
    }
  }
}

template <class Weights, class M, class Copy>
void check_grads(const std::string& name) {
  check_pair<Weights, float, M, Copy>(name + " grads f32");
  check_pair<Weights, half, M, Copy>(name + " grads f16");
  check_pair<Weights, bfloat16, M, Copy>(name + " grads bf16");
}

TEST(AdamVector, F32WeightsEqualTheScalarLoopBitForBit) {
  check_grads<float, float, NoCopy>("weights f32, moments f32");
  check_grads<float, float, half>("weights f32, moments f32, copy f16");
  check_grads<float, float, bfloat16>("weights f32, moments f32, copy bf16");
  check_grads<float, bfloat16, NoCopy>("weights f32, moments bf16");
  check_grads<float, bfloat16, half>("weights f32, moments bf16, copy f16");
  check_grads<float, bfloat16, bfloat16>("weights f32, moments bf16, copy bf16");
}

TEST(AdamVector, RemainderMastersEqualTheScalarLoopBitForBit) {
  check_grads<RemainderMaster, float, NoCopy>("weights bf16 + remainder, moments f32");
  check_grads<RemainderMaster, bfloat16, NoCopy>("weights bf16 + remainder, moments bf16");
}

TEST(AdamVector, F64EqualsTheScalarLoopBitForBit) {
  check_pair<double, double, double, NoCopy>("f64");
}

}  // namespace
}  // namespace gradkit::test
