/* strata_engine_add_param_shaped: every refusal names the tensor and what is
 * wrong with its shape, changes nothing, and a refused name stays free; a
 * scalar and shaped tensors register and lay out like flat ones. Compiled
 * as C against the public header. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata/strata.h"

#include "tests/capi/expect.h"

static const char* kConfig = "{\"optimizer\": {\"type\": \"AdamW\"}}";

static void refusals(strata_engine_t* e) {
  const int64_t two_by_zero[] = {2, 0}, negative[] = {3, -2}, ok[] = {2, 3};
  const int64_t huge[] = {INT64_C(1) << 31, INT64_C(1) << 31, INT64_C(1) << 31};
  const int64_t just_over[] = {INT64_C(1) << 20, (INT64_C(1) << 20) + 1};
  int64_t many[STRATA_MAX_NDIM + 1];
  for (int i = 0; i <= STRATA_MAX_NDIM; ++i) many[i] = 1;
  uint64_t off = 77;
  EXPECT(STRATA_INVALID, "strata_engine_add_param_shaped: engine is NULL",
         strata_engine_add_param_shaped(NULL, 0, "w", 2, ok, NULL, &off));
  EXPECT(STRATA_INVALID, "name must not be NULL",
         strata_engine_add_param_shaped(e, 0, NULL, 2, ok, NULL, &off));
  EXPECT(STRATA_INVALID, "add_param 'w': ndim -1 is not in 0..32",
         strata_engine_add_param_shaped(e, 0, "w", -1, ok, NULL, &off));
  EXPECT(STRATA_INVALID, "add_param 'w': ndim 33 is not in 0..32",
         strata_engine_add_param_shaped(e, 0, "w", STRATA_MAX_NDIM + 1, many, NULL, &off));
  EXPECT(STRATA_INVALID, "add_param 'w': shape is NULL with ndim 2",
         strata_engine_add_param_shaped(e, 0, "w", 2, NULL, NULL, &off));
  EXPECT(STRATA_INVALID, "add_param 'w': dim 1 of the shape is 0",
         strata_engine_add_param_shaped(e, 0, "w", 2, two_by_zero, NULL, &off));
  EXPECT(STRATA_INVALID, "add_param 'w': dim 1 of the shape is -2",
         strata_engine_add_param_shaped(e, 0, "w", 2, negative, NULL, &off));
  /* 2^93 elements: the product overflows 64 bits; refused, not wrapped. */
  EXPECT(STRATA_INVALID,
         "add_param 'w': shape [2147483648, 2147483648, 2147483648] has more than 1099511627776",
         strata_engine_add_param_shaped(e, 0, "w", 3, huge, NULL, &off));
  EXPECT(STRATA_INVALID, "add_param 'w': shape [1048576, 1048577] has more than 1099511627776",
         strata_engine_add_param_shaped(e, 0, "w", 2, just_over, NULL, &off));
  EXPECT(STRATA_INVALID, "add_param 'w': group -1 is negative",
         strata_engine_add_param_shaped(e, -1, "w", 2, ok, NULL, &off));
  CHECK(off == 77); /* out* is written only on OK */
  /* A full 32-dim shape of ones is a tensor of one element. */
  OK(strata_engine_add_param_shaped(e, 1, "ones", STRATA_MAX_NDIM, many, NULL, &off));
  CHECK(off == 0);
}

int main(void) {
  strata_engine_t* e = NULL;
  OK(strata_engine_create(kConfig, NULL, &e));
  refusals(e);
  /* After the refusals 'w' is still free, and group 0 still empty. */
  const int64_t w_shape[] = {2, 3};
  const float w[6] = {1, 2, 3, 4, 5, 6};
  const float s = 7;
  uint64_t off = 99;
  OK(strata_engine_add_param_shaped(e, 0, "w", 2, w_shape, w, &off));
  CHECK(off == 0);
  OK(strata_engine_add_param_shaped(e, 0, "scalar", 0, NULL, &s, &off));
  CHECK(off == 6);
  OK(strata_engine_add_param(e, 0, "flat", 5, NULL, &off));
  CHECK(off == 7);
  EXPECT(STRATA_INVALID, "add_param 'w': name already used in group 0",
         strata_engine_add_param_shaped(e, 0, "w", 2, w_shape, w, &off));
  EXPECT(STRATA_INVALID, "add_param 'flat': name already used in group 0",
         strata_engine_add_param_shaped(e, 0, "flat", 2, w_shape, NULL, &off));
  OK(strata_engine_build(e));
  EXPECT(STRATA_STATE, "add_param 'late' after build",
         strata_engine_add_param_shaped(e, 0, "late", 2, w_shape, NULL, &off));
  uint64_t n = 0;
  OK(strata_engine_group_numel(e, 0, &n));
  CHECK(n == 12);
  float master[12];
  OK(strata_engine_read_master(e, 0, master));
  for (int i = 0; i < 6; ++i) CHECK(master[i] == w[i]);
  CHECK(master[6] == 7);
  for (int i = 7; i < 12; ++i) CHECK(master[i] == 0);
  OK(strata_engine_destroy(e));
  if (failures) {
    fprintf(stderr, "%d failure(s)\n", failures);
    return 1;
  }
  printf("shapes_test: all refusals named the tensor; shaped tensors registered\n");
  return 0;
}
