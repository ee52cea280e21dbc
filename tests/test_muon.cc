// muon_step / MuonPlan on every backend against the float64 reference
// (support/muon_reference.h), plus batching, determinism, the non-finite
// rules and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/ops/muon.h"
#include "support/device_param.h"
#include "support/expect_error.h"
#include "support/muon_reference.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

// One run's tensors and the reference state of each of their matrices.
struct MuonLists {
  std::vector<TestTensor> w, g, buf, second;
  std::vector<TensorView> wv, gv, bv, sv;
  std::vector<MatrixShape> shapes;
  std::vector<std::vector<MuonReferenceMatrix>> ref;  // per tensor, per matrix
  MuonReferenceDtypes d;

  MuonLists(Device device, std::mt19937_64& rng, const std::vector<MatrixShape>& s, MuonReferenceDtypes dtypes)
      : shapes(s), d(dtypes) {
    for (const MatrixShape& shape : shapes) {
      const int64_t n = shape.batch * shape.rows * shape.cols;
      const auto weights = round_to(d.param, random_values(rng, n));
      const auto buffer = round_to(d.momentum, random_values(rng, n, 0.1));
      w.emplace_back(device, d.param, weights);
      g.emplace_back(device, d.grad, random_values(rng, n));
      buf.emplace_back(device, d.momentum, buffer);
      second.emplace_back(device, DType::f32, std::vector<double>(static_cast<size_t>(muon_second_moment_numel(shape))));
      std::vector<MuonReferenceMatrix> per_matrix;
      const int64_t e = shape.rows * shape.cols;
      for (int64_t m = 0; m < shape.batch; ++m) {
        per_matrix.push_back({shape.rows, shape.cols, {weights.begin() + m * e, weights.begin() + (m + 1) * e},
                              {buffer.begin() + m * e, buffer.begin() + (m + 1) * e}});
      }
      ref.push_back(per_matrix);
    }
    for (auto& t : w) wv.push_back(t.view());
    for (auto& t : g) gv.push_back(t.view());
    for (auto& t : buf) bv.push_back(t.view());
    for (auto& t : second) sv.push_back(t.view());
  }
  // With the second moments (NorMuon's state; unread by groups without it).
  MuonTensors tensors() const { return {wv, gv, bv, shapes, sv}; }

  // New seeded gradients in the same memory; returns them as the tensors hold them.
  std::vector<std::vector<double>> new_gradients(std::mt19937_64& rng, double scale = 1.0) {
    std::vector<std::vector<double>> out;
    for (auto& t : g) {
      out.push_back(round_to(d.grad, random_values(rng, t.numel(), scale)));
      const TestTensor fresh(t.view().device, d.grad, out.back());
      const auto bytes = fresh.bytes();
      copy_from_host(t.view().data, t.view().device, bytes.data(), bytes.size());
    }
    return out;
  }

  void reference_step(const std::vector<std::vector<double>>& grads, std::span<const MuonHyperparameters> h,
                      const std::vector<int32_t>& groups, bool bf16_products = true) {
    for (size_t i = 0; i < ref.size(); ++i) {
      const int64_t e = shapes[i].rows * shapes[i].cols;
      for (size_t m = 0; m < ref[i].size(); ++m) {
        const std::vector<double> gm(grads[i].begin() + m * e, grads[i].begin() + (m + 1) * e);
        muon_reference_step(ref[i][m], gm, h[groups.empty() ? 0 : groups[i]], d, bf16_products);
      }
    }
  }

  std::vector<double> reference_weights(size_t i) const {
    std::vector<double> out;
    for (const auto& m : ref[i]) out.insert(out.end(), m.w.begin(), m.w.end());
    return out;
  }
  std::vector<double> reference_momentum(size_t i) const {
    std::vector<double> out;
    for (const auto& m : ref[i]) out.insert(out.end(), m.buf.begin(), m.buf.end());
    return out;
  }
  std::vector<double> reference_second_moment(size_t i) const {
    std::vector<double> out;
    for (const auto& m : ref[i]) out.insert(out.end(), m.second.begin(), m.second.end());
    return out;
  }
  std::vector<std::vector<uint8_t>> bits() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto* list : {&w, &g, &buf})
      for (const auto& t : *list) out.push_back(t.bytes());
    return out;
  }
};

std::vector<double> minus(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] - b[i];
  return out;
}

struct Case {
  std::string name;
  std::vector<MatrixShape> shapes;
  std::vector<MuonHyperparameters> h = {MuonHyperparameters{}};
  std::vector<int32_t> groups;
  MuonReferenceDtypes d;
};

