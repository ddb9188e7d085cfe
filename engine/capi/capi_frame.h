// The C API's frame (internal to engine/capi/): the handle, the guard
// around every call, sized structs, argument checks. capi.cpp and
// capi_state.cpp implement include/strata/strata.h over it.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "engine/capi/capi_testing.h"
#include "engine/config/config.h"
#include "engine/engine.h"
#include "engine/layout/partition.h"
#include "io/net/launch_env.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/parallel.h"
#include "strata/strata.h"
#include "tiers/gpu.h"

using strata::Code;
using strata::Status;

struct strata_engine {
  std::unique_ptr<strata::Engine> rep;
  pid_t pid = ::getpid();  // the process that created it: the only one it works in
  bool built = false;
  bool gpu = false;    // the device tier is a GPU: caller streams are honoured
  int device = -1;     // that GPU (the engine's placement)
  std::string broken;  // non-empty: why every further call returns STATE
};

namespace strata_capi {


static_assert(static_cast<int>(Code::kInternal) == STRATA_INTERNAL, "Code and strata_status_t differ");
static_assert(static_cast<int>(Code::kNotFound) == STRATA_NOT_FOUND, "Code and strata_status_t differ");
static_assert(static_cast<int>(strata::DType::kF16) == STRATA_DTYPE_F16, "DType and strata_dtype_t differ");
static_assert(strata::kMaxShapeDims == STRATA_MAX_NDIM, "the engine's and the header's most dims differ");

// The latest failure on this thread (strata_last_error).
extern thread_local std::string last_error;

inline strata_status_t Fail(const char* fn, const Status& s) {
  last_error = std::string(fn) + ": " + s.message();
  return static_cast<strata_status_t>(s.code());
}

// Runs `body` (returning Status) so that no exception escapes; an exception
// is a bug (or NOMEM for bad_alloc).
template <typename Body>
Status Guarded(Body&& body) {
  try {
    return body();
  } catch (const std::exception& ex) {
    return strata::StatusOfException(ex, "");
  } catch (...) {
    return strata::InternalError("uncaught exception of unknown type");
  }
}

// An engine used in a process other than its creator's (a fork's child): its
// threads, rings, sockets and arenas are not there, and its memory is a copy.
inline Status ForkedError(const strata_engine_t* e) {
  return strata::StateError("this engine was created by process " + std::to_string(e->pid) + ", and this is process " +
                            std::to_string(::getpid()) +
                            " (a child of fork): an engine works only in the process that created it (its threads "
                            "and I/O are not here); create one in this process");
}

// The frame of every call on an engine: null, process and broken checks,
// the guard, and marking the engine broken after an internal error.
template <typename Body>
strata_status_t OnEngine(const char* fn, strata_engine_t* e, Body&& body) {
  if (e == nullptr) return Fail(fn, strata::InvalidError("engine is NULL"));
  if (e->pid != ::getpid()) return Fail(fn, ForkedError(e));
  if (!e->broken.empty())
    return Fail(fn, strata::StateError("engine is unusable after an earlier error: " + e->broken));
  Status s = Guarded(std::forward<Body>(body));
  if (s.ok()) return STRATA_OK;
  if (s.code() == Code::kInternal) e->broken = std::string(fn) + ": " + s.message();
  return Fail(fn, s);
}

// Ends the loans of gradient parts (Engine::EndLoans) where step or load
// returns before reaching the engine: a refused argument, a broken engine.
inline void EndLoans(strata_engine_t* e) {
  if (e == nullptr || !e->rep) return;
  (void)Guarded([&] {
    e->rep->EndLoans();
    return Status::Ok();
  });
}

// Copies the caller's sized struct over `*out` (which holds the defaults):
// only the bytes the caller's struct_size covers, so older callers work.
template <typename T>
Status ReadSized(const T* in, const char* what, T* out) {
  if (in->struct_size < sizeof(size_t))
    return strata::InvalidError(std::string(what) + ".struct_size is " + std::to_string(in->struct_size) +
                                "; set it with the _INIT macro");
  std::memcpy(static_cast<void*>(out), in, std::min(in->struct_size, sizeof(T)));
  return Status::Ok();
}

// Writes `full` into the caller's struct, as far as its struct_size covers.
template <typename T>
Status WriteSized(const T& full, const char* what, T* out) {
  if (out->struct_size < sizeof(size_t))
    return strata::InvalidError(std::string(what) + ".struct_size is " + std::to_string(out->struct_size) +
                                "; set it with the _INIT macro");
  const size_t caller_size = out->struct_size;
  std::memcpy(static_cast<void*>(out), &full, std::min(caller_size, sizeof(T)));
  out->struct_size = caller_size;
  return Status::Ok();
}

inline Status CheckDType(strata_dtype_t t, const char* what) {
  if (t == STRATA_DTYPE_F32 || t == STRATA_DTYPE_BF16 || t == STRATA_DTYPE_F16) return Status::Ok();
  return strata::InvalidError(std::string(what) + ": unknown dtype " + std::to_string(static_cast<int>(t)));
}

inline Status CheckGroup(const strata_engine_t* e, int group) {
  if (!e->built) return strata::StateError("the engine is not built yet (call strata_engine_build)");
  const int n = e->rep->num_groups();
  if (group < 0 || group >= n)
    return strata::InvalidError("group " + std::to_string(group) + " out of range [0, " + std::to_string(n) +
                                ")");
  return Status::Ok();
}

// Waits for the work queued on the caller's stream. Release and Grads hand
// memory to the engine that the caller's kernels may still read or write;
// the engine's own copies run on its streams, which know nothing of the
// caller's, so the one safe order is to finish the caller's stream first.
inline Status WaitCallerStream(const strata_engine_t* e, void* stream) {
  if (!e->gpu) return Status::Ok();  // no GPU: the stream is ignored
  // The event is made on the current device and must be the stream's: the
  // caller's stream is on the engine's GPU (one process per GPU), and NULL
  // is that GPU's default stream.
  STRATA_RETURN_IF_ERROR(strata::gpu::SetDevice(e->device));
  STRATA_ASSIGN_OR_RETURN(strata::gpu::Event ev, strata::gpu::EventRecord(stream));
  return strata::gpu::EventSynchronize(ev);
}

// The engine reads "zero or negative" as "from the config"; the C API reads
// only negative so. A zero the caller asks for becomes the least positive
// double, which has the same effect in every formula (lr*wd, 1-beta, +eps
// all round to what zero gives).
// NaN and infinities pass unchanged: the engine refuses them, naming the option.
inline double StepValue(double v) {
  if (!std::isfinite(v)) return v;
  return v < 0 ? -1 : std::max(v, DBL_TRUE_MIN);
}

inline strata::Result<strata::StepOptions> ToStepOptions(const strata_step_options_t* options) {
  strata_step_options_t o = STRATA_STEP_OPTIONS_INIT;
  if (options) STRATA_RETURN_IF_ERROR(ReadSized(options, "options", &o));
  strata::StepOptions so;
  so.lr = StepValue(o.lr);
  so.beta1 = StepValue(o.beta1);
  so.beta2 = StepValue(o.beta2);
  so.eps = StepValue(o.eps);
  so.weight_decay = StepValue(o.weight_decay);
  // Zero is a value here (no clipping), negative the config's; NaN and
  // infinities pass to the engine, which refuses them.
  so.max_grad_norm = std::isfinite(o.max_grad_norm) && o.max_grad_norm < 0 ? -1 : o.max_grad_norm;
  return so;
}

// The trace calls may run on any thread, beside the one driving the engine:
// they touch only the engine's recorder (which has its own lock), never the
// handle's `built` or `broken` (which the driving thread writes), so they
// work on a broken engine too, where a trace helps most.
template <typename Body>
strata_status_t OnTrace(const char* fn, strata_engine_t* e, Body&& body) {
  if (e == nullptr) return Fail(fn, strata::InvalidError("engine is NULL"));
  if (e->pid != ::getpid()) return Fail(fn, ForkedError(e));
  Status s = Guarded(std::forward<Body>(body));
  return s.ok() ? STRATA_OK : Fail(fn, s);
}

}  // namespace strata_capi
