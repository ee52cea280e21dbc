#include "gradkit/core/device.h"

#include <charconv>
#include <string>

#include "spec/cuda_runtime.h"
#include "gradkit/core/error.h"

namespace gradkit {

std::string to_string(Device d) {
  return d.is_cuda() ? "cuda:" + std::to_string(d.index) : std::string("cpu");
}

Device parse_device(const std::string& text, const char* arg) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  if (text.starts_with("cuda:")) {
    int index = -1;
    const char* first = text.data() + 5;
    const char* last = text.data() + text.size();
    auto [end, ec] = std::from_chars(first, last, index);
    if (ec == std::errc() && end == last && first != last && index >= 0) return Device::cuda(index);
  }
  throw_argument_error(ErrorCode::invalid_argument, "parse_device", arg,
                       "is '" + text + "', expected 'cpu', 'cuda' or 'cuda:N' with N >= 0");
}

int cuda_device_count() { return spec::cuda_device_count(); }

}  // namespace gradkit
