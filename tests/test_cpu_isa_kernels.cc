// Every instruction-set copy of the CPU kernels for accumulate, the gradient
// check and LAMB (src/cpu/isa.h) against scalar references built here from
// the shared formulas (spec/*_math.h), bit for bit: every dtype pair,
// tensors of 0, 1, 7, 4097 and 65836 elements (two chunks) in one plan, and
// non-finite values where the kernel has a path for them. Adam's copies:
// test_cpu_isa_adam.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "spec/grad_check_math.h"
#include "spec/lamb_low_bit.h"  // lane_strided_sum
#include "spec/lamb_math.h"
#include "cpu/types.h"
#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/ops/grad_check.h"
#include "gradkit/ops/gradient.h"
#include "gradkit/ops/lamb.h"
#include "support/cpu_isa.h"
#include "support/element_bytes.h"
#include "support/low_bit_moments.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

const std::vector<int64_t> kSizes = {0, 1, 7, 4097, MultiTensorPlan::kDefaultChunkElements + 300};
constexpr int64_t kChunk = MultiTensorPlan::kDefaultChunkElements;

template <class T>
std::vector<uint8_t> bits(T x) {
  std::vector<uint8_t> out(sizeof(T));
  std::memcpy(out.data(), &x, sizeof(T));
  return out;
}

std::vector<TensorView> views(const std::vector<TestTensor>& ts) {
  std::vector<TensorView> out;
  for (const auto& t : ts) out.push_back(t.view());
  return out;
}

// Seeded values with an Inf and a NaN in the largest tensor when asked.
std::vector<TestTensor> tensors(DType dtype, uint64_t seed, double scale, bool specials = false) {
  std::mt19937_64 rng(seed);
  std::vector<TestTensor> out;
  for (int64_t n : kSizes) {
    std::vector<double> x = random_values(rng, n, scale);
    if (specials && n > kChunk) {
      x[11] = std::numeric_limits<double>::infinity();
      x[kChunk + 5] = std::numeric_limits<double>::quiet_NaN();
    }
    out.emplace_back(Device::cpu(), dtype, x);
  }
  return out;
}

class CpuIsaKernels : public EachCpuIsa {};

const std::vector<std::pair<DType, DType>> kAccumulatePairs = {
    {DType::f32, DType::f32}, {DType::f32, DType::f16},  {DType::f32, DType::bf16}, {DType::f16, DType::f32},
    {DType::f16, DType::f16}, {DType::f16, DType::bf16}, {DType::bf16, DType::f32}, {DType::bf16, DType::f16},
    {DType::bf16, DType::bf16}, {DType::f64, DType::f64}};

TEST_P(CpuIsaKernels, AccumulateEqualsTheScalarReference) {
  for (const auto& [bt, vt] : kAccumulatePairs) {
    for (bool overwrite : {false, true}) {
      std::vector<TestTensor> buffers = tensors(bt, 1, 1.0), values = tensors(vt, 2, 1.0, true);
      std::vector<std::vector<uint8_t>> want;
      for (size_t t = 0; t < kSizes.size(); ++t) want.push_back(buffers[t].bytes());
      const auto bv = views(buffers), vv = views(values);
      AccumulatePlan(bv, vv).accumulate_v2(Flag::host(overwrite));
      dispatch_dtype_pair({bt, vt}, [&]<class B, class V>() {
        using C = cpu::compute_t<B>;
        for (size_t t = 0; t < kSizes.size(); ++t) {
          const std::vector<uint8_t> value = values[t].bytes();
          for (int64_t i = 0; i < kSizes[t]; ++i) {
            const C x = cpu::to_compute<C>(get<V>(value, i));
            put(want[t], i, cpu::from_compute<B>(overwrite ? x : cpu::to_compute<C>(get<B>(want[t], i)) + x));
          }
        }
      });
      for (size_t t = 0; t < kSizes.size(); ++t) {
        EXPECT_EQ(buffers[t].bytes(), want[t]) << GetParam() << " " << dtype_name(bt) << "+=" << dtype_name(vt)
                                               << (overwrite ? " overwrite" : "") << " tensor of " << kSizes[t];
      }
    }
  }
}

