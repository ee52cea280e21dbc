// Tensor-list and flat-buffer collectives on every backend, compared with a
// float64 reference: every rank regenerates every rank's seeded input, so
// each knows the exact expected result. Every dtype, odd sizes, totals not
// divisible by the world size, in place and out of place, the contiguous
// path and the fusion-buffer path, sum and average.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/comm_test_support.h"

namespace gradkit::test {
namespace {

// Odd sizes whose total (1173) divides by no world size and no padding unit.
const std::vector<int64_t> kOddSizes = {1, 7, 33, 1000, 3, 129};
// Sizes whose total (256) needs no padding for 2 or 4 ranks in any dtype,
// so that all-gather and reduce-scatter can take their contiguous path.
const std::vector<int64_t> kAlignedSizes = {5, 59, 128, 64};
// A zero-size tensor in the middle of a list.
const std::vector<int64_t> kWithEmpty = {17, 0, 31};

const std::vector<std::vector<int64_t>> kSizeLists = {kOddSizes, kAlignedSizes, kWithEmpty};
constexpr Layout kLayouts[] = {Layout::back_to_back, Layout::with_gaps};

std::string describe(DType dtype, Layout in, Layout out, bool in_place, ReduceOp op, size_t list) {
  return std::string(dtype_name(dtype)) + (in == Layout::back_to_back ? " back-to-back" : " with-gaps") +
         (in_place ? " in-place" : (out == Layout::back_to_back ? " -> back-to-back" : " -> with-gaps")) +
         (op == ReduceOp::average ? " average" : " sum") + " list " + std::to_string(list);
}

constexpr Placement kPlacements[] = {
    {Layout::back_to_back, Layout::back_to_back, true},  {Layout::with_gaps, Layout::with_gaps, true},
    {Layout::back_to_back, Layout::back_to_back, false}, {Layout::with_gaps, Layout::with_gaps, false},
    {Layout::back_to_back, Layout::with_gaps, false},    {Layout::with_gaps, Layout::back_to_back, false},
};

using Collectives = OnEachBackend;

TEST_P(Collectives, AllReduceMatchesTheFloat64Sum) {
  Communicator& c = comm();
  uint64_t seed = 100;
  for (DType dtype : kAllDTypes) {
    for (size_t l = 0; l < kSizeLists.size(); ++l) {
      for (const Placement& p : kPlacements) {
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
          ++seed;
          check_all_reduce(c, dtype, kSizeLists[l], p, op, seed, describe(dtype, p.in, p.out, p.in_place, op, l));
        }
      }
    }
  }
}

// Ranks may lay the same list out differently (one back to back, another
// with gaps): the collectives each issues depend only on the list's shape,
// so they still match. The first tensor (1.2 MB) is large enough to be
// reduced where it lies on NCCL.
TEST_P(Collectives, RanksWithDifferentLayoutsOfOneListStillMatch) {
  Communicator& c = comm();
  const std::vector<int64_t> sizes = {300000, 5, 17, 1000};
  const Layout mine = c.rank() % 2 == 0 ? Layout::back_to_back : Layout::with_gaps;
  const Layout other = c.rank() % 2 == 0 ? Layout::with_gaps : Layout::back_to_back;
  uint64_t seed = 1500;
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
      for (const Placement& p : {Placement{mine, mine, true}, Placement{mine, other, false}}) {
        ++seed;
        check_all_reduce(c, dtype, sizes, p, op, seed,
                         std::string(dtype_name(dtype)) + (p.in_place ? " in place" : " out of place") +
                             (op == ReduceOp::average ? " average" : " sum") + ", rank " + std::to_string(c.rank()) +
                             (mine == Layout::back_to_back ? " back to back" : " with gaps"));
      }
    }
  }
}