// nanochat's recipe (docs/ops.md, "muon_step", "The recipe") and its parts one at a time.
MuonHyperparameters recipe(MuonHyperparameters h) {
  h.set_ns_coefficients(kPolarExpressCoefficients);
  h.divisor = MuonDivisor::polar_express;
  h.eps = 1e-6f;
  h.equilibrate_rows = true;
  h.renormalize = true;
  h.second_moment = true;
  h.beta2 = 0.9;
  h.cautious_weight_decay = true;
  return h;
}

std::vector<Case> recipe_cases() {
  MuonHyperparameters fast;
  fast.lr = 0.02;
  const std::vector<MatrixShape> shapes = {{1, 24, 40}, {1, 40, 24}, {1, 32, 32}, {3, 16, 24}};
  std::vector<Case> out;
  out.push_back({"recipe", shapes, {recipe(fast)}});
  Case low{"recipe_bf16", {{1, 24, 40}, {2, 40, 24}}, {recipe(fast)}};
  low.d = {DType::bf16, DType::bf16, DType::bf16};
  out.push_back(low);
  const auto one = [&](std::string name, auto change) {
    MuonHyperparameters h = fast;
    change(h);
    out.push_back({std::move(name), shapes, {h}});
  };
  one("polar_express", [](auto& h) {
    h.set_ns_coefficients(kPolarExpressCoefficients);
    h.divisor = MuonDivisor::polar_express;
  });
  one("three_triples_for_five_steps", [](auto& h) {
    h.set_ns_coefficients(std::span(kPolarExpressCoefficients).first(3));  // the third for iterations 3 to 5
  });
  one("equilibrate_rows", [](auto& h) { h.equilibrate_rows = true; });
  one("renormalize", [](auto& h) { h.renormalize = true; });
  one("second_moment", [](auto& h) { h.second_moment = true; });
  one("cautious_weight_decay", [](auto& h) {
    h.cautious_weight_decay = true;
    h.weight_decay = 0.5;
  });
  // A group with the recipe beside one without: each batch takes its own.
  Case mixed{"recipe_beside_torch", {{1, 24, 40}, {1, 24, 40}, {1, 40, 24}}, {fast, recipe(fast)}, {0, 1, 1}};
  out.push_back(mixed);
  return out;
}

std::vector<Case> cases() {
  MuonHyperparameters fast;  // a larger lr than the default, so that f32 weights show the update well
  fast.lr = 0.02;
  std::vector<Case> out;
  out.push_back({"wide_and_tall", {{1, 24, 40}, {1, 40, 24}, {1, 24, 40}, {1, 33, 17}}, {fast}});
  Case plain{"square_no_nesterov_match_rms", {{1, 32, 32}, {1, 16, 48}}, {fast}};
  plain.h[0].nesterov = false;
  plain.h[0].adjust_lr = MuonLrAdjust::match_rms_adamw;
  plain.h[0].weight_decay = 0.3;
  out.push_back(plain);
  out.push_back({"expert_stack", {{4, 16, 24}, {1, 16, 24}, {3, 24, 16}}, {fast}});
  // Small matrices, one of each shape (a batch of one), whose products cuBLASLt's
  // heuristic would split over K and add in bf16 were the plan not to forbid it.
  out.push_back({"lone_small_matrices", {{1, 20, 14}, {1, 18, 10}, {1, 10, 18}, {2, 12, 10}}, {fast}});
  Case groups{"two_groups", {{1, 24, 40}, {1, 24, 40}, {1, 8, 8}}, {fast, fast}, {0, 1, 1}};
  groups.h[1].lr = 0.05;
  groups.h[1].momentum = 0.9;
  groups.h[1].ns_steps = 4;
  out.push_back(groups);
  Case low{"bf16_params_grads_momentum", {{1, 24, 40}, {2, 40, 24}}, {fast}};
  low.d = {DType::bf16, DType::bf16, DType::bf16};
  out.push_back(low);
  Case half_grads{"f16_grads", {{1, 24, 40}}, {fast}};
  half_grads.d.grad = DType::f16;
  out.push_back(half_grads);
  for (const Case& c : recipe_cases()) out.push_back(c);
  return out;
}

