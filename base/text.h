// Checks on text that leaves the process in JSON (names in manifests and traces).
#pragma once

#include <string_view>

namespace strata {

// Well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, at most
// U+10FFFF). JSON writers refuse anything else, so names that end up in a
// manifest or a trace are checked with it when they are given.
bool IsUtf8(std::string_view s);

}  // namespace strata