TEST_P(Collectives, AllGatherTakesEachElementFromItsOwner) {
  Communicator& c = comm();
  uint64_t seed = 2000;
  for (DType dtype : kAllDTypes) {
    for (size_t l = 0; l < kSizeLists.size(); ++l) {
      for (const Placement& p : kPlacements) {
        ++seed;
        const std::string what = describe(dtype, p.in, p.out, p.in_place, ReduceOp::sum, l);
        TestList in(c.device(), dtype, kSizeLists[l], p.in);
        const int64_t total = in.total();
        const ShardLayout shards = ShardLayout::of(total, dtype, c.size());
        std::vector<double> want(static_cast<size_t>(total));
        for (int r = 0; r < c.size(); ++r) {
          const std::vector<double> theirs = rank_input(seed, r, total, dtype);
          for (int64_t e = shards.begin(r); e < shards.end(r); ++e) want[e] = theirs[e];
        }
        const std::vector<double> mine = rank_input(seed, c.rank(), total, dtype);
        in.write(mine);
        if (p.in_place) {
          c.all_gather(in.views());
          c.wait();
          expect_equal(in.read(), want, 0, total, what);
        } else {
          TestList out(c.device(), dtype, kSizeLists[l], p.out);
          out.write(rank_input(seed + 77777, c.rank(), total, dtype));
          c.all_gather(in.views(), out.views());
          c.wait();
          expect_equal(out.read(), want, 0, total, what);
          expect_equal(in.read(), mine, 0, total, what + " (input untouched)");
        }
      }
    }
  }
}

TEST_P(Collectives, ReduceScatterReducesThisRanksShardOnly) {
  Communicator& c = comm();
  uint64_t seed = 3000;
  for (DType dtype : kAllDTypes) {
    for (size_t l = 0; l < kSizeLists.size(); ++l) {
      for (const Placement& p : kPlacements) {
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
          ++seed;
          const std::string what = describe(dtype, p.in, p.out, p.in_place, op, l);
          TestList in(c.device(), dtype, kSizeLists[l], p.in);
          const int64_t total = in.total();
          const ShardLayout shards = ShardLayout::of(total, dtype, c.size());
          const int64_t begin = shards.begin(c.rank()), end = shards.end(c.rank());
          const std::vector<double> mine = rank_input(seed, c.rank(), total, dtype);
          in.write(mine);
          const bool average = op == ReduceOp::average;
          if (p.in_place) {
            c.reduce_scatter(in.views(), op);
            c.wait();
            const std::vector<double> got = in.read();
            expect_reduced(got, seed, c.size(), dtype, average, begin, end, what);
            expect_equal(got, mine, 0, begin, what + " (before the shard: untouched)");
            expect_equal(got, mine, end, total, what + " (after the shard: untouched)");
          } else {
            TestList out(c.device(), dtype, kSizeLists[l], p.out);
            const std::vector<double> sentinel = rank_input(seed + 77777, c.rank(), total, dtype);
            out.write(sentinel);
            c.reduce_scatter(in.views(), out.views(), op);
            c.wait();
            const std::vector<double> got = out.read();
            expect_reduced(got, seed, c.size(), dtype, average, begin, end, what);
            expect_equal(got, sentinel, 0, begin, what + " (before the shard: untouched)");
            expect_equal(got, sentinel, end, total, what + " (after the shard: untouched)");
            expect_equal(in.read(), mine, 0, total, what + " (input untouched)");
          }
        }
      }
    }
  }
}

