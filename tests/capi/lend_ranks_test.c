/* Lent gradients at two ranks when the engine breaks mid-reduction: the
 * loan still ends before strata_engine_step returns, so the caller may unmap
 * the buffer at once. Rank 0 lends its gradient and ends the group: the
 * background reduction starts, reading the lent buffer where it lies, and
 * waits for rank 1, which lends only after rank 0 said so (a file). Rank
 * 0's engine is then broken (as an internal error would break it) and its
 * step is refused (STATE). That refusal waits for the reduction in flight
 * before it returns: rank 1 joins it only after rank 0's step has returned
 * and the buffer is unmapped (a second file), or after 3 s. An engine
 * that returned at once would read the unmapped buffer when rank 1 joins, and
 * rank 0 would die of SIGSEGV. Run under strata-launch --nproc 2; alone it
 * skips (77). */
#define _DEFAULT_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine/capi/capi_testing.h"
#include "strata/strata.h"

#include "tests/capi/expect.h"

#define N 600000 /* floats: each rank's half of the reduction spans 2 of the channel's rounds */

static const char* kConfig =
    "{\"optimizer\": {\"type\": \"AdamW\"}, \"zero_optimization\": {\"stage\": 2, \"overlap_comm\": true,"
    " \"offload_optimizer\": {\"device\": \"cpu\"}}}";

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void touch(const char* path) {
  FILE* f = fopen(path, "w");
  CHECK(f != NULL);
  if (f) fclose(f);
}

int main(void) {
  int rank = 0, world = 1;
  if (strata_rank_from_env(&rank, &world) != STRATA_OK) {
    fprintf(stderr, "%s\n", strata_last_error());
    return 1;
  }
  if (world != 2) {
    printf("capi_lend_ranks_test: needs 2 ranks (strata-launch --nproc 2); skipped\n");
    return 77;
  }
  /* Rank 0 says "group ended" and "returned and unmapped" with these files
   * (the ranks share the launcher). */
  char ended[96], unmapped[96];
  snprintf(ended, sizeof ended, "/tmp/strata_lend_ranks_test.%d.ended", (int)getppid());
  snprintf(unmapped, sizeof unmapped, "/tmp/strata_lend_ranks_test.%d.unmapped", (int)getppid());

  strata_engine_options_t o = STRATA_ENGINE_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = world;
  o.force_no_gpu = 1;
  strata_engine_t* e = NULL;
  OK(strata_engine_create(kConfig, &o, &e));
  static float w[N];
  for (int i = 0; i < N; ++i) w[i] = 0.001f * (float)(i % 97);
  OK(strata_engine_add_param(e, 0, "w", N, w, NULL));
  if (rank == 0) { /* (stale ones; rank 1 looks only after build, which all ranks reach) */
    unlink(ended);
    unlink(unmapped);
  }
  OK(strata_engine_build(e));

  const size_t bytes = (size_t)N * sizeof(float);
  float* g = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(g != MAP_FAILED);
  if (g == MAP_FAILED) return 1;
  for (int i = 0; i < N; ++i) g[i] = 0.01f * (float)((i * 7 + rank) % 13) - 0.06f;

  if (rank == 1) { /* after rank 0 ended its group; then after it unmapped, or 3 s */
    while (access(ended, F_OK) != 0) sleep_ms(10);
    for (int waited = 0; waited < 3000 && access(unmapped, F_OK) != 0; waited += 10) sleep_ms(10);
  }
  OK(strata_engine_grads_part_lend(e, 0, 0, N, g, STRATA_DTYPE_F32));
  OK(strata_engine_grads_end(e, 0));
  int in_use = -1;
  if (rank == 0) {
    OK(strata_engine_grads_lent(e, 0, &in_use));
    CHECK(in_use == 1); /* reduced from where it lies, in the background; rank 1 not there yet */
    touch(ended);
  }
  strata_internal_break_engine(e, "broken by capi_lend_ranks_test");
  strata_step_options_t opt = STRATA_STEP_OPTIONS_INIT;
  EXPECT(STRATA_STATE, "broken by capi_lend_ranks_test", strata_engine_step(e, &opt, NULL));
  /* The loan has ended: nothing reads the buffer any more. */
  EXPECT(STRATA_STATE, "unusable", strata_engine_grads_lent(e, 0, &in_use));
  CHECK(munmap(g, bytes) == 0);
  if (rank == 0) {
    touch(unmapped);
    sleep_ms(200); /* where a reduction were still reading, rank 1 joins it now */
  }
  strata_engine_destroy(e);
  if (rank == 1) {
    unlink(ended);
    unlink(unmapped);
  }
  if (failures)
    fprintf(stderr, "rank %d: %d failure(s)\n", rank, failures);
  else
    printf("capi_lend_ranks_test rank %d: ok\n", rank);
  return failures ? 1 : 0;
}
