/* Every error path of the C API returns its status and a message that says
 * what was wrong; a broken engine answers STATE to every call. Compiled as C;
 * linked with capi.cpp's objects directly for the test-only hook. */
#define _XOPEN_SOURCE 700
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/capi/capi_testing.h"
#include "strata/strata.h"

#include "tests/capi/expect.h"

static const char* kConfig = "{\"optimizer\": {\"type\": \"AdamW\"}}";

static void status_names(void) {
  static const char* const names[] = {"OK",      "INVALID", "CONFIG",  "NOMEM",       "IO",    "NOSPACE",
                                      "CORRUPT", "COMM",    "TIMEOUT", "UNSUPPORTED", "STATE", "INTERNAL",
                                      "NOT_FOUND"};
  for (int i = 0; i <= STRATA_NOT_FOUND; ++i)
    if (strcmp(strata_status_name((strata_status_t)i), names[i]) != 0) {
      fprintf(stderr, "strata_status_name(%d) = %s\n", i, strata_status_name((strata_status_t)i));
      ++failures;
    }
  if (strcmp(strata_status_name((strata_status_t)99), "UNKNOWN") != 0) ++failures;
  if (strcmp(strata_status_name((strata_status_t)-1), "UNKNOWN") != 0) ++failures;
}

static void create_errors(void) {
  strata_engine_t* e = NULL;
  EXPECT(STRATA_INVALID, "strata_engine_create: json and out", strata_engine_create(NULL, NULL, &e));
  EXPECT(STRATA_INVALID, "must not be NULL", strata_engine_create(kConfig, NULL, NULL));
  EXPECT(STRATA_CONFIG, "strata_engine_create", strata_engine_create("{not json", NULL, &e));
  EXPECT(STRATA_CONFIG, "zero_optimization.offload_optimizer.devce",
         strata_engine_create("{\"zero_optimization\": {\"offload_optimizer\": {\"devce\": \"cpu\"}}}", NULL,
                              &e));
  EXPECT(STRATA_CONFIG, "zero_optimization.stage",
         strata_engine_create("{\"zero_optimization\": {\"stage\": 7}}", NULL, &e));
  strata_engine_options_t o = STRATA_ENGINE_OPTIONS_INIT;
  o.struct_size = 0;
  EXPECT(STRATA_INVALID, "options.struct_size", strata_engine_create(kConfig, &o, &e));
  o = (strata_engine_options_t)STRATA_ENGINE_OPTIONS_INIT;
  o.world_size = -1;
  EXPECT(STRATA_INVALID, "world_size -1", strata_engine_create(kConfig, &o, &e));
  o = (strata_engine_options_t)STRATA_ENGINE_OPTIONS_INIT;
  o.rank = 1; /* the environment gives the rank with world_size 0 */
  EXPECT(STRATA_INVALID, "rank 1 with world_size 0", strata_engine_create(kConfig, &o, &e));
  o = (strata_engine_options_t)STRATA_ENGINE_OPTIONS_INIT;
  o.rank = 2;
  o.world_size = 2;
  EXPECT(STRATA_INVALID, "rank 2 of world_size 2", strata_engine_create(kConfig, &o, &e));
  o = (strata_engine_options_t)STRATA_ENGINE_OPTIONS_INIT;
  o.grad_accumulation_steps = 0;
  EXPECT(STRATA_INVALID, "grad_accumulation_steps", strata_engine_create(kConfig, &o, &e));
  if (e != NULL) fprintf(stderr, "create wrote *out on failure\n"), ++failures;
  /* An old caller: options that end after world_size still work. */
  o = (strata_engine_options_t)STRATA_ENGINE_OPTIONS_INIT;
  o.struct_size = offsetof(strata_engine_options_t, grad_accumulation_steps);
  o.force_no_gpu = 7; /* beyond struct_size: not read */
  OK(strata_engine_create(kConfig, &o, &e));
  OK(strata_engine_destroy(e));
  OK(strata_engine_destroy(NULL));
}

/* strata_engine_placement: the size query, a short buffer refused, the line
 * without a GPU; options.device below -1 refused; stats say the same. */
