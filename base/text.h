// Checks on text that leaves the process in JSON (names in manifests and traces).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace strata {

// Well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, at most
// U+10FFFF). JSON writers refuse anything else, so names that end up in a
// manifest or a trace are checked with it when they are given.
bool IsUtf8(std::string_view s);

// `s` for a message: as it is where it is UTF-8; otherwise every byte
// outside printable ASCII as \xNN, so that a message about a bad name is
// itself UTF-8 (callers log it and put it in JSON). At most `max_bytes` of
// `s` are shown, then "...".
std::string ForMessage(std::string_view s, size_t max_bytes = 64);

// The largest double that rounds to 0 as a float (half the least float
// denormal, 2^-150, rounds to even: 0). Compared in double: a cast of a
// double beyond float's range is undefined.
inline constexpr double kZeroAsFloat = 0x1p-150;

// `v` as printf's %g writes it, for messages: 1e-50, not to_string's 0.000000.
std::string ShortDouble(double v);

}  // namespace strata