// Cautious weight decay's mask is a step function of the result's sign: an
// element whose result lies within a bf16 unit of 0 may take the decay on
// one side and not on the other (a difference of the whole decay,
// lr' wd |w|), and keeps that weight difference after. Two runs' results
// differ near 0 by about a bf16 unit of the matrix's largest values, which
// puts about 1% of a small matrix's elements at risk (measured on the
// CPU's cases: up to 8 of 1024 at the first step). Drops such elements
// from both updates and returns their count; the rest must agree as any
// other update does.
size_t drop_mask_flips(std::vector<double>& got, std::vector<double>& ref, const std::vector<double>& w,
                       double decay) {
  std::vector<double> g, r;
  size_t flips = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    if (std::fabs(got[e] - ref[e]) > 0.5 * decay * std::fabs(w[e]) && std::fabs(got[e] - ref[e]) > 1e-6) {
      ++flips;
      continue;
    }
    g.push_back(got[e]);
    r.push_back(ref[e]);
  }
  got = std::move(g);
  ref = std::move(r);
  return flips;
}

using Muon = OnEachDevice;

// Three steps; after each, the update (f32 weights) or the weights (bf16)
// against the reference that rounds as torch's bf16 tensors do, and the
// momentum buffers; after the last, the update against the unrounded f64
// Newton-Schulz too.
TEST_P(Muon, MatchesReferenceOverThreeSteps) {
  uint64_t seed = 900;
  for (const Case& c : cases()) {
    std::mt19937_64 rng(seed++);
    MuonLists l(device(), rng, c.shapes, c.d);
    MuonLists exact = l;  // the same start, for the unrounded reference (reference state only)
    const MuonPlan plan(l.tensors(), c.h, c.groups);
    for (int step = 1; step <= 3; ++step) {
      std::vector<std::vector<double>> before;
      for (auto& t : l.w) before.push_back(t.read());
      std::vector<std::vector<double>> before_exact;
      for (size_t i = 0; i < exact.ref.size(); ++i) before_exact.push_back(exact.reference_weights(i));
      const auto grads = l.new_gradients(rng);
      plan.step();
      l.reference_step(grads, c.h, c.groups);
      exact.reference_step(grads, c.h, c.groups, /*bf16_products=*/false);
      for (size_t i = 0; i < l.w.size(); ++i) {
        const std::string what = c.name + " step " + std::to_string(step) + " tensor " + std::to_string(i);
        const auto got = l.w[i].read();
        const MuonHyperparameters& h = c.h[c.groups.empty() ? 0 : c.groups[i]];
        const bool polar = h.ns_coefficient_count > 1;
        if (c.d.param == DType::f32) {
          const double decay = muon_adjusted_lr(h, c.shapes[i].rows, c.shapes[i].cols) * h.weight_decay;
          const auto compare = [&](std::vector<double> got_update, std::vector<double> ref_update, bool exact_products,
                                   const std::string& against) {
            if (h.cautious_weight_decay) {
              const size_t flips = drop_mask_flips(got_update, ref_update, before[i], decay);
              // Against float64 products the results differ by the bf16 products' few percent (measured: up to 93 of 1152).
              EXPECT_LE(flips, got.size() / (exact_products ? 8 : 32)) << what << " cautious masks that differ" << against;
            }
            EXPECT_LE(relative_error(got_update, ref_update), muon_update_tolerance(exact_products, polar))
                << what << " update" << against;
          };
          compare(minus(got, before[i]), minus(l.reference_weights(i), before[i]), false, "");
          if (step == 1) {  // from the same weights: the unrounded products
            compare(minus(got, before[i]), minus(exact.reference_weights(i), before_exact[i]), true,
                    " against float64 products");
          }
        } else {
          EXPECT_LE(relative_error(got, l.reference_weights(i)), optimizer_tolerance(c.d.param, step)) << what;
        }
        EXPECT_LE(relative_error(l.buf[i].read(), l.reference_momentum(i)), optimizer_tolerance(c.d.momentum, step))
            << what << " momentum";
        const auto second = l.reference_second_moment(i);
        if (!second.empty()) {
          EXPECT_LE(relative_error(l.second[i].read(), second), muon_second_moment_tolerance()) << what << " second moment";
        }
      }
    }
  }
}