static void placement(void) {
  strata_engine_options_t o = STRATA_ENGINE_OPTIONS_INIT;
  CHECK(o.device == -1);
  o.device = -2;
  strata_engine_t* e = NULL;
  EXPECT(STRATA_INVALID, "options.device: -2", strata_engine_create(kConfig, &o, &e));
  o = (strata_engine_options_t)STRATA_ENGINE_OPTIONS_INIT;
  o.force_no_gpu = 1;
  o.device = 5; /* without a GPU it does not matter */
  OK(strata_engine_create(kConfig, &o, &e));
  size_t size = 0;
  EXPECT(STRATA_INVALID, "strata_engine_placement: size must not be NULL", strata_engine_placement(e, NULL, NULL));
  OK(strata_engine_placement(e, NULL, &size));
  CHECK(size > 10);
  char small[8] = "xxxxxxx";
  size_t small_size = sizeof small;
  EXPECT(STRATA_INVALID, "the placement is", strata_engine_placement(e, small, &small_size));
  CHECK(small_size == size && small[0] == 'x');
  char* line = (char*)malloc(size);
  OK(strata_engine_placement(e, line, &size));
  CHECK(strlen(line) + 1 == size);
  const char* want = "rank 0/1: no GPU (force_no_gpu): device tier is a host arena; no NUMA binding (no GPU); ";
  if (strncmp(line, want, strlen(want)) != 0) fprintf(stderr, "placement: \"%s\"\n", line), ++failures;
  free(line);
  strata_stats_t s = STRATA_STATS_INIT;
  s.gpu_device = 9;
  s.numa_node = 9;
  OK(strata_engine_stats(e, &s));
  CHECK(s.gpu_device == -1 && s.numa_node == -1);
  OK(strata_engine_destroy(e));
}

static void null_engine(void) {
  void* p;
  float f;
  int n;
  uint64_t u;
  strata_dtype_t t;
  strata_stats_t s = STRATA_STATS_INIT;
  EXPECT(STRATA_INVALID, "strata_engine_add_param: engine is NULL",
         strata_engine_add_param(NULL, 0, "x", 1, NULL, NULL));
  EXPECT(STRATA_INVALID, "strata_engine_build: engine is NULL", strata_engine_build(NULL));
  EXPECT(STRATA_INVALID, "strata_engine_fetch: engine is NULL", strata_engine_fetch(NULL, 0, NULL, &p));
  EXPECT(STRATA_INVALID, "strata_engine_release: engine is NULL", strata_engine_release(NULL, 0, NULL));
  EXPECT(STRATA_INVALID, "strata_engine_grads: engine is NULL",
         strata_engine_grads(NULL, 0, &f, STRATA_DTYPE_F32, NULL));
  EXPECT(STRATA_INVALID, "strata_engine_step: engine is NULL", strata_engine_step(NULL, NULL, NULL));
  EXPECT(STRATA_INVALID, "strata_engine_prepare_step: engine is NULL",
         strata_engine_prepare_step(NULL, NULL));
  EXPECT(STRATA_INVALID, "strata_engine_read_master: engine is NULL", strata_engine_read_master(NULL, 0, &f));
  EXPECT(STRATA_INVALID, "strata_engine_num_groups: engine is NULL", strata_engine_num_groups(NULL, &n));
  EXPECT(STRATA_INVALID, "strata_engine_group_numel: engine is NULL", strata_engine_group_numel(NULL, 0, &u));
  EXPECT(STRATA_INVALID, "strata_engine_compute_dtype: engine is NULL",
         strata_engine_compute_dtype(NULL, &t));
  EXPECT(STRATA_INVALID, "strata_engine_stats: engine is NULL", strata_engine_stats(NULL, &s));
  EXPECT(STRATA_INVALID, "strata_engine_device_is_gpu: engine is NULL",
         strata_engine_device_is_gpu(NULL, &n));
  size_t size = 0;
  EXPECT(STRATA_INVALID, "strata_engine_placement: engine is NULL", strata_engine_placement(NULL, NULL, &size));
}

