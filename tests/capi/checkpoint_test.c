/* Checkpoints through the C API: save, train on, load back, and the errors
 * a caller meets (existing tag, small blob buffer, nothing saved), in both
 * state formats (fp32, and compact with bf16 compute). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "strata/strata.h"

#define CHECK(call)                                                                   \
  do {                                                                                \
    strata_status_t s_ = (call);                                                      \
    if (s_ != STRATA_OK) {                                                            \
      fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,             \
              strata_status_name(s_), strata_last_error());                           \
      return 1;                                                                       \
    }                                                                                 \
  } while (0)
#define EXPECT(cond)                                                                  \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      fprintf(stderr, "%s:%d: expected %s (last error: %s)\n", __FILE__, __LINE__,    \
              #cond, strata_last_error());                                            \
      return 1;                                                                       \
    }                                                                                 \
  } while (0)

static int one_step(strata_engine_t* e, float g) {
  float grads[100];
  strata_step_result_t r = STRATA_STEP_RESULT_INIT;
  for (int i = 0; i < 100; ++i) grads[i] = g * (float)(i % 7 - 3);
  CHECK(strata_engine_grads(e, 0, grads, STRATA_DTYPE_F32, NULL));
  CHECK(strata_engine_step(e, NULL, &r));
  return 0;
}

static int run(int compact) {
  char dir[] = "/var/tmp/strata-capi-ckpt-XXXXXX";
  if (!mkdtemp(dir)) return 1;
  char json[640];
  snprintf(json, sizeof json,
           "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.05}}, \"zero_optimization\": "
           "{\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}}%s}", dir,
           compact ? ", \"bf16\": {\"enabled\": true}, \"strata\": {\"state_format\": \"compact\"}" : "");
  strata_engine_options_t opts = STRATA_ENGINE_OPTIONS_INIT;
  opts.force_no_gpu = 1;
  strata_engine_t* e = NULL;
  CHECK(strata_engine_create(json, &opts, &e));
  float init[100];
  for (int i = 0; i < 100; ++i) init[i] = (float)i / 100.0f;
  uint64_t off = 0;
  CHECK(strata_engine_add_param(e, 0, "w", 100, init, &off));
  CHECK(strata_engine_build(e));
  if (one_step(e, 1.0f)) return 1;
  float saved[100], now[100];
  CHECK(strata_engine_read_master(e, 0, saved));
  char ckpt[600];
  snprintf(ckpt, sizeof ckpt, "%s/ckpt", dir);
  const char blob[] = "data position 42";
  CHECK(strata_checkpoint_save(e, ckpt, "step1", blob, sizeof blob));
  /* The same state under the same tag again (a save killed before it
   * updated latest, repeated): nothing to write, it succeeds. */
  CHECK(strata_checkpoint_save(e, ckpt, "step1", blob, sizeof blob));
  if (one_step(e, 2.0f)) return 1;
  EXPECT(strata_checkpoint_save(e, ckpt, "step1", NULL, 0) == STRATA_INVALID);
  EXPECT(strstr(strata_last_error(), "never overwritten") != NULL);
  CHECK(strata_engine_read_master(e, 0, now));
  EXPECT(memcmp(now, saved, sizeof now) != 0);
  char small[4];
  uint64_t len = sizeof small;
  EXPECT(strata_checkpoint_load(e, ckpt, NULL, small, &len) == STRATA_INVALID);
  EXPECT(len == sizeof blob);
  char back[64];
  len = sizeof back;
  CHECK(strata_checkpoint_load(e, ckpt, "", back, &len));
  EXPECT(len == sizeof blob && memcmp(back, blob, sizeof blob) == 0);
  CHECK(strata_engine_read_master(e, 0, now));
  EXPECT(memcmp(now, saved, sizeof now) == 0);
  len = sizeof back;
  /* Nothing saved yet is NOT_FOUND (start fresh), not CORRUPT. */
  EXPECT(strata_checkpoint_load(e, "/nonexistent/ckpt", NULL, back, &len) == STRATA_NOT_FOUND);
  EXPECT(strstr(strata_last_error(), "/nonexistent/ckpt") != NULL);
  EXPECT(strcmp(strata_status_name(STRATA_NOT_FOUND), "NOT_FOUND") == 0);
  EXPECT(strata_checkpoint_load(e, dir, NULL, back, &len) == STRATA_NOT_FOUND); /* a folder, no checkpoint */
  EXPECT(strata_checkpoint_load(e, ckpt, "step2", back, &len) == STRATA_NOT_FOUND);
  EXPECT(strstr(strata_last_error(), "step2") != NULL);
  /* The optimizer's state, for a trainer's own state_dict. */
  float m[100], v[100], w2[100];
  CHECK(strata_engine_read_state(e, 0, STRATA_STATE_EXP_AVG, m));
  CHECK(strata_engine_read_state(e, 0, STRATA_STATE_EXP_AVG_SQ, v));
  EXPECT(m[1] != 0.0f && v[1] > 0.0f);
  for (int i = 0; i < 100; ++i) w2[i] = (float)i;
  CHECK(strata_engine_write_state(e, 0, STRATA_STATE_MASTER, w2));
  CHECK(strata_engine_read_master(e, 0, now));
  EXPECT(memcmp(now, w2, sizeof now) == 0);
  void* p = NULL;
  CHECK(strata_engine_fetch(e, 0, NULL, &p));
  /* The parameters follow the master weights (bf16 of 7.0 in compact). */
  if (compact) {
    EXPECT(((const uint16_t*)p)[7] == 0x40e0);
  } else {
    EXPECT(((const float*)p)[7] == 7.0f);
  }
  CHECK(strata_engine_release(e, 0, NULL));
  int64_t steps = 0;
  CHECK(strata_engine_get_steps(e, &steps));
  EXPECT(steps == 1);
  CHECK(strata_engine_set_steps(e, 40));
  CHECK(strata_engine_get_steps(e, &steps));
  EXPECT(steps == 40);
  EXPECT(strata_engine_set_steps(e, -1) == STRATA_INVALID);
  EXPECT(strata_engine_read_state(e, 0, (strata_state_t)7, m) == STRATA_INVALID);
  CHECK(strata_engine_destroy(e));
  char cmd[700];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) return 1;
  printf("capi checkpoint (%s): ok\n", compact ? "compact" : "fp32");
  return 0;
}

int main(void) {
  if (run(0)) return 1;
  return run(1);
}
