// adam_step with 8-bit blockwise moments on every backend: one step against
// a float64 reference (decode, update, encode) within one code, skipped and
// non-finite steps, determinism, bad arguments; and the CPU and CUDA
// backends bit for bit.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/blockwise.h"
#include "gradkit/ops/master.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/state_file.h"
#include "support/adam_config.h"
#include "support/adam_reference.h"
#include "support/blockwise_reference.h"
#include "support/device_param.h"
#include "support/eight_bit.h"
#include "support/expect_error.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

using Config = AdamConfig;

std::vector<Config> configs() {
  std::vector<Config> out;
  Config adamw{"adamw"};
  adamw.h.weight_decay = 0.01f;
  out.push_back(adamw);
  Config l2{"l2_bf16_grads_bf16_copy"};
  l2.h.decay = WeightDecay::l2;
  l2.h.weight_decay = 0.05f;
  l2.grad = DType::bf16;
  l2.copy = DType::bf16;
  out.push_back(l2);
  Config hf{"hugging_face_f16_grads_scaled"};
  hf.h.decay = WeightDecay::hugging_face;
  hf.h.weight_decay = 0.02f;
  hf.grad = DType::f16;
  hf.grad_scale = 1024.0f;
  out.push_back(hf);
  Config pair{"remainder_weights_maximize_nobias"};
  pair.h.maximize = true;
  pair.h.bias_correction = false;
  pair.remainder = true;
  pair.grad = DType::bf16;
  out.push_back(pair);
  return out;
}

const std::vector<int64_t> kSizes = {1, 255, 256 + 7, 65536 + 300, 1000};

// Everything one 8-bit step reads and writes, on one device.
struct Tensors {
  std::vector<TestTensor> w, rem, copy, g, m, v, am, av;

  Tensors(Device device, const Config& c, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int64_t n : kSizes) {
      const std::vector<double> master = round_to(DType::f32, random_values(rng, n));
      if (c.remainder) {
        const TestTensor f32(device, DType::f32, master);
        w.emplace_back(device, DType::bf16, std::vector<double>(n, 0.0));
        rem.emplace_back(device, DType::i16, std::vector<double>(n, 0.0));
        split_masters(f32.view(), w.back().view(), rem.back().view());
      } else {
        w.emplace_back(device, DType::f32, master);
      }
      copy.emplace_back(device, DType::bf16, std::vector<double>(n, 0.0));
      g.emplace_back(device, c.grad, round_to(c.grad, random_values(rng, n, c.grad_scale)));
      m.emplace_back(device, DType::u8, std::vector<double>(n, 0.0));
      v.emplace_back(device, DType::u8, std::vector<double>(n, 0.0));
      am.emplace_back(device, DType::f32, std::vector<double>(quant_blocks(n), 0.0));
      av.emplace_back(device, DType::f32, std::vector<double>(quant_blocks(n), 0.0));
      const TestTensor m0(device, DType::f32, moment_values(rng, n, true, -4)), v0(device, DType::f32, moment_values(rng, n, false, -4));
      quantize_blockwise(QuantCode::signed_dynamic, m0.view(), m.back().view(), am.back().view());
      quantize_blockwise(QuantCode::unsigned_dynamic, v0.view(), v.back().view(), av.back().view());
    }
    wv = views(w), rv = views(rem), cv = views(copy), gv = views(g), mv = views(m), vv = views(v), amv = views(am),
    avv = views(av);
  }
  AdamTensors tensors(const Config& c) const {
    AdamTensors t{wv, gv, mv, vv, {}, {}, amv, avv, {}};
    if (c.copy != DType::f32) t.model_copy = cv;
    if (c.remainder) t.weight_remainder = rv;
    return t;
  }
  std::vector<double> masters(size_t i) const {
    if (rem.empty()) return w[i].read();
    TestTensor out(w[i].view().device, DType::f32, std::vector<double>(w[i].numel(), 0.0));
    join_masters(w[i].view(), rem[i].view(), out.view());
    return out.read();
  }
  std::vector<double> decoded(size_t i, bool first) const {
    TestTensor out(w[i].view().device, DType::f32, std::vector<double>(w[i].numel(), 0.0));
    dequantize_blockwise(first ? QuantCode::signed_dynamic : QuantCode::unsigned_dynamic,
                         (first ? m : v)[i].view(), (first ? am : av)[i].view(), out.view());
    return out.read();
  }
  std::vector<std::vector<uint8_t>> bytes() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto* list : {&w, &rem, &copy, &m, &v, &am, &av}) {
      for (const auto& t : *list) out.push_back(t.bytes());
    }
    return out;
  }

  std::vector<TensorView> wv, rv, cv, gv, mv, vv, amv, avv;
};