// The symmetric products by row blocks (CUDA, MuonPlanOptions::split_from):
// the same step within the products' tolerance of the reference, on wide
// and tall matrices, two of each shape in a batch.
TEST_P(Muon, SplitSymmetricProductsMatchTheReference) {
  std::mt19937_64 rng(25);
  MuonLists l(device(), rng, {{2, 128, 200}, {2, 200, 128}, {1, 192, 192}}, {});
  MuonHyperparameters h;
  h.lr = 0.02;
  const MuonPlan plan(l.tensors(), std::span(&h, 1), {}, MuonPlanOptions{128});
  for (int step = 1; step <= 2; ++step) {
    std::vector<std::vector<double>> before;
    for (auto& t : l.w) before.push_back(t.read());
    const auto grads = l.new_gradients(rng);
    plan.step();
    l.reference_step(grads, std::span(&h, 1), {});
    for (size_t i = 0; i < l.w.size(); ++i) {
      EXPECT_LE(relative_error(minus(l.w[i].read(), before[i]), minus(l.reference_weights(i), before[i])),
                muon_update_tolerance(false))
          << "step " << step << " tensor " << i;
    }
  }
}

// Small batches run at once on side streams (CUDA, MuonPlanOptions::streams):
// the same step as one after another, within the products' tolerance (each
// stream's products may take another cuBLAS algorithm), the momentum bit for bit.
TEST_P(Muon, BatchesOnSideStreamsStepAsOneAfterAnother) {
  std::mt19937_64 rng(26), rng_serial(26);
  const std::vector<MatrixShape> shapes = {{1, 24, 40}, {2, 40, 24}, {1, 32, 32}, {3, 16, 48}, {1, 8, 8}};
  MuonLists together(device(), rng, shapes, {}), serial(device(), rng_serial, shapes, {});
  MuonHyperparameters h;
  h.lr = 0.02;
  const MuonPlan a(together.tensors(), std::span(&h, 1));
  MuonPlanOptions one;
  one.streams = 1;
  const MuonPlan b(serial.tensors(), std::span(&h, 1), {}, one);
  std::vector<std::vector<double>> before;
  for (auto& t : together.w) before.push_back(t.read());
  std::mt19937_64 g1(27), g2(27);
  for (int step = 0; step < 2; ++step) {
    together.new_gradients(g1);
    serial.new_gradients(g2);
    a.step();
    b.step();
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_LE(relative_error(minus(together.w[i].read(), before[i]), minus(serial.w[i].read(), before[i])),
              muon_update_tolerance(false))
        << i;
    EXPECT_EQ(together.buf[i].bytes(), serial.buf[i].bytes()) << i;
  }
  MuonPlanOptions none;
  none.streams = 0;
  expect_error([&] { MuonPlan(serial.tensors(), std::span(&h, 1), {}, none); }, ErrorCode::invalid_argument,
               {"options.streams", ">= 1"});
}

// CUDA: the step recorded into a graph and replayed (MuonPlanOptions::graphs)
// is the eager step bit for bit, through a new learning rate (read from the
// device table by the replays), a new ns_steps (recorded again) and a
// found_inf flag (recorded again, and honoured).
TEST_P(Muon, ReplayedStepsAreTheEagerStepsBitForBit) {
  std::mt19937_64 rng(28), rng_eager(28);
  const std::vector<MatrixShape> shapes = {{1, 24, 40}, {2, 40, 24}, {1, 300, 260}};
  MuonLists replayed(device(), rng, shapes, {}), eager(device(), rng_eager, shapes, {});
  std::vector<MuonHyperparameters> h(1);
  h[0].lr = 0.02;
  MuonPlan a(replayed.tensors(), h);
  MuonPlanOptions off;
  off.graphs = false;
  MuonPlan b(eager.tensors(), h, {}, off);
  const TestFlag clear(device(), false);
  std::mt19937_64 g1(29), g2(29);
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {
      h[0].lr = 0.05;
      h[0].weight_decay = 0.2;
      a.set_hyperparameters(h);
      b.set_hyperparameters(h);
    }
    if (step == 4) {
      h[0].ns_steps = 3;
      a.set_hyperparameters(h);
      b.set_hyperparameters(h);
    }
    replayed.new_gradients(g1);
    eager.new_gradients(g2);
    const MuonStepInputs in{step == 5 ? clear.pointer() : nullptr};
    a.step(in);
    b.step(in);
    ASSERT_EQ(replayed.bits(), eager.bits()) << "step " << step;
  }
  const TestFlag found(device(), true);
  const auto before = replayed.bits();
  a.step({found.pointer()});
  EXPECT_EQ(replayed.bits(), before);
}

TEST_P(Muon, BatchesMatricesOfOneShapeAndGroup) {
  std::mt19937_64 rng(11);
  MuonLists l(device(), rng, {{1, 24, 40}, {3, 24, 40}, {1, 40, 24}, {1, 24, 40}, {2, 8, 8}}, {});
  const MuonPlan one(l.tensors(), std::vector<MuonHyperparameters>{{}});
  EXPECT_EQ(one.num_batches(), 3u);  // 24x40 (5 matrices), 40x24, 8x8
  const std::vector<int32_t> groups = {0, 1, 0, 0, 1};
  const MuonPlan two(l.tensors(), std::vector<MuonHyperparameters>{{}, {}}, groups);
  EXPECT_EQ(two.num_batches(), 4u);  // 24x40 in each group
}

