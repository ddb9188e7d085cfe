// The C API (include/strata/strata.h) over the C++ Engine: one thin layer in
// one file, as leveldb's db/c.cc. Each call checks its arguments, runs the
// engine inside a catch-all, and turns a Status into a status code plus a
// thread-local message. Nothing here decides anything the engine decides.
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

#define STRATA_BUILDING_LIBRARY 1
#include "base/dtype.h"
#include "base/status.h"
#include "engine/capi/capi_testing.h"
#include "engine/config/config.h"
#include "engine/engine.h"
#include "engine/layout/partition.h"
#include "io/net/launch_env.h"
#include "kernels/cpu/adam.h"
#include "strata/strata.h"
#include "tiers/gpu.h"

using strata::Code;
using strata::Status;

struct strata_engine {
  std::unique_ptr<strata::Engine> rep;
  bool built = false;
  bool gpu = false;    // the device tier is a GPU: caller streams are honoured
  int device = -1;     // that GPU (the engine's placement)
  std::string broken;  // non-empty: why every further call returns STATE
};

namespace {

static_assert(static_cast<int>(Code::kInternal) == STRATA_INTERNAL, "Code and strata_status_t differ");
static_assert(static_cast<int>(Code::kNotFound) == STRATA_NOT_FOUND, "Code and strata_status_t differ");
static_assert(static_cast<int>(strata::DType::kF16) == STRATA_DTYPE_F16, "DType and strata_dtype_t differ");
static_assert(strata::kMaxShapeDims == STRATA_MAX_NDIM, "the engine's and the header's most dims differ");

// The latest failure on this thread (strata_last_error).
thread_local std::string last_error;

strata_status_t Fail(const char* fn, const Status& s) {
  last_error = std::string(fn) + ": " + s.message();
  return static_cast<strata_status_t>(s.code());
}

// Runs `body` (returning Status) so that no exception escapes; an exception
// is a bug (or NOMEM for bad_alloc).
template <typename Body>
Status Guarded(Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return strata::NoMemError("out of memory (std::bad_alloc)");
  } catch (const std::exception& ex) {
    return strata::InternalError(std::string("uncaught exception: ") + ex.what());
  } catch (...) {
    return strata::InternalError("uncaught exception of unknown type");
  }
}

