// How the ranks that `gradkit train` starts under mpiexec end with it. The
// launcher becomes mpiexec (exec keeps its pid) and tells the ranks who it
// is; each rank watches it and stops when it is gone, however it ended
// (kill -9 included, which mpiexec cannot pass on). The ranks' parent is
// not the launcher under every MPI (a daemon's children, re-parented), so a
// rank watches the process itself, not its parent.
#pragma once

#include <optional>
#include <string>

namespace gradkit::train {

// The environment variable that carries the launcher's identity to its ranks.
inline constexpr const char* kLauncherVariable = "GRADKIT_TRAIN_LAUNCHER";

// This process's identity, "<pid>:<start time>" (the start time tells a
// pid taken again by another process from ours), for kLauncherVariable;
// none where /proc does not say.
std::optional<std::string> launcher_identity();

// Where kLauncherVariable names a launcher, starts a thread that checks it
// every `kLauncherPollMs` and, once it is gone (or a zombie), prints that on
// stderr under `command` and ends this process with exit status 1. Does
// nothing where the variable is unset (ranks that a user's mpiexec started).
void watch_launcher(const std::string& command);

inline constexpr int kLauncherPollMs = 50;

}  // namespace gradkit::train
