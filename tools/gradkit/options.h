// A small command-line parser: --name value or --name=value, --help, and
// errors that name the option and what it expected.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace gradkit::tool {

class Options {
 public:
  Options(std::string command, std::string summary);
  void add(const std::string& name, const std::string& default_value, const std::string& help);

  // False when the command should stop now (after --help, or a bad option,
  // whose message has been printed); exit_code() is then its exit status.
  bool parse(const std::vector<std::string>& args);
  int exit_code() const { return exit_code_; }

  const std::string& get(const std::string& name) const;
  // Throws gradkit::Error naming --name unless the value is an integer in [min, max].
  long long get_int(const std::string& name, long long min, long long max) const;
  double get_double(const std::string& name, double min, double max) const;
  std::vector<std::string> get_list(const std::string& name) const;
  std::string get_choice(const std::string& name, const std::vector<std::string>& choices) const;
  void print_usage() const;

 private:
  struct Option {
    std::string value, help;
  };
  std::string command_, summary_;
  std::vector<std::string> order_;
  std::map<std::string, Option> options_;
  int exit_code_ = 0;
};

}  // namespace gradkit::tool