// The frame of every call on an engine: null and broken checks, the guard,
// and marking the engine broken after an internal error.
template <typename Body>
strata_status_t OnEngine(const char* fn, strata_engine_t* e, Body&& body) {
  if (e == nullptr) return Fail(fn, strata::InvalidError("engine is NULL"));
  if (!e->broken.empty())
    return Fail(fn, strata::StateError("engine is unusable after an earlier error: " + e->broken));
  Status s = Guarded(std::forward<Body>(body));
  if (s.ok()) return STRATA_OK;
  if (s.code() == Code::kInternal) e->broken = std::string(fn) + ": " + s.message();
  return Fail(fn, s);
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

Status CheckDType(strata_dtype_t t, const char* what) {
  if (t == STRATA_DTYPE_F32 || t == STRATA_DTYPE_BF16 || t == STRATA_DTYPE_F16) return Status::Ok();
  return strata::InvalidError(std::string(what) + ": unknown dtype " + std::to_string(static_cast<int>(t)));
}

Status CheckGroup(const strata_engine_t* e, int group) {
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
Status WaitCallerStream(const strata_engine_t* e, void* stream) {
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
double StepValue(double v) {
  if (!std::isfinite(v)) return v;
  return v < 0 ? -1 : std::max(v, DBL_TRUE_MIN);
}

strata::Result<strata::StepOptions> ToStepOptions(const strata_step_options_t* options) {
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
  Status s = Guarded(std::forward<Body>(body));
  return s.ok() ? STRATA_OK : Fail(fn, s);
}

}  // namespace

extern "C" {

int strata_version(void) { return STRATA_VERSION_CODE; }

const char* strata_status_name(strata_status_t status) {
  static const char* const kNames[] = {"OK",      "INVALID", "CONFIG",  "NOMEM",       "IO",    "NOSPACE",  "CORRUPT",
                                       "COMM",    "TIMEOUT", "UNSUPPORTED", "STATE", "INTERNAL", "NOT_FOUND"};
  const int i = static_cast<int>(status);
  return i >= 0 && i < static_cast<int>(sizeof kNames / sizeof kNames[0]) ? kNames[i] : "UNKNOWN";
}

const char* strata_last_error(void) { return last_error.c_str(); }

strata_status_t strata_engine_create(const char* json, const strata_engine_options_t* options,
                                     strata_engine_t** out) {
  const char* fn = "strata_engine_create";
  std::unique_ptr<strata_engine_t> e;
  Status s = Guarded([&]() -> Status {
    if (json == nullptr || out == nullptr) return strata::InvalidError("json and out must not be NULL");
    strata_engine_options_t o = STRATA_ENGINE_OPTIONS_INIT;
    if (options) STRATA_RETURN_IF_ERROR(ReadSized(options, "options", &o));
    if (o.world_size == 0 && o.rank != 0)
      return strata::InvalidError("options: rank " + std::to_string(o.rank) +
                                  " with world_size 0 (from the environment): the environment gives the rank; "
                                  "leave rank 0");
    if (o.world_size < 0 || o.rank < 0 || (o.world_size > 0 && o.rank >= o.world_size))
      return strata::InvalidError("options: rank " + std::to_string(o.rank) + " of world_size " +
                                  std::to_string(o.world_size) + " is not a rank");
    if (o.grad_accumulation_steps < 1)
      return strata::InvalidError("options.grad_accumulation_steps must be >= 1");
    if (o.device < -1)
      return strata::InvalidError("options.device: " + std::to_string(o.device) +
                                  " is not -1 (the launcher's local rank) or a GPU index");
    STRATA_ASSIGN_OR_RETURN(strata::Config config, strata::ParseConfig(json));
    strata::EngineOptions eo;
    eo.rank = o.rank;
    eo.world_size = o.world_size;
    eo.grad_accumulation_steps = o.grad_accumulation_steps;
    eo.force_no_gpu = o.force_no_gpu != 0;
    eo.overlap_step = o.overlap_step != 0;
    eo.device = o.device;
    eo.skip_groups_without_grads = o.skip_groups_without_grads != 0;
    e = std::make_unique<strata_engine_t>();
    STRATA_ASSIGN_OR_RETURN(e->rep, strata::Engine::Create(config, eo));
    e->device = e->rep->placement().device;
    e->gpu = e->device >= 0;
    return Status::Ok();
  });
  if (!s.ok()) return Fail(fn, s);
  *out = e.release();
  return STRATA_OK;
}

strata_status_t strata_engine_destroy(strata_engine_t* engine) {
  // The engine's destructor joins its threads and removes its swap files; a
  // throw from it is a bug that we can only swallow here.
  try {
    delete engine;
  } catch (...) {
  }
  return STRATA_OK;
}

strata_status_t strata_engine_add_param(strata_engine_t* engine, int group, const char* name, uint64_t numel,
                                        const float* init, uint64_t* offset_out) {
  return OnEngine("strata_engine_add_param", engine, [&]() -> Status {
    if (name == nullptr) return strata::InvalidError("name must not be NULL");
    if (group < 0) return strata::InvalidError("group " + std::to_string(group) + " is negative");
    if (engine->built) return strata::StateError("add_param after build");
    STRATA_ASSIGN_OR_RETURN(uint64_t offset, engine->rep->AddParam(group, name, numel, init));
    if (offset_out) *offset_out = offset;
    return Status::Ok();
  });
}

strata_status_t strata_engine_add_param_shaped(strata_engine_t* engine, int group, const char* name, int ndim,
                                               const int64_t* shape, const float* init,
                                               uint64_t* offset_out) {
  return OnEngine("strata_engine_add_param_shaped", engine, [&]() -> Status {
    if (name == nullptr) return strata::InvalidError("name must not be NULL");
    const std::string what = std::string("add_param '") + name + "'";
    if (ndim < 0 || ndim > STRATA_MAX_NDIM)
      return strata::InvalidError(what + ": ndim " + std::to_string(ndim) + " is not in 0.." +
                                  std::to_string(STRATA_MAX_NDIM));
    if (shape == nullptr && ndim > 0)
      return strata::InvalidError(what + ": shape is NULL with ndim " + std::to_string(ndim));
    std::vector<uint64_t> dims;
    for (int i = 0; i < ndim; ++i) {
      if (shape[i] < 1)
        return strata::InvalidError(what + ": dim " + std::to_string(i) + " of the shape is " +
                                    std::to_string(shape[i]) + "; every dim must be at least 1");
      dims.push_back(static_cast<uint64_t>(shape[i]));
    }
    if (group < 0) return strata::InvalidError(what + ": group " + std::to_string(group) + " is negative");
    if (engine->built) return strata::StateError(what + " after build");
    STRATA_ASSIGN_OR_RETURN(uint64_t offset, engine->rep->AddShapedParam(group, name, dims, init));
    if (offset_out) *offset_out = offset;
    return Status::Ok();
  });
}

strata_status_t strata_engine_add_alias(strata_engine_t* engine, int group, const char* alias, const char* of) {
  return OnEngine("strata_engine_add_alias", engine, [&]() -> Status {
    if (alias == nullptr || of == nullptr) return strata::InvalidError("alias and of must not be NULL");
    if (engine->built) return strata::StateError(std::string("add_alias '") + alias + "' after build");
    return engine->rep->AddAlias(group, alias, of);
  });
}

strata_status_t strata_engine_freeze_group(strata_engine_t* engine, int group) {
  return OnEngine("strata_engine_freeze_group", engine, [&]() -> Status {
    if (engine->built)
      return strata::StateError("group " + std::to_string(group) + ": the engine is already built (freeze before build)");
    return engine->rep->FreezeGroup(group);
  });
}

strata_status_t strata_engine_group_frozen(strata_engine_t* engine, int group, int* out) {
  return OnEngine("strata_engine_group_frozen", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    if (engine->built) STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    else if (group < 0 || group > 1'000'000)
      return strata::InvalidError("group " + std::to_string(group) + " is not in 0..1000000");
    *out = engine->rep->group_frozen(group) ? 1 : 0;
    return Status::Ok();
  });
}

strata_status_t strata_engine_build(strata_engine_t* engine) {
  return OnEngine("strata_engine_build", engine, [&]() -> Status {
    if (engine->built) return strata::StateError("the engine is already built");
    STRATA_RETURN_IF_ERROR(engine->rep->Build());
    engine->built = true;
    return Status::Ok();
  });
}

strata_status_t strata_engine_fetch(strata_engine_t* engine, int group, void* cuda_stream,
                                    void** device_ptr) {
  (void)cuda_stream;  // Fetch returns once the data is on the device: any stream may read it
  return OnEngine("strata_engine_fetch", engine, [&]() -> Status {
    if (device_ptr == nullptr) return strata::InvalidError("device_ptr must not be NULL");
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    STRATA_ASSIGN_OR_RETURN(void* p, engine->rep->Fetch(group));
    *device_ptr = p;
    return Status::Ok();
  });
}

strata_status_t strata_engine_release(strata_engine_t* engine, int group, void* cuda_stream) {
  return OnEngine("strata_engine_release", engine, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    STRATA_RETURN_IF_ERROR(WaitCallerStream(engine, cuda_stream));
    return engine->rep->Release(group);
  });
}

strata_status_t strata_engine_grads(strata_engine_t* engine, int group, const void* grads,
                                    strata_dtype_t dtype, void* cuda_stream) {
  return OnEngine("strata_engine_grads", engine, [&]() -> Status {
    if (grads == nullptr) return strata::InvalidError("grads must not be NULL");
    STRATA_RETURN_IF_ERROR(CheckDType(dtype, "grads"));
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    STRATA_RETURN_IF_ERROR(WaitCallerStream(engine, cuda_stream));
    return engine->rep->Grads(group, grads, static_cast<strata::DType>(dtype));
  });
}

strata_status_t strata_engine_prepare_step(strata_engine_t* engine, const strata_step_options_t* options) {
  return OnEngine("strata_engine_prepare_step", engine, [&]() -> Status {
    if (!engine->built) return strata::StateError("the engine is not built yet (call strata_engine_build)");
    STRATA_ASSIGN_OR_RETURN(const strata::StepOptions so, ToStepOptions(options));
    return engine->rep->PrepareStep(so);
  });
}

strata_status_t strata_engine_step(strata_engine_t* engine, const strata_step_options_t* options,
                                   strata_step_result_t* result) {
  return OnEngine("strata_engine_step", engine, [&]() -> Status {
    if (!engine->built) return strata::StateError("the engine is not built yet (call strata_engine_build)");
    if (result && result->struct_size < sizeof(size_t))
      return strata::InvalidError("result.struct_size is " + std::to_string(result->struct_size));
    STRATA_ASSIGN_OR_RETURN(const strata::StepOptions so, ToStepOptions(options));
    STRATA_ASSIGN_OR_RETURN(strata::StepResult r, engine->rep->Step(so));
    if (result == nullptr) return Status::Ok();
    strata_step_result_t full = STRATA_STEP_RESULT_INIT;
    full.grad_norm = r.grad_norm;
    full.skipped = r.skipped ? 1 : 0;
    full.loss_scale = r.loss_scale;
    return WriteSized(full, "result", result);
  });
}

strata_status_t strata_engine_grad_norm(strata_engine_t* engine, double* norm) {
  return OnEngine("strata_engine_grad_norm", engine, [&]() -> Status {
    if (norm == nullptr) return strata::InvalidError("norm must not be NULL");
    if (!engine->built) return strata::StateError("the engine is not built yet (call strata_engine_build)");
    STRATA_ASSIGN_OR_RETURN(*norm, engine->rep->GradNorm());
    return Status::Ok();
  });
}

strata_status_t strata_engine_read_master(strata_engine_t* engine, int group, float* out) {
  return OnEngine("strata_engine_read_master", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    return engine->rep->ReadMaster(group, out);
  });
}

