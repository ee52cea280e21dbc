// Every instruction-set copy of the CPU Adam kernels (src/cpu/isa.h:
// baseline, AVX2, AVX-512, those this CPU has) against a scalar reference
// built here from the shared element formulas (spec/adam_math.h,
// master_math.h, low_bit_int8_math.h), bit for bit: every dtype combination the
// kernels take, every mode (weight decay rule, amsgrad, maximize), a scaled
// and an unscaled gradient, tensors of 0, 1, 7 and 4097 elements in one
// plan, and an Inf and a NaN among the gradients. The float64-reference
// tests (test_adam*.cc) say the formula is right; these say the vector loops
// compute exactly that formula.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "spec/adam_math.h"
#include "spec/master_math.h"
#include "spec/low_bit_tables.h"
#include "cpu/isa.h"
#include "cpu/types.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/master.h"
#include "support/cpu_isa.h"
#include "support/element_bytes.h"
#include "support/expect_error.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

using spec::AdamCoefficients;

const std::vector<int64_t> kSizes = {0, 1, 7, 4097};

struct Case {
  DType grads, moments;
  DType copy = DType::f32;  // f32: no model copy
  bool remainder = false;   // bf16 weights with their remainder
  bool f64 = false;         // everything f64
  std::string name() const {
    if (f64) return "f64";
    std::string n = std::string(remainder ? "bf16+remainder" : "f32") + "_g" + std::string(dtype_name(grads)) + "_m" +
                    std::string(dtype_name(moments));
    return copy == DType::f32 ? n : n + "_copy" + std::string(dtype_name(copy));
  }
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (DType g : {DType::f32, DType::f16, DType::bf16}) {
    for (DType m : {DType::f32, DType::bf16, DType::u8}) {
      for (DType copy : {DType::f32, DType::f16, DType::bf16}) out.push_back({g, m, copy});
      out.push_back({g, m, DType::f32, true});
    }
  }
  out.push_back({DType::f64, DType::f64, DType::f32, false, true});
  return out;
}

std::vector<AdamHyperparameters> modes(bool quantized) {
  std::vector<AdamHyperparameters> out;
  for (WeightDecay decay : {WeightDecay::l2, WeightDecay::decoupled, WeightDecay::hugging_face}) {
    for (bool amsgrad : {false, true}) {
      for (bool maximize : {false, true}) {
        if (amsgrad && quantized) continue;
        AdamHyperparameters h;
        h.lr = 3e-3f;
        h.weight_decay = 0.02f;
        h.decay = decay;
        h.amsgrad = amsgrad;
        h.maximize = maximize;
        out.push_back(h);
      }
    }
  }
  return out;
}

// "" if equal, else the first element that differs, with both bit patterns.
std::string difference(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, size_t element) {
  if (got == want) return "";
  if (got.size() != want.size()) return "sizes differ";
  for (size_t i = 0; i < got.size(); i += element) {
    if (std::memcmp(got.data() + i, want.data() + i, element) == 0) continue;
    uint64_t a = 0, b = 0;
    std::memcpy(&a, got.data() + i, element);
    std::memcpy(&b, want.data() + i, element);
    char text[96];
    std::snprintf(text, sizeof text, "element %zu: got 0x%llx, want 0x%llx", i / element,
                  static_cast<unsigned long long>(a), static_cast<unsigned long long>(b));
    return text;
  }
  return "";
}

// One tensor's state, as bytes, for the reference.
struct State {
  std::vector<uint8_t> w, r, g, m, v, vmax, copy, am, av;
};

