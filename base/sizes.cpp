// Parsing and printing byte sizes.
#include "base/sizes.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

namespace strata {
namespace {

std::string Lower(std::string_view s) {
  std::string out;
  for (char c : s) if (!std::isspace(static_cast<unsigned char>(c))) out += static_cast<char>(std::tolower(c));
  return out;
}

// A lower-cased suffix's unit: 10^dec * 2^bin bytes; false when unknown.
bool SuffixUnit(const std::string& s, int* dec, int* bin) {
  struct Entry { const char* name; int dec, bin; };
  static const Entry kTable[] = {
      {"", 0, 0}, {"b", 0, 0},
      {"k", 3, 0}, {"kb", 3, 0}, {"kib", 0, 10},
      {"m", 6, 0}, {"mb", 6, 0}, {"mib", 0, 20},
      {"g", 9, 0}, {"gb", 9, 0}, {"gib", 0, 30},
      {"t", 12, 0}, {"tb", 12, 0}, {"tib", 0, 40},
  };
  for (const auto& e : kTable)
    if (s == e.name) return *dec = e.dec, *bin = e.bin, true;
  return false;
}

}  // namespace

// Exact: the number's decimal digits as an integer M and a power of ten E
// (no floating point: "4.1GB" is 4100000000, "9007199254740993" itself).
Result<uint64_t> ParseByteSize(std::string_view text) {
  const std::string s = Lower(text);
  const std::string quoted = "'" + std::string(text) + "'";
  if (s.empty()) return InvalidError("byte size " + quoted + " is empty");
  if (s[0] == '-') return InvalidError("byte size " + quoted + " is negative");
  size_t i = 0;
  std::string digits;  // significant digits of the mantissa
  int64_t e10 = 0;     // value = digits * 10^e10 * unit
  bool any = false;
  for (; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i) digits += s[i], any = true;
  if (i < s.size() && s[i] == '.') {
    for (++i; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i) digits += s[i], --e10, any = true;
  }
  const std::string kNotANumber = " is not a number with an optional unit (e.g. 64MiB, 2GB, 1e8, 4.1GB)";
  if (!any) return InvalidError("byte size " + quoted + kNotANumber);
  if (i < s.size() && s[i] == 'e' && (i + 1 < s.size() && (std::isdigit(static_cast<unsigned char>(s[i + 1])) ||
                                                           ((s[i + 1] == '+' || s[i + 1] == '-') && i + 2 < s.size() &&
                                                            std::isdigit(static_cast<unsigned char>(s[i + 2])))))) {
    ++i;
    const bool neg = s[i] == '-';
    if (s[i] == '+' || s[i] == '-') ++i;
    int64_t x = 0;
    for (; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i) x = std::min<int64_t>(x * 10 + (s[i] - '0'), 100000);
    e10 += neg ? -x : x;
  }
  int dec = 0, bin = 0;
  if (!SuffixUnit(s.substr(i), &dec, &bin))
    return InvalidError("byte size " + quoted + " has an unknown unit '" + s.substr(i) +
                        "' (use B, KB, KiB, MB, MiB, GB, GiB, TB, TiB)");
  e10 += dec;
  const size_t first = digits.find_first_not_of('0');
  if (first == std::string::npos) return uint64_t{0};
  digits.erase(0, first);
  while (digits.back() == '0') digits.pop_back(), ++e10;
  const Status too_large = InvalidError("byte size " + quoted + " is too large");
  const Status not_whole = InvalidError("byte size " + quoted + " is not a whole number of bytes");
  constexpr unsigned __int128 kMax = static_cast<unsigned __int128>(INT64_MAX);
  // Exact up to 38 significant digits (10^38 < 2^127); beyond, whatever the
  // digits, the value is at least 10^19 (too large) or has a fraction far
  // below a byte (refused as not whole: no real size needs such digits).
  if (digits.size() > 38) return e10 + static_cast<int64_t>(digits.size()) > 19 ? too_large : not_whole;
  unsigned __int128 v = 0;
  for (char c : digits) v = v * 10 + static_cast<unsigned>(c - '0');
  if (e10 >= 0) {  // v * 10^e10 * 2^bin
    for (; e10 > 0; --e10)
      if ((v *= 10) > kMax) return too_large;
    if (v > (kMax >> bin)) return too_large;
    v <<= bin;
  } else {  // v * 2^bin / (5^k * 2^k), k = -e10: whole when 5^k and 2^(k-bin) divide v
    const int64_t k = -e10;
    if (k > 54) return not_whole;  // 5^55 > 2^127 > v: 5^k cannot divide it
    unsigned __int128 p5 = 1;
    for (int64_t j = 0; j < k; ++j) p5 *= 5;
    if (v % p5 != 0) return not_whole;
    v /= p5;
    if (bin >= k) {
      const int shift = bin - static_cast<int>(k);
      if (v > (kMax >> shift)) return too_large;
      v <<= shift;
    } else {
      const int shift = static_cast<int>(k) - bin;
      if ((v & ((static_cast<unsigned __int128>(1) << shift) - 1)) != 0) return not_whole;
      v >>= shift;
    }
  }
  if (v > kMax) return too_large;
  return static_cast<uint64_t>(v);
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