strata_status_t strata_checkpoint_save(strata_engine_t* engine, const char* dir, const char* tag, const void* blob,
                                       uint64_t blob_bytes) {
  return OnEngine("strata_checkpoint_save", engine, [&]() -> Status {
    if (dir == nullptr || tag == nullptr) return strata::InvalidError("dir and tag must not be NULL");
    if (blob == nullptr && blob_bytes > 0) return strata::InvalidError("blob is NULL with blob_bytes > 0");
    return engine->rep->SaveCheckpoint(dir, tag, blob, blob_bytes);
  });
}

strata_status_t strata_checkpoint_load(strata_engine_t* engine, const char* dir, const char* tag, void* blob,
                                       uint64_t* blob_bytes) {
  return OnEngine("strata_checkpoint_load", engine, [&]() -> Status {
    if (dir == nullptr || blob_bytes == nullptr) return strata::InvalidError("dir and blob_bytes must not be NULL");
    if (blob == nullptr && *blob_bytes > 0) return strata::InvalidError("blob is NULL with *blob_bytes > 0");
    std::vector<uint8_t> got;
    STRATA_RETURN_IF_ERROR(engine->rep->LoadCheckpoint(dir, tag ? tag : "", &got));
    if (got.size() > *blob_bytes) {
      // The state is loaded; only the blob did not fit. Say how much is needed.
      const uint64_t have = *blob_bytes;
      *blob_bytes = got.size();
      return strata::InvalidError("the checkpoint's blob is " + std::to_string(got.size()) +
                                  " bytes; the buffer holds " + std::to_string(have) +
                                  " (the state was loaded; call again with a larger buffer)");
    }
    if (!got.empty()) std::memcpy(blob, got.data(), got.size());
    *blob_bytes = got.size();
    return Status::Ok();
  });
}