TEST_P(Collectives, FlatBuffersInPlaceAndOutOfPlace) {
  Communicator& c = comm();
  const int P = c.size(), r = c.rank();
  uint64_t seed = 4000;
  for (DType dtype : kAllDTypes) {
    for (bool in_place : {true, false}) {
      const std::string what = std::string(dtype_name(dtype)) + (in_place ? " in place" : " out of place");
      // all_reduce_buffer, average: 1001 elements.
      {
        ++seed;
        TestList in(c.device(), dtype, {1001}, Layout::back_to_back);
        TestList out(c.device(), dtype, {1001}, Layout::back_to_back);
        in.write(rank_input(seed, r, 1001, dtype));
        const TensorView& target = in_place ? in.views()[0] : out.views()[0];
        c.all_reduce_buffer(in.views()[0], target, ReduceOp::average);
        c.wait();
        expect_reduced(in_place ? in.read() : out.read(), seed, P, dtype, true, 0, 1001, "all_reduce_buffer " + what);
      }
      // all_gather_buffer: 37 elements per rank.
      {
        ++seed;
        const int64_t n = 37;
        TestList whole(c.device(), dtype, {n * P}, Layout::back_to_back);
        TestList mine(c.device(), dtype, {n}, Layout::back_to_back);
        std::vector<double> want;
        for (int q = 0; q < P; ++q) {
          const std::vector<double> theirs = rank_input(seed, q, n, dtype);
          want.insert(want.end(), theirs.begin(), theirs.end());
        }
        const std::vector<double> own = rank_input(seed, r, n, dtype);
        TensorView input = mine.views()[0];
        if (in_place) {
          std::vector<double> staged(static_cast<size_t>(n * P), 1.5);
          std::copy(own.begin(), own.end(), staged.begin() + n * r);
          whole.write(staged);
          input = TensorView{static_cast<unsigned char*>(whole.views()[0].data) + n * r * dtype_size(dtype), n, dtype,
                             c.device()};
        } else {
          mine.write(own);
        }
        c.all_gather_buffer(input, whole.views()[0]);
        c.wait();
        expect_equal(whole.read(), want, 0, n * P, "all_gather_buffer " + what);
      }
      // reduce_scatter_buffer: 29 elements per rank.
      {
        ++seed;
        const int64_t n = 29;
        TestList whole(c.device(), dtype, {n * P}, Layout::back_to_back);
        TestList mine(c.device(), dtype, {n}, Layout::back_to_back);
        whole.write(rank_input(seed, r, n * P, dtype));
        TensorView output = mine.views()[0];
        if (in_place) {
          output = TensorView{static_cast<unsigned char*>(whole.views()[0].data) + n * r * dtype_size(dtype), n, dtype,
                              c.device()};
        }
        c.reduce_scatter_buffer(whole.views()[0], output, ReduceOp::sum);
        c.wait();
        const std::vector<double> got_all = in_place ? whole.read() : std::vector<double>{};
        std::vector<double> got = in_place ? std::vector<double>(got_all.begin() + n * r, got_all.begin() + n * (r + 1))
                                           : mine.read();
        // The expected values are the reduced slice r of the whole input.
        std::vector<double> placed(static_cast<size_t>(n * P), 0.0);
        std::copy(got.begin(), got.end(), placed.begin() + n * r);
        expect_reduced(placed, seed, P, dtype, false, n * r, n * (r + 1), "reduce_scatter_buffer " + what);
      }
    }
  }
}

