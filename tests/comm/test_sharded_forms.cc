// The sharded optimizers with compact state against the unsharded step:
// 8-bit moments (a layout aligned to whole quantization blocks) and
// remainder masters (bf16 models), each with its state file and a load back
// into the shards. Shared fixtures: sharded_pair.h.
#include "comm/sharded_pair.h"

namespace gradkit::test {
namespace {

// 8- and 4-bit moments on a layout aligned to kQuantBlock: every shard
// holds whole blocks (and whole 4-byte words of 4-bit codes), so Adam's
// weights are bitwise the unsharded step's and LAMB's moments (codes and
// absmax) are; the state file is the unsharded one's (absmax sections
// included; 4-bit codes two a byte, odd tensors' last byte half used); a
// layout not aligned to blocks is refused.
TEST_P(ShardedAdamTest, EightAndFourBitMomentsMatchTheUnshardedStep) {
  const std::vector<int64_t> model = {1000, 37, 3, 4096, 129, 1, 700};
  const Case cases[] = {{DType::f32, DType::f32, model, LossScaling::none},
                        {DType::f16, DType::f16, model, LossScaling::dynamic, 2},
                        {DType::bf16, DType::f32, kTiny, LossScaling::none, 1}};
  for (const auto& [lamb, bits] : {std::pair{false, 8}, std::pair{false, 4}, std::pair{true, 8}, std::pair{true, 4}}) {
    for (const Case& c : cases) {
      RunSetup s = setup_of(c);
      s.alignment = kQuantBlock;
      s.options.adam.moment_dtype = DType::u8;
      s.options.adam.moment_bits = bits;
      s.options.lamb.moment_dtype = DType::u8;
      s.options.lamb.moment_bits = bits;
      s.options.lamb.eta = 1e-2f;
      const std::string name =
          std::string(lamb ? "LAMB " : "Adam ") + std::to_string(bits) + "-bit " + name_of(c);
      auto run = [&](auto& pair, double tolerance) {
        pair.run_steps(name, 12, 7, tolerance);
        EXPECT_EQ(pair.sharded().step_count(), 11) << name;
        pair.expect_the_unsharded_state(
            name, {"exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax", "meta", "groups"}, false,
            "exp_avg_absmax", 11, 13, tolerance);
      };
      if (lamb) {
        Pair<Lamb> pair(comm(), s);
        run(pair, c.weights == DType::f32 ? 1e-6 : 2 * elementwise_tolerance(c.weights).relative);
      } else {
        Pair<> pair(comm(), s);
        run(pair, 0);
      }
    }
  }
  const ShardedLayout cutting = ShardedLayout::make(model, comm().size(), 1500, 64);
  const GradientArena weights(comm().device(), DType::f32, cutting), grads(comm().device(), DType::f32, cutting);
  ShardedOptions u8;
  u8.adam.moment_dtype = DType::u8;
  expect_error([&] { ShardedAdam(comm(), cutting, groups_of(weights.gradients(), grads.gradients(), Kind<Adam>::hyperparameters(false)), u8); },
               ErrorCode::invalid_argument, {"'layout.alignment'", "is 64", "options.adam.moment_dtype", "multiple of 256"});
}

// Remainder masters (bf16 models): each rank keeps an i16 remainder per
// element of its shard instead of an f32 master. Adam's weights and
// remainders are bitwise the unsharded MixedPrecision<Adam> with remainder
// masters (f32 and 8-bit moments), LAMB's within its usual tolerance with
// the moments bitwise; the state is 2 bytes an element smaller than with
// f32 masters; the file is the unsharded one's (f32 masters, joined), byte
// for byte for Adam, and it loads back and the run goes on alike. f16
// weights are refused naming the tensor.
TEST_P(ShardedAdamTest, RemainderMastersMatchTheUnshardedStep) {
  const Case cases[] = {{DType::bf16, DType::bf16, kModel, LossScaling::none},
                        {DType::bf16, DType::f32, kTiny, LossScaling::none, 1}};
  for (bool lamb : {false, true}) {
    for (DType moments : {DType::f32, DType::u8}) {
      if (lamb && moments == DType::u8) continue;  // LAMB's remainder takes float moments
      for (const Case& c : cases) {
        RunSetup s = setup_of(c);
        s.alignment = kQuantBlock;
        s.options.master = MasterStorage::remainder;
        s.options.adam.moment_dtype = moments;
        s.options.lamb.eta = 1e-2f;
        const std::string name = std::string(lamb ? "LAMB " : "Adam ") + std::string(dtype_name(moments)) +
                                 " moments, remainder masters, " + name_of(c);
        auto run = [&](auto& pair, double tolerance) {
          int64_t mine = 0;
          for (const ShardedLayout::Piece& p : pair.sharded().pieces()) mine += p.count;
          const size_t per_element = 2 + 2 * (moments == DType::u8 ? 1 : 4);  // remainder, two moments
          EXPECT_GE(pair.sharded().state_bytes(), static_cast<size_t>(mine) * per_element) << name;
          EXPECT_LE(pair.sharded().state_bytes(),
                    static_cast<size_t>(mine) * (per_element + 1) + 5 * 256 * (pair.sharded().pieces().size() + 1))
              << name;
          EXPECT_TRUE(pair.sharded().masters().empty()) << name;
          EXPECT_EQ(pair.sharded().weight_remainders().size(), std::max<size_t>(1, pair.sharded().pieces().size()));
          pair.run_steps(name, 20, 7, tolerance);
          EXPECT_EQ(pair.sharded().step_count(), 19) << name;
          expect_same_on_every_rank(comm(), pair.weights().buffer().view(c.weights, 0, pair.layout().total), name);
          // Adam: the whole file, its masters joined alike; the loaded masters split back into
          // weights and remainders.
          pair.expect_the_unsharded_state(name, {"exp_avg", "exp_avg_sq", "meta", "groups"}, !lamb, "masters", 19, 21,
                                          tolerance);
        };
        if (lamb) {
          Pair<Lamb> pair(comm(), s);
          run(pair, 2 * elementwise_tolerance(c.weights).relative);
        } else {
          Pair<> pair(comm(), s);
          run(pair, 0);
        }
      }
    }
  }
  const ShardedLayout layout = ShardedLayout::make(kModel, comm().size(), 1500);
  const GradientArena weights(comm().device(), DType::f16, layout), grads(comm().device(), DType::f16, layout);
  ShardedOptions remainder;
  remainder.master = MasterStorage::remainder;
  expect_error([&] { ShardedAdam(comm(), layout, groups_of(weights.gradients(), grads.gradients(), Kind<Adam>::hyperparameters(false)), remainder); },
               ErrorCode::dtype_unsupported, {"'groups[0].params[0]'", "has dtype f16", "expected bf16", "options.master"});
}

GRADKIT_INSTANTIATE_ON_EACH_BACKEND(ShardedAdamTest);

}  // namespace
}  // namespace gradkit::test