TEST_P(CpuIsaKernels, GradientCheckEqualsTheScalarReference) {
  for (DType gt : {DType::f32, DType::f16, DType::bf16}) {
    for (NormType type : {NormType::l2, NormType::infinity}) {
      for (bool specials : {false, true}) {
        const float scale = 64.0f;
        std::vector<TestTensor> grads = tensors(gt, 3, 100.0, specials);
        std::vector<std::vector<uint8_t>> want;
        for (const auto& g : grads) want.push_back(g.bytes());
        TestFlag found(Device::cpu(), false);
        float divisor = 0, global = 0;
        std::vector<float> norms(kSizes.size());
        const auto gv = views(grads);
        GradientCheckPlan(gv, {.norm = type, .max_norm = 1.0f, .write_unscaled = true})
            .check({found.pointer(), &divisor, &global, norms.data()}, scale);

        // The reference: each chunk's partial in element order, the chunks
        // combined in order, per tensor and over the list.
        double all = 0;
        bool any = false;
        std::vector<float> want_norms;
        dispatch_dtype(gt, [&]<class G>() {
          for (size_t t = 0; t < kSizes.size(); ++t) {
            double tensor = 0;
            bool bad = false;
            for (int64_t begin = 0; begin < kSizes[t]; begin += kChunk) {
              double partial = 0;
              for (int64_t i = begin; i < std::min(kSizes[t], begin + kChunk); ++i) {
                const float raw = cpu::to_compute<float>(get<G>(want[t], i));
                bad = bad || !spec::finite(raw);
                partial = spec::norm_accumulate(partial, static_cast<double>(raw) * (1.0 / scale), type);
                put(want[t], i, cpu::from_compute<G>(raw * (1.0f / scale)));
              }
              tensor = spec::norm_combine(tensor, partial, type);
              all = spec::norm_combine(all, partial, type);
            }
            any = any || bad;
            want_norms.push_back(bad ? NAN : static_cast<float>(spec::norm_finish(tensor, type)));
          }
        });
        bool want_found = false;
        float want_divisor = 0, want_global = 0;
        spec::write_check_outputs({&want_found, &want_divisor, &want_global}, all, any, type, scale, 1.0f);
        const std::string label = std::string(GetParam()) + " " + std::string(dtype_name(gt)) +
                                  (type == NormType::l2 ? " l2" : " inf") + (specials ? " with Inf/NaN" : "");
        EXPECT_EQ(found.read(), want_found) << label;
        EXPECT_EQ(bits(global), bits(want_global)) << label;
        EXPECT_EQ(bits(divisor), bits(want_divisor)) << label;
        for (size_t t = 0; t < kSizes.size(); ++t) {
          EXPECT_EQ(bits(norms[t]), bits(want_norms[t])) << label << " tensor of " << kSizes[t];
          EXPECT_EQ(grads[t].bytes(), want[t]) << label << " unscaled tensor of " << kSizes[t];
        }
      }
    }
  }
}

// LAMB's two passes as lamb.cc ran them before its vector loops, one
// element at a time, on bytes.
template <class W, class G, class M, class Copy>
void lamb_reference(std::vector<std::vector<uint8_t>>& w, const std::vector<std::vector<uint8_t>>& g,
                    std::vector<std::vector<uint8_t>>& m, std::vector<std::vector<uint8_t>>& v,
                    std::vector<std::vector<uint8_t>>& copy, std::vector<std::vector<uint8_t>>& update,
                    const LambHyperparameters& h, const LambStepInputs& in, bool with_copy, bool with_update) {
  using C = cpu::compute_t<W>;
  const auto c = spec::lamb_coefficients<C>(h, in.eta, in.loss_scale, in.gradient_norm, in.step);
  for (size_t t = 0; t < kSizes.size(); ++t) {
    std::vector<double> partials;  // (w2, d2) per chunk, added in the CUDA ratio kernel's order
    for (int64_t begin = 0; begin < kSizes[t]; begin += kChunk) {
      double w2c = 0, d2c = 0;
      for (int64_t i = begin; i < std::min(kSizes[t], begin + kChunk); ++i) {
        const C wc = cpu::to_compute<C>(get<W>(w[t], i));
        C mc = cpu::to_compute<C>(get<M>(m[t], i)), vc = cpu::to_compute<C>(get<M>(v[t], i));
        spec::lamb_moments(cpu::to_compute<C>(get<G>(g[t], i)), mc, vc, c);
        const M ms = cpu::from_compute<M>(mc), vs = cpu::from_compute<M>(vc);
        const C d = spec::lamb_direction(wc, cpu::to_compute<C>(ms), cpu::to_compute<C>(vs), c);
        if (spec::finite(d)) {
          put(m[t], i, ms);
          put(v[t], i, vs);
          d2c += static_cast<double>(d) * d;
        } else {
          put(v[t], i, cpu::from_compute<M>(-cpu::to_compute<C>(get<M>(v[t], i))));
        }
        w2c += static_cast<double>(wc) * wc;
      }
      partials.push_back(w2c);
      partials.push_back(d2c);
    }
    const auto chunks = static_cast<int64_t>(partials.size() / 2);
    const double w2 = chunks ? spec::lane_strided_sum(partials.data(), chunks, 2) : 0.0;
    const double d2 = chunks ? spec::lane_strided_sum(partials.data() + 1, chunks, 2) : 0.0;
    const C step_size = c.eta * static_cast<C>(spec::lamb_ratio(w2, d2, h));
    for (int64_t i = 0; i < kSizes[t]; ++i) {
      const C w_old = cpu::to_compute<C>(get<W>(w[t], i));
      const C vc = cpu::to_compute<C>(get<M>(v[t], i));
      C w_new = w_old;
      if (std::signbit(vc)) {
        put(v[t], i, cpu::from_compute<M>(-vc));
      } else {
        const C updated =
            spec::lamb_apply(w_old, step_size, spec::lamb_direction(w_old, cpu::to_compute<C>(get<M>(m[t], i)), vc, c));
        if (spec::finite(updated)) w_new = updated;
      }
      if (with_update) put(update[t], i, cpu::from_compute<W>(w_new - w_old));
      else put(w[t], i, cpu::from_compute<W>(w_new));
      if (with_copy) put(copy[t], i, cpu::from_compute<Copy>(static_cast<float>(w_new)));
    }
  }
}

