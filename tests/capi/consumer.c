/* A program built against the installed package (pkg-config strata, or
 * find_package(strata)): the header compiles as C99, the library links and
 * the optimizer-alone call runs. */
#include <stdio.h>
#include <strata/strata.h>

int main(void) {
  float w[3] = {1, 2, 3}, m[3] = {0}, v[3] = {0}, g[3] = {1, -1, 1};
  strata_adam_options_t opt = STRATA_ADAM_OPTIONS_INIT;
  strata_status_t st = strata_adam_step(&opt, 3, w, m, v, g, NULL);
  if (st != STRATA_OK) return fprintf(stderr, "%s: %s\n", strata_status_name(st), strata_last_error()), 1;
  strata_engine_t* e = NULL;
  st = strata_engine_create("{\"zero_optimization\": {\"stage\": 9}}", NULL, &e);
  if (st != STRATA_CONFIG) return fprintf(stderr, "bad config gave %s\n", strata_status_name(st)), 1;
  printf("strata %d: w = %.4f %.4f %.4f; bad config: %s\n", strata_version(), w[0], w[1], w[2],
         strata_last_error());
  return strata_version() == STRATA_VERSION_CODE && w[0] < 1 && w[1] > 2 ? 0 : 1;
}