// The scalar reference of one tensor: the element formula with its choices
// read per element (RuntimeAdamFlags), one element at a time; 8-bit moments
// in the folded form, block by block with absmax_fold and the binary search (quantize_search,
// the definition), element by element.
template <class C, class G, class M, class Copy>
void reference(State& s, int64_t n, const Case& k, const AdamHyperparameters& h, int64_t step, float scale) {
  const AdamCoefficients<C> c = spec::adam_coefficients<C>(h, h.lr, step);
  const bool quantized = k.moments == DType::u8;
  const spec::QuantTables& tables = spec::quant_tables();
  for (int64_t base = 0; base < n; base += kQuantBlock) {
    const int64_t end = std::min<int64_t>(n, base + kQuantBlock);
    std::vector<float> m_new, v_new;
    for (int64_t i = base; i < end; ++i) {
      C w = k.remainder ? static_cast<C>(spec::join_master(get<uint16_t>(s.w, i), get<int16_t>(s.r, i)))
                        : cpu::to_compute<C>(get<std::conditional_t<std::is_same_v<C, double>, double, float>>(s.w, i));
      C g = cpu::to_compute<C>(get<G>(s.g, i));
      // 8-bit moments take the folded form (docs/ops.md): the gradient times
      // the scale's reciprocal, the bias correction folded into the step.
      if (scale != 1.0f) g = quantized ? g * (C(1) / static_cast<C>(scale)) : g / static_cast<C>(scale);
      C m, v, vmax = 0;
      if (quantized) {
        m = spec::dequantize(tables.table[0], get<uint8_t>(s.m, i), get<float>(s.am, i / kQuantBlock));
        v = spec::dequantize(tables.table[1], get<uint8_t>(s.v, i), get<float>(s.av, i / kQuantBlock));
      } else {
        m = cpu::to_compute<C>(get<M>(s.m, i));
        v = cpu::to_compute<C>(get<M>(s.v, i));
        if (h.amsgrad) vmax = cpu::to_compute<C>(get<M>(s.vmax, i));
      }
      if (quantized) {
        spec::adam_element<C, spec::RuntimeAdamFlags, spec::AdamForm::folded>(
            w, g, m, v, vmax, c, spec::RuntimeAdamFlags{c.decay, c.amsgrad, c.maximize});
      } else {
        spec::adam_element(w, g, m, v, vmax, c);
      }
      if (k.remainder) {
        uint16_t wb;
        int16_t rb;
        spec::split_master(static_cast<float>(w), wb, rb);
        put(s.w, i, wb);
        put(s.r, i, rb);
      } else {
        put(s.w, i, w);
      }
      if (k.copy != DType::f32) put(s.copy, i, cpu::from_compute<Copy>(static_cast<float>(w)));
      if (quantized) {
        m_new.push_back(static_cast<float>(m));
        v_new.push_back(static_cast<float>(v));
      } else {
        put(s.m, i, cpu::from_compute<M>(m));
        put(s.v, i, cpu::from_compute<M>(v));
        if (h.amsgrad) put(s.vmax, i, cpu::from_compute<M>(vmax));
      }
    }
    if (!quantized) continue;
    for (int t = 0; t < 2; ++t) {
      const std::vector<float>& x = t == 0 ? m_new : v_new;
      float amax = 0.0f;
      for (float value : x) amax = spec::absmax_fold(amax, value);
      const float inv = spec::quant_scale(amax);
      for (size_t j = 0; j < x.size(); ++j) {
        put(t == 0 ? s.m : s.v, base + static_cast<int64_t>(j),
            spec::quantize_search(tables.table[t], spec::exact::mul(x[j], inv)));
      }
      put(t == 0 ? s.am : s.av, base / kQuantBlock, amax);
    }
  }
}

// Both copies of one case: the library's (tensors) and the reference's (bytes).
struct Lists {
  std::vector<TestTensor> w, r, g, m, v, vmax, copy, am, av;
  std::vector<TensorView> view(const std::vector<TestTensor>& ts) const {
    std::vector<TensorView> out;
    for (const auto& t : ts) out.push_back(t.view());
    return out;
  }
};

