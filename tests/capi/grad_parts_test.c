/* strata_engine_grads_part, _grads_end, _takes_grad_parts and _grads_view
 * through the header, compiled as C: a gradient given in parts (one given
 * twice, a gap) trains bitwise as one strata_engine_grads call of what the
 * parts make; the view reads that gradient; each misuse is refused naming
 * it. strata_engine_grads_part_lend: parts over whole tiles lent, and the
 * caller's buffer overwritten once step returns (or a step refused before
 * it starts: the loan ends there too): bitwise the copied parts' step;
 * strata_engine_grads_lent says which parts the engine still reads. */
#include <stdint.h>
#include <string.h>

#include "strata/strata.h"

#include "tests/capi/expect.h"

#define N 1000

static const char* kConfig =
    "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.01}}, \"gradient_clipping\": 0.1,"
    " \"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"cpu\"},"
    " \"offload_param\": {\"device\": \"cpu\"}}}";

#define NL 150000 /* over two of the 65536-element tiles that a lent part keeps */

static strata_engine_t* make_n(const float* w, uint64_t n) {
  strata_engine_options_t eo = STRATA_ENGINE_OPTIONS_INIT;
  eo.force_no_gpu = 1;
  strata_engine_t* e = NULL;
  uint64_t off = 0;
  OK(strata_engine_create(kConfig, &eo, &e));
  OK(strata_engine_add_param(e, 0, "w", n, w, &off));
  OK(strata_engine_build(e));
  return e;
}

static strata_engine_t* make(const float* w) { return make_n(w, N); }

/* Both engines' masters (n elements) bitwise alike and moved off `w`; both destroyed. */
static void expect_same_trained(strata_engine_t* x, strata_engine_t* y, const float* w, float* a, float* b,
                                size_t n) {
  OK(strata_engine_read_master(x, 0, a));
  OK(strata_engine_read_master(y, 0, b));
  CHECK(memcmp(a, b, n * sizeof(float)) == 0);
  CHECK(memcmp(a, w, n * sizeof(float)) != 0); /* it trained */
  OK(strata_engine_destroy(x));
  OK(strata_engine_destroy(y));
}

/* Two steps: lent parts ([0, 70000) and the rest) against the same parts
 * copied; the lent buffer scribbled over after each step returns. */
static void lend(void) {
  static float w[NL], g[NL], lent[NL], a[NL], b[NL];
  for (int i = 0; i < NL; ++i) {
    w[i] = 0.001f * (float)(i % 89) - 0.04f;
    g[i] = 0.01f * (float)((i * 5) % 11) - 0.05f;
  }
  strata_engine_t* le = make_n(w, NL);
  strata_engine_t* co = make_n(w, NL);
  EXPECT(STRATA_INVALID, "engine is NULL", strata_engine_grads_part_lend(NULL, 0, 0, 1, g, STRATA_DTYPE_F32));
  EXPECT(STRATA_INVALID, "group 2", strata_engine_grads_part_lend(le, 2, 0, 1, g, STRATA_DTYPE_F32));
  int flag = -1;
  EXPECT(STRATA_INVALID, "group 2", strata_engine_grads_lent(le, 2, &flag));
  EXPECT(STRATA_INVALID, "out must not be NULL", strata_engine_grads_lent(le, 0, NULL));
  strata_step_options_t opt = STRATA_STEP_OPTIONS_INIT;
  strata_step_result_t rl = STRATA_STEP_RESULT_INIT, rc = STRATA_STEP_RESULT_INIT;
  for (int step = 0; step < 3; ++step) {
    memcpy(lent, g, sizeof lent);
    OK(strata_engine_grads_part_lend(le, 0, 0, 70000, lent, STRATA_DTYPE_F32));
    OK(strata_engine_grads_part_lend(le, 0, 70000, NL - 70000, lent + 70000, STRATA_DTYPE_F32));
    OK(strata_engine_grads_end(le, 0));
    OK(strata_engine_grads_part(co, 0, 0, 70000, g, STRATA_DTYPE_F32));
    OK(strata_engine_grads_part(co, 0, 70000, NL - 70000, g + 70000, STRATA_DTYPE_F32));
    OK(strata_engine_grads_end(co, 0));
    int in_use = -1;
    OK(strata_engine_grads_lent(le, 0, &in_use));
    CHECK(in_use == 1); /* the step will read the whole tiles where they are */
    OK(strata_engine_grads_lent(co, 0, &in_use));
    CHECK(in_use == 0); /* copied */
    if (step == 1) {
      /* A step refused before it starts returns too: the loan ends there
       * (the parts copied in), so the buffer may be scribbled over at once. */
      strata_step_result_t bad = STRATA_STEP_RESULT_INIT;
      bad.struct_size = 1;
      EXPECT(STRATA_INVALID, "result.struct_size is 1", strata_engine_step(le, &opt, &bad));
      OK(strata_engine_grads_lent(le, 0, &in_use));
      CHECK(in_use == 0);
      memset(lent, 0xff, sizeof lent);
    }
    if (step == 2) {
      /* So does a load refused before it starts. */
      uint64_t bytes = 0;
      EXPECT(STRATA_INVALID, "dir and blob_bytes must not be NULL", strata_checkpoint_load(le, NULL, NULL, NULL, &bytes));
      OK(strata_engine_grads_lent(le, 0, &in_use));
      CHECK(in_use == 0);
      memset(lent, 0xff, sizeof lent);
    }
    OK(strata_engine_step(le, &opt, &rl));
    OK(strata_engine_grads_lent(le, 0, &in_use));
    CHECK(in_use == 0);
    OK(strata_engine_step(co, &opt, &rc));
    memset(lent, 0xff, sizeof lent); /* NaNs: the caller's again */
    CHECK(rl.grad_norm == rc.grad_norm);
  }
  expect_same_trained(le, co, w, a, b, NL);
}