using Adam8bit = OnEachDevice;

// Decode, update in f64, encode in f64: the kernel's absmax agrees to f32
// rounding, its codes are the reference's or a neighbour (f32 arithmetic may
// land on the other side of a decision point), its weights agree to f32
// rounding (they are updated from the f32 moments, before encoding).
TEST_P(Adam8bit, OneStepMatchesTheReferenceWithinOneCode) {
  uint64_t seed = 40;
  for (const Config& c : configs()) {
    Tensors t(device(), c, seed++);
    const int64_t step = 5;
    std::vector<AdamReferenceState> ref;
    for (size_t i = 0; i < kSizes.size(); ++i) ref.push_back({t.masters(i), t.decoded(i, true), t.decoded(i, false), {}});
    AdamPlan(t.tensors(c), std::span(&c.h, 1)).step({.step = step, .grad_scale = c.grad_scale});
    synchronize(device());
    for (size_t i = 0; i < kSizes.size(); ++i) {
      const std::string what = c.name + " tensor " + std::to_string(i);
      reference_adam_step(ref[i], t.g[i].read(), c.h, step, c.grad_scale, DType::f64, DType::f64);
      EXPECT_LE(relative_error(t.masters(i), ref[i].w), optimizer_tolerance(DType::f32, 1)) << what << " (weights)";
      for (bool first : {true, false}) {
        expect_encoded(first ? ref[i].m : ref[i].v, (first ? t.m : t.v)[i].read(), (first ? t.am : t.av)[i].read(),
                       first, what);
      }
      if (c.copy != DType::f32) EXPECT_EQ(t.copy[i].read(), round_to(DType::bf16, t.w[i].read())) << what << " (copy)";
    }
  }
}

// Over many steps the 8-bit moments follow the f32 moments: the weights'
// movement differs by a few percent (the codes' relative spacing).
TEST_P(Adam8bit, ManyStepsFollowTheF32MomentPath) {
  std::mt19937_64 rng(5);
  const int64_t n = 65536 + 1000;
  const std::vector<double> w0 = round_to(DType::f32, random_values(rng, n));
  TestTensor w8(device(), DType::f32, w0), w32(device(), DType::f32, w0), g(device(), DType::f32, w0);
  TestTensor q_m(device(), DType::u8, std::vector<double>(n, 127)), q_v(device(), DType::u8, std::vector<double>(n, 0));
  TestTensor am(device(), DType::f32, std::vector<double>(quant_blocks(n), 0)), av(device(), DType::f32, std::vector<double>(quant_blocks(n), 0));
  TestTensor m(device(), DType::f32, std::vector<double>(n, 0)), v(device(), DType::f32, std::vector<double>(n, 0));
  const TensorView W8[] = {w8.view()}, W32[] = {w32.view()}, G[] = {g.view()}, QM[] = {q_m.view()}, QV[] = {q_v.view()},
                   AM[] = {am.view()}, AV[] = {av.view()}, M[] = {m.view()}, V[] = {v.view()};
  AdamHyperparameters h;
  h.lr = 1e-3f;
  const AdamPlan eight({W8, G, QM, QV, {}, {}, AM, AV, {}}, std::span(&h, 1)), full({W32, G, M, V, {}, {}}, std::span(&h, 1));
  std::normal_distribution<double> noise(0.0, 1.0);
  for (int step = 1; step <= 50; ++step) {
    // A gradient with a steady direction per element plus noise, as training has.
    std::vector<double> grad(n);
    for (int64_t k = 0; k < n; ++k) grad[k] = 0.01 * w0[k] + 0.005 * noise(rng);
    const TestTensor fresh(device(), DType::f32, grad);
    copy_from_host(g.view().data, device(), fresh.bytes().data(), fresh.bytes().size());
    eight.step({.step = step});
    full.step({.step = step});
  }
  synchronize(device());
  const std::vector<double> a = w8.read(), b = w32.read();
  double diff = 0, moved = 0;
  for (int64_t k = 0; k < n; ++k) {
    diff += (a[k] - b[k]) * (a[k] - b[k]);
    moved += (b[k] - w0[k]) * (b[k] - w0[k]);
  }
  EXPECT_LT(std::sqrt(diff / moved), 0.05);
}

