#include "train/launcher.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include "cli.h"

namespace gradkit::train {
namespace {

// The start time (clock ticks after boot, /proc/PID/stat's 22nd field) of
// the live process `pid`; none if there is no such process or it is a zombie
// (it has ended, its parent has not yet collected it).
std::optional<unsigned long long> start_time(long pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  const std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(stat.substr(close + 1));
  std::string state, field;
  rest >> state;
  if (state == "Z" || state == "X") return std::nullopt;
  for (int i = 4; i < 22 && rest >> field; ++i) {
  }
  unsigned long long ticks = 0;
  if (!(rest >> ticks)) return std::nullopt;
  return ticks;
}

}  // namespace

std::optional<std::string> launcher_identity() {
  const long pid = ::getpid();
  const std::optional<unsigned long long> started = start_time(pid);
  if (!started) return std::nullopt;
  return std::to_string(pid) + ":" + std::to_string(*started);
}

void watch_launcher(const std::string& command) {
  const char* identity = std::getenv(kLauncherVariable);
  if (identity == nullptr) return;
  long pid = 0;
  unsigned long long started = 0;
  if (std::sscanf(identity, "%ld:%llu", &pid, &started) != 2 || pid <= 0) return;
  std::thread([command, pid, started] {
    for (;;) {
      const std::optional<unsigned long long> now = start_time(pid);
      if (!now || *now != started) {
        tool::print_error(command, "the launcher (pid " + std::to_string(pid) + ") has ended: this rank stops");
        std::_Exit(tool::kExitFailure);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(kLauncherPollMs));
    }
  }).detach();
}

}  // namespace gradkit::train
