/* linear_regression.c: the whole C protocol of Strata on a model small enough
 * to read. It fits y = x . w + b (8 weights, 1 bias) to a fixed batch with
 * AdamW whose master weights and moments live in swap files on disk, saves a
 * checkpoint, and loads it into a second engine.
 *
 * Build and run (see docs/c-guide.md):
 *   cc -std=c99 -Wall -o linear_regression linear_regression.c \
 *      $(pkg-config --cflags --libs strata)
 *   ./linear_regression [SWAP_DIR]        default SWAP_DIR: a new folder under /var/tmp
 *
 * The engine runs with force_no_gpu = 1, so fetched parameters and the
 * gradients we hand back are host memory (with a GPU they would be device
 * memory, to be read and written with CUDA kernels or cudaMemcpy). */
#define _DEFAULT_SOURCE /* mkdtemp */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <strata/strata.h>

/* Every call returns a status; the message of the last failure on this
 * thread is strata_last_error(). */
#define CHECK(call)                                                                     \
  do {                                                                                  \
    strata_status_t s_ = (call);                                                        \
    if (s_ != STRATA_OK) {                                                              \
      fprintf(stderr, "%s failed: %s: %s\n", #call, strata_status_name(s_),             \
              strata_last_error());                                                     \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

enum { N = 8, BATCH = 32, STEPS = 300 };
static float xs[BATCH][N], ys[BATCH];

static void make_data(void) {
  unsigned seed = 12345;
  for (int i = 0; i < BATCH; ++i) {
    ys[i] = 0.5f; /* b_true */
    for (int j = 0; j < N; ++j) {
      seed = seed * 1103515245u + 12345u;
      xs[i][j] = (float)((seed >> 16) % 2001) / 1000.0f - 1.0f; /* in [-1, 1] */
      ys[i] += xs[i][j] * (float)(j + 1) / N;                   /* w_true[j] = (j+1)/8 */
    }
  }
}

/* Registers the two groups (group 0: "w", group 1: "b") and builds. */
static strata_engine_t* make_engine(const char* json) {
  strata_engine_options_t opts = STRATA_ENGINE_OPTIONS_INIT; /* rank 0 of 1 */
  opts.force_no_gpu = 1;
  strata_engine_t* e = NULL;
  CHECK(strata_engine_create(json, &opts, &e));
  float w0[N] = {0};
  CHECK(strata_engine_add_param(e, 0, "w", N, w0, NULL));
  CHECK(strata_engine_add_param(e, 1, "b", 1, NULL, NULL)); /* NULL: zeros */
  CHECK(strata_engine_build(e));
  return e;
}

/* One training step: fetch, forward and backward (mean squared error),
 * release, grads, step. Returns the loss. */
static double train_step(strata_engine_t* e) {
  void* pw = NULL;
  void* pb = NULL;
  CHECK(strata_engine_fetch(e, 0, NULL, &pw)); /* compute dtype: f32 here */
  CHECK(strata_engine_fetch(e, 1, NULL, &pb));
  const float* w = pw;
  const float b = *(const float*)pb;
  float gw[N] = {0}, gb = 0;
  double loss = 0;
  for (int i = 0; i < BATCH; ++i) {
    float pred = b;
    for (int j = 0; j < N; ++j) pred += xs[i][j] * w[j];
    const float err = pred - ys[i];
    loss += (double)err * err / BATCH;
    for (int j = 0; j < N; ++j) gw[j] += 2.0f * err * xs[i][j] / BATCH;
    gb += 2.0f * err / BATCH;
  }
  CHECK(strata_engine_release(e, 0, NULL)); /* the pointers may not be used after this */
  CHECK(strata_engine_release(e, 1, NULL));
  CHECK(strata_engine_grads(e, 0, gw, STRATA_DTYPE_F32, NULL)); /* copied during the call */
  CHECK(strata_engine_grads(e, 1, &gb, STRATA_DTYPE_F32, NULL));
  strata_step_options_t so = STRATA_STEP_OPTIONS_INIT; /* every field: the config's value */
  strata_step_result_t r = STRATA_STEP_RESULT_INIT;
  CHECK(strata_engine_step(e, &so, &r));
  return loss;
}

int main(int argc, char** argv) {
  char tmpl[] = "/var/tmp/strata-example-XXXXXX";
  const char* swap = argc > 1 ? argv[1] : mkdtemp(tmpl); /* the engine does not create it */
  if (swap == NULL) {
    perror("mkdtemp");
    return 1;
  }
  printf("swap folder: %s\n", swap);
  char json[1024];
  snprintf(json, sizeof json,
           "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.05}},"
           " \"zero_optimization\": {\"stage\": 0,"
           "   \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}},"
           " \"strata\": {\"host_budget\": \"64MiB\", \"device_budget\": \"16MiB\"}}",
           swap);
  make_data();

  /* A bad key is refused at create, naming the key and the nearest valid one. */
  strata_engine_t* bad = NULL;
  if (strata_engine_create("{\"zero_optimization\": {\"stag\": 1}}", NULL, &bad) != STRATA_OK)
    printf("refused as expected: %s\n", strata_last_error());

  strata_engine_t* e = make_engine(json);

  for (int step = 0; step < STEPS; ++step) {
    const double loss = train_step(e);
    if (step % 100 == 0 || step == STEPS - 1) printf("step %3d  loss %.6f\n", step, loss);
  }
  strata_stats_t st = STRATA_STATS_INIT;
  CHECK(strata_engine_stats(e, &st));
  printf("steps %llu, nvme peak %llu bytes, nvme->host %llu bytes, host->nvme %llu bytes\n",
         (unsigned long long)st.steps, (unsigned long long)st.nvme.peak,
         (unsigned long long)st.nvme_to_host, (unsigned long long)st.host_to_nvme);

  /* Checkpoint: this engine's state plus our own blob (here: the step count). */
  char ckpt[1200];
  snprintf(ckpt, sizeof ckpt, "%s/ckpt", swap); /* save creates the folder */
  const long long blob = STEPS;
  CHECK(strata_checkpoint_save(e, ckpt, "final", &blob, sizeof blob));
  float w_saved[N];
  CHECK(strata_engine_read_master(e, 0, w_saved));
  CHECK(strata_engine_destroy(e)); /* removes this engine's swap files */

  /* Resume: a new engine with the same groups, then load (tag NULL: the newest). */
  strata_engine_t* e2 = make_engine(json);
  long long blob_back = 0;
  uint64_t blob_len = sizeof blob_back;
  CHECK(strata_checkpoint_load(e2, ckpt, NULL, &blob_back, &blob_len));
  float w_loaded[N];
  CHECK(strata_engine_read_master(e2, 0, w_loaded));
  int64_t steps = 0;
  CHECK(strata_engine_get_steps(e2, &steps));
  printf("resumed at step %lld (blob says %lld), weights %s:", (long long)steps, blob_back,
         memcmp(w_saved, w_loaded, sizeof w_saved) == 0 ? "identical" : "DIFFERENT");
  for (int j = 0; j < N; ++j) printf(" %.3f", w_loaded[j]);
  printf("\n");
  /* Fetch is reference-counted: two fetches of a group need two releases;
   * a release with nothing fetched is STATE. (Done on an engine that
   * will not step again: the first step records the order of fetches for
   * prefetching, and later fetches in another order restart the recording,
   * with a warning.) */
  void* p1 = NULL;
  void* p2 = NULL;
  CHECK(strata_engine_fetch(e2, 0, NULL, &p1));
  CHECK(strata_engine_fetch(e2, 0, NULL, &p2));
  printf("two fetches, same buffer: %s\n", p1 == p2 ? "yes" : "no");
  CHECK(strata_engine_release(e2, 0, NULL));
  CHECK(strata_engine_release(e2, 0, NULL));
  strata_status_t s = strata_engine_release(e2, 0, NULL);
  printf("a third release: %s: %s\n", strata_status_name(s), strata_last_error());

  CHECK(strata_engine_destroy(e2));
  return 0;
}
