#include "options.h"

#include <charconv>
#include <cstdio>
#include <sstream>

#include "gradkit/core/error.h"

namespace gradkit::tool {

Options::Options(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void Options::add(const std::string& name, const std::string& default_value, const std::string& help) {
  order_.push_back(name);
  options_[name] = {default_value, help};
}

void Options::print_usage() const {
  std::printf("usage: %s [options]\n%s\n\noptions:\n", command_.c_str(), summary_.c_str());
  for (const std::string& name : order_) {
    const Option& o = options_.at(name);
    std::printf("  --%-14s %s (default: %s)\n", name.c_str(), o.help.c_str(),
                o.value.empty() ? "none" : o.value.c_str());
  }
}

bool Options::parse(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      print_usage();
      exit_code_ = 0;
      return false;
    }
    std::string name, value;
    bool has_value = false;
    if (arg.rfind("--", 0) == 0) {
      const size_t eq = arg.find('=');
      name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      if (eq != std::string::npos) {
        value = arg.substr(eq + 1);
        has_value = true;
      }
    }
    auto it = options_.find(name);
    if (name.empty() || it == options_.end()) {
      std::fprintf(stderr, "%s: unknown argument '%s' (see --help)\n", command_.c_str(), arg.c_str());
      exit_code_ = 2;
      return false;
    }
    if (!has_value) {
      if (i + 1 >= args.size()) {
        std::fprintf(stderr, "%s: argument '--%s' expects a value\n", command_.c_str(), name.c_str());
        exit_code_ = 2;
        return false;
      }
      value = args[++i];
    }
    it->second.value = value;
  }
  return true;
}

const std::string& Options::get(const std::string& name) const { return options_.at(name).value; }

long long Options::get_int(const std::string& name, long long min, long long max) const {
  const std::string& text = get(name);
  long long v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < min || v > max) {
    throw_argument_error(ErrorCode::invalid_argument, command_, "--" + name,
                         "is '" + text + "', expected an integer from " + std::to_string(min) + " to " +
                             std::to_string(max));
  }
  return v;
}

double Options::get_double(const std::string& name, double min, double max) const {
  const std::string& text = get(name);
  double v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !(v >= min && v <= max)) {
    std::ostringstream range;
    range << min << " to " << max;
    throw_argument_error(ErrorCode::invalid_argument, command_, "--" + name,
                         "is '" + text + "', expected a number from " + range.str());
  }
  return v;
}

std::vector<std::string> Options::get_list(const std::string& name) const {
  std::vector<std::string> items;
  std::istringstream in(get(name));
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

std::string Options::get_choice(const std::string& name, const std::vector<std::string>& choices) const {
  const std::string& v = get(name);
  std::string expected;
  for (const std::string& c : choices) {
    if (c == v) return v;
    expected += (expected.empty() ? "" : ", ") + c;
  }
  throw_argument_error(ErrorCode::invalid_argument, command_, "--" + name,
                       "is '" + v + "', expected one of " + expected);
}

}  // namespace gradkit::tool
