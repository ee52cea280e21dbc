#include "cli.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "gradkit/core/error.h"

namespace gradkit::tool {

void print_error(const std::string& command, const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "%s: error: %s\n", command.c_str(), message.c_str());
  std::fflush(stderr);
}

void check_writable(const std::string& option, const std::string& path, bool in_place) {
  auto fail = [&](const std::string& why) {
    throw Error(ErrorCode::io_error, option + ": cannot write '" + path + "': " + why);
  };
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(path, ec);
  if (std::filesystem::is_directory(status)) fail("it is a directory");
  if (in_place && std::filesystem::exists(status)) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);  // changes nothing
    if (fd < 0) fail(std::strerror(errno));
    ::close(fd);
    return;
  }
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string directory = parent.empty() ? "." : parent.string();
  // Whether a file can be made there is known only by making one: access()
  // says yes to root on read-only and virtual file systems.
  std::string probe = directory + "/.gradkit-write-test-XXXXXX";
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) fail("no file can be created in '" + directory + "' (" + std::strerror(errno) + ")");
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace gradkit::tool