// A small gradient in a block beside a large one: with a steady gradient
// Adam steps each weight by about lr. Were the small element's v (1e-8 of
// the block's absmax) encoded as 0, its history would be lost each step
// while its m kept it, and its steps would grow to several lr (a run of
// gradkit train diverged so); the unsigned map's positive floor keeps it.
TEST_P(Adam8bit, ASmallGradientBesideALargeOneStepsNoFurtherThanLr) {
  const int64_t n = kQuantBlock;
  std::vector<double> grad(n, 1e-4);
  grad[0] = 1.0;
  TestTensor w(device(), DType::f32, std::vector<double>(n, 0.5)), g(device(), DType::f32, grad);
  TestTensor qm(device(), DType::u8, std::vector<double>(n, 0)), qv(device(), DType::u8, std::vector<double>(n, 0));
  TestTensor am(device(), DType::f32, {0.0}), av(device(), DType::f32, {0.0});
  const TensorView W[] = {w.view()}, G[] = {g.view()}, QM[] = {qm.view()}, QV[] = {qv.view()}, AM[] = {am.view()},
                   AV[] = {av.view()};
  AdamHyperparameters h;
  h.lr = 1e-3f;
  const AdamPlan plan({W, G, QM, QV, {}, {}, AM, AV, {}}, std::span(&h, 1));
  std::vector<double> before = w.read();
  for (int step = 1; step <= 40; ++step) {
    plan.step({.step = step});
    const std::vector<double> after = w.read();
    for (int64_t k = 0; k < n; ++k) ASSERT_LE(std::abs(after[k] - before[k]), 1.5 * h.lr) << "step " << step << " element " << k;
    before = after;
  }
  const std::vector<double> codes = qv.read();
  for (int64_t k = 1; k < n; ++k) ASSERT_GE(codes[k], 1) << "a positive v keeps a positive code";
}

TEST_P(Adam8bit, FoundInfSkipsTheWholeStep) {
  const Config c = configs()[0];
  Tensors t(device(), c, 3);
  const auto before = t.bytes();
  TestFlag found(device(), true);
  AdamPlan(t.tensors(c), std::span(&c.h, 1)).step({.step = 1, .found_inf = found.pointer()});
  synchronize(device());
  EXPECT_EQ(t.bytes(), before);
}

// Without found_inf, a NaN gradient makes its element's weight NaN and its
// blocks' absmax NaN (the whole block then decodes to NaN); other blocks and
// tensors are untouched by it.
TEST_P(Adam8bit, ANanGradientPoisonsOnlyItsBlock) {
  const Config c = configs()[0];
  Tensors t(device(), c, 4), clean(device(), c, 4);
  const size_t i = 3;  // 65836 elements: blocks 0 .. 257
  std::vector<double> grad = t.g[i].read();
  grad[300] = std::numeric_limits<double>::quiet_NaN();  // block 1
  t.g[i] = TestTensor(device(), DType::f32, grad);
  t.gv = views(t.g);
  AdamPlan(t.tensors(c), std::span(&c.h, 1)).step({.step = 1});
  AdamPlan(clean.tensors(c), std::span(&c.h, 1)).step({.step = 1});
  synchronize(device());
  const auto am = t.am[i].read(), clean_am = clean.am[i].read();
  EXPECT_TRUE(std::isnan(am[1]));
  EXPECT_TRUE(std::isnan(t.w[i].read()[300]));
  for (size_t b = 0; b < am.size(); ++b) {
    if (b != 1) ASSERT_EQ(am[b], clean_am[b]) << "block " << b;
  }
  EXPECT_EQ(t.m[0].bytes(), clean.m[0].bytes());
}