static void engine_errors(void) {
  strata_engine_options_t o = STRATA_ENGINE_OPTIONS_INIT;
  o.force_no_gpu = 1;
  strata_engine_t* e = NULL;
  OK(strata_engine_create(kConfig, &o, &e));
  float init[4] = {1, 2, 3, 4}, grads[4] = {0}, out[4];
  void* p = NULL;
  uint64_t u;
  EXPECT(STRATA_INVALID, "name must not be NULL", strata_engine_add_param(e, 0, NULL, 4, init, NULL));
  EXPECT(STRATA_INVALID, "group -1 is negative", strata_engine_add_param(e, -1, "w", 4, init, NULL));
  EXPECT(STRATA_STATE, "strata_engine_fetch: the engine is not built", strata_engine_fetch(e, 0, NULL, &p));
  EXPECT(STRATA_STATE, "not built", strata_engine_release(e, 0, NULL));
  EXPECT(STRATA_STATE, "not built", strata_engine_grads(e, 0, grads, STRATA_DTYPE_F32, NULL));
  EXPECT(STRATA_STATE, "strata_engine_step: the engine is not built", strata_engine_step(e, NULL, NULL));
  EXPECT(STRATA_STATE, "strata_engine_prepare_step: the engine is not built",
         strata_engine_prepare_step(e, NULL));
  EXPECT(STRATA_STATE, "not built", strata_engine_read_master(e, 0, out));
  EXPECT(STRATA_STATE, "not built", strata_engine_group_numel(e, 0, &u));
  OK(strata_engine_add_param(e, 0, "w", 4, init, NULL));
  OK(strata_engine_build(e));
  EXPECT(STRATA_STATE, "strata_engine_build: the engine is already built", strata_engine_build(e));
  EXPECT(STRATA_STATE, "add_param after build", strata_engine_add_param(e, 0, "w2", 4, init, NULL));

  EXPECT(STRATA_INVALID, "strata_engine_fetch: group 1 out of range [0, 1)",
         strata_engine_fetch(e, 1, NULL, &p));
  EXPECT(STRATA_INVALID, "group -3 out of range", strata_engine_fetch(e, -3, NULL, &p));
  EXPECT(STRATA_INVALID, "device_ptr must not be NULL", strata_engine_fetch(e, 0, NULL, NULL));
  EXPECT(STRATA_INVALID, "strata_engine_release: group 5 out of range", strata_engine_release(e, 5, NULL));
  EXPECT(STRATA_INVALID, "strata_engine_grads: grads must not be NULL",
         strata_engine_grads(e, 0, NULL, STRATA_DTYPE_F32, NULL));
  EXPECT(STRATA_INVALID, "grads: unknown dtype 9", strata_engine_grads(e, 0, grads, (strata_dtype_t)9, NULL));
  EXPECT(STRATA_INVALID, "group 2 out of range", strata_engine_grads(e, 2, grads, STRATA_DTYPE_F32, NULL));
  EXPECT(STRATA_INVALID, "strata_engine_read_master: out must not be NULL",
         strata_engine_read_master(e, 0, NULL));
  EXPECT(STRATA_INVALID, "group 1 out of range", strata_engine_read_master(e, 1, out));
  EXPECT(STRATA_INVALID, "out must not be NULL", strata_engine_num_groups(e, NULL));
  EXPECT(STRATA_INVALID, "out must not be NULL", strata_engine_group_numel(e, 0, NULL));
  EXPECT(STRATA_INVALID, "out must not be NULL", strata_engine_compute_dtype(e, NULL));
  EXPECT(STRATA_INVALID, "stats must not be NULL", strata_engine_stats(e, NULL));
  EXPECT(STRATA_INVALID, "strata_engine_device_is_gpu: out must not be NULL",
         strata_engine_device_is_gpu(e, NULL));
  int is_gpu = 7;
  OK(strata_engine_device_is_gpu(e, &is_gpu));
  if (is_gpu != 0) fprintf(stderr, "force_no_gpu engine says it is on a GPU\n"), ++failures;
  /* Releasing a group that is not fetched is the engine's to refuse. */
  strata_status_t st = strata_engine_release(e, 0, NULL);
  if (st == STRATA_OK || strstr(strata_last_error(), "strata_engine_release") == NULL)
    fprintf(stderr, "release of an unfetched group: %s %s\n", strata_status_name(st), strata_last_error()),
        ++failures;

  strata_step_options_t so = STRATA_STEP_OPTIONS_INIT;
  so.struct_size = 0;
  EXPECT(STRATA_INVALID, "strata_engine_step: options.struct_size is 0", strata_engine_step(e, &so, NULL));
  strata_step_result_t sr = STRATA_STEP_RESULT_INIT;
  sr.struct_size = 3;
  EXPECT(STRATA_INVALID, "result.struct_size is 3", strata_engine_step(e, NULL, &sr));
  strata_stats_t ss = STRATA_STATS_INIT;
  ss.struct_size = 1;
  EXPECT(STRATA_INVALID, "stats.struct_size is 1", strata_engine_stats(e, &ss));

  /* A success leaves the last message as it was. */
  OK(strata_engine_grads(e, 0, grads, STRATA_DTYPE_F32, NULL));
  if (strstr(strata_last_error(), "stats.struct_size is 1") == NULL)
    fprintf(stderr, "a successful call changed strata_last_error: %s\n", strata_last_error()), ++failures;

  /* Sized results: an old caller's shorter struct is written only as far as it reaches. */
  strata_step_result_t old = STRATA_STEP_RESULT_INIT;
  old.struct_size = offsetof(strata_step_result_t, skipped);
  old.skipped = 12345;
  old.loss_scale = -7;
  OK(strata_engine_step(e, NULL, &old));
  if (old.skipped != 12345 || old.loss_scale != -7 ||
      old.struct_size != offsetof(strata_step_result_t, skipped))
    fprintf(stderr, "step wrote past the caller's struct_size\n"), ++failures;
  strata_stats_t short_stats;
  memset(&short_stats, 0xab, sizeof short_stats);
  short_stats.struct_size = offsetof(strata_stats_t, host);
  OK(strata_engine_stats(e, &short_stats));
  if (short_stats.host.budget != 0xababababababababull ||
      short_stats.struct_size != offsetof(strata_stats_t, host))
    fprintf(stderr, "stats wrote past the caller's struct_size\n"), ++failures;

  /* Overlapped step: options announced after gradients, or changed at the
   * step. With nothing that could change the early update (no clipping, no
   * fp16, non-finite gradients applied) it is committed as it lands, so
   * other options at the step are refused; else it is speculative and they
   * only cost a replay (tests/engine/speculate_test.cpp). */
  strata_engine_options_t ov = STRATA_ENGINE_OPTIONS_INIT;
  ov.force_no_gpu = 1;
  ov.overlap_step = 1;
  strata_engine_t* e2 = NULL;
  OK(strata_engine_create("{\"optimizer\": {\"type\": \"AdamW\"}, \"strata\": {\"nonfinite\": \"apply\"}}", &ov, &e2));
  OK(strata_engine_add_param(e2, 0, "w", 4, init, NULL));
  OK(strata_engine_build(e2));
  so = (strata_step_options_t)STRATA_STEP_OPTIONS_INIT;
  so.lr = 0.1;
  OK(strata_engine_prepare_step(e2, &so));
  OK(strata_engine_grads(e2, 0, grads, STRATA_DTYPE_F32, NULL));
  EXPECT(STRATA_STATE,
         "strata_engine_prepare_step: prepare_step: gradients of this step have already arrived",
         strata_engine_prepare_step(e2, &so));
  so.lr = 0.2;
  EXPECT(STRATA_INVALID, "options differ from those given to prepare_step",
         strata_engine_step(e2, &so, NULL));
  so.lr = 0.1;
  OK(strata_engine_step(e2, &so, NULL));
  so.struct_size = 0;
  EXPECT(STRATA_INVALID, "options.struct_size is 0", strata_engine_prepare_step(e2, &so));
  OK(strata_engine_destroy(e2));

  /* A broken engine refuses everything with STATE and says why; destroy works. */
  strata_internal_break_engine(e, "injected fault");
  EXPECT(STRATA_STATE, "strata_engine_fetch: engine is unusable after an earlier error: injected fault",
         strata_engine_fetch(e, 0, NULL, &p));
  EXPECT(STRATA_STATE, "injected fault", strata_engine_step(e, NULL, NULL));
  EXPECT(STRATA_STATE, "injected fault", strata_engine_stats(e, &ss));
  EXPECT(STRATA_STATE, "injected fault", strata_engine_read_master(e, 0, out));
  OK(strata_engine_destroy(e));
}

