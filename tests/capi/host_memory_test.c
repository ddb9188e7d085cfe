/* strata_host_memory: the memory the "auto" budgets start from and the ranks
 * the launcher puts on this host, before there is an engine. The cgroup
 * arithmetic is engine_host_memory_test's; a real cgroup's limit seen through
 * this call is tests/python/test_sizing.py's. */
#define _XOPEN_SOURCE 700
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "strata/strata.h"

#include "tests/capi/expect.h"

static const char* const kLauncher[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                        "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                        "SLURM_PROCID", "SLURM_NTASKS"};

int main(void) {
  for (size_t i = 0; i < sizeof kLauncher / sizeof kLauncher[0]; ++i) unsetenv(kLauncher[i]);
  const uint64_t ram = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGE_SIZE);
  uint64_t bytes = 0;
  int local = -1;
  OK(strata_host_memory(NULL, NULL));
  OK(strata_host_memory(&bytes, &local));
  /* At most physical RAM (less under a cgroup limit), and not nothing. */
  CHECK(bytes > 0 && bytes <= ram);
  CHECK(local == 1);
  uint64_t again = 0;
  OK(strata_host_memory(&again, NULL));
  CHECK(again == bytes);

  /* torchrun's variables: rank 1 of 4, two of them on this host. */
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("LOCAL_WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29500", 1);
  local = -1;
  OK(strata_host_memory(NULL, &local));
  CHECK(local == 2);

  /* A partial set is refused, naming what is missing; the memory alone is
   * still given (it reads no launcher variable). */
  unsetenv("WORLD_SIZE");
  local = -1;
  EXPECT(STRATA_INVALID, "WORLD_SIZE", strata_host_memory(&bytes, &local));
  CHECK(local == -1);
  bytes = 0;
  OK(strata_host_memory(&bytes, NULL));
  CHECK(bytes == again);

  if (failures) fprintf(stderr, "%d failure(s)\n", failures);
  else printf("host_memory_test: %llu bytes, ok\n", (unsigned long long)again);
  return failures ? 1 : 0;
}