TEST_P(Adam8bit, BitwiseDeterministic) {
  for (const Config& c : configs()) {
    Tensors a(device(), c, 9), b(device(), c, 9);
    for (int step = 1; step <= 3; ++step) {
      AdamPlan(a.tensors(c), std::span(&c.h, 1)).step({.step = step});
      AdamPlan(b.tensors(c), std::span(&c.h, 1)).step({.step = step});
    }
    synchronize(device());
    EXPECT_EQ(a.bytes(), b.bytes()) << c.name;
  }
}

TEST_P(Adam8bit, RejectsBadArgumentsNamingThem) {
  const Config c = configs()[0];
  Tensors t(device(), c, 6);
  const auto before = t.bytes();
  AdamTensors x = t.tensors(c);
  const AdamHyperparameters h;
  auto plan = [&](const AdamTensors& tensors, AdamHyperparameters hyper = {}) { AdamPlan(tensors, std::span(&hyper, 1)); };

  AdamTensors missing = x;
  missing.exp_avg_sq_absmax = {};
  expect_error([&] { plan(missing); }, ErrorCode::size_mismatch, {"exp_avg_sq_absmax", "exp_avg is u8"});

  AdamHyperparameters ams;
  ams.amsgrad = true;
  AdamTensors with_max = x;
  with_max.max_exp_avg_sq = x.exp_avg_sq;
  expect_error([&] { plan(with_max, ams); }, ErrorCode::invalid_argument, {"hyperparameters[0].amsgrad", "8-bit"});

  std::vector<TensorView> wrong_blocks = t.amv;
  wrong_blocks[2].numel += 1;
  AdamTensors blocks = x;
  blocks.exp_avg_absmax = wrong_blocks;
  expect_error([&] { plan(blocks); }, ErrorCode::size_mismatch, {"exp_avg_absmax[2]", "expected 2"});

  std::vector<TestTensor> f32_v;
  for (int64_t n : kSizes) f32_v.emplace_back(device(), DType::f32, std::vector<double>(n, 0.0));
  const auto f32_views = views(f32_v);
  AdamTensors mixed = x;
  mixed.exp_avg_sq = f32_views;
  expect_error([&] { plan(mixed); }, ErrorCode::dtype_unsupported, {"exp_avg_sq", "u8"});

  AdamTensors absmax_without_codes = x;
  absmax_without_codes.exp_avg = f32_views;
  absmax_without_codes.exp_avg_sq = f32_views;
  expect_error([&] { plan(absmax_without_codes); }, ErrorCode::invalid_argument, {"exp_avg_absmax", "not u8"});

  AdamTensors u8_grads = x;
  u8_grads.grads = t.mv;
  expect_error([&] { plan(u8_grads); }, ErrorCode::dtype_unsupported, {"grads[0]", "u8"});
  (void)h;
  EXPECT_EQ(t.bytes(), before);
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(Adam8bit);

// The owning Adam with 8-bit moments (support/eight_bit.h).
AdamGroup owning_group() {
  AdamGroup group;
  group.hyperparameters.lr = 1e-2f;
  group.hyperparameters.weight_decay = 0.01f;
  return group;
}

using Adam8bitOptimizer = OnEachDevice;

TEST_P(Adam8bitOptimizer, ResumeFromACheckpointEqualsTheStraightRun) {
  expect_resumed_run_equals_straight_run<Adam>(device(), owning_group(), {.moment_dtype = DType::u8});
}

// FNV-1a (64-bit), as docs/state-format.md closes a file with.
uint64_t fnv1a(const std::vector<char>& bytes, size_t end) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < end; ++i) {
    h ^= static_cast<uint8_t>(bytes[i]);
    h *= 0x100000001b3ull;
  }
  return h;
}

