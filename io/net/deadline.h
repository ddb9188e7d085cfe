// Small helpers for timeouts shared by the store and the communicators
// (internal to io/net).
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace strata::net {

// "5 s", "0.25 s": how errors print a timeout.
inline std::string FormatSeconds(std::chrono::milliseconds ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

inline std::chrono::milliseconds SecondsToMillis(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0 + 0.5));
}

}  // namespace strata::net
