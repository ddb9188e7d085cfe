// Logging facade over spdlog: one logger named "strata", level from
// STRATA_LOG_LEVEL (trace|debug|info|warn|error|off), default info.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace strata {

spdlog::logger& Logger();

// Logs `msg` at warn level only the first time `key` is seen in this process.
void WarnOnce(const std::string& key, const std::string& msg);

}  // namespace strata

#define STRATA_LOG_DEBUG(...) ::strata::Logger().debug(__VA_ARGS__)
#define STRATA_LOG_INFO(...) ::strata::Logger().info(__VA_ARGS__)
#define STRATA_LOG_WARN(...) ::strata::Logger().warn(__VA_ARGS__)
#define STRATA_LOG_ERROR(...) ::strata::Logger().error(__VA_ARGS__)
