#include "cli.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "gradkit/core/error.h"
#include "gradkit/optim/state_file.h"

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
  // says yes to root on read-only and virtual file systems. In place, the
  // probe's name is any; replaced, it is as long as the longest temporary
  // file the write makes beside `path`, so that a name too long for the
  // file system is found now rather than at the first save.
  std::string probe = in_place ? directory + "/.gradkit-write-test-XXXXXX" : StateFile::temporary_template(path);
  const int fd = ::mkstemp(probe.data());
  if (fd < 0 && errno == ENAMETOOLONG && !in_place) {
    fail("the name of the temporary file written beside it, '" +
         std::filesystem::path(StateFile::temporary_path(path, ::getpid())).filename().string() +
         "', is too long for the file system (" + std::strerror(ENAMETOOLONG) + ")");
  }
  if (fd < 0) fail("no file can be created in '" + directory + "' (" + std::strerror(errno) + ")");
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace gradkit::tool