strata_status_t strata_engine_loss_scale(strata_engine_t* engine, double* out) {
  return OnEngine("strata_engine_loss_scale", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    *out = engine->rep->loss_scale();
    return Status::Ok();
  });
}

static strata::Result<strata::Engine::OptimizerState> StateOf(strata_state_t which) {
  if (which < STRATA_STATE_MASTER || which > STRATA_STATE_EXP_AVG_SQ)
    return strata::InvalidError("state " + std::to_string(static_cast<int>(which)) + " is not one of MASTER, EXP_AVG, EXP_AVG_SQ");
  return static_cast<strata::Engine::OptimizerState>(which);
}

strata_status_t strata_engine_read_state(strata_engine_t* engine, int group, strata_state_t which, float* out) {
  return OnEngine("strata_engine_read_state", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    STRATA_ASSIGN_OR_RETURN(strata::Engine::OptimizerState s, StateOf(which));
    return engine->rep->ReadState(group, s, out);
  });
}

strata_status_t strata_engine_write_state(strata_engine_t* engine, int group, strata_state_t which, const float* in) {
  return OnEngine("strata_engine_write_state", engine, [&]() -> Status {
    if (in == nullptr) return strata::InvalidError("in must not be NULL");
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    STRATA_ASSIGN_OR_RETURN(strata::Engine::OptimizerState s, StateOf(which));
    return engine->rep->WriteState(group, s, in);
  });
}

strata_status_t strata_engine_get_steps(strata_engine_t* engine, int64_t* out) {
  return OnEngine("strata_engine_get_steps", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    *out = engine->rep->steps_applied();
    return Status::Ok();
  });
}

strata_status_t strata_engine_set_steps(strata_engine_t* engine, int64_t steps) {
  return OnEngine("strata_engine_set_steps", engine, [&]() -> Status { return engine->rep->SetStepsApplied(steps); });
}