// Several flat buffers in one call (one NCCL group): pairs of different
// dtypes and sizes, one in place, one empty, each as the single call gives.
TEST_P(Collectives, SeveralFlatBuffersAtOnce) {
  Communicator& c = comm();
  const int P = c.size(), r = c.rank();
  const std::vector<int64_t> per_rank = {29, 0, 113};
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f64};
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
    const uint64_t seed = op == ReduceOp::sum ? 5100 : 5200;
    std::vector<std::unique_ptr<TestList>> wholes, mine;
    std::vector<TensorView> inputs, outputs;
    for (size_t i = 0; i < per_rank.size(); ++i) {
      const int64_t n = per_rank[i];
      wholes.push_back(
          std::make_unique<TestList>(c.device(), dtypes[i], std::vector<int64_t>{n * P}, Layout::back_to_back));
      mine.push_back(std::make_unique<TestList>(c.device(), dtypes[i], std::vector<int64_t>{n}, Layout::back_to_back));
      wholes[i]->write(rank_input(seed + i, r, n * P, dtypes[i]));
      inputs.push_back(wholes[i]->views()[0]);
      // pair 0 in place (rank r's slice of its input), the others into their own buffers
      outputs.push_back(i == 0 ? TensorView{static_cast<unsigned char*>(inputs[i].data) + n * r * dtype_size(dtypes[i]),
                                            n, dtypes[i], c.device()}
                               : mine[i]->views()[0]);
    }
    c.reduce_scatter_buffers(inputs, outputs, op);
    c.wait();
    for (size_t i = 0; i < per_rank.size(); ++i) {
      const int64_t n = per_rank[i];
      const std::vector<double> got_all = i == 0 ? wholes[i]->read() : std::vector<double>{};
      const std::vector<double> got =
          i == 0 ? std::vector<double>(got_all.begin() + n * r, got_all.begin() + n * (r + 1)) : mine[i]->read();
      std::vector<double> placed(static_cast<size_t>(n * P), 0.0);
      std::copy(got.begin(), got.end(), placed.begin() + n * r);
      expect_reduced(placed, seed + i, P, dtypes[i], op == ReduceOp::average, n * r, n * (r + 1),
                     "reduce_scatter_buffers pair " + std::to_string(i));
    }
    // And back: every rank's slice gathered into every rank's whole buffer.
    std::vector<TensorView> slices;
    for (size_t i = 0; i < per_rank.size(); ++i) {
      const int64_t n = per_rank[i];
      mine[i]->write(rank_input(seed + 50 + i, r, n, dtypes[i]));
      slices.push_back(mine[i]->views()[0]);
    }
    c.all_gather_buffers(slices, inputs);
    c.wait();
    for (size_t i = 0; i < per_rank.size(); ++i) {
      std::vector<double> want;
      for (int q = 0; q < P; ++q) {
        const std::vector<double> theirs = rank_input(seed + 50 + i, q, per_rank[i], dtypes[i]);
        want.insert(want.end(), theirs.begin(), theirs.end());
      }
      expect_equal(wholes[i]->read(), want, 0, per_rank[i] * P, "all_gather_buffers pair " + std::to_string(i));
    }
  }
}

// CommunicatorOptions::blocking_calls changes how the calls are issued,
// not what they compute: a list all-reduce (split path and fusion path),
// reduce-scatter and all-gather give bitwise the same results either way.
// (NCCL only; MPI ignores the option.)
TEST_P(Collectives, BlockingAndNonBlockingCallsGiveBitwiseTheSameResults) {
  if (GetParam() != Backend::nccl) GTEST_SKIP() << "an NCCL option";
  Communicator& plain = comm();
  // The other way than the tests' communicators (make_communicator would
  // set the tests' way).
  CommunicatorOptions options;
  options.timeout = plain.timeout();
  options.cuda_device = test_gpu();
  options.blocking_calls = !test_blocking_calls();
  std::unique_ptr<Communicator> other = create_nccl_communicator(options);
  const std::vector<int64_t> sizes = {1000, 3, 300000, 17};  // one tensor past direct_tensor_bytes
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (Layout layout : {Layout::back_to_back, Layout::with_gaps}) {
      const std::string what = std::string(dtype_name(dtype)) + (layout == Layout::with_gaps ? " with gaps" : "");
      TestList a(plain.device(), dtype, sizes, layout), b(plain.device(), dtype, sizes, layout);
      const std::vector<double> mine = rank_input(5300, plain.rank(), a.total(), dtype);
      a.write(mine);
      b.write(mine);
      plain.all_reduce(a.views(), ReduceOp::average);
      plain.wait();
      other->all_reduce(b.views(), ReduceOp::average);
      other->reduce_scatter(b.views());
      other->all_gather(b.views());
      other->wait();
      plain.reduce_scatter(a.views());
      plain.all_gather(a.views());
      plain.wait();
      expect_equal(b.read(), a.read(), 0, a.total(), what);
    }
  }
}

TEST_P(Collectives, ExchangeSwapsBuffersWithAPeer) {
  Communicator& c = comm();
  const int peer = c.rank() ^ 1;
  if (peer >= c.size()) GTEST_SKIP() << "an odd world size leaves the last rank without a partner";
  for (DType dtype : kAllDTypes) {
    TestList send(c.device(), dtype, {333}, Layout::back_to_back);
    TestList receive(c.device(), dtype, {333}, Layout::back_to_back);
    send.write(rank_input(5000, c.rank(), 333, dtype));
    c.exchange(send.views()[0], receive.views()[0], peer);
    c.wait();
    expect_equal(receive.read(), rank_input(5000, peer, 333, dtype), 0, 333,
                 std::string("exchange ") + std::string(dtype_name(dtype)));
  }
}