Lists make_lists(const Case& k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Device cpu = Device::cpu();
  const DType wt = k.f64 ? DType::f64 : DType::f32;
  Lists l;
  for (int64_t n : kSizes) {
    const std::vector<double> master = round_to(DType::f32, random_values(rng, n));
    if (k.remainder) {
      const TestTensor f32(cpu, DType::f32, master);
      l.w.emplace_back(cpu, DType::bf16, std::vector<double>(n, 0.0));
      l.r.emplace_back(cpu, DType::i16, std::vector<double>(n, 0.0));
      split_masters(f32.view(), l.w.back().view(), l.r.back().view());
    } else {
      l.w.emplace_back(cpu, wt, master);
    }
    std::vector<double> g = random_values(rng, n, 4.0);
    if (n == 4097) {  // one Inf and one NaN, in different 8-bit blocks
      g[5] = std::numeric_limits<double>::infinity();
      g[3000] = std::numeric_limits<double>::quiet_NaN();
    }
    l.g.emplace_back(cpu, k.grads, g);
    std::vector<double> m = random_values(rng, n, 0.1), v = random_values(rng, n, 0.01), vmax(n);
    for (double& x : v) x = x * x;
    for (int64_t i = 0; i < n; ++i) vmax[i] = v[i] * (i % 2 == 0 ? 2.0 : 0.5);
    if (k.moments == DType::u8) {
      l.m.emplace_back(cpu, DType::u8, std::vector<double>(n, 0.0));
      l.v.emplace_back(cpu, DType::u8, std::vector<double>(n, 0.0));
      l.am.emplace_back(cpu, DType::f32, std::vector<double>(quant_blocks(n), 0.0));
      l.av.emplace_back(cpu, DType::f32, std::vector<double>(quant_blocks(n), 0.0));
      const TestTensor m0(cpu, DType::f32, m), v0(cpu, DType::f32, v);
      quantize_blockwise(QuantCode::signed_dynamic, m0.view(), l.m.back().view(), l.am.back().view());
      quantize_blockwise(QuantCode::unsigned_dynamic, v0.view(), l.v.back().view(), l.av.back().view());
    } else {
      l.m.emplace_back(cpu, k.moments, m);
      l.v.emplace_back(cpu, k.moments, v);
      l.vmax.emplace_back(cpu, k.moments, vmax);
    }
    l.copy.emplace_back(cpu, k.copy == DType::f32 ? DType::f16 : k.copy, std::vector<double>(n, 0.0));
  }
  return l;
}

std::vector<uint8_t> bytes_of(const std::vector<TestTensor>& list, size_t t) {
  return t < list.size() ? list[t].bytes() : std::vector<uint8_t>();
}