strata_status_t strata_engine_group_steps(strata_engine_t* engine, int group, int64_t* out) {
  return OnEngine("strata_engine_group_steps", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    STRATA_ASSIGN_OR_RETURN(*out, engine->rep->GroupSteps(group));
    return Status::Ok();
  });
}

strata_status_t strata_engine_set_group_steps(strata_engine_t* engine, int group, int64_t steps) {
  return OnEngine("strata_engine_set_group_steps", engine, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    return engine->rep->SetGroupSteps(group, steps);
  });
}

strata_status_t strata_engine_num_groups(strata_engine_t* engine, int* out) {
  return OnEngine("strata_engine_num_groups", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    *out = engine->rep->num_groups();
    return Status::Ok();
  });
}

strata_status_t strata_engine_group_numel(strata_engine_t* engine, int group, uint64_t* out) {
  return OnEngine("strata_engine_group_numel", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    *out = engine->rep->group_numel(group);
    return Status::Ok();
  });
}

// Copies `text` and its NUL into out[*size] and sets *size to the bytes
// needed; with `out` NULL only the size. `what` names it in the refusal.
static Status CopyText(const std::string& text, const char* what, char* out, size_t* size) {
  if (size == nullptr) return strata::InvalidError("size must not be NULL");
  const size_t need = text.size() + 1;
  if (out == nullptr || *size < need) {
    const size_t had = *size;
    *size = need;
    if (out == nullptr) return Status::Ok();
    return strata::InvalidError(std::string(what) + " is " + std::to_string(need) +
                                " bytes with its NUL; the buffer holds " + std::to_string(had));
  }
  std::memcpy(out, text.c_str(), need);
  *size = need;
  return Status::Ok();
}

strata_status_t strata_engine_config(strata_engine_t* engine, char* out, size_t* size) {
  return OnEngine("strata_engine_config", engine, [&]() -> Status {
    if (size == nullptr) return strata::InvalidError("size must not be NULL");
    return CopyText(strata::ConfigToJson(engine->rep->config()), "the config", out, size);
  });
}

strata_status_t strata_engine_placement(strata_engine_t* engine, char* out, size_t* size) {
  return OnEngine("strata_engine_placement", engine, [&]() -> Status {
    return CopyText(strata::DescribePlacement(engine->rep->placement()), "the placement", out, size);
  });
}

strata_status_t strata_engine_compute_dtype(strata_engine_t* engine, strata_dtype_t* out) {
  return OnEngine("strata_engine_compute_dtype", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    *out = static_cast<strata_dtype_t>(engine->rep->compute_dtype());
    return Status::Ok();
  });
}

strata_status_t strata_engine_device_is_gpu(strata_engine_t* engine, int* out) {
  return OnEngine("strata_engine_device_is_gpu", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    *out = engine->gpu ? 1 : 0;
    return Status::Ok();
  });
}

strata_status_t strata_engine_stats(strata_engine_t* engine, strata_stats_t* stats) {
  return OnEngine("strata_engine_stats", engine, [&]() -> Status {
    if (stats == nullptr) return strata::InvalidError("stats must not be NULL");
    const strata::EngineStats s = engine->rep->stats();
    strata_stats_t f = STRATA_STATS_INIT;
    f.device = {s.device.budget, s.device.used, s.device.peak};
    f.host = {s.host.budget, s.host.used, s.host.peak};
    f.nvme = {s.nvme.budget, s.nvme.used, s.nvme.peak};
    f.nvme_to_host = s.nvme_to_host;
    f.host_to_nvme = s.host_to_nvme;
    f.host_to_device = s.host_to_device;
    f.device_to_host = s.device_to_host;
    f.fetches = s.fetches;
    f.prefetch_hits = s.prefetch_hits;
    f.fetch_stalls = s.fetch_stalls;
    f.fetch_stall_s = s.fetch_stall_s;
    f.disk_busy_s = s.disk_busy_s;
    f.copy_busy_s = s.copy_busy_s;
    f.cpu_optimizer_s = s.cpu_optimizer_s;
    f.step_wall_s = s.step_wall_s;
    f.overlap_efficiency = s.overlap_efficiency;
    f.steps = s.steps;
    f.skipped_steps = s.skipped_steps;
    f.device_cached = s.device_cached;
    f.device_raw_allocs = s.device_raw_allocs;
    f.device_pool_hits = s.device_pool_hits;
    const strata::Placement pl = engine->rep->placement();
    f.gpu_device = pl.device;
    f.numa_node = pl.cpu_node;
    return WriteSized(f, "stats", stats);
  });
}