// A matrix's result does not depend on the others in its batch: the same
// matrix stepped alone gives the same numbers (bitwise on the CPU, whose
// products run one matrix at a time; within the products' tolerance on
// CUDA, where cuBLAS may tile a batch of one differently).
TEST_P(Muon, BatchedEqualsOneByOne) {
  std::mt19937_64 rng(12);
  MuonLists batched(device(), rng, {{1, 24, 40}, {2, 24, 40}, {1, 24, 40}}, {});
  std::mt19937_64 rng_alone(12);
  MuonLists alone(device(), rng_alone, {{1, 24, 40}, {2, 24, 40}, {1, 24, 40}}, {});
  std::mt19937_64 grads(13);
  batched.new_gradients(grads);
  std::mt19937_64 grads_alone(13);
  alone.new_gradients(grads_alone);
  const MuonHyperparameters h;
  MuonPlan(batched.tensors(), std::span(&h, 1)).step();
  for (size_t i = 0; i < alone.w.size(); ++i) {
    const std::vector<MatrixShape> shape = {alone.shapes[i]};
    muon_step({std::span(&alone.wv[i], 1), std::span(&alone.gv[i], 1), std::span(&alone.bv[i], 1), shape}, h);
  }
  for (size_t i = 0; i < alone.w.size(); ++i) {
    if (device().is_cuda()) {
      EXPECT_LE(relative_error(batched.w[i].read(), alone.w[i].read()), muon_update_tolerance(false)) << i;
    } else {
      EXPECT_EQ(batched.w[i].bytes(), alone.w[i].bytes()) << i;
    }
    EXPECT_EQ(batched.buf[i].bytes(), alone.buf[i].bytes()) << i;
  }
}

TEST_P(Muon, SameInputsGiveTheSameBits) {
  std::vector<std::vector<std::vector<uint8_t>>> runs;
  for (int run = 0; run < 2; ++run) {
    std::mt19937_64 rng(14);
    MuonLists l(device(), rng, {{1, 40, 24}, {2, 24, 40}, {1, 300, 260}}, {});
    const MuonPlan plan(l.tensors(), std::vector<MuonHyperparameters>{{}});
    for (int step = 0; step < 2; ++step) {
      l.new_gradients(rng);
      plan.step();
    }
    runs.push_back(l.bits());
  }
  EXPECT_EQ(runs[0], runs[1]);
}

TEST_P(Muon, FoundInfWritesNothing) {
  std::mt19937_64 rng(15);
  MuonLists l(device(), rng, {{1, 24, 40}, {1, 40, 24}}, {});
  l.new_gradients(rng);
  const auto before = l.bits();
  const TestFlag found(device(), true);
  MuonPlan(l.tensors(), std::vector<MuonHyperparameters>{{}}).step({found.pointer()});
  EXPECT_EQ(l.bits(), before);
  const TestFlag clear(device(), false);
  MuonPlan(l.tensors(), std::vector<MuonHyperparameters>{{}}).step({clear.pointer()});
  EXPECT_NE(l.bits(), before);
}

// A NaN or an infinity in a gradient makes its matrix's weights NaN (its
// norm is not finite, and the products spread it), as torch.optim.Muon's
// does; the other matrices of the batch are untouched by it.
TEST_P(Muon, NonFiniteGradientReachesItsMatrixOnly) {
  for (double bad : {NAN, INFINITY}) {
    std::mt19937_64 rng(16);
    MuonLists l(device(), rng, {{3, 24, 40}}, {});
    std::mt19937_64 clean_rng(16);
    MuonLists clean(device(), clean_rng, {{3, 24, 40}}, {});
    auto grads = l.new_gradients(rng);
    std::mt19937_64 same(17);
    grads = l.new_gradients(same);
    std::mt19937_64 same_clean(17);
    clean.new_gradients(same_clean);
    grads[0][960 + 5] = bad;  // the second matrix
    const TestTensor poisoned(device(), DType::f32, grads[0]);
    copy_from_host(l.gv[0].data, device(), poisoned.bytes().data(), poisoned.bytes().size());
    const MuonHyperparameters h;
    muon_step(l.tensors(), h);
    muon_step(clean.tensors(), h);
    const auto got = l.w[0].read(), want = clean.w[0].read();
    for (int64_t i = 0; i < 960; ++i) {
      ASSERT_EQ(got[i], want[i]) << "first matrix, element " << i;
      ASSERT_TRUE(std::isnan(got[960 + i])) << "second matrix, element " << i;
      ASSERT_EQ(got[1920 + i], want[1920 + i]) << "third matrix, element " << i;
    }
  }
}

