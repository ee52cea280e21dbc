// How gradkit's tools end and what they check before any work: exit
// statuses, error messages said once, files that must be writable. (The
// parsing itself is in options.h, over CLI11.)
#pragma once

#include <string>

namespace gradkit::tool {

inline constexpr int kExitFailure = 1;  // a failure at run time
inline constexpr int kExitUsage = 2;    // a bad command line, found before any work

// Prints "<command>: error: <message>" on stderr: how every command reports
// an error, whatever raised it.
void print_error(const std::string& command, const std::string& message);

// Throws gradkit::Error(io_error) naming `option` unless a file can be
// written at `path` now: its directory exists and takes new files, and
// `path` is not a directory. `in_place`: the file is opened and written
// where it is (an existing one must be writable); otherwise it is a state
// file, replaced by renaming StateFile::write's temporary over it (the
// directory must take that temporary, its name not too long). Nothing is
// left behind.
void check_writable(const std::string& option, const std::string& path, bool in_place);

}  // namespace gradkit::tool
