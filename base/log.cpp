// The "strata" logger: stderr, a short pattern, level from the environment.
#include "base/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>
#include <set>

namespace strata {

spdlog::logger& Logger() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::stderr_color_mt("strata");
    l->set_pattern("[strata %L] %v");
    const char* lvl = std::getenv("STRATA_LOG_LEVEL");
    l->set_level(lvl ? spdlog::level::from_str(lvl) : spdlog::level::info);
    return l;
  }();
  return *logger;
}

void WarnOnce(const std::string& key, const std::string& msg) {
  static std::mutex mu;  // guards `seen`
  static std::set<std::string> seen;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen.insert(key).second) return;
  }
  Logger().warn("{}", msg);
}

}  // namespace strata
