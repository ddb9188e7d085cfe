// Parsing and printing byte sizes.
#include "base/sizes.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace strata {
namespace {

std::string Lower(std::string_view s) {
  std::string out;
  for (char c : s) if (!std::isspace(static_cast<unsigned char>(c))) out += static_cast<char>(std::tolower(c));
  return out;
}

// Multiplier for a lower-cased suffix, 0 when unknown.
double SuffixMultiplier(const std::string& s) {
  struct Entry { const char* name; double mult; };
  static const Entry kTable[] = {
      {"", 1}, {"b", 1},
      {"k", 1e3}, {"kb", 1e3}, {"kib", 1024.0},
      {"m", 1e6}, {"mb", 1e6}, {"mib", 1048576.0},
      {"g", 1e9}, {"gb", 1e9}, {"gib", 1073741824.0},
      {"t", 1e12}, {"tb", 1e12}, {"tib", 1099511627776.0},
  };
  for (const auto& e : kTable) if (s == e.name) return e.mult;
  return 0;
}

}  // namespace

Result<uint64_t> ParseByteSize(std::string_view text) {
  const std::string s = Lower(text);
  const std::string quoted = "'" + std::string(text) + "'";
  if (s.empty()) return InvalidError("byte size " + quoted + " is empty");
  if (s[0] == '-') return InvalidError("byte size " + quoted + " is negative");
  char* end = nullptr;
  errno = 0;
  const double number = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || errno == ERANGE || !std::isfinite(number))
    return InvalidError("byte size " + quoted + " is not a number with an optional unit (e.g. 64MiB, 2GB, 1e8)");
  const double mult = SuffixMultiplier(std::string(end));
  if (mult == 0)
    return InvalidError("byte size " + quoted + " has an unknown unit '" + std::string(end) +
                        "' (use B, KB, KiB, MB, MiB, GB, GiB, TB, TiB)");
  const double bytes = number * mult;
  if (bytes >= 9.2e18) return InvalidError("byte size " + quoted + " is too large");
  if (bytes != std::floor(bytes))
    return InvalidError("byte size " + quoted + " is not a whole number of bytes");
  return static_cast<uint64_t>(bytes);
}

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 5) { v /= 1024; ++u; }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[u]);
  return buf;
}

}  // namespace strata
