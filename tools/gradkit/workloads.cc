#include "workloads.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace gradkit::tool {

int64_t Workload::total() const { return std::accumulate(sizes.begin(), sizes.end(), int64_t{0}); }

Workload single_tensor(int64_t elements) { return {"1 tensor", {elements}}; }

Workload bert_large() {
  constexpr int64_t hidden = 1024, intermediate = 4096, vocab = 30522, positions = 512, types = 2;
  Workload w{"BERT-large", {}};
  auto add = [&](int64_t n) { w.sizes.push_back(n); };
  add(vocab * hidden);
  add(positions * hidden);
  add(types * hidden);
  add(hidden);  // embedding layer norm: gamma, beta
  add(hidden);
  for (int layer = 0; layer < 24; ++layer) {
    for (int p = 0; p < 4; ++p) {  // query, key, value, attention output
      add(hidden * hidden);
      add(hidden);
    }
    add(hidden);  // attention layer norm
    add(hidden);
    add(intermediate * hidden);
    add(intermediate);
    add(hidden * intermediate);
    add(hidden);
    add(hidden);  // output layer norm
    add(hidden);
  }
  return w;
}

Workload gpt2_small() {
  constexpr int64_t width = 768, vocab = 50257, positions = 1024, hidden = 4 * width;
  Workload w{"GPT-2", {vocab * width, positions * width}};
  for (int layer = 0; layer < 12; ++layer) {
    for (int64_t n : {width, width,                            // layer norm 1
                      width * 3 * width, 3 * width,            // attention: q, k, v
                      width * width, width,                    // attention output
                      width, width,                            // layer norm 2
                      width * hidden, hidden, hidden * width, width}) {  // MLP
      w.sizes.push_back(n);
    }
  }
  w.sizes.push_back(width);  // final layer norm
  w.sizes.push_back(width);
  return w;
}

Workload small_tensors(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> exponent(10.0, 16.0);  // 2^10 .. 2^16 elements
  Workload w{std::to_string(count) + " small", {}};
  for (int i = 0; i < count; ++i) w.sizes.push_back(static_cast<int64_t>(std::exp2(exponent(rng))));
  return w;
}

Workload scaled(const Workload& w, int64_t divisor) {
  Workload s{w.name, {}};
  for (int64_t n : w.sizes) s.sizes.push_back(std::max<int64_t>(1, n / divisor));
  return s;
}

}  // namespace gradkit::tool
