/* The C API's ranks block: strata_rank_from_env, strata_engine_rank and
 * strata_engine_sum_over_ranks. Alone it checks the one-rank answers and the
 * error paths; under strata-launch --nproc 2 each rank checks that the sums
 * are the sums of both ranks' values (the same bits on both), and that ranks
 * calling with different counts fail with COMM instead of mixing values.
 * Usage: capi_ranks_test            (one rank; sets and clears RANK itself)
 *        strata-launch --nproc 2 -- capi_ranks_test */
#define _XOPEN_SOURCE 700
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata/strata.h"

#include "tests/capi/expect.h"
/* Each rank goes on after a failed call, so that its peer is not left
 * waiting in a collective: OK counts like EXPECT here. */
#undef OK
#define OK(call) EXPECT(STRATA_OK, "", call)

static const char* kConfig = "{\"optimizer\": {\"type\": \"AdamW\"}, \"zero_optimization\": {\"stage\": 1}}";

static strata_engine_t* make_engine(int rank, int world) {
  strata_engine_options_t o = STRATA_ENGINE_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = world;
  o.force_no_gpu = 1;
  strata_engine_t* e = NULL;
  if (strata_engine_create(kConfig, &o, &e) != STRATA_OK) {
    fprintf(stderr, "create: %s\n", strata_last_error());
    exit(1);
  }
  float w[64] = {0};
  OK(strata_engine_add_param(e, 0, "w", 64, w, NULL));
  OK(strata_engine_build(e));
  return e;
}

static void alone(void) {
  int rank = -1, world = -1;
  EXPECT(STRATA_INVALID, "must not be NULL", strata_rank_from_env(NULL, &world));
  OK(strata_rank_from_env(&rank, &world));
  CHECK(rank == 0 && world == 1);
  /* A partial set of torchrun's variables is refused, naming them. */
  setenv("RANK", "1", 1);
  EXPECT(STRATA_INVALID, "WORLD_SIZE", strata_rank_from_env(&rank, &world));
  unsetenv("RANK");

  strata_engine_t* e = make_engine(0, 1);
  OK(strata_engine_rank(e, &rank, &world));
  CHECK(rank == 0 && world == 1);
  EXPECT(STRATA_INVALID, "must not be NULL", strata_engine_rank(e, &rank, NULL));
  EXPECT(STRATA_INVALID, "engine is NULL", strata_engine_rank(NULL, &rank, &world));
  double v[2] = {1.25, -3.5};
  OK(strata_engine_sum_over_ranks(e, v, 2));
  CHECK(v[0] == 1.25 && v[1] == -3.5);
  OK(strata_engine_sum_over_ranks(e, NULL, 0));
  EXPECT(STRATA_INVALID, "values is null", strata_engine_sum_over_ranks(e, NULL, 1));
  EXPECT(STRATA_INVALID, "engine is NULL", strata_engine_sum_over_ranks(NULL, v, 2));
  /* Mid-step (gradients pending) it is refused: the overlapped step may be communicating. */
  float g[64] = {0};
  OK(strata_engine_grads(e, 0, g, STRATA_DTYPE_F32, NULL));
  EXPECT(STRATA_STATE, "pending", strata_engine_sum_over_ranks(e, v, 2));
  OK(strata_engine_step(e, NULL, NULL));
  OK(strata_engine_sum_over_ranks(e, v, 2));
  strata_engine_destroy(e);
}

static void ranks(int rank, int world) {
  strata_engine_t* e = make_engine(rank, world);
  int r = -1, w = -1;
  OK(strata_engine_rank(e, &r, &w));
  CHECK(r == rank && w == world);
  /* Rank k brings k + 1 and 0.1 * (k + 1); every rank gets the sums, in rank order. */
  double v[2] = {rank + 1.0, 0.1 * (rank + 1)};
  OK(strata_engine_sum_over_ranks(e, v, 2));
  double want0 = 0, want1 = 0;
  for (int k = 0; k < world; ++k) {
    want0 += k + 1.0;
    want1 += 0.1 * (k + 1);
  }
  CHECK(v[0] == want0 && v[1] == want1);
  /* A count whose gathered copy (n values from each rank) overflows size_t is
   * refused on every rank before any collective runs (the same n everywhere). */
  EXPECT(STRATA_INVALID, "overflows", strata_engine_sum_over_ranks(e, v, SIZE_MAX / 16 + 1));
  /* Ranks that ask for different counts fail, on every rank, naming the call. */
  double u[3] = {0, 0, 0};
  EXPECT(STRATA_COMM, "sum_over_ranks", strata_engine_sum_over_ranks(e, u, rank == 0 ? 2 : 3));
  strata_engine_destroy(e);
  printf("rank %d of %d: sums %.17g %.17g\n", rank, world, v[0], v[1]);
}

int main(void) {
  int rank = 0, world = 1;
  if (strata_rank_from_env(&rank, &world) != STRATA_OK) {
    fprintf(stderr, "%s\n", strata_last_error());
    return 1;
  }
  if (world == 1)
    alone();
  else
    ranks(rank, world);
  if (failures)
    fprintf(stderr, "%d failure(s)\n", failures);
  else
    printf("capi_ranks_test (%d rank%s): ok\n", world, world > 1 ? "s" : "");
  return failures ? 1 : 0;
}