static void adam_errors(void) {
  float w[4] = {1, 2, 3, 4}, m[4] = {0}, v[4] = {0}, g[4] = {1, 1, 1, 1};
  strata_adam_options_t o = STRATA_ADAM_OPTIONS_INIT;
  EXPECT(STRATA_INVALID, "strata_adam_step: options must not be NULL",
         strata_adam_step(NULL, 4, w, m, v, g, NULL));
  EXPECT(STRATA_INVALID, "param, exp_avg, exp_avg_sq and grad", strata_adam_step(&o, 4, NULL, m, v, g, NULL));
  EXPECT(STRATA_INVALID, "param, exp_avg, exp_avg_sq and grad", strata_adam_step(&o, 4, w, m, v, NULL, NULL));
  OK(strata_adam_step(&o, 0, NULL, NULL, NULL, NULL, NULL)); /* nothing to do */
  o.mode = (strata_adam_mode_t)5;
  EXPECT(STRATA_INVALID, "options.mode: unknown mode 5", strata_adam_step(&o, 4, w, m, v, g, NULL));
  o = (strata_adam_options_t)STRATA_ADAM_OPTIONS_INIT;
  o.grad_dtype = (strata_dtype_t)4;
  EXPECT(STRATA_INVALID, "options.grad_dtype: unknown dtype 4", strata_adam_step(&o, 4, w, m, v, g, NULL));
  o = (strata_adam_options_t)STRATA_ADAM_OPTIONS_INIT;
  o.struct_size = 0;
  EXPECT(STRATA_INVALID, "options.struct_size is 0", strata_adam_step(&o, 4, w, m, v, g, NULL));
  o = (strata_adam_options_t)STRATA_ADAM_OPTIONS_INIT;
  o.step = 0; /* the kernel refuses a 0th step (bias correction divides by zero) */
  strata_status_t st = strata_adam_step(&o, 4, w, m, v, g, NULL);
  if (st != STRATA_INVALID || strstr(strata_last_error(), "strata_adam_step") == NULL)
    fprintf(stderr, "adam step 0: %s %s\n", strata_status_name(st), strata_last_error()), ++failures;
  /* An infinite eps or weight_decay is refused (it would turn every
   * parameter to infinity or NaN), and the arrays are left as they were. */
  o = (strata_adam_options_t)STRATA_ADAM_OPTIONS_INIT;
  o.weight_decay = INFINITY;
  EXPECT(STRATA_INVALID, "weight_decay must be finite", strata_adam_step(&o, 4, w, m, v, g, NULL));
  o.mode = STRATA_ADAM_MODE_ADAM;
  EXPECT(STRATA_INVALID, "weight_decay must be finite", strata_adam_step(&o, 4, w, m, v, g, NULL));
  o = (strata_adam_options_t)STRATA_ADAM_OPTIONS_INIT;
  o.eps = INFINITY;
  EXPECT(STRATA_INVALID, "eps must be finite", strata_adam_step(&o, 4, w, m, v, g, NULL));
  CHECK(w[0] == 1.0f && m[0] == 0.0f && v[0] == 0.0f);
  /* Finite, but beyond float's range, which the update computes in. */
  o = (strata_adam_options_t)STRATA_ADAM_OPTIONS_INIT;
  o.grad_scale = 1e39;
  EXPECT(STRATA_INVALID, "grad_scale is 1e+39, beyond float's range", strata_adam_step(&o, 4, w, m, v, g, NULL));
  o = (strata_adam_options_t)STRATA_ADAM_OPTIONS_INIT;
  o.mode = STRATA_ADAM_MODE_ADAM;
  o.weight_decay = 1e39;
  EXPECT(STRATA_INVALID, "weight_decay is 1e+39", strata_adam_step(&o, 4, w, m, v, g, NULL));
  CHECK(w[0] == 1.0f && m[0] == 0.0f && v[0] == 0.0f);
  o = (strata_adam_options_t)STRATA_ADAM_OPTIONS_INIT;
  OK(strata_adam_step(&o, 4, w, m, v, g, NULL));
  if (!(w[0] < 1.0f && w[0] > 0.99f)) fprintf(stderr, "adam step did not move w[0]: %g\n", w[0]), ++failures;
}

int main(void) {
  if (strcmp(strata_last_error(), "") != 0) fprintf(stderr, "last error not empty at start\n"), ++failures;
  status_names();
  create_errors();
  placement();
  null_engine();
  engine_errors();
  adam_errors();
  if (failures)
    fprintf(stderr, "%d checks failed\n", failures);
  else
    printf("all error paths return their status and message\n");
  return failures ? 1 : 0;
}