// grad_scale divides the gradients: scaled by a power of two and divided
// back, they give the unscaled step bit for bit (host value or device one).
TEST_P(Muon, GradScaleDividesTheGradients) {
  for (bool on_device : {false, true}) {
    std::mt19937_64 rng(21), rng_scaled(21);
    MuonLists plain(device(), rng, {{1, 24, 40}, {2, 40, 24}}, {});
    MuonLists scaled(device(), rng_scaled, {{1, 24, 40}, {2, 40, 24}}, {});
    std::mt19937_64 g1(22), g2(22);
    plain.new_gradients(g1);
    scaled.new_gradients(g2, 512.0);
    const MuonHyperparameters h;
    muon_step(plain.tensors(), h);
    const TestTensor scale(device(), DType::f32, {512.0});
    MuonStepInputs in;
    if (on_device) in.grad_scale_device = scale.view().as<float>();
    else in.grad_scale = 512.0f;
    muon_step(scaled.tensors(), h, in);
    for (size_t i = 0; i < plain.w.size(); ++i) {
      EXPECT_EQ(plain.w[i].bytes(), scaled.w[i].bytes()) << i;
      EXPECT_EQ(plain.buf[i].bytes(), scaled.buf[i].bytes()) << i;
    }
  }
}

// set_grads re-points a plan: its step is that of a plan made on the new gradients.
TEST_P(Muon, SetGradsRepointsEveryBatch) {
  std::mt19937_64 rng(23), rng_fresh(23);
  MuonLists moved(device(), rng, {{1, 24, 40}, {2, 40, 24}, {1, 24, 40}}, {});
  MuonLists fresh(device(), rng_fresh, {{1, 24, 40}, {2, 40, 24}, {1, 24, 40}}, {});
  const MuonHyperparameters h;
  MuonPlan plan(moved.tensors(), std::span(&h, 1));
  std::mt19937_64 g(24);
  std::vector<TestTensor> other;
  std::vector<TensorView> other_views;
  for (auto& t : moved.g) other.emplace_back(device(), DType::f32, random_values(g, t.numel()));
  for (auto& t : other) other_views.push_back(t.view());
  for (size_t i = 0; i < other.size(); ++i) {
    const auto bytes = other[i].bytes();
    copy_from_host(fresh.gv[i].data, device(), bytes.data(), bytes.size());
  }
  plan.set_grads(other_views);
  plan.step();
  muon_step(fresh.tensors(), h);
  for (size_t i = 0; i < moved.w.size(); ++i) EXPECT_EQ(moved.w[i].bytes(), fresh.w[i].bytes()) << i;
  const std::vector<TensorView> short_list(other_views.begin(), other_views.begin() + 2);
  expect_error([&] { plan.set_grads(short_list); }, ErrorCode::size_mismatch, {"grads"});
}