// A file written before 8-bit moments (format version 1) still loads.
TEST_P(Adam8bitOptimizer, AVersion1FileStillLoads) {
  OwningModel model(device(), 8);
  Adam adam(model.groups(owning_group()));
  std::mt19937_64 rng(1);
  model.new_gradients(rng);
  adam.step();
  const std::string path = ::testing::TempDir() + "gradkit_adam_v1_" + std::to_string(::getpid());
  adam.save(path);
  std::vector<char> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const uint32_t one = 1;
  std::memcpy(bytes.data() + 8, &one, 4);
  const uint64_t sum = fnv1a(bytes, bytes.size() - 8);
  std::memcpy(bytes.data() + bytes.size() - 8, &sum, 8);
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  Adam second(model.groups(owning_group()));
  second.load(path);
  EXPECT_EQ(second.step_count(), 1);
  EXPECT_EQ(moment_state(second), moment_state(adam));
  std::remove(path.c_str());
}

TEST_P(Adam8bitOptimizer, RejectsWhatCannotWork) {
  OwningModel model(device(), 9);
  auto groups = model.groups(owning_group());
  groups[0].hyperparameters.amsgrad = true;
  expect_error([&] { Adam(groups, {.moment_dtype = DType::u8}); }, ErrorCode::invalid_argument,
               {"hyperparameters[0].amsgrad", "8-bit"});
  expect_error([&] { Adam(model.groups(owning_group()), {.moment_dtype = DType::i16}); }, ErrorCode::dtype_unsupported,
               {"options.moment_dtype", "f32, bf16 or u8"});
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(Adam8bitOptimizer);

// The same steps on the CPU and on CUDA give the same bytes: weights,
// remainders, copies, codes, absmax; for the f32-moment path too.
TEST(Adam8bitBackends, CpuAndCudaAgreeBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  for (const Config& c : configs()) {
    Tensors cpu(Device::cpu(), c, 77), gpu(Device::cuda(0), c, 77);
    const AdamPlan on_cpu(cpu.tensors(c), std::span(&c.h, 1)), on_gpu(gpu.tensors(c), std::span(&c.h, 1));
    for (int step = 1; step <= 20; ++step) {
      on_cpu.step({.step = step, .grad_scale = c.grad_scale});
      on_gpu.step({.step = step, .grad_scale = c.grad_scale});
    }
    synchronize(Device::cuda(0));
    EXPECT_EQ(cpu.bytes(), gpu.bytes()) << c.name;
  }
}

TEST(AdamBackends, F32MomentsCpuAndCudaAgreeBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  for (DType weights : {DType::f32, DType::bf16}) {
    std::vector<std::vector<uint8_t>> results;
    for (Device device : {Device::cpu(), Device::cuda(0)}) {
      std::mt19937_64 rng(8);
      const int64_t n = 65536 * 2 + 5;
      const std::vector<double> master = round_to(DType::f32, random_values(rng, n));
      TestTensor w(device, weights, master), rem(device, DType::i16, std::vector<double>(n, 0.0));
      if (weights == DType::bf16) {
        const TestTensor f32(device, DType::f32, master);
        split_masters(f32.view(), w.view(), rem.view());
      }
      TestTensor g(device, DType::bf16, random_values(rng, n)), m(device, DType::f32, std::vector<double>(n, 0.0)),
          v(device, DType::f32, std::vector<double>(n, 0.0));
      const TensorView W[] = {w.view()}, G[] = {g.view()}, M[] = {m.view()}, V[] = {v.view()}, R[] = {rem.view()};
      AdamTensors t{W, G, M, V, {}, {}};
      if (weights == DType::bf16) t.weight_remainder = R;
      AdamHyperparameters h;
      h.weight_decay = 0.1f;
      const AdamPlan plan(t, std::span(&h, 1));
      for (int step = 1; step <= 10; ++step) plan.step({.step = step});
      synchronize(device);
      results.push_back(w.bytes());
      results.push_back(m.bytes());
      results.push_back(v.bytes());
    }
    EXPECT_EQ(std::vector(results.begin(), results.begin() + 3), std::vector(results.begin() + 3, results.end()))
        << dtype_name(weights) << " weights";
  }
}

}  // namespace
}  // namespace gradkit::test