TEST_P(CpuIsaKernels, LambEqualsTheScalarReference) {
  struct Case {
    DType w, g, m, copy;  // copy f32: none
    bool update;
  };
  std::vector<Case> cases;
  for (DType g : {DType::f32, DType::f16, DType::bf16}) {
    for (DType m : {DType::f32, DType::bf16}) {
      for (DType copy : {DType::f32, DType::f16, DType::bf16}) cases.push_back({DType::f32, g, m, copy, false});
      cases.push_back({DType::f32, g, m, DType::f32, true});
    }
  }
  cases.push_back({DType::f64, DType::f64, DType::f64, DType::f32, false});
  for (const Case& k : cases) {
    LambHyperparameters h;
    h.lambda = 0.01f;
    h.max_norm = 1.0f;
    const LambStepInputs in{.eta = 2e-3f, .loss_scale = 8.0f, .gradient_norm = 100.0f, .step = 3};
    std::vector<TestTensor> w = tensors(k.w, 4, 1.0), g = tensors(k.g, 5, 8.0, true), m = tensors(k.m, 6, 0.1),
                            v = tensors(k.m, 7, 0.01), copy = tensors(k.copy == DType::f32 ? DType::f16 : k.copy, 8, 1.0),
                            update = tensors(k.w, 9, 1.0);
    for (auto& t : v) t = TestTensor(Device::cpu(), k.m, [&] {
                        std::vector<double> x = t.read();
                        for (double& e : x) e = e * e;  // v >= 0
                        return x;
                      }());
    auto snapshot = [](const std::vector<TestTensor>& ts) {
      std::vector<std::vector<uint8_t>> out;
      for (const auto& t : ts) out.push_back(t.bytes());
      return out;
    };
    auto ww = snapshot(w), gg = snapshot(g), mm = snapshot(m), vv = snapshot(v), cc = snapshot(copy),
         uu = snapshot(update);
    const auto wv = views(w), gv = views(g), mv = views(m), vvv = views(v), cv = views(copy), uv = views(update);
    LambTensors tensors_{wv, gv, mv, vvv, {}, {}};
    if (k.copy != DType::f32) tensors_.model_copy = cv;
    if (k.update) tensors_.update = uv;
    LambPlan(tensors_, std::span(&h, 1)).step(in);
    if (k.w == DType::f64) {
      lamb_reference<double, double, double, half>(ww, gg, mm, vv, cc, uu, h, in, false, false);
    } else {
      dispatch_dtype(k.g, [&]<class G>() {
        dispatch_dtype(k.m, [&]<class M>() {
          dispatch_dtype(k.copy == DType::f32 ? DType::f16 : k.copy, [&]<class Copy>() {
            if constexpr (!std::is_same_v<G, double> && !std::is_same_v<M, double> && !std::is_same_v<Copy, double> &&
                          !std::is_same_v<M, half>) {
              lamb_reference<float, G, M, Copy>(ww, gg, mm, vv, cc, uu, h, in, k.copy != DType::f32, k.update);
            }
          });
        });
      });
    }
    const std::string label = std::string(GetParam()) + " w " + std::string(dtype_name(k.w)) + " g " + std::string(dtype_name(k.g)) + " m " +
                              std::string(dtype_name(k.m)) + (k.copy != DType::f32 ? std::string(" copy ") + std::string(dtype_name(k.copy)) : "") +
                              (k.update ? " update" : "");
    for (size_t t = 0; t < kSizes.size(); ++t) {
      const std::string where = label + " tensor of " + std::to_string(kSizes[t]);
      EXPECT_EQ(w[t].bytes(), ww[t]) << where << ": weights";
      EXPECT_EQ(m[t].bytes(), mm[t]) << where << ": exp_avg";
      EXPECT_EQ(v[t].bytes(), vv[t]) << where << ": exp_avg_sq";
      if (k.copy != DType::f32) EXPECT_EQ(copy[t].bytes(), cc[t]) << where << ": model copy";
      if (k.update) EXPECT_EQ(update[t].bytes(), uu[t]) << where << ": update";
    }
    if (HasFailure()) return;
  }
}

