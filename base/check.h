// STRATA_CHECK: a broken invariant aborts with a message, in every build type.
// Never use it on an I/O or CUDA result: those become a Status.
#pragma once

namespace strata::detail {
[[noreturn]] void CheckFailed(const char* expr, const char* file, int line, const char* msg);
}  // namespace strata::detail

#define STRATA_CHECK(cond)                                                          \
  do {                                                                              \
    if (__builtin_expect(!(cond), 0))                                               \
      ::strata::detail::CheckFailed(#cond, __FILE__, __LINE__, nullptr);            \
  } while (0)

#define STRATA_CHECK_MSG(cond, msg)                                                 \
  do {                                                                              \
    if (__builtin_expect(!(cond), 0))                                               \
      ::strata::detail::CheckFailed(#cond, __FILE__, __LINE__, (msg));              \
  } while (0)