int main(void) {
  static float w[N], g[N], whole[N], a[N], b[N];
  for (int i = 0; i < N; ++i) {
    w[i] = 0.001f * (float)(i % 97) - 0.05f;
    g[i] = 0.01f * (float)((i * 7) % 13) - 0.06f;
  }
  strata_engine_t* parts = make(w);
  strata_engine_t* plain = make(w);
  int takes = -1;
  OK(strata_engine_takes_grad_parts(parts, 0, STRATA_DTYPE_F32, &takes));
  CHECK(takes == 1);
  OK(strata_engine_takes_grad_parts(parts, 0, STRATA_DTYPE_BF16, &takes));
  CHECK(takes == 0 && strstr(strata_last_error(), "accumulator of f32") != NULL);
  EXPECT(STRATA_INVALID, "out must not be NULL", strata_engine_takes_grad_parts(parts, 0, STRATA_DTYPE_F32, NULL));
  EXPECT(STRATA_INVALID, "engine is NULL", strata_engine_grads_part(NULL, 0, 0, 1, g, STRATA_DTYPE_F32));
  EXPECT(STRATA_INVALID, "group 3", strata_engine_grads_part(parts, 3, 0, 1, g, STRATA_DTYPE_F32));
  EXPECT(STRATA_STATE, "no grads call in parts open", strata_engine_grads_end(parts, 0));
  const void* view = NULL;
  EXPECT(STRATA_STATE, "no gradients this step", strata_engine_grads_view(parts, 0, &view));

  /* Parts [0, 400) twice, [410, 1000); [400, 410) is a gap: zeros. */
  OK(strata_engine_grads_part(parts, 0, 410, N - 410, g + 410, STRATA_DTYPE_F32));
  OK(strata_engine_grads_part(parts, 0, 0, 400, g, STRATA_DTYPE_F32));
  OK(strata_engine_grads_part(parts, 0, 0, 400, g, STRATA_DTYPE_F32));
  EXPECT(STRATA_INVALID, "overlap the part [410, 1000)", strata_engine_grads_part(parts, 0, 405, 10, g, STRATA_DTYPE_F32));
  EXPECT(STRATA_INVALID, "outside group 0", strata_engine_grads_part(parts, 0, 990, 11, g, STRATA_DTYPE_F32));
  strata_step_options_t opt = STRATA_STEP_OPTIONS_INIT;
  strata_step_result_t res = STRATA_STEP_RESULT_INIT, res_plain = STRATA_STEP_RESULT_INIT;
  EXPECT(STRATA_INVALID, "group 0 has a grads call in parts open", strata_engine_step(parts, &opt, &res));
  EXPECT(STRATA_INVALID, "in parts open", strata_engine_grads(parts, 0, g, STRATA_DTYPE_F32, NULL));
  OK(strata_engine_grads_end(parts, 0));
  for (int i = 0; i < N; ++i) whole[i] = i < 400 ? g[i] + g[i] : i < 410 ? 0.0f : g[i];
  OK(strata_engine_grads_view(parts, 0, &view));
  CHECK(view != NULL && memcmp(view, whole, sizeof whole) == 0);
  OK(strata_engine_grads(plain, 0, whole, STRATA_DTYPE_F32, NULL));
  OK(strata_engine_step(parts, &opt, &res));
  OK(strata_engine_step(plain, &opt, &res_plain));
  CHECK(res.grad_norm == res_plain.grad_norm && res.grad_norm > 0.1); /* clipped */
  expect_same_trained(parts, plain, w, a, b, N);
  lend();
  return failures ? 1 : 0;
}
