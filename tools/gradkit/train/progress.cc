#include "train/progress.h"

#include <cstdio>

namespace gradkit::train {

Progress::Progress(bool report, bool bar, int epoch, int epochs, int64_t steps)
    : report_(report), bar_(report && bar), epoch_(epoch), epochs_(epochs), steps_(steps) {}

void Progress::update(int64_t done, double loss) {
  if (!bar_) return;
  const auto now = std::chrono::steady_clock::now();
  if (done != steps_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * done / (steps_ > 0 ? steps_ : 1));
  std::printf("\repoch %d/%d [%.*s%*s] %3d%% loss %.4f", epoch_, epochs_, filled, "##############################",
              kWidth - filled, "", static_cast<int>(100 * done / (steps_ > 0 ? steps_ : 1)), loss);
  std::fflush(stdout);
}

void Progress::finish(const std::string& summary) {
  if (!report_) return;
  if (bar_) std::printf("\r\033[K");
  std::printf("%s\n", summary.c_str());
  std::fflush(stdout);
}

}  // namespace gradkit::train