// LAMB over 8- and 4-bit moments (cpu/lamb_low_bit.h): this copy's bytes
// equal the baseline copy's, with a NaN gradient (one block kept and marked)
// and an Inf, with and without the update list and the model copy. The
// formulas themselves are checked against float64 in test_lamb_low_bit.
TEST_P(CpuIsaKernels, LowBitLambEqualsTheBaselineCopy) {
  struct Case {
    int32_t bits;
    DType g, copy;  // copy f32: none
    bool update;
  };
  std::vector<Case> cases;
  for (int32_t bits : {8, 4}) {
    for (DType g : {DType::f32, DType::bf16}) cases.push_back({bits, g, DType::f32, false});
    cases.push_back({bits, DType::f32, DType::bf16, false});
    cases.push_back({bits, DType::f32, DType::f16, false});
    cases.push_back({bits, DType::f32, DType::f32, true});
  }
  const std::string isa = GetParam();
  for (const Case& k : cases) {
    // One run under `run_isa`: every tensor's bytes after the step.
    auto step = [&](const char* run_isa) {
      cpu::set_isa(run_isa);
      std::vector<TestTensor> w = tensors(DType::f32, 4, 1.0), g = tensors(k.g, 5, 8.0, true),
                              copy = tensors(k.copy == DType::f32 ? DType::f16 : k.copy, 8, 1.0),
                              update = tensors(DType::f32, 9, 1.0);
      LowBitMoments moments(k.bits);
      std::mt19937_64 rng(6);
      for (int64_t n : kSizes) {
        std::vector<double> m0 = random_values(rng, n, 0.1), v0 = random_values(rng, n, 0.1);
        for (double& e : v0) e = e * e;
        moments.add_moments(Device::cpu(), m0, v0);
      }
      const auto wv = views(w), gv = views(g), mv = views(moments.m), vv = views(moments.v), amv = views(moments.am),
                 avv = views(moments.av), cv = views(copy), uv = views(update);
      LambTensors t{wv, gv, mv, vv, {}, {}, amv, avv, {}, k.bits};
      if (k.copy != DType::f32) t.model_copy = cv;
      if (k.update) t.update = uv;
      LambHyperparameters h;
      h.lambda = 0.01f;
      LambPlan(t, std::span(&h, 1)).step({.eta = 2e-3f, .loss_scale = 8.0f, .step = 3});
      std::vector<std::vector<uint8_t>> out;
      for (const auto* list : {&w, &moments.m, &moments.v, &moments.am, &moments.av, &copy, &update}) {
        for (const TestTensor& x : *list) out.push_back(x.bytes());
      }
      return out;
    };
    const auto want = step("baseline");
    const auto got = step(isa.c_str());
    const std::string label = isa + " " + std::to_string(k.bits) + "-bit g " + std::string(dtype_name(k.g)) +
                              (k.copy != DType::f32 ? " copy " + std::string(dtype_name(k.copy)) : "") +
                              (k.update ? " update" : "");
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << label << ": tensor " << i;
    if (HasFailure()) return;
  }
}

GRADKIT_INSTANTIATE_EACH_CPU_ISA(CpuIsaKernels);

}  // namespace
}  // namespace gradkit::test
