// The sharded Adam and LAMB steps (ZeRO stages 1 and 2) against the
// unsharded step on the same averaged gradients: Adam's weights bitwise
// equal over 50 steps with injected Inf/NaN, LAMB's moments bitwise and its
// weights to f32 roundoff, on every rank; the layout; the state file (byte
// for byte the unsharded optimizer's, loaded onto other rank counts); bad
// input. The compact state forms: test_sharded_forms.cc.
#include "comm/sharded_pair.h"

namespace gradkit::test {
namespace {

TEST(ShardedLayout, EveryElementBelongsToExactlyOneRank) {
  for (int world : {1, 2, 3, 4}) {
    for (int64_t bucket : {int64_t{0}, int64_t{1}, int64_t{1500}, int64_t{1} << 20}) {
      const ShardedLayout layout = ShardedLayout::make(kModel, world, bucket);
      std::vector<std::vector<int>> owners(kModel.size());
      for (size_t t = 0; t < kModel.size(); ++t) owners[t].assign(static_cast<size_t>(kModel[t]), 0);
      for (int r = 0; r < world; ++r) {
        for (const ShardedLayout::Piece& p : layout.pieces(r)) {
          const int64_t flat = layout.offsets[p.tensor] + p.offset;
          EXPECT_EQ(flat, layout.slice_begin(p.bucket, r) + p.in_slice);
          EXPECT_LE(p.in_slice + p.count, layout.buckets[p.bucket].slice);
          for (int64_t k = 0; k < p.count; ++k) ++owners[p.tensor][static_cast<size_t>(p.offset + k)];
        }
      }
      for (size_t t = 0; t < kModel.size(); ++t) {
        EXPECT_EQ(layout.offsets[t] % layout.alignment, 0) << "tensor " << t;
        for (int n : owners[t]) ASSERT_EQ(n, 1) << "world " << world << " bucket " << bucket << " tensor " << t;
      }
      int64_t end = 0;
      for (const ShardedLayout::Bucket& b : layout.buckets) {
        EXPECT_EQ(b.begin, end);
        EXPECT_EQ(b.slice % layout.alignment, 0);
        end = b.begin + b.slice * world;
        EXPECT_GE(end, layout.offsets[b.last - 1] + kModel[b.last - 1]);
      }
      EXPECT_EQ(end, layout.total);
      if (bucket == 0) EXPECT_EQ(layout.buckets.size(), 1u);
      if (bucket == 1) EXPECT_EQ(layout.buckets.size(), kModel.size());
    }
  }
}

TEST(ShardedLayout, RejectsBadArguments) {
  expect_error([] { ShardedLayout::make(kModel, 0); }, ErrorCode::invalid_argument, {"'world_size'", ">= 1"});
  expect_error([] { ShardedLayout::make(kModel, 2, -1); }, ErrorCode::invalid_argument, {"'bucket_elements'"});
  expect_error([] { ShardedLayout::make(kModel, 2, 0, 48); }, ErrorCode::invalid_argument, {"'alignment'", "power of two"});
  const std::vector<int64_t> negative = {4, -2};
  expect_error([&] { ShardedLayout::make(negative, 2); }, ErrorCode::invalid_argument, {"'numels[1]'", "-2"});
  // A layout edited by hand is refused by its users, naming the field.
  const ShardedLayout good = ShardedLayout::make(kModel, 2, 1500);
  ShardedLayout bad = good;
  bad.offsets[3] = good.offsets[2];  // on top of tensor 2
  expect_error([&] { GradientArena(Device::cpu(), DType::f32, bad); }, ErrorCode::invalid_argument,
               {"'layout.offsets[3]'"});
  bad = good;
  bad.total += 1;
  expect_error([&] { GradientArena(Device::cpu(), DType::f32, bad); }, ErrorCode::invalid_argument, {"'layout.total'"});
  bad = good;
  bad.buckets[1].begin += 64;
  expect_error([&] { GradientArena(Device::cpu(), DType::f32, bad); }, ErrorCode::invalid_argument,
               {"'layout.buckets[1]'"});
  bad = good;
  bad.buckets.pop_back();
  expect_error([&] { GradientArena(Device::cpu(), DType::f32, bad); }, ErrorCode::invalid_argument, {"'layout.buckets'"});
  for (int world : {1, 2, 3, 4}) {
    for (int64_t bucket : {int64_t{0}, int64_t{1}, int64_t{1500}}) EXPECT_NO_THROW(ShardedLayout::make(kModel, world, bucket).validate("t"));
  }
}

// 50 steps, stage 1 and stage 2 alternating, with Inf/NaN on steps 7, 20
// and 33, an lr change at step 25: bitwise the unsharded weights after every
// step, the same skipped steps and loss scales, identical on every rank.
TEST_P(ShardedAdamTest, EqualsTheUnshardedStepBitwise) {
  const Case cases[] = {{DType::f32, DType::f32, kModel, LossScaling::none},
                        {DType::f32, DType::f32, kModel, LossScaling::none, 1},
                        {DType::f16, DType::f16, kModel, LossScaling::dynamic, 1000},
                        {DType::bf16, DType::f32, kModel, LossScaling::none, 2},
                        {DType::f32, DType::bf16, kTiny, LossScaling::none},
                        {DType::f16, DType::f32, kTiny, LossScaling::dynamic}};
  for (const Case& c : cases) {
    Pair<> pair(comm(), setup_of(c));
    const std::string name = name_of(c);
    int failures = 0;
    for (int step = 1; step <= 50 && failures == 0; ++step) {
      if (step == 25) {
        Kind<Adam>::set_rate(pair.sharded(), 5e-3f);
        pair.reference().set_rate(5e-3f);
      }
      pair.write_gradients(step, step == 7 || step == 20 || step == 33);
      pair.step(step % 2 == 0);
      failures += pair.expect_same(name + " step " + std::to_string(step));
      if (step == 7 || step == 20 || step == 33) EXPECT_TRUE(pair.sharded().last_step_skipped()) << name;
    }
    EXPECT_EQ(pair.sharded().step_count(), 47) << name;  // three skipped
    expect_same_on_every_rank(comm(), pair.weights().buffer().view(c.weights, 0, pair.layout().total), name);
  }
}

// With clipping the global norm is summed per rank, then across ranks: it
// agrees with the unsharded norm to f64 rounding, and the weights to a few
// units of f32 roundoff; every rank still holds the same bits.
TEST_P(ShardedAdamTest, ClipsByTheGlobalNormOfAllRanks) {
  RunSetup s;
  s.options.max_norm = 1.0f;
  Pair<> pair(comm(), s);
  for (int step = 1; step <= 10; ++step) {
    pair.write_gradients(step);
    pair.step(false);
    const float norm = pair.sharded().last_grad_norm();
    EXPECT_GT(norm, 1.0f);  // clipping happens
    EXPECT_NEAR(norm, pair.reference().norm(), 1e-6 * norm);
  }
  for (size_t i = 0; i < kModel.size(); ++i) {
    const TestTensor got(Device::cpu(), DType::f32, std::vector<double>(static_cast<size_t>(kModel[i])));
    copy_to_host(got.view().data, pair.weights()[i].data, pair.weights()[i].bytes(), comm().device());
    const TestTensor want(Device::cpu(), DType::f32, std::vector<double>(static_cast<size_t>(kModel[i])));
    copy_to_host(want.view().data, pair.reference().weights()[i].data, pair.weights()[i].bytes(), comm().device());
    const std::vector<double> a = got.read(), b = want.read();
    for (size_t k = 0; k < a.size(); ++k) ASSERT_NEAR(a[k], b[k], 1e-5 * std::abs(b[k]) + 1e-7) << i << "/" << k;
  }
  expect_same_on_every_rank(comm(), pair.weights().buffer().view(DType::f32, 0, pair.layout().total), "clipped");
}

TEST_P(ShardedAdamTest, HoldsOnlyItsShardOfTheState) {
  RunSetup s;
  s.weights = DType::f16;
  s.grads = DType::f16;
  Pair<> pair(comm(), s);
  int64_t mine = 0;
  for (const ShardedLayout::Piece& p : pair.sharded().pieces()) mine += p.count;
  // 12 bytes per element of its pieces (f32 master, two f32 moments), each
  // piece's state starting on a 256-byte boundary.
  EXPECT_GE(pair.sharded().state_bytes(), static_cast<size_t>(mine) * 12);
  EXPECT_LE(pair.sharded().state_bytes(), static_cast<size_t>(mine) * 12 + 3 * 256 * pair.sharded().pieces().size() + 3 * 256);
  EXPECT_LE(mine, pair.layout().shard_elements());
}

// The file is the unsharded optimizer's, byte for byte, with and without
// amsgrad, f32 and f16 weights.
TEST_P(ShardedAdamTest, SavesTheUnshardedFileByteForByte) {
  for (DType weights : {DType::f32, DType::f16}) {
    for (bool amsgrad : {false, true}) {
      RunSetup s;
      s.weights = weights;
      s.grads = weights;
      s.amsgrad = amsgrad;
      s.options.scaler.mode = weights == DType::f16 ? LossScaling::dynamic : LossScaling::none;
      Pair<> pair(comm(), s);
      for (int step = 1; step <= 6; ++step) {
        pair.write_gradients(step, step == 3);
        pair.step(step % 2 == 0);
      }
      const std::string sharded = shared_path(MPI_COMM_WORLD, "sharded");
      const std::string unsharded = shared_path(MPI_COMM_WORLD, "unsharded");
      pair.sharded().save(sharded);
      if (comm().rank() == 0) pair.reference().save(unsharded);
      MPI_Barrier(MPI_COMM_WORLD);
      const std::vector<uint8_t> a = file_bytes(sharded), b = file_bytes(unsharded);
      EXPECT_FALSE(a.empty());
      EXPECT_TRUE(a == b) << dtype_name(weights) << " amsgrad " << amsgrad << ": " << a.size() << " vs " << b.size()
                          << " bytes";
      MPI_Barrier(MPI_COMM_WORLD);
      if (comm().rank() == 0) {
        std::remove(sharded.c_str());
        std::remove(unsharded.c_str());
      }
    }
  }
}

// A communicator of the first `n` ranks of the world (null on the others).
std::unique_ptr<Communicator> first_ranks(Backend backend, int n, MPI_Comm* out) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_split(MPI_COMM_WORLD, rank < n ? 0 : MPI_UNDEFINED, rank, out);
  if (*out == MPI_COMM_NULL) return nullptr;
  return make_communicator(backend, {}, mpi_comm_handle(*out));
}

// State saved on `from` ranks loads onto `to` ranks (and onto the unsharded
// optimizer), and the runs go on bitwise alike.
void expect_reshards(Backend backend, int from, int to, DType weights) {
  RunSetup s;
  s.weights = weights;
  s.grads = weights;
  s.options.scaler.mode = weights == DType::f32 ? LossScaling::none : LossScaling::dynamic;
  const std::string path = shared_path(MPI_COMM_WORLD, "reshard");
  const std::string name = std::to_string(from) + " to " + std::to_string(to) + " ranks, " + std::string(dtype_name(weights));
  std::vector<uint8_t> saved_weights;
  {
    MPI_Comm sub = MPI_COMM_NULL;
    auto comm = first_ranks(backend, from, &sub);
    if (comm) {
      Pair<> pair(*comm, s);
      for (int step = 1; step <= 5; ++step) {
        pair.write_gradients(step);
        pair.step(false);
      }
      pair.sharded().save(path);
      if (comm->rank() == 0) saved_weights = bits(pair.weights().flat());
      comm.reset();
      MPI_Comm_free(&sub);
    }
  }
  // The weights go with the model (f32 models: not in the file).
  int size = static_cast<int>(saved_weights.size());
  MPI_Bcast(&size, 1, MPI_INT, 0, MPI_COMM_WORLD);
  saved_weights.resize(static_cast<size_t>(size));
  MPI_Bcast(saved_weights.data(), size, MPI_BYTE, 0, MPI_COMM_WORLD);
  {
    MPI_Comm sub = MPI_COMM_NULL;
    auto comm = first_ranks(backend, to, &sub);
    if (comm) {
      Pair<> pair(*comm, s);  // a new layout for `to` ranks; offsets within tensors alike
      if (weights == DType::f32) {
        // Same tensor order and alignment, another padding: copy tensor by tensor.
        const ShardedLayout old_layout = ShardedLayout::make(s.model, from, s.bucket_elements);
        for (size_t i = 0; i < s.model.size(); ++i) {
          const auto* at = saved_weights.data() + (old_layout.offsets[i] - old_layout.offsets[0]) * 4;
          copy_from_host(pair.weights()[i].data, comm->device(), at, pair.weights()[i].bytes());
          copy_from_host(pair.reference().weights()[i].data, comm->device(), at, pair.weights()[i].bytes());
        }
      }
      pair.sharded().load(path);
      pair.reference().load(path);
      EXPECT_EQ(pair.sharded().step_count(), 5) << name;
      pair.expect_same(name + " after load");
      for (int step = 6; step <= 10; ++step) {
        pair.write_gradients(step);
        pair.step(step % 2 == 0);
        if (pair.expect_same(name + " step " + std::to_string(step)) > 0) break;
      }
      comm.reset();
      MPI_Comm_free(&sub);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) std::remove(path.c_str());
}

TEST_P(ShardedAdamTest, LoadsOntoAnotherNumberOfRanks) {
  const int world = comm().size();
  for (DType weights : {DType::f32, DType::f16}) {
    expect_reshards(GetParam(), world, 1, weights);  // onto one rank: the unsharded layout
    expect_reshards(GetParam(), 1, world, weights);  // an unsharded run's file onto every rank
    if (world >= 4) expect_reshards(GetParam(), 4, 2, weights);
    if (world >= 3) expect_reshards(GetParam(), 2, 3, weights);
  }
}

TEST_P(ShardedAdamTest, RefusesAFileOfAnotherModelOnEveryRankWritingNothing) {
  RunSetup s;
  Pair<> pair(comm(), s);
  pair.write_gradients(1);
  pair.step(false);
  RunSetup other = s;
  other.model = kTiny;
  Pair<> small(comm(), other);
  const std::string path = shared_path(MPI_COMM_WORLD, "other");
  small.sharded().save(path);
  const std::vector<uint8_t> before = bits(pair.weights().flat());
  expect_error([&] { pair.sharded().load(path); }, ErrorCode::io_error, {path, "does not match"});
  expect_error([&] { pair.sharded().load(path + ".missing"); }, ErrorCode::io_error, {".missing"});
  EXPECT_EQ(pair.sharded().step_count(), 1);
  EXPECT_TRUE(bits(pair.weights().flat()) == before);
  // An unwritable path: every rank hears of rank 0's failure.
  expect_error([&] { pair.sharded().save("/nonexistent-dir/x.state"); }, ErrorCode::io_error,
               {comm().rank() == 0 ? "/nonexistent-dir/x.state" : "other rank"});
  MPI_Barrier(MPI_COMM_WORLD);
  if (comm().rank() == 0) std::remove(path.c_str());
}

TEST_P(ShardedAdamTest, RejectsBadArgumentsNamingThem) {
  const ShardedLayout layout = ShardedLayout::make(kModel, comm().size(), 1500);
  const GradientArena weights(comm().device(), DType::f32, layout), grads(comm().device(), DType::f32, layout);
  auto groups = [&] { return groups_of(weights.gradients(), grads.gradients(), Kind<Adam>::hyperparameters(false)); };

  const ShardedLayout wrong_world = ShardedLayout::make(kModel, comm().size() + 1, 1500);
  expect_error([&] { ShardedAdam(comm(), wrong_world, groups()); }, ErrorCode::invalid_argument,
               {"'layout'", "comm.size()"});
  // Gradients that are not views of one buffer laid out by the layout.
  const GradientArena loose(comm().device(), DType::f32, kModel, 4);  // back to back
  expect_error([&] { ShardedAdam(comm(), layout, groups_of(weights.gradients(), loose.gradients(), Kind<Adam>::hyperparameters(false))); },
               ErrorCode::invalid_argument, {"grads[1]", "not at element"});
  auto with_copy = groups();
  with_copy[1].model_copy = with_copy[1].params;
  expect_error([&] { ShardedAdam(comm(), layout, with_copy); }, ErrorCode::invalid_argument, {"groups[1].model_copy"});
  const GradientArena doubles(comm().device(), DType::f64, layout);
  expect_error([&] { ShardedAdam(comm(), layout, groups_of(doubles.gradients(), grads.gradients(), Kind<Adam>::hyperparameters(false))); },
               ErrorCode::dtype_unsupported, {"params", "f64"});
  const std::vector<int64_t> fewer(kModel.begin(), kModel.end() - 1);
  expect_error([&] { ShardedAdam(comm(), ShardedLayout::make(fewer, comm().size()), groups()); },
               ErrorCode::size_mismatch, {"params", "the layout's"});

  ShardedOptions no_parts;
  no_parts.update_parts = 0;
  expect_error([&] { ShardedAdam(comm(), layout, groups(), no_parts); }, ErrorCode::invalid_argument,
               {"'options.update_parts'", ">= 1"});

  ShardedAdam adam(comm(), layout, groups());
  adam.mark_ready(2);
  expect_error([&] { adam.mark_ready(2); }, ErrorCode::invalid_argument, {"'gradient'", "already marked"});
  expect_error([&] { adam.mark_ready(kModel.size()); }, ErrorCode::invalid_argument, {"'gradient'", "below"});
}

// LAMB: the moments are element-wise, so bitwise the unsharded step's (its
// state file's moment sections, byte for byte); each trust ratio adds every
// rank's partial sums in rank order, so the weights agree with the
// unsharded step's to f32 roundoff (f16/bf16 weights: to their own
// rounding); the same skipped steps and scales; identical on every rank.
TEST_P(ShardedAdamTest, LambMatchesTheUnshardedLamb) {
  const Case cases[] = {{DType::f32, DType::f32, kModel, LossScaling::none},
                        {DType::f16, DType::f16, kModel, LossScaling::dynamic, 1000},
                        {DType::f32, DType::bf16, kTiny, LossScaling::none, 1}};
  for (const Case& c : cases) {
    RunSetup s = setup_of(c);
    s.options.lamb.eta = 1e-2f;
    Pair<Lamb> pair(comm(), s);
    const std::string name = "LAMB " + name_of(c);
    const double tolerance = c.weights == DType::f32 ? 1e-6 : 2 * elementwise_tolerance(c.weights).relative;
    int failures = 0;
    for (int step = 1; step <= 30 && failures == 0; ++step) {
      if (step == 15) {
        Kind<Lamb>::set_rate(pair.sharded(), 5e-3f);
        pair.reference().set_rate(5e-3f);
      }
      pair.write_gradients(step, step == 7 || step == 20);
      pair.step(step % 2 == 0);
      failures += pair.expect_same(name + " step " + std::to_string(step), tolerance);
    }
    EXPECT_EQ(pair.sharded().step_count(), 28) << name;  // two skipped
    EXPECT_FLOAT_EQ(pair.sharded().eta(), 5e-3f) << name;
    expect_same_on_every_rank(comm(), pair.weights().buffer().view(c.weights, 0, pair.layout().total), name);

    const std::string sharded = shared_path(MPI_COMM_WORLD, "lamb_sharded");
    const std::string unsharded = shared_path(MPI_COMM_WORLD, "lamb_unsharded");
    pair.sharded().save(sharded);
    if (comm().rank() == 0) pair.reference().save(unsharded);
    MPI_Barrier(MPI_COMM_WORLD);
    const StateFile a = StateFile::read(sharded), b = StateFile::read(unsharded);
    for (const char* section : {"exp_avg", "exp_avg_sq", "meta", "groups"}) {
      EXPECT_TRUE(a.get(section) == b.get(section)) << name << ": section " << section;
    }
    // f32 models: no masters, so the whole file is the unsharded one.
    if (c.weights == DType::f32) EXPECT_TRUE(file_bytes(sharded) == file_bytes(unsharded)) << name;
    // The unsharded file loads into the sharded LAMB (the same state back).
    pair.sharded().load(unsharded);
    EXPECT_EQ(pair.sharded().step_count(), 28) << name;
    MPI_Barrier(MPI_COMM_WORLD);
    if (comm().rank() == 0) {
      std::remove(sharded.c_str());
      std::remove(unsharded.c_str());
    }
  }
}

GRADKIT_INSTANTIATE_ON_EACH_BACKEND(ShardedAdamTest);

}  // namespace
}  // namespace gradkit::test
