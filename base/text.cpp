#include "base/text.h"

#include <cstdio>

#include <cstddef>
#include <cstdint>

namespace strata {

bool IsUtf8(std::string_view s) {
  static const uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80         ? 0
                     : (c >> 5) == 6  ? 1
                     : (c >> 4) == 14 ? 2
                     : (c >> 3) == 30 ? 3
                                      : 4;  // continuation bytes
    if (n == 4 || n >= s.size() - i) return false;
    uint32_t cp = n == 0 ? c : c & (0x3fu >> n);
    for (size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xc0) != 0x80) return false;
      cp = cp << 6 | (d & 0x3fu);
    }
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n + 1;
  }
  return true;
}

std::string ForMessage(std::string_view s, size_t max_bytes) {
  const bool cut = s.size() > max_bytes;
  if (cut) s = s.substr(0, max_bytes);
  std::string out;
  if (IsUtf8(s)) {
    out.assign(s);
  } else {
    static const char kHex[] = "0123456789abcdef";
    for (const char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      if (c >= 0x20 && c < 0x7f) {
        out += ch;
      } else {
        out += "\\x";
        out += kHex[c >> 4];
        out += kHex[c & 15];
      }
    }
  }
  return cut ? out + "..." : out;
}

std::string ShortDouble(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace strata
