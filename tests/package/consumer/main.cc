// A user's program: accumulate a gradient through the installed package.
#include <gradkit/ops/gradient.h>

#include <cstdio>
#include <vector>

int main() {
  std::vector<float> buffer = {1.0f, 2.0f, 3.0f};
  const std::vector<float> value = {0.5f, 0.25f, -3.0f};
  gradkit::accumulate(gradkit::view(buffer.data(), 3), gradkit::view(value.data(), 3));
  const bool ok = buffer[0] == 1.5f && buffer[1] == 2.25f && buffer[2] == 0.0f;
  std::printf("consumer: %s\n", ok ? "ok" : "wrong result");
  return ok ? 0 : 1;
}
