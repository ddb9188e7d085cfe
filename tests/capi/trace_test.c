/* The trace calls: spans from several threads at once while the engine
 * trains, every refusal (bad names, tokens that are not open, spans that do
 * not nest) naming what is wrong and changing nothing, write_trace without
 * a trace path, and spans on a broken engine. The written file holds every
 * span once. Compiled as C; linked with capi.cpp's objects for the hook. */
#define _XOPEN_SOURCE 700
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/capi/capi_testing.h"
#include "strata/strata.h"

#include "tests/capi/expect.h"

enum { kThreads = 4, kRounds = 2000, kSteps = 3, kN = 4096 };

static strata_engine_t* engine;
/* The workers are alive together (a thread that ended could pass its id, and
 * so its trace track, to one started after it). */
static pthread_barrier_t all_alive;

/* Each worker nests "inner" in "work" kRounds times; any refusal is a failure. */
static void* worker(void* arg) {
  (void)arg;
  pthread_barrier_wait(&all_alive);
  for (int i = 0; i < kRounds; ++i) {
    uint64_t a = 0, b = 0;
    if (strata_engine_span_begin(engine, "work", &a) != STRATA_OK ||
        strata_engine_span_begin(engine, "inner", &b) != STRATA_OK ||
        strata_engine_span_end(engine, b) != STRATA_OK || strata_engine_span_end(engine, a) != STRATA_OK) {
      fprintf(stderr, "worker: %s\n", strata_last_error());
      pthread_barrier_wait(&all_alive);
      return (void*)1;
    }
  }
  pthread_barrier_wait(&all_alive);
  return NULL;
}

/* Ends a span begun on another thread. */
static void* end_it(void* token) {
  return strata_engine_span_end(engine, *(uint64_t*)token) == STRATA_OK ? NULL : (void*)1;
}

static size_t count(const char* text, const char* needle) {
  size_t n = 0;
  for (const char* p = text; (p = strstr(p, needle)) != NULL; p += strlen(needle)) ++n;
  return n;
}

static char* slurp(const char* path) {
  FILE* f = fopen(path, "rb");
  if (!f) return NULL;
  static char buf[16 << 20];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = 0;
  fclose(f);
  return buf;
}

static void refusals(void) {
  uint64_t t = 99, a = 0, b = 0;
  char long_name[300];
  memset(long_name, 'x', sizeof long_name - 1);
  long_name[sizeof long_name - 1] = 0;
  EXPECT(STRATA_INVALID, "strata_engine_span_begin: engine is NULL", strata_engine_span_begin(NULL, "x", &t));
  EXPECT(STRATA_INVALID, "token_out must not be NULL", strata_engine_span_begin(engine, "x", NULL));
  EXPECT(STRATA_INVALID, "span name is NULL", strata_engine_span_begin(engine, NULL, &t));
  EXPECT(STRATA_INVALID, "span name '' has 0 bytes", strata_engine_span_begin(engine, "", &t));
  EXPECT(STRATA_INVALID, "has 299 bytes; it must have 1..256",
         strata_engine_span_begin(engine, long_name, &t));
  EXPECT(STRATA_INVALID, "is not UTF-8", strata_engine_span_begin(engine, "bad \xff", &t));
  EXPECT(STRATA_INVALID, "is not UTF-8", strata_engine_span_begin(engine, "overlong \xc0\x80", &t));
  EXPECT(STRATA_INVALID, "is not UTF-8", strata_engine_span_begin(engine, "surrogate \xed\xa0\x80", &t));
  EXPECT(STRATA_INVALID, "is not UTF-8", strata_engine_span_begin(engine, "cut \xe2\x9c", &t));
  CHECK(t == 99);
  EXPECT(STRATA_INVALID, "strata_engine_span_end: span token 0 is not open",
         strata_engine_span_end(engine, 0));
  EXPECT(STRATA_INVALID, "strata_engine_span_end: engine is NULL", strata_engine_span_end(NULL, 1));
  OK(strata_engine_span_begin(engine, "outer \xe2\x9c\x93", &a)); /* "outer ✓" */
  OK(strata_engine_span_begin(engine, "inner", &b));
  CHECK(a != 0 && b != 0 && a != b);
  EXPECT(STRATA_INVALID, "cannot end before 'inner'", strata_engine_span_end(engine, a));
  OK(strata_engine_span_end(engine, b)); /* the refusal changed nothing */
  EXPECT(STRATA_INVALID, "is not open (never begun, or already ended)", strata_engine_span_end(engine, b));
  OK(strata_engine_span_end(engine, a));
  EXPECT(STRATA_INVALID, "is not open", strata_engine_span_end(engine, a));
}

