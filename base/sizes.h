// Byte sizes: "64MiB", "2GB", "1e8", "4096" <-> uint64_t, and back for humans.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace strata {

// Accepts an integer, a decimal or exponent number ("1e8", "1.5GiB"), and the
// suffixes B, K/KB (1000), KiB (1024), M/MB, MiB, G/GB, GiB, T/TB, TiB, case-
// insensitive, with optional spaces. The result must be a whole number of
// bytes below 2^63. Errors name the text.
Result<uint64_t> ParseByteSize(std::string_view text);

// "1.50 GiB", "512 B".
std::string FormatBytes(uint64_t bytes);

}  // namespace strata
