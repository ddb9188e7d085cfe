// The project assert's failure path: print where and why, then abort.
#include "base/check.h"

#include <cstdio>
#include <cstdlib>

namespace strata::detail {

void CheckFailed(const char* expr, const char* file, int line, const char* msg) {
  std::fprintf(stderr, "strata: invariant broken at %s:%d: %s%s%s\n", file, line, expr,
               msg ? " — " : "", msg ? msg : "");
  std::fflush(stderr);
  std::abort();
}

}  // namespace strata::detail