static void train(void) {
  static float init[kN], grads[kN];
  for (int i = 0; i < kN; ++i) init[i] = 0.001f * (float)i, grads[i] = 0.5f;
  OK(strata_engine_add_param(engine, 0, "a", kN, init, NULL));
  OK(strata_engine_add_param(engine, 1, "b", kN, init, NULL));
  OK(strata_engine_build(engine));
  for (int s = 0; s < kSteps; ++s) {
    for (int g = 0; g < 2; ++g) {
      void* p = NULL;
      OK(strata_engine_fetch(engine, g, NULL, &p));
      OK(strata_engine_release(engine, g, NULL));
      OK(strata_engine_grads(engine, g, grads, STRATA_DTYPE_F32, NULL));
    }
    OK(strata_engine_step(engine, NULL, NULL));
    if (s == 1) OK(strata_engine_write_trace(engine)); /* mid-run, workers busy */
  }
}

int main(void) {
  char dir[] = "/tmp/strata-trace-test-XXXXXX";
  if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
  char path[256], json[512];
  snprintf(path, sizeof path, "%s/trace.json", dir);
  snprintf(json, sizeof json,
           "{\"optimizer\": {\"type\": \"AdamW\"}, \"zero_optimization\": {\"stage\": 3, \"offload_param\": "
           "{\"device\": \"nvme\", \"nvme_path\": \"%s\"}}, \"strata\": {\"trace_path\": \"%s\"}}",
           dir, path);
  strata_engine_options_t o = STRATA_ENGINE_OPTIONS_INIT;
  o.force_no_gpu = 1;
  OK(strata_engine_create(json, &o, &engine));
  refusals();
  /* A span handed between threads: begun here, ended there, and back. */
  uint64_t here = 0, there = 0;
  OK(strata_engine_span_begin(engine, "handoff", &here));
  pthread_t th;
  void* res = NULL;
  pthread_create(&th, NULL, end_it, &here);
  pthread_join(th, &res);
  CHECK(res == NULL);
  pthread_t workers[kThreads];
  pthread_barrier_init(&all_alive, NULL, kThreads);
  for (int i = 0; i < kThreads; ++i) pthread_create(&workers[i], NULL, worker, NULL);
  train();
  for (int i = 0; i < kThreads; ++i) {
    pthread_join(workers[i], &res);
    CHECK(res == NULL);
  }
  pthread_barrier_destroy(&all_alive);
  OK(strata_engine_span_begin(engine, "open at close", &there));
  /* A broken engine still takes spans and writes its trace. */
  strata_internal_break_engine(engine, "broken by trace_test");
  EXPECT(STRATA_STATE, "broken by trace_test", strata_engine_step(engine, NULL, NULL));
  uint64_t late = 0;
  OK(strata_engine_span_begin(engine, "after the break", &late));
  OK(strata_engine_span_end(engine, late));
  OK(strata_engine_write_trace(engine));
  OK(strata_engine_destroy(engine));

  const char* text = slurp(path);
  CHECK(text != NULL);
  if (text) {
    CHECK(strncmp(text, "{\"displayTimeUnit\"", 18) == 0);
    CHECK(strlen(text) > 4 && strcmp(text + strlen(text) - 4, "\n]}\n") == 0);
    CHECK(count(text, "\"name\":\"work\"") == kThreads * kRounds);
    CHECK(count(text, "\"name\":\"inner\"") == kThreads * kRounds + 1);
    CHECK(count(text, "\"name\":\"outer \xe2\x9c\x93\"") == 1);
    CHECK(count(text, "\"name\":\"handoff\"") == 1);
    CHECK(count(text, "\"name\":\"fetch\"") == 2 * kSteps);
    CHECK(count(text, "\"name\":\"grads\"") == 2 * kSteps);
    CHECK(count(text, "\"name\":\"step\"") == kSteps);
    /* P on NVMe: the first step loads each group on demand (P in host
     * memory would be handed out as it is, with nothing to load). */
    CHECK(count(text, "\"name\":\"stall\"") >= 2);
    CHECK(count(text, "\"name\":\"after the break\"") == 1);
    CHECK(count(text, "\"unfinished\":true") == 1);
    CHECK(count(text, "trainer thread ") == 1 + kThreads); /* main and the workers; end_it began none */
  }
  /* No trace path: write_trace says so. */
  OK(strata_engine_create("{}", &o, &engine));
  EXPECT(STRATA_CONFIG, "strata.trace_path is not set", strata_engine_write_trace(engine));
  OK(strata_engine_destroy(engine));
  unlink(path);
  rmdir(dir);
  if (failures) {
    fprintf(stderr, "%d failure(s)\n", failures);
    return 1;
  }
  printf("trace_test: %d threads x %d spans beside %d steps; every refusal named\n", kThreads, kRounds,
         kSteps);
  return 0;
}
