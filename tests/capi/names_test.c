/* What the C API refuses when it is given, not at the first checkpoint save:
 * tensor names and aliases (empty, not UTF-8, a name already an alias, too
 * many aliases), a group past 2^40 elements, a trainer blob past 4 GiB, and
 * step counts set before build, mid-step or at INT64_MAX. A name in UTF-8
 * beyond ASCII, and a tensor with the most aliases, save and load. Compiled
 * as C against the public header. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "strata/strata.h"

#include "tests/capi/expect.h"

static const char* kConfig = "{\"optimizer\": {\"type\": \"AdamW\"}}";

/* Names: refused at add_param / add_alias, each naming what is wrong. */
static void name_refusals(void) {
  strata_engine_t* e = NULL;
  OK(strata_engine_create(kConfig, NULL, &e));
  uint64_t off = 77;
  EXPECT(STRATA_INVALID, "add_param: an empty name", strata_engine_add_param(e, 0, "", 4, NULL, &off));
  /* A lone continuation byte, a byte that starts nothing, an overlong '/',
   * a surrogate (U+D800), and a sequence cut short. */
  /* The message shows the bad bytes escaped: it is UTF-8 itself. */
  EXPECT(STRATA_INVALID, "add_param 'w\\x80': the name is not UTF-8", strata_engine_add_param(e, 0, "w\x80", 4, NULL, &off));
  EXPECT(STRATA_INVALID, "the name is not UTF-8", strata_engine_add_param(e, 0, "w\xff", 4, NULL, &off));
  EXPECT(STRATA_INVALID, "the name is not UTF-8", strata_engine_add_param(e, 0, "\xc0\xaf", 4, NULL, &off));
  EXPECT(STRATA_INVALID, "the name is not UTF-8", strata_engine_add_param(e, 0, "\xed\xa0\x80", 4, NULL, &off));
  EXPECT(STRATA_INVALID, "the name is not UTF-8", strata_engine_add_param(e, 0, "w\xe6\x97", 4, NULL, &off));
  CHECK(off == 77);
  OK(strata_engine_add_param(e, 0, "a", 4, NULL, &off));
  EXPECT(STRATA_INVALID, "add_alias: an empty name", strata_engine_add_alias(e, 0, "", "a"));
  EXPECT(STRATA_INVALID, "the name is not UTF-8", strata_engine_add_alias(e, 0, "b\xff", "a"));
  OK(strata_engine_add_alias(e, 0, "b", "a"));
  /* A tensor's name may not be an alias already (the manifest holds both). */
  EXPECT(STRATA_INVALID, "add_param 'b': name already used in group 0, as an alias of 'a'",
         strata_engine_add_param(e, 0, "b", 4, NULL, &off));
  /* A group holds at most 2^40 elements (registered without values: no memory). */
  OK(strata_engine_add_param(e, 1, "big", UINT64_C(1) << 40, NULL, &off));
  EXPECT(STRATA_INVALID, "add_param 'one': group 1 would have 1099511627777 elements; a group holds at most",
         strata_engine_add_param(e, 1, "one", 1, NULL, &off));
  OK(strata_engine_destroy(e));
}

/* A name that is UTF-8 beyond ASCII and a tensor with 64 aliases save and
 * load; a 65th alias and a blob past 4 GiB are refused. */