void run_case(const Case& k, const AdamHyperparameters& h, float scale, const std::string& label) {
  Lists l = make_lists(k, 41);
  std::vector<State> states;
  for (size_t t = 0; t < kSizes.size(); ++t) {
    states.push_back({bytes_of(l.w, t), bytes_of(l.r, t), bytes_of(l.g, t), bytes_of(l.m, t), bytes_of(l.v, t),
                      bytes_of(l.vmax, t), bytes_of(l.copy, t), bytes_of(l.am, t), bytes_of(l.av, t)});
  }
  const auto w = l.view(l.w), r = l.view(l.r), g = l.view(l.g), m = l.view(l.m), v = l.view(l.v),
             vmax = l.view(l.vmax), copy = l.view(l.copy), am = l.view(l.am), av = l.view(l.av);
  AdamTensors tensors{w, g, m, v, {}, {}, {}, {}, {}};
  if (h.amsgrad) tensors.max_exp_avg_sq = vmax;
  if (k.copy != DType::f32) tensors.model_copy = copy;
  if (k.moments == DType::u8) tensors.exp_avg_absmax = am, tensors.exp_avg_sq_absmax = av;
  if (k.remainder) tensors.weight_remainder = r;
  const int64_t step = 3;
  AdamPlan(tensors, std::span(&h, 1)).step({.step = step, .grad_scale = scale});

  const DType m_type = k.moments == DType::u8 ? DType::f32 : k.moments;
  for (size_t t = 0; t < kSizes.size(); ++t) {
    if (k.f64) {
      reference<double, double, double, float>(states[t], kSizes[t], k, h, step, scale);
    } else {
      dispatch_dtype(k.grads, [&]<class G>() {
        dispatch_dtype(m_type, [&]<class M>() {
          dispatch_dtype(k.copy == DType::f32 ? DType::f16 : k.copy, [&]<class Copy>() {
            if constexpr (!std::is_same_v<G, double> && !std::is_same_v<M, double> && !std::is_same_v<Copy, double>) {
              reference<float, G, M, Copy>(states[t], kSizes[t], k, h, step, scale);
            }
          });
        });
      });
    }
    const std::string where = label + " tensor of " + std::to_string(kSizes[t]);
    EXPECT_EQ(difference(l.w[t].bytes(), states[t].w, dtype_size(l.w[t].view().dtype)), "") << where << ": weights";
    if (k.remainder) EXPECT_EQ(difference(l.r[t].bytes(), states[t].r, 2), "") << where << ": remainder";
    EXPECT_EQ(difference(l.m[t].bytes(), states[t].m, dtype_size(l.m[t].view().dtype)), "") << where << ": exp_avg";
    EXPECT_EQ(difference(l.v[t].bytes(), states[t].v, dtype_size(l.v[t].view().dtype)), "") << where << ": exp_avg_sq";
    if (h.amsgrad) EXPECT_EQ(difference(l.vmax[t].bytes(), states[t].vmax, dtype_size(l.vmax[t].view().dtype)), "") << where << ": max_exp_avg_sq";
    if (k.copy != DType::f32) EXPECT_EQ(difference(l.copy[t].bytes(), states[t].copy, 2), "") << where << ": model copy";
    if (k.moments == DType::u8) {
      EXPECT_EQ(difference(l.am[t].bytes(), states[t].am, 4), "") << where << ": exp_avg absmax";
      EXPECT_EQ(difference(l.av[t].bytes(), states[t].av, 4), "") << where << ": exp_avg_sq absmax";
    }
  }
}

class CpuIsaAdam : public EachCpuIsa {};

TEST_P(CpuIsaAdam, EveryDtypeAndModeEqualsTheScalarReference) {
  for (const Case& k : cases()) {
    for (const AdamHyperparameters& h : modes(k.moments == DType::u8)) {
      for (float scale : {1.0f, 512.0f}) {
        const std::string label = std::string(GetParam()) + " " + k.name() + " decay " +
                                  std::to_string(static_cast<int>(h.decay)) + (h.amsgrad ? " amsgrad" : "") +
                                  (h.maximize ? " maximize" : "") + " scale " + std::to_string(scale);
        run_case(k, h, scale, label);
        if (HasFailure()) return;  // one case's report is enough to go on
      }
    }
  }
}

GRADKIT_INSTANTIATE_EACH_CPU_ISA(CpuIsaAdam);

// 4-bit moments: each copy's step (the AVX-512 one decodes nibbles with a
// permute) equals the baseline copy's bit for bit, weights, codes and
// absmax, over f32 and bf16-with-remainder weights, scaled and unscaled
// gradients with an Inf and a NaN; the baseline copy is the one the
// float64-reference tests (test_adam_low_bit_int4.cc) hold to the definition.
class CpuIsaAdamInt4 : public EachCpuIsa {};

struct FourBitRun {
  std::vector<TestTensor> w, r, g, m, v, am, av;
  std::vector<std::vector<uint8_t>> bytes() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto* list : {&w, &r, &m, &v, &am, &av}) {
      for (const TestTensor& t : *list) out.push_back(t.bytes());
    }
    return out;
  }
};