TEST_P(Muon, RefusesBadInputWritingNothing) {
  std::mt19937_64 rng(18);
  MuonLists l(device(), rng, {{1, 24, 40}, {2, 8, 8}}, {});
  const auto before = l.bits();
  const MuonHyperparameters good;
  auto with_shapes = [&](std::vector<MatrixShape> shapes) {
    return [&, shapes] { muon_step({l.wv, l.gv, l.bv, shapes}, good); };
  };
  expect_error(with_shapes({{1, 24, 40}}), ErrorCode::size_mismatch, {"shapes", "one per parameter"});
  expect_error(with_shapes({{1, 24, 40}, {1, 8, 8}}), ErrorCode::size_mismatch, {"shapes[1]", "128 elements"});
  expect_error(with_shapes({{1, 24, 40}, {0, 8, 16}}), ErrorCode::invalid_argument, {"shapes[1]", ">= 1"});
  auto with = [&](auto change, std::vector<std::string> parts) {
    MuonHyperparameters h = good;
    change(h);
    expect_error([&] { muon_step(l.tensors(), h); }, ErrorCode::invalid_argument, parts);
  };
  with([](auto& h) { h.momentum = 1.0; }, {"hyperparameters[0].momentum", "[0, 1)"});
  with([](auto& h) { h.ns_steps = 0; }, {"ns_steps", "[1, 100)"});
  with([](auto& h) { h.ns_steps = 100; }, {"ns_steps", "[1, 100)"});
  with([](auto& h) { h.eps = 0; }, {"eps", "> 0"});
  with([](auto& h) { h.lr = NAN; }, {".lr", "finite"});
  with([](auto& h) { h.weight_decay = -1; }, {"weight_decay", ">= 0"});
  with([](auto& h) { h.ns_coefficients[0].b = INFINITY; }, {"ns_coefficients[0].b", "finite"});
  with([](auto& h) { h.ns_coefficient_count = 9; }, {"ns_coefficient_count", "[1, 8]"});
  with([](auto& h) { h.divisor = static_cast<MuonDivisor>(2); }, {"divisor", "polar_express"});
  with([](auto& h) { h.beta2 = 1.0; }, {"beta2", "[0, 1)"});
  // NorMuon without second moments, with too few, with the wrong size or dtype.
  MuonHyperparameters normuon = good;
  normuon.second_moment = true;
  expect_error([&] { muon_step({l.wv, l.gv, l.bv, l.shapes}, normuon); }, ErrorCode::invalid_argument,
               {"second_moment", "is empty", "hyperparameters[0].second_moment"});
  expect_error([&] { muon_step({l.wv, l.gv, l.bv, l.shapes, std::span(l.sv).first(1)}, normuon); },
               ErrorCode::size_mismatch, {"second_moment", "one per parameter"});
  const TestTensor short_second(device(), DType::f32, std::vector<double>(10));
  const std::vector<TensorView> wrong_size = {l.sv[0], short_second.view()};
  expect_error([&] { muon_step({l.wv, l.gv, l.bv, l.shapes, wrong_size}, normuon); }, ErrorCode::size_mismatch,
               {"second_moment[1]", "10 elements", "expected 16"});
  const TestTensor bf16_second(device(), DType::bf16, std::vector<double>(16));
  const std::vector<TensorView> wrong_dtype = {l.sv[0], bf16_second.view()};
  expect_error([&] { muon_step({l.wv, l.gv, l.bv, l.shapes, wrong_dtype}, normuon); }, ErrorCode::dtype_unsupported,
               {"second_moment[1]", "expected f32"});
  {  // a plan made without them refuses to turn NorMuon on
    MuonPlan without({l.wv, l.gv, l.bv, l.shapes}, std::span(&good, 1));
    expect_error([&] { without.set_hyperparameters(std::span(&normuon, 1)); }, ErrorCode::invalid_argument,
                 {"hyperparameters[0].second_moment", "without second_moment"});
  }
  {
    MuonHyperparameters h = good;
    const std::vector<MuonNsCoefficients> nine(9, MuonNsCoefficients{1, 0, 0});
    expect_error([&] { h.set_ns_coefficients(nine); }, ErrorCode::invalid_argument, {"ns_coefficients", "1 to 8"});
  }
  with([](auto& h) { h.adjust_lr = static_cast<MuonLrAdjust>(7); }, {"adjust_lr", "match_rms_adamw"});
  MuonStepInputs zero_scale;
  zero_scale.grad_scale = 0.0f;
  expect_error([&] { muon_step(l.tensors(), good, zero_scale); }, ErrorCode::invalid_argument, {"grad_scale", "> 0"});
  // dtypes: f64 weights, f16 momentum
  const TestTensor w64(device(), DType::f64, random_values(rng, 960));
  const std::vector<TensorView> w64v = {w64.view()};
  const std::vector<MatrixShape> one = {{1, 24, 40}};
  expect_error([&] { muon_step({w64v, std::span(&l.gv[0], 1), std::span(&l.bv[0], 1), one}, good); },
               ErrorCode::dtype_unsupported, {"params", "f32 or bf16"});
  const TestTensor b16(device(), DType::f16, random_values(rng, 960));
  const std::vector<TensorView> b16v = {b16.view()};
  expect_error([&] { muon_step({std::span(&l.wv[0], 1), std::span(&l.gv[0], 1), b16v, one}, good); },
               ErrorCode::dtype_unsupported, {"momentum", "f32 or bf16"});
  MuonPlan plan(l.tensors(), std::span(&good, 1));
  const std::vector<MuonHyperparameters> two(2);
  expect_error([&] { plan.set_hyperparameters(two); }, ErrorCode::size_mismatch, {"hyperparameters", "2 groups"});
  EXPECT_EQ(l.bits(), before);
}

