/* A whole training loop through include/strata/strata.h, compiled as C99:
 * a two-layer linear model (two parameter groups, optimizer state on NVMe in
 * a temporary folder) trained with a changing learning rate, checked step by
 * step against the same model stepped with strata_adam_step on arrays of its
 * own (the optimizer alone). */
#define _XOPEN_SOURCE 700
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "strata/strata.h"

enum { IN = 8, HID = 4, SAMPLES = 16, STEPS = 40 };
enum { N0 = HID * IN + HID, N1 = HID + 1 }; /* group 0: W1 (HID, IN), b1 (HID); group 1: w2 (HID), b2 */

#include "tests/capi/expect.h"
/* Checks here say why in printf style. */
#undef CHECK
#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                            \
      fprintf(stderr, "\n");                                                   \
      ++failures;                                                              \
    }                                                                          \
  } while (0)

static float xs[SAMPLES][IN], ts[SAMPLES];

static float uniform(unsigned* s) { /* LCG in [-1, 1) */
  *s = *s * 1664525u + 1013904223u;
  return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* Loss (mean squared error) and its gradients for params p0 (group 0) and
 * p1 (group 1); g0 and g1 receive the gradients. */
static double loss_and_grads(const float* p0, const float* p1, float* g0, float* g1) {
  const float* w1 = p0;
  const float* b1 = p0 + HID * IN;
  double loss = 0;
  memset(g0, 0, sizeof(float) * N0);
  memset(g1, 0, sizeof(float) * N1);
  for (int s = 0; s < SAMPLES; ++s) {
    float h[HID], y = p1[HID];
    for (int j = 0; j < HID; ++j) {
      h[j] = b1[j];
      for (int i = 0; i < IN; ++i) h[j] += w1[j * IN + i] * xs[s][i];
      y += p1[j] * h[j];
    }
    const float d = 2.0f * (y - ts[s]) / SAMPLES; /* dloss/dy */
    loss += (double)(y - ts[s]) * (y - ts[s]) / SAMPLES;
    for (int j = 0; j < HID; ++j) {
      g1[j] += d * h[j];
      const float dh = d * p1[j];
      g0[HID * IN + j] += dh;
      for (int i = 0; i < IN; ++i) g0[j * IN + i] += dh * xs[s][i];
    }
    g1[HID] += d;
  }
  return loss;
}

static int remove_entry(const char* path, const struct stat* sb, int flag, struct FTW* ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(path);
}

static double rel_diff(const float* a, const float* b, int n) {
  double num = 0, den = 0;
  for (int i = 0; i < n; ++i) {
    num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    den += (double)b[i] * b[i];
  }
  return sqrt(num / (den > 0 ? den : 1));
}

/* One training run; `overlap` selects the overlapped step (each group
 * updated as soon as its gradients are in), which must give the same. */
static void train(int overlap) {
  unsigned seed = 42;
  float init0[N0], init1[N1], teacher[IN];
  for (int i = 0; i < N0; ++i) init0[i] = 0.3f * uniform(&seed);
  for (int i = 0; i < N1; ++i) init1[i] = 0.3f * uniform(&seed);
  for (int i = 0; i < IN; ++i) teacher[i] = uniform(&seed);
  for (int s = 0; s < SAMPLES; ++s) {
    ts[s] = 0.5f;
    for (int i = 0; i < IN; ++i) {
      xs[s][i] = uniform(&seed);
      ts[s] += teacher[i] * xs[s][i];
    }
  }

  char dir[] = "/tmp/strata_capi_train_XXXXXX";
  if (!mkdtemp(dir)) perror("mkdtemp"), exit(1);
  char json[1024];
  snprintf(json, sizeof json,
           "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.01, \"betas\": [0.9, 0.999],"
           " \"eps\": 1e-8, \"weight_decay\": 0.01}},"
           " \"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {\"device\": \"nvme\","
           " \"nvme_path\": \"%s\"}}}",
           dir);

  strata_engine_options_t eo = STRATA_ENGINE_OPTIONS_INIT;
  eo.force_no_gpu = 1; /* fetched pointers are host memory that this test reads */
  eo.overlap_step = overlap;
  strata_engine_t* e = NULL;
  OK(strata_engine_create(json, &eo, &e));
  uint64_t off = 99;
  OK(strata_engine_add_param(e, 0, "l1.w", HID * IN, init0, &off));
  CHECK(off == 0, "offset %llu", (unsigned long long)off);
  OK(strata_engine_add_param(e, 0, "l1.b", HID, init0 + HID * IN, &off));
  CHECK(off == HID * IN, "offset %llu", (unsigned long long)off);
  OK(strata_engine_add_param(e, 1, "l2.w", HID, init1, &off));
  OK(strata_engine_add_param(e, 1, "l2.b", 1, init1 + HID, &off));
  CHECK(off == HID, "offset %llu", (unsigned long long)off);
  OK(strata_engine_build(e));

  int groups = 0;
  uint64_t n0 = 0, n1 = 0;
  strata_dtype_t dt = STRATA_DTYPE_BF16;
  OK(strata_engine_num_groups(e, &groups));
  OK(strata_engine_group_numel(e, 0, &n0));
  OK(strata_engine_group_numel(e, 1, &n1));
  OK(strata_engine_compute_dtype(e, &dt));
  CHECK(groups == 2 && n0 == N0 && n1 == N1 && dt == STRATA_DTYPE_F32, "groups %d numel %llu %llu dtype %d",
        groups, (unsigned long long)n0, (unsigned long long)n1, (int)dt);

  /* The reference: the same model and AdamW on arrays of our own. */
  float r0[N0], r1[N1], m0[N0] = {0}, v0[N0] = {0}, m1[N1] = {0}, v1[N1] = {0};
  memcpy(r0, init0, sizeof r0);
  memcpy(r1, init1, sizeof r1);
  float g0[N0], g1[N1], rg0[N0], rg1[N1];
  double first_loss = 0, last_loss = 0;
  for (int step = 1; step <= STEPS; ++step) {
    const double lr = 0.02 * (1.0 - (double)step / (STEPS + 1)); /* a linear schedule */
    void* p0 = NULL;
    void* p1 = NULL;
    OK(strata_engine_fetch(e, 0, NULL, &p0));
    OK(strata_engine_fetch(e, 1, NULL, &p1));
    CHECK(rel_diff((const float*)p0, r0, N0) < 1e-6, "step %d group 0 differs: %g", step,
          rel_diff((const float*)p0, r0, N0));
    CHECK(rel_diff((const float*)p1, r1, N1) < 1e-6, "step %d group 1 differs", step);
    const double loss = loss_and_grads((const float*)p0, (const float*)p1, g0, g1);
    strata_step_options_t opt = STRATA_STEP_OPTIONS_INIT;
    opt.lr = lr;
    if (overlap) OK(strata_engine_prepare_step(e, &opt));
    OK(strata_engine_release(e, 1, NULL));
    OK(strata_engine_grads(e, 1, g1, STRATA_DTYPE_F32, NULL));
    OK(strata_engine_release(e, 0, NULL));
    OK(strata_engine_grads(e, 0, g0, STRATA_DTYPE_F32, NULL));
    strata_step_result_t res = STRATA_STEP_RESULT_INIT;
    OK(strata_engine_step(e, &opt, &res));

    loss_and_grads(r0, r1, rg0, rg1);
    double ss = 0;
    for (int i = 0; i < N0; ++i) ss += (double)rg0[i] * rg0[i];
    for (int i = 0; i < N1; ++i) ss += (double)rg1[i] * rg1[i];
    CHECK(fabs(res.grad_norm - sqrt(ss)) <= 1e-5 * sqrt(ss), "step %d grad_norm %g, expected %g", step,
          res.grad_norm, sqrt(ss));
    CHECK(!res.skipped && res.loss_scale == 1.0, "step %d skipped %d loss_scale %g", step, res.skipped,
          res.loss_scale);
    strata_adam_options_t ao = STRATA_ADAM_OPTIONS_INIT;
    ao.lr = lr;
    ao.weight_decay = 0.01;
    ao.step = step;
    OK(strata_adam_step(&ao, N0, r0, m0, v0, rg0, NULL));
    OK(strata_adam_step(&ao, N1, r1, m1, v1, rg1, NULL));

    if (step == 1) first_loss = loss;
    last_loss = loss;
  }
  printf("overlap_step %d: loss %.6f -> %.6f over %d steps\n", overlap, first_loss, last_loss, STEPS);
  CHECK(last_loss < 0.2 * first_loss, "loss did not fall: %g -> %g", first_loss, last_loss);

  float w0[N0], w1[N1];
  OK(strata_engine_read_master(e, 0, w0));
  OK(strata_engine_read_master(e, 1, w1));
  CHECK(rel_diff(w0, r0, N0) < 1e-6 && rel_diff(w1, r1, N1) < 1e-6, "master weights differ: %g %g",
        rel_diff(w0, r0, N0), rel_diff(w1, r1, N1));

  strata_stats_t stats = STRATA_STATS_INIT;
  OK(strata_engine_stats(e, &stats));
  printf("steps %llu fetches %llu host peak %llu nvme peak %llu\n", (unsigned long long)stats.steps,
         (unsigned long long)stats.fetches, (unsigned long long)stats.host.peak,
         (unsigned long long)stats.nvme.peak);
  CHECK(stats.steps == STEPS && stats.skipped_steps == 0, "steps %llu", (unsigned long long)stats.steps);
  CHECK(stats.fetches > 0, "fetches %llu", (unsigned long long)stats.fetches);

  OK(strata_engine_destroy(e));
  nftw(dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS);
}

int main(void) {
  printf("strata %d (header %d)\n", strata_version(), STRATA_VERSION_CODE);
  CHECK(strata_version() == STRATA_VERSION_CODE, "library and header versions differ");
  train(0);
  train(1);
  if (failures) fprintf(stderr, "%d checks failed\n", failures);
  return failures ? 1 : 0;
}
