// The command line of gradkit's tools: CLI11 (Debian: libcli11-dev) with
// gradkit's conventions on top.
//
// - `--name value` or `--name=value`; given twice, the last value counts.
// - A value-taking option followed by nothing, or by another option, is an
//   error ("--epochs needs a value"): CLI11 alone would take the next
//   option as the value.
// - `--help` prints the options and their defaults on stdout; exit status 0.
// - Errors are said once, as "<command>: error: <what>" on stderr; exit
//   status 2 for a usage error (a bad or missing value, an unknown argument,
//   a file that cannot be written), 1 for a failure at run time (cli.h).
#pragma once

#include <CLI/CLI.hpp>

#include <optional>
#include <string>
#include <vector>

#include "cli.h"

namespace gradkit::tool {

// One command's options. Declare them on app() (with the validators below),
// then parse().
class Command {
 public:
  // `name` as the user types it ("gradkit train"); it starts every message.
  Command(std::string name, const std::string& summary);
  CLI::App& app() { return app_; }
  const std::string& name() const { return name_; }

  // Parses `args` (the arguments after the command's name) into the bound
  // variables and runs the app's callback, where checks across options go
  // (they throw CLI::ValidationError or gradkit::Error). Returns nothing
  // when the command should go on, or the exit status to stop with: 0 after
  // --help, kExitUsage after an error, each printed unless `report` is false
  // (the other ranks of an MPI job, which would print the same).
  std::optional<int> parse(const std::vector<std::string>& args, bool report = true);

 private:
  std::string name_;
  CLI::App app_;
};

// Validators whose failure reads "--name: expected <what>, not '<value>'".
// `allow_auto`: the word "auto" is accepted too.
CLI::Validator integer(long long min, long long max, bool allow_auto = false);
CLI::Validator number(double min, double max, bool allow_auto = false);
CLI::Validator one_of(const std::vector<std::string>& choices);
// A comma-separated list (empty items ignored) of at least one item, each
// passing `item`.
CLI::Validator list_of(const CLI::Validator& item);
std::vector<std::string> split_list(const std::string& text);

}  // namespace gradkit::tool
