/* The C API tests' checks, in one place. EXPECT: `call` returns `want` and
 * leaves a message containing `needle`; CHECK: `cond` holds; both count
 * failures and go on. OK: `call` succeeds, else the test stops (what
 * follows would only fail for the same reason). Include once per test. */
#pragma once

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata/strata.h"

static int failures = 0;

#define EXPECT(want, needle, call)                                                                \
  do {                                                                                            \
    strata_status_t got_ = (call);                                                                \
    const char* msg_ = strata_last_error();                                                       \
    if (got_ != (want) || strstr(msg_, (needle)) == NULL) {                                       \
      fprintf(stderr, "%s:%d: %s -> %s \"%s\"; want %s with \"%s\"\n", __FILE__, __LINE__, #call, \
              strata_status_name(got_), msg_, strata_status_name(want), (needle));                \
      ++failures;                                                                                 \
    }                                                                                             \
  } while (0)
#define OK(call)                                                                                   \
  do {                                                                                             \
    strata_status_t st_ = (call);                                                                  \
    if (st_ != STRATA_OK) {                                                                        \
      fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call, strata_status_name(st_), \
              strata_last_error());                                                                \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)
#define CHECK(cond)                                                       \
  do {                                                                    \
    if (!(cond)) {                                                        \
      fprintf(stderr, "%s:%d: %s is false\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                         \
    }                                                                     \
  } while (0)
