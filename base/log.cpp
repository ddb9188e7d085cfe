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
    // STRATA_LOG_LEVEL: trace, debug, info (the default), warn, error,
    // critical or off. spdlog reads any other word as "off": a typo would
    // silence every warning, so it is named and info is kept.
    const char* lvl = std::getenv("STRATA_LOG_LEVEL");
    l->set_level(spdlog::level::info);
    if (lvl && *lvl) {
      const std::string v = lvl;
      const auto level = spdlog::level::from_str(v);
      if (level != spdlog::level::off || v == "off")
        l->set_level(level);
      else
        l->warn("STRATA_LOG_LEVEL='{}' is not one of trace, debug, info, warn, error, critical, off; using info", v);
    }
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