// all_to_all: rank s sends rank r count(s, r) elements (some zero, its own
// section too), the values of rank s's seeded input from an offset that
// names the pair; every rank checks each received section against the
// sender's input. Then the refusals, which write nothing.
int64_t pair_count(int s, int r) { return (3 * s + 5 * r + 1) % 7 * 13; }  // 0 for some pairs
int64_t pair_offset(int s, int r) {
  int64_t at = 0;
  for (int k = 0; k < r; ++k) at += pair_count(s, k);
  return at;
}

TEST_P(Collectives, AllToAllDeliversEverySection) {
  Communicator& c = comm();
  const int n = c.size(), me = c.rank();
  for (DType dtype : {DType::f32, DType::bf16, DType::f64}) {
    std::vector<int64_t> send_counts, receive_counts;
    for (int r = 0; r < n; ++r) {
      send_counts.push_back(pair_count(me, r));
      receive_counts.push_back(pair_count(r, me));
    }
    int64_t sent = 0, received = 0;
    for (int r = 0; r < n; ++r) sent += send_counts[r], received += receive_counts[r];
    TestList send(c.device(), dtype, {sent}, Layout::back_to_back);
    TestList receive(c.device(), dtype, {received}, Layout::back_to_back);
    const auto mine = rank_input(6000, me, sent, dtype);
    send.write(mine);
    c.all_to_all(send.views()[0], send_counts, receive.views()[0], receive_counts);
    c.wait();
    const auto got = receive.read();
    int64_t at = 0;
    for (int s = 0; s < n; ++s) {
      const auto theirs = rank_input(6000, s, pair_offset(s, n), dtype);
      const int64_t from = pair_offset(s, me), count = pair_count(s, me);
      const std::vector<double> want(theirs.begin() + from, theirs.begin() + from + count);
      const std::vector<double> part(got.begin() + at, got.begin() + at + count);
      expect_equal(part, want, 0, count, "all_to_all " + std::string(dtype_name(dtype)) + " from rank " +
                                             std::to_string(s));
      at += count;
    }
    EXPECT_EQ(send.read(), mine) << "the send buffer changed";
  }
  TestList send(c.device(), DType::f32, {8 * n}, Layout::back_to_back);
  TestList receive(c.device(), DType::f32, {8 * n}, Layout::back_to_back);
  const std::vector<int64_t> eights(static_cast<size_t>(n), 8);
  std::vector<int64_t> short_list(eights.begin(), eights.end() - 1), too_many = eights;
  too_many[0] = 9;
  receive.write(std::vector<double>(static_cast<size_t>(8 * n), 2.0));
  expect_error([&] { c.all_to_all(send.views()[0], short_list, receive.views()[0], eights); },
               ErrorCode::size_mismatch, {"send_counts", "one per rank"});
  expect_error([&] { c.all_to_all(send.views()[0], eights, receive.views()[0], too_many); },
               ErrorCode::size_mismatch, {"receive_counts"});
  TestList halves(c.device(), DType::bf16, {8 * n}, Layout::back_to_back);
  expect_error([&] { c.all_to_all(send.views()[0], eights, halves.views()[0], eights); },
               ErrorCode::dtype_unsupported, {"receive", "bf16"});
  expect_error([&] { c.all_to_all(send.views()[0], eights, send.views()[0], eights); }, ErrorCode::aliasing,
               {"receive"});
  // This rank's own section: the same size on both sides (else its copy would overrun).
  std::vector<int64_t> skewed = eights;
  skewed[static_cast<size_t>(c.rank())] = 6;
  skewed[static_cast<size_t>((c.rank() + 1) % n)] = 10;
  expect_error([&] { c.all_to_all(send.views()[0], eights, receive.views()[0], skewed); }, ErrorCode::size_mismatch,
               {"receive_counts", "to itself"});
  EXPECT_EQ(receive.read(), std::vector<double>(static_cast<size_t>(8 * n), 2.0));
}