FourBitRun four_bit_step(bool remainder, float scale) {
  std::mt19937_64 rng(43);
  const Device cpu = Device::cpu();
  FourBitRun run;
  for (int64_t n : kSizes) {
    const std::vector<double> master = round_to(DType::f32, random_values(rng, n));
    if (remainder) {
      const TestTensor f32(cpu, DType::f32, master);
      run.w.emplace_back(cpu, DType::bf16, std::vector<double>(n, 0.0));
      run.r.emplace_back(cpu, DType::i16, std::vector<double>(n, 0.0));
      split_masters(f32.view(), run.w.back().view(), run.r.back().view());
    } else {
      run.w.emplace_back(cpu, DType::f32, master);
    }
    std::vector<double> g = random_values(rng, n, 4.0);
    if (n == 4097) {
      g[5] = std::numeric_limits<double>::infinity();
      g[3000] = std::numeric_limits<double>::quiet_NaN();
    }
    run.g.emplace_back(cpu, DType::f32, g);
    std::vector<double> m = random_values(rng, n, 0.1), v = random_values(rng, n, 0.01);
    for (double& x : v) x = x * x;
    run.m.emplace_back(cpu, DType::u8, std::vector<double>(quant4_bytes(n), 0.0));
    run.v.emplace_back(cpu, DType::u8, std::vector<double>(quant4_bytes(n), 0.0));
    run.am.emplace_back(cpu, DType::f32, std::vector<double>(quant4_blocks(n), 0.0));
    run.av.emplace_back(cpu, DType::f32, std::vector<double>(quant4_blocks(n), 0.0));
    const TestTensor m0(cpu, DType::f32, m), v0(cpu, DType::f32, v);
    quantize_blockwise4(QuantCode::signed_dynamic, m0.view(), run.m.back().view(), run.am.back().view());
    quantize_blockwise4(QuantCode::unsigned_dynamic, v0.view(), run.v.back().view(), run.av.back().view());
  }
  auto views = [](std::vector<TestTensor>& list) {
    std::vector<TensorView> out;
    for (TestTensor& t : list) out.push_back(t.view());
    return out;
  };
  const auto w = views(run.w), g = views(run.g), m = views(run.m), v = views(run.v), am = views(run.am),
             av = views(run.av), r = views(run.r);  // AdamTensors holds spans of these
  AdamTensors tensors{w, g, m, v, {}, {}, am, av, {}};
  if (remainder) tensors.weight_remainder = r;
  tensors.moment_bits = 4;
  AdamHyperparameters h;
  h.lr = 1e-2f;
  h.weight_decay = 0.01f;
  h.decay = WeightDecay::decoupled;
  AdamPlan(tensors, std::span(&h, 1)).step({.step = 3, .grad_scale = scale});
  return run;
}

TEST_P(CpuIsaAdamInt4, EqualsTheBaselineCopy) {
  for (bool remainder : {false, true}) {
    for (float scale : {1.0f, 512.0f}) {
      const FourBitRun mine = four_bit_step(remainder, scale);
      cpu::set_isa("baseline");
      const FourBitRun baseline = four_bit_step(remainder, scale);
      cpu::set_isa(GetParam());
      EXPECT_EQ(mine.bytes(), baseline.bytes()) << GetParam() << (remainder ? " bf16+remainder" : " f32") << " scale "
                                                << scale;
    }
  }
}

GRADKIT_INSTANTIATE_EACH_CPU_ISA(CpuIsaAdamInt4);

// Naming a copy that does not exist, or one this CPU cannot run, is an
// error that says what there is; the default stays.
TEST(CpuIsa, UnknownOrUnavailableIsRefused) {
  expect_error([] { cpu::set_isa("avx1024"); }, ErrorCode::invalid_argument,
               {"set_isa", "'avx1024'", "expected baseline, avx2 or avx512"});
  for (const char* name : {"avx2", "avx512"}) {
    try {
      cpu::set_isa(name);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is not available on this CPU (it has: baseline"), std::string::npos)
          << e.what();
    }
  }
  cpu::reset_isa();
  EXPECT_NO_THROW(cpu::active_isa());
}

}  // namespace
}  // namespace gradkit::test
