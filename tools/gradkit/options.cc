#include "options.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <functional>
#include <sstream>

#include "gradkit/core/error.h"

namespace gradkit::tool {
namespace {

// "-1" and "-.5" are values; "-h", "--ranks" are options.
bool looks_like_option(const std::string& arg) {
  return arg.size() > 1 && arg[0] == '-' && std::isdigit(static_cast<unsigned char>(arg[1])) == 0 && arg[1] != '.';
}

// `args` with each value-taking `--name=value` split in two, as CLI11 reads
// them best (it would take the argument after `--name=` as the value); the
// name of an option left without its value, if any. CLI11 takes whatever
// follows a value-taking option as its value, another option included.
std::vector<std::string> split_values(const CLI::App& app, const std::vector<std::string>& args,
                                      std::string& missing) {
  auto takes_value = [&](const std::string& name) {
    const CLI::Option* option = app.get_option_no_throw(name);
    return option != nullptr && option->get_items_expected_max() != 0;  // flags (--help) take none
  };
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    const size_t eq = arg.find('=');
    if (arg.starts_with("--") && eq != std::string::npos && takes_value(arg.substr(0, eq))) {
      out.push_back(arg.substr(0, eq));
      out.push_back(arg.substr(eq + 1));
    } else if (arg.starts_with("--") && takes_value(arg)) {
      if (i + 1 == args.size() || looks_like_option(args[i + 1])) {
        missing = arg;
        return out;
      }
      out.push_back(arg);
      out.push_back(args[++i]);
    } else {
      out.push_back(arg);
    }
  }
  return out;
}

CLI::Validator expect(std::string what, std::function<bool(const std::string&)> ok) {
  return CLI::Validator(
      [what = std::move(what), ok = std::move(ok)](std::string& value) {
        return ok(value) ? std::string() : "expected " + what + ", not '" + value + "'";
      },
      "");
}

template <class T>
bool parse_whole(const std::string& text, T& value) {
  const char* last = text.data() + text.size();
  auto [end, ec] = std::from_chars(text.data(), last, value);
  return ec == std::errc() && end == last;
}

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

bool contains(const std::vector<std::string>& items, const std::string& item) {
  return std::find(items.begin(), items.end(), item) != items.end();
}

}  // namespace

Command::Command(std::string name, const std::string& summary) : name_(std::move(name)), app_(summary, name_) {
  app_.option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

std::optional<int> Command::parse(const std::vector<std::string>& args, bool report) {
  auto usage_error = [&](const std::string& message) {
    if (report) print_error(name_, message);
    return kExitUsage;
  };
  std::string missing;
  std::vector<std::string> reversed = split_values(app_, args, missing);
  if (!missing.empty()) return usage_error(missing + " needs a value (see --help)");
  std::reverse(reversed.begin(), reversed.end());  // CLI11 reads from the back
  try {
    app_.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    if (report) std::printf("%s", app_.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    return usage_error(std::string(e.what()) + " (see --help)");
  } catch (const Error& e) {  // the checks across options
    return usage_error(e.what());
  }
  return std::nullopt;
}

CLI::Validator integer(long long min, long long max, bool allow_auto) {
  return expect((allow_auto ? "auto or " : "") + std::string("an integer from ") + std::to_string(min) + " to " +
                    std::to_string(max),
                [=](const std::string& text) {
                  long long v = 0;
                  return (allow_auto && text == "auto") || (parse_whole(text, v) && v >= min && v <= max);
                });
}

CLI::Validator number(double min, double max, bool allow_auto) {
  std::ostringstream what;
  what << (allow_auto ? "auto or " : "") << "a number from " << min << " to " << max;
  return expect(what.str(), [=](const std::string& text) {
    double v = 0;
    return (allow_auto && text == "auto") || (parse_whole(text, v) && v >= min && v <= max);
  });
}

CLI::Validator one_of(const std::vector<std::string>& choices) {
  return expect("one of " + joined(choices), [=](const std::string& text) { return contains(choices, text); });
}

CLI::Validator list_of(const CLI::Validator& item) {
  return CLI::Validator(
      [item](std::string& text) {
        const std::vector<std::string> items = split_list(text);
        if (items.empty()) return "expected a comma-separated list, not '" + text + "'";
        for (std::string each : items) {
          if (std::string error = item(each); !error.empty()) return error;
        }
        return std::string();
      },
      "");
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

}  // namespace gradkit::tool