TEST_P(Collectives, EmptyListsAndBarrier) {
  Communicator& c = comm();
  c.all_reduce(std::span<const TensorView>{});
  c.all_gather(std::span<const TensorView>{});
  c.reduce_scatter(std::span<const TensorView>{});
  c.barrier();
  c.wait();
  EXPECT_GE(c.rank(), 0);
  EXPECT_LT(c.rank(), c.size());
  EXPECT_GE(c.local_rank(), 0);
  EXPECT_LT(c.local_rank(), c.local_size());
  EXPECT_LE(c.local_size(), c.size());
}

// A fresh communicator shows which path a call took: the contiguous path
// never touches the fusion buffer; the fusion path grows it once and reuses it.
TEST_P(Collectives, ContiguousPathNeedsNoFusionBufferAndTheFusionBufferIsKept) {
  std::unique_ptr<Communicator> fresh = make_communicator(GetParam());
  Communicator& c = *fresh;
  TestList packed(c.device(), DType::f32, kAlignedSizes, Layout::back_to_back);
  packed.write(rank_input(6000, c.rank(), packed.total(), DType::f32));
  c.all_reduce(packed.views());
  c.all_gather(packed.views());
  c.reduce_scatter(packed.views());
  c.wait();
  EXPECT_EQ(c.fusion_buffer_bytes(), 0u) << "a back-to-back list went through the fusion buffer";

  TestList gaps(c.device(), DType::f32, kOddSizes, Layout::with_gaps);
  gaps.write(rank_input(6001, c.rank(), gaps.total(), DType::f32));
  c.all_reduce(gaps.views());
  c.wait();
  const size_t grown = c.fusion_buffer_bytes();
  EXPECT_GE(grown, static_cast<size_t>(gaps.total()) * 4);
  c.all_reduce(gaps.views());
  TestList smaller(c.device(), DType::f32, {3, 5}, Layout::with_gaps);
  smaller.write(rank_input(6002, c.rank(), 8, DType::f32));
  c.all_reduce(smaller.views());
  c.wait();
  EXPECT_EQ(c.fusion_buffer_bytes(), grown) << "the fusion buffer was reallocated for a list that fits";
  expect_reduced(smaller.read(), 6002, c.size(), DType::f32, false, 0, 8, "after reuse");
}

GRADKIT_INSTANTIATE_ON_EACH_BACKEND(Collectives);

TEST(ShardLayout, EachShareIsAMultipleOf32BytesAndTheTotalDividesByTheWorld) {
  for (DType dtype : kAllDTypes) {
    for (int world : {1, 2, 3, 4, 8}) {
      for (int64_t total : {int64_t{0}, int64_t{1}, int64_t{31}, int64_t{256}, int64_t{1173}, int64_t{100003}}) {
        const ShardLayout s = ShardLayout::of(total, dtype, world);
        const int64_t unit = 32 / static_cast<int64_t>(dtype_size(dtype)) * world;
        EXPECT_EQ(s.padded_total % world, 0);
        EXPECT_EQ(s.shard * world, s.padded_total);
        EXPECT_EQ(s.shard * static_cast<int64_t>(dtype_size(dtype)) % 32, 0);
        EXPECT_GE(s.padded_total, total);
        EXPECT_LT(s.padded_total - total, unit) << "more padding than one unit";
        EXPECT_EQ(s.begin(0), 0);
        EXPECT_EQ(s.end(world - 1), total);
      }
    }
  }
  // 1173 f16 elements over 4 ranks: units of 16 elements per rank, 304 each.
  const ShardLayout s = ShardLayout::of(1173, DType::f16, 4);
  EXPECT_EQ(s.shard, 304);
  EXPECT_EQ(s.begin(3), 912);
  EXPECT_EQ(s.end(3), 1173);
}

}  // namespace
}  // namespace gradkit::test
