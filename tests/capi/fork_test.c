/* An engine in a child of fork (a data loader's worker, a subprocess before
 * its exec): every call on it is STATE naming both processes, destroy does
 * nothing (the swap files and the trace are the parent's), and the parent
 * trains on. */
#define _GNU_SOURCE
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "strata/strata.h"
#include "tests/capi/expect.h"

static int swap_files(const char* dir) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "find '%s' -name 'strata-swap*' | wc -l", dir);
  FILE* f = popen(cmd, "r");
  int n = -1;
  if (f == NULL || fscanf(f, "%d", &n) != 1) n = -1;
  if (f) pclose(f);
  return n;
}

/* Descriptors of process `pid` whose target names `what`. */
static int held_by(pid_t pid, const char* what) {
  char path[64], link[512], target[512];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR* d = opendir(path);
  if (d == NULL) return -1;
  int n = 0;
  for (struct dirent* de; (de = readdir(d)) != NULL;) {
    if (de->d_name[0] == '.') continue;
    snprintf(link, sizeof link, "%s/%s", path, de->d_name);
    const ssize_t len = readlink(link, target, sizeof target - 1);
    if (len <= 0) continue;
    target[len] = 0;
    if (strstr(target, what) != NULL) ++n;
  }
  closedir(d);
  return n;
}

int main(void) {
  char dir[] = "/tmp/strata-fork-test-XXXXXX";
  if (mkdtemp(dir) == NULL) return perror("mkdtemp"), 1;
  char json[512];
  snprintf(json, sizeof json,
           "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}},"
           " \"strata\": {\"host_budget\": \"1GiB\", \"device_budget\": \"64MiB\"}}",
           dir);
  strata_engine_options_t o = STRATA_ENGINE_OPTIONS_INIT;
  o.force_no_gpu = 1;
  o.world_size = 1;
  strata_engine_t* e = NULL;
  OK(strata_engine_create(json, &o, &e));
  enum { N = 1 << 22 };
  float* w = malloc(N * sizeof(float));
  float* g = malloc(N * sizeof(float));
  float* back = malloc(N * sizeof(float));
  if (!w || !g || !back) return perror("malloc"), 1;
  for (int i = 0; i < N; ++i) w[i] = 0.5f, g[i] = 0.25f;
  OK(strata_engine_add_param(e, 0, "w", N, w, NULL));
  OK(strata_engine_build(e));
  OK(strata_engine_grads(e, 0, g, STRATA_DTYPE_F32, NULL));
  OK(strata_engine_step(e, NULL, NULL));
  const int files = swap_files(dir);
  CHECK(files > 0);

  const pid_t pid = fork();
  if (pid < 0) return perror("fork"), 1;
  if (pid == 0) {
    strata_stats_t s = STRATA_STATS_INIT;
    uint64_t token = 0;
    EXPECT(STRATA_STATE, "(a child of fork): an engine works only in the process that created it",
           strata_engine_stats(e, &s));
    EXPECT(STRATA_STATE, "and this is process", strata_engine_grads(e, 0, g, STRATA_DTYPE_F32, NULL));
    EXPECT(STRATA_STATE, "a child of fork", strata_engine_step(e, NULL, NULL));
    EXPECT(STRATA_STATE, "a child of fork", strata_engine_read_master(e, 0, back));
    EXPECT(STRATA_STATE, "a child of fork", strata_engine_span_begin(e, "x", &token));
    OK(strata_engine_destroy(e));
    CHECK(swap_files(dir) == files); /* the parent's, kept */
    /* The child may make an engine of its own. */
    strata_engine_t* mine = NULL;
    OK(strata_engine_create("{}", &o, &mine));
    OK(strata_engine_add_param(mine, 0, "w", 16, NULL, NULL));
    OK(strata_engine_build(mine));
    OK(strata_engine_destroy(mine));
    _exit(failures == 0 ? 0 : 1);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return perror("waitpid"), 1;
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);

  /* A child that lives on (a data loader's worker) holds none of the
   * engine's swap files or rings: its copies would keep a file's lock and,
   * once the parent deletes it, its space, for as long as the child lives. */
  int ready[2];
  if (pipe(ready) != 0) return perror("pipe"), 1;
  const pid_t idle = fork();
  if (idle < 0) return perror("fork"), 1;
  if (idle == 0) {
    alarm(60); /* (gone even if the parent fails before its kill) */
    if (write(ready[1], "x", 1) != 1) _exit(1); /* (fork has returned here: the fork handlers ran) */
    pause();
    _exit(0);
  }
  char x = 0;
  CHECK(read(ready[0], &x, 1) == 1);
  close(ready[0]);
  close(ready[1]);
  CHECK(held_by(idle, "strata-swap") == 0);
  CHECK(held_by(idle, "io_uring") == 0);
  CHECK(held_by(getpid(), "strata-swap") > 0); /* (the parent's, as a check of the check) */
  kill(idle, SIGKILL);
  waitpid(idle, NULL, 0);
  CHECK(swap_files(dir) == files);
  OK(strata_engine_grads(e, 0, g, STRATA_DTYPE_F32, NULL));
  OK(strata_engine_step(e, NULL, NULL));
  int64_t steps = 0;
  OK(strata_engine_get_steps(e, &steps));
  CHECK(steps == 2);
  OK(strata_engine_read_master(e, 0, back));
  CHECK(back[0] < 0.5f);
  OK(strata_engine_destroy(e));
  CHECK(swap_files(dir) == 0);
  rmdir(dir);
  free(w), free(g), free(back);
  if (failures) fprintf(stderr, "%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