static void checkpoint_names(void) {
  char dir[] = "/var/tmp/strata-capi-names-XXXXXX";
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    exit(1);
  }
  strata_engine_t* e = NULL;
  OK(strata_engine_create(kConfig, NULL, &e));
  float init[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  const char* wide = "w\xc3\xb6rter_\xc3\x9f_\xe6\x97\xa5\xf0\x9f\x98\x80"; /* wörter_ß_日😀 */
  OK(strata_engine_add_param(e, 0, wide, 8, init, NULL));
  OK(strata_engine_add_param(e, 0, "tied", 8, init, NULL));
  char alias[32];
  for (int i = 0; i < 64; ++i) {
    snprintf(alias, sizeof alias, "tied_%d", i);
    OK(strata_engine_add_alias(e, 0, alias, "tied"));
  }
  EXPECT(STRATA_INVALID, "add_alias 'one_more' of 'tied': 'tied' has 64 aliases already",
         strata_engine_add_alias(e, 0, "one_more", "tied"));
  /* Steps counted before build would be lost to the groups (build starts them at 0). */
  EXPECT(STRATA_STATE, "set_steps: the engine is not built", strata_engine_set_steps(e, 5));
  OK(strata_engine_build(e));

  /* A blob of 4 GiB + 1: refused before a byte of it is read (the mapping
   * cannot be read at all) and before anything is written. */
  const uint64_t too_big = (UINT64_C(1) << 32) + 1;
  void* unreadable = mmap(NULL, too_big, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (unreadable == MAP_FAILED) {
    perror("mmap");
    exit(1);
  }
  EXPECT(STRATA_INVALID, "a checkpoint holds at most 4294967296", strata_checkpoint_save(e, dir, "t1", unreadable, too_big));
  munmap(unreadable, too_big);
  char path[256];
  struct stat st;
  snprintf(path, sizeof path, "%s/t1", dir);
  CHECK(stat(path, &st) != 0);

  /* Step counts: not mid-step, not INT64_MAX. */
  float grads[16];
  for (int i = 0; i < 16; ++i) grads[i] = 0.25f * (float)(i % 5 - 2);
  EXPECT(STRATA_INVALID, "set_steps: 9223372036854775807 leaves no count for the next step",
         strata_engine_set_steps(e, INT64_MAX));
  OK(strata_engine_grads(e, 0, grads, STRATA_DTYPE_F32, NULL));
  EXPECT(STRATA_STATE, "set_steps: gradients of this step are pending", strata_engine_set_steps(e, 100));
  strata_step_result_t res = STRATA_STEP_RESULT_INIT;
  OK(strata_engine_step(e, NULL, &res));
  int64_t steps = -1;
  OK(strata_engine_get_steps(e, &steps));
  CHECK(steps == 1);
  OK(strata_engine_set_steps(e, 5));
  OK(strata_engine_group_steps(e, 0, &steps));
  CHECK(steps == 5);

  float before[16], after[16];
  OK(strata_engine_read_master(e, 0, before));
  OK(strata_checkpoint_save(e, dir, "t1", "blob", 4));
  OK(strata_engine_grads(e, 0, grads, STRATA_DTYPE_F32, NULL));
  OK(strata_engine_step(e, NULL, &res));
  char blob[8] = {0};
  uint64_t blob_bytes = sizeof blob;
  OK(strata_checkpoint_load(e, dir, "t1", blob, &blob_bytes));
  CHECK(blob_bytes == 4 && memcmp(blob, "blob", 4) == 0);
  OK(strata_engine_read_master(e, 0, after));
  CHECK(memcmp(before, after, sizeof before) == 0);
  OK(strata_engine_get_steps(e, &steps));
  CHECK(steps == 5);
  OK(strata_engine_destroy(e));
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

/* Initial values that cannot be kept are NOMEM and register nothing: the
 * name may be added again. Before, the name stayed taken by a tensor whose
 * values were lost ("name already used"). In a child, under an address-space
 * limit of its own: 2^30 values (4 GiB) cannot be had, whatever the
 * machine's overcommit setting. */
static void add_param_out_of_memory(void) {
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    strata_engine_t* e = NULL;
    OK(strata_engine_create(kConfig, NULL, &e));
    float small[16] = {0};
    uint64_t off = 77;
    OK(strata_engine_add_param(e, 0, "first", 16, small, &off));
    unsigned long vm_pages = 0;
    FILE* f = fopen("/proc/self/statm", "r");
    CHECK(f != NULL && fscanf(f, "%lu", &vm_pages) == 1);
    if (f) fclose(f);
    struct rlimit old, lim;
    CHECK(getrlimit(RLIMIT_AS, &old) == 0);
    lim = old;
    lim.rlim_cur = (rlim_t)vm_pages * (rlim_t)sysconf(_SC_PAGESIZE) + ((rlim_t)512 << 20);
    CHECK(setrlimit(RLIMIT_AS, &lim) == 0);
    /* (the values are never read: keeping them fails first) */
    CHECK(off == 0);
    off = 77;
    EXPECT(STRATA_NOMEM, "add_param 'w': its initial values",
           strata_engine_add_param(e, 0, "w", UINT64_C(1) << 30, small, &off));
    CHECK(setrlimit(RLIMIT_AS, &old) == 0);
    CHECK(off == 77);
    off = 77;
    EXPECT(STRATA_OK, "", strata_engine_add_param(e, 0, "w", 16, small, &off));
    CHECK(off == 16);
    if (failures) _exit(1);  /* (what follows would build a 4 GiB group) */
    /* A group that the failed call created is gone again: the build does not
     * find an empty group 1. */
    CHECK(setrlimit(RLIMIT_AS, &lim) == 0);
    EXPECT(STRATA_NOMEM, "nothing was registered", strata_engine_add_param(e, 1, "v", UINT64_C(1) << 30, small, &off));
    CHECK(setrlimit(RLIMIT_AS, &old) == 0);
    if (failures) _exit(1);
    EXPECT(STRATA_OK, "", strata_engine_build(e));
    OK(strata_engine_destroy(e));
    fflush(stderr);
    _exit(failures ? 1 : 0);
  }
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "add_param_out_of_memory: the child ended with status 0x%x\n", status);
    ++failures;
  }
}

int main(void) {
  name_refusals();
  checkpoint_names();
  add_param_out_of_memory();
  if (failures) {
    fprintf(stderr, "%d failure(s)\n", failures);
    return 1;
  }
  printf("names_test: names, aliases, blob and step counts refused when given; a UTF-8 name and 64 aliases saved and loaded\n");
  return 0;
}