INSTANTIATE_TEST_SUITE_P(Devices, Muon, ::testing::Values(Device::cpu(), Device::cuda(0)), device_test_name);

TEST(MuonCpuAndCuda, AgreeWithinTheProductsTolerance) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  std::mt19937_64 rng(19);
  MuonLists cpu(Device::cpu(), rng, {{1, 40, 24}, {2, 24, 40}, {1, 128, 96}}, {});
  std::mt19937_64 rng_cuda(19);
  MuonLists gpu(Device::cuda(0), rng_cuda, {{1, 40, 24}, {2, 24, 40}, {1, 128, 96}}, {});
  std::mt19937_64 g1(20), g2(20);
  std::vector<std::vector<double>> before;
  for (auto& t : cpu.w) before.push_back(t.read());
  MuonHyperparameters h;
  h.lr = 0.02;
  for (int step = 0; step < 2; ++step) {
    cpu.new_gradients(g1);
    gpu.new_gradients(g2);
    muon_step(cpu.tensors(), h);
    muon_step(gpu.tensors(), h, {}, {});
  }
  for (size_t i = 0; i < cpu.w.size(); ++i) {
    EXPECT_EQ(cpu.buf[i].bytes(), gpu.buf[i].bytes()) << i;  // the element formulas: bit for bit
    EXPECT_LE(relative_error(minus(gpu.w[i].read(), before[i]), minus(cpu.w[i].read(), before[i])),
              muon_update_tolerance(false))
        << i;
  }
}

// The recipe: the momentum bit for bit, the second moment and the update
// within the products' tolerance (cautious masks that differ dropped).
TEST(MuonCpuAndCuda, TheRecipeAgreesWithinTheProductsTolerance) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  const std::vector<MatrixShape> shapes = {{1, 40, 24}, {2, 24, 40}, {1, 128, 96}, {1, 64, 64}};
  std::mt19937_64 rng(21), rng_cuda(21);
  MuonLists cpu(Device::cpu(), rng, shapes, {});
  MuonLists gpu(Device::cuda(0), rng_cuda, shapes, {});
  std::mt19937_64 g1(22), g2(22);
  MuonHyperparameters base;
  base.lr = 0.02;
  const MuonHyperparameters h = recipe(base);
  const MuonPlan cpu_plan(cpu.tensors(), std::span(&h, 1)), gpu_plan(gpu.tensors(), std::span(&h, 1));
  for (int step = 0; step < 3; ++step) {
    std::vector<std::vector<double>> before;
    for (auto& t : cpu.w) before.push_back(t.read());
    cpu.new_gradients(g1);
    gpu.new_gradients(g2);
    cpu_plan.step();
    gpu_plan.step();
    for (size_t i = 0; i < cpu.w.size(); ++i) {
      const std::string what = "step " + std::to_string(step) + " tensor " + std::to_string(i);
      EXPECT_EQ(cpu.buf[i].bytes(), gpu.buf[i].bytes()) << what;
      EXPECT_LE(relative_error(gpu.second[i].read(), cpu.second[i].read()), muon_second_moment_tolerance()) << what;
      auto got = minus(gpu.w[i].read(), before[i]), ref = minus(cpu.w[i].read(), before[i]);
      const size_t flips =
          drop_mask_flips(got, ref, before[i], muon_adjusted_lr(h, shapes[i].rows, shapes[i].cols) * h.weight_decay);
      EXPECT_LE(flips, before[i].size() / 32) << what;
      EXPECT_LE(relative_error(got, ref), muon_update_tolerance(false, true)) << what;
      // Each backend goes on from its own weights: the CPU's become the GPU's.
      const auto bytes = gpu.w[i].bytes();
      copy_from_host(cpu.w[i].view().data, Device::cpu(), bytes.data(), bytes.size());
    }
  }
}

TEST(MuonAdjustedLr, IsTheShapesScaling) {
  MuonHyperparameters h;
  h.lr = 0.01;
  EXPECT_DOUBLE_EQ(muon_adjusted_lr(h, 64, 16), 0.01 * 2.0);  // sqrt(max(1, 64/16))
  EXPECT_DOUBLE_EQ(muon_adjusted_lr(h, 16, 64), 0.01);
  h.adjust_lr = MuonLrAdjust::match_rms_adamw;
  EXPECT_DOUBLE_EQ(muon_adjusted_lr(h, 16, 64), 0.01 * 0.2 * 8.0);  // 0.2 sqrt(max(16, 64))
}

}  // namespace
}  // namespace gradkit::test