strata_status_t strata_engine_span_begin(strata_engine_t* engine, const char* name, uint64_t* token_out) {
  return OnTrace("strata_engine_span_begin", engine, [&]() -> Status {
    if (token_out == nullptr) return strata::InvalidError("token_out must not be NULL");
    STRATA_ASSIGN_OR_RETURN(uint64_t token, engine->rep->BeginSpan(name));
    *token_out = token;
    return Status::Ok();
  });
}

strata_status_t strata_engine_span_end(strata_engine_t* engine, uint64_t token) {
  return OnTrace("strata_engine_span_end", engine, [&]() -> Status { return engine->rep->EndSpan(token); });
}

strata_status_t strata_engine_write_trace(strata_engine_t* engine) {
  return OnTrace("strata_engine_write_trace", engine, [&]() -> Status { return engine->rep->WriteTrace(); });
}

strata_status_t strata_adam_step(const strata_adam_options_t* options, size_t n, float* param, float* exp_avg,
                                 float* exp_avg_sq, const void* grad, void* param_copy) {
  Status s = Guarded([&]() -> Status {
    if (options == nullptr) return strata::InvalidError("options must not be NULL");
    strata_adam_options_t o = STRATA_ADAM_OPTIONS_INIT;
    STRATA_RETURN_IF_ERROR(ReadSized(options, "options", &o));
    if (n > 0 && (!param || !exp_avg || !exp_avg_sq || !grad))
      return strata::InvalidError("param, exp_avg, exp_avg_sq and grad must not be NULL");
    if (o.mode != STRATA_ADAM_MODE_ADAMW && o.mode != STRATA_ADAM_MODE_ADAM)
      return strata::InvalidError("options.mode: unknown mode " + std::to_string(static_cast<int>(o.mode)));
    STRATA_RETURN_IF_ERROR(CheckDType(o.grad_dtype, "options.grad_dtype"));
    STRATA_RETURN_IF_ERROR(CheckDType(o.param_copy_dtype, "options.param_copy_dtype"));
    strata::kernels::AdamOptions k;
    k.lr = o.lr;
    k.beta1 = o.beta1;
    k.beta2 = o.beta2;
    k.eps = o.eps;
    k.weight_decay = o.weight_decay;
    k.step = o.step;
    k.mode = o.mode == STRATA_ADAM_MODE_ADAM ? strata::kernels::AdamMode::kAdam
                                             : strata::kernels::AdamMode::kAdamW;
    k.grad_scale = o.grad_scale;
    k.grad_dtype = static_cast<strata::DType>(o.grad_dtype);
    k.param_copy_dtype = static_cast<strata::DType>(o.param_copy_dtype);
    return strata::kernels::AdamStep(k, n, param, exp_avg, exp_avg_sq, grad, param_copy);
  });
  return s.ok() ? STRATA_OK : Fail("strata_adam_step", s);
}

/* ---- Ranks: data-parallel trainers (strata-train on many ranks, #14) ---- */

strata_status_t strata_rank_from_env(int* rank_out, int* world_size_out) {
  Status s = Guarded([&]() -> Status {
    if (rank_out == nullptr || world_size_out == nullptr)
      return strata::InvalidError("rank_out and world_size_out must not be NULL");
    STRATA_ASSIGN_OR_RETURN(strata::net::RankInfo info, strata::net::RankInfoFromEnv());
    *rank_out = info.rank;
    *world_size_out = info.world_size;
    return Status::Ok();
  });
  return s.ok() ? STRATA_OK : Fail("strata_rank_from_env", s);
}

strata_status_t strata_engine_rank(strata_engine_t* engine, int* rank_out, int* world_size_out) {
  return OnEngine("strata_engine_rank", engine, [&]() -> Status {
    if (rank_out == nullptr || world_size_out == nullptr)
      return strata::InvalidError("rank_out and world_size_out must not be NULL");
    *rank_out = engine->rep->rank();
    *world_size_out = engine->rep->world_size();
    return Status::Ok();
  });
}

strata_status_t strata_engine_sum_over_ranks(strata_engine_t* engine, double* values, size_t n) {
  return OnEngine("strata_engine_sum_over_ranks", engine,
                  [&]() -> Status { return engine->rep->SumOverRanks(values, n); });
}

/* ---- End of the ranks block ---- */

void strata_internal_break_engine(strata_engine_t* engine, const char* why) {
  if (engine) engine->broken = why ? why : "broken by a test";
}

}  // extern "C"
