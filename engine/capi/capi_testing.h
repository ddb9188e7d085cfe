/* Test-only entry points of engine/capi.cpp. Hidden: they never leave
 * libstrata.so; tests reach them by linking capi.cpp's objects directly. */
#ifndef STRATA_ENGINE_CAPI_TESTING_H_
#define STRATA_ENGINE_CAPI_TESTING_H_

#include "strata/strata.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Marks `engine` broken as an internal error would, with `why` as the reason:
 * every later call on it returns STRATA_STATE. */
void strata_internal_break_engine(strata_engine_t* engine, const char* why);

#ifdef __cplusplus
}
#endif

#endif /* STRATA_ENGINE_CAPI_TESTING_H_ */
