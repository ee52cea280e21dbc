// The state-file container (docs/state-format.md) as a file system meets
// it: what read() refuses before reading (a directory, a device, a FIFO, a
// file larger than its sections), and what write() leaves behind (no
// temporaries of writers gone, the mode of the file it replaces).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/optim/state_file.h"
#include "support/expect_error.h"
#include "support/state_file_bytes.h"

namespace gradkit::test {
namespace {

namespace fs = std::filesystem;

// Runs `check` in a child process whose address space is capped at
// `memory` bytes and that is killed after `seconds`: a reader that reads
// without end (or waits for ever) fails the test instead of the machine.
// True when `check` returned true.
bool in_bounded_child(const std::function<bool()>& check, size_t memory, unsigned seconds) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const rlimit limit{memory, memory};
    ::setrlimit(RLIMIT_AS, &limit);
    ::alarm(seconds);
    bool ok = false;
    try {
      ok = check();
    } catch (...) {
    }
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Whether read(path) fails with an io_error naming `path` and `part`.
bool refuses(const std::string& path, const std::string& part) {
  try {
    StateFile::read(path);
  } catch (const Error& e) {
    const std::string what = e.what();
    return e.code() == ErrorCode::io_error && what.find(path) != std::string::npos &&
           what.find(part) != std::string::npos;
  }
  return false;
}

constexpr size_t kChildMemory = size_t{1} << 30;

TEST(StateFileRead, RefusesADirectoryNamingIt) {
  const std::string dir = temp_path("state_dir");
  fs::create_directory(dir);
  expect_error([&] { StateFile::read(dir); }, ErrorCode::io_error, {dir, "is a directory"});
  expect_error([&] { StateFile::check_readable(dir); }, ErrorCode::io_error, {dir, "is a directory"});
  fs::remove(dir);
}

// A device has no end: /dev/zero read whole grows until memory runs out.
// A FIFO without a writer would block its reader. Both are refused at once.
TEST(StateFileRead, RefusesDevicesAndFifosWithoutReadingThem) {
  EXPECT_TRUE(in_bounded_child([] { return refuses("/dev/zero", "is not a regular file"); }, kChildMemory, 20));
  const std::string fifo = temp_path("state_fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_TRUE(in_bounded_child([&] { return refuses(fifo, "is not a regular file"); }, kChildMemory, 20));
  std::remove(fifo.c_str());
}

// A valid file of a few bytes followed by 4 GiB (sparse: no disk) that no
// section accounts for: refused from its framing, without reading the rest
// (the child's memory is capped at 1 GiB).
TEST(StateFileRead, ReadsNoMoreThanTheSectionsDeclare) {
  const std::string path = temp_path("state_huge");
  write_raw_state_file(path, {{"kind", {'a', 'd', 'a', 'm'}}});
  const auto valid_size = fs::file_size(path);
  fs::resize_file(path, valid_size + (uint64_t{4} << 30));
  EXPECT_TRUE(in_bounded_child([&] { return refuses(path, "unexpected bytes after its sections"); }, kChildMemory, 20));
  // A section that says it is larger than the file: refused as truncated.
  std::vector<uint8_t> big(64, 7);
  write_raw_state_file(path, {{"kind", big}});
  std::vector<uint8_t> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  put_at<uint64_t>(bytes, 12 + 4 + 4 + 4, uint64_t{1} << 50);  // count, name length, "kind", then the size
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(bytes.data()),
                                                                 static_cast<std::streamsize>(bytes.size()));
  EXPECT_TRUE(in_bounded_child([&] { return refuses(path, "is truncated in section 'kind'"); }, kChildMemory, 20));
  // Not a state file at all: named from its first bytes.
  std::ofstream(path, std::ios::trunc) << "epoch,train_loss\n1,0.5\n2,0.4\n";
  expect_error([&] { StateFile::check_readable(path); }, ErrorCode::io_error, {path, "not a gradkit state file"});
  std::remove(path.c_str());
}

TEST(StateFileRead, ReadsWhatWriteWrote) {
  const std::string path = temp_path("state_roundtrip");
  StateFile file;
  std::vector<uint8_t> large(200000);
  for (size_t i = 0; i < large.size(); ++i) large[i] = static_cast<uint8_t>(i * 31 + 7);
  file.add("empty", {});
  file.add("large", large);
  file.add("small", {1, 2, 3});
  file.write(path);
  const StateFile again = StateFile::read(path);
  EXPECT_EQ(again.names(), (std::vector<std::string>{"empty", "large", "small"}));
  EXPECT_EQ(again.get("large"), large);
  EXPECT_EQ(again.get("small"), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_TRUE(again.get("empty").empty());
  StateFile::check_readable(path);
  std::remove(path.c_str());
}

// A pid that no process has now: a child's, once it is collected.
pid_t gone_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

// A save killed mid-write leaves PATH.tmp.PID; the next save removes those
// of processes now gone, and keeps a live writer's and every other file.
TEST(StateFileWrite, RemovesTheTemporariesOfWritersGone) {
  const fs::path dir = temp_path("state_temps");
  fs::create_directories(dir);
  const std::string path = (dir / "run.ckpt").string();
  auto touch = [](const fs::path& p) { std::ofstream(p) << "partial"; };
  const fs::path stale = StateFile::temporary_path(path, gone_pid());
  const fs::path live = StateFile::temporary_path(path, ::getppid());
  const fs::path other = StateFile::temporary_path((dir / "other.ckpt").string(), gone_pid());
  const fs::path not_a_pid = path + ".tmp.backup";
  for (const fs::path& p : {stale, live, other, not_a_pid}) touch(p);
  StateFile file;
  file.add("kind", {'x'});
  file.write(path);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_FALSE(fs::exists(StateFile::temporary_path(path, ::getpid())));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(other));
  EXPECT_TRUE(fs::exists(not_a_pid));
  EXPECT_EQ(StateFile::read(path).get("kind"), std::vector<uint8_t>{'x'});
  fs::remove_all(dir);
}

TEST(StateFileWrite, ASaveOverAFileKeepsItsMode) {
  const std::string path = temp_path("state_mode");
  StateFile file;
  file.add("kind", {'x'});
  file.write(path);
  for (fs::perms mode : {fs::perms::owner_read | fs::perms::owner_write,
                         fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                             fs::perms::others_read | fs::perms::others_write}) {
    fs::permissions(path, mode);
    file.write(path);
    EXPECT_EQ(fs::status(path).permissions(), mode);
  }
  std::remove(path.c_str());
}

TEST(StateFileWrite, TheTemplateIsAsLongAsTheLongestTemporary) {
  const std::string path = "/some/dir/run.ckpt";
  EXPECT_EQ(StateFile::temporary_path(path, 1234), path + ".tmp.1234");
  EXPECT_EQ(StateFile::temporary_template(path).size(), StateFile::temporary_path(path, 2147483647).size());
  EXPECT_TRUE(StateFile::temporary_template(path).ends_with("XXXXXX"));
}

}  // namespace
}  // namespace gradkit::test
