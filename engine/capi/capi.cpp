// The C API (include/strata/strata.h) over the C++ Engine: one thin layer, as
// leveldb's db/c.cc. Each call checks its arguments, runs the engine inside a
// catch-all, and turns a Status into a status code plus a thread-local
// message (capi_frame.h). Nothing here decides anything the engine decides.
// This file: versions, errors, create and build, fetch, grads, step,
// checkpoints; capi_state.cpp the rest.
#define STRATA_BUILDING_LIBRARY 1
#include "engine/capi/capi_frame.h"

using namespace strata_capi;  // NOLINT: the frame's helpers

namespace strata_capi {
thread_local std::string last_error;

namespace {
// strata_engine_grads_part and its lending twin (`lend`).
strata_status_t GradsPartCall(strata_engine_t* engine, int group, uint64_t first, uint64_t count,
                              const void* grads, strata_dtype_t dtype, bool lend) {
  return OnEngine(lend ? "strata_engine_grads_part_lend" : "strata_engine_grads_part", engine, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(CheckDType(dtype, lend ? "grads_part_lend" : "grads_part"));
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    return engine->rep->GradsPart(group, first, count, grads, static_cast<strata::DType>(dtype), lend);
  });
}
}  // namespace
}  // namespace strata_capi

extern "C" {

int strata_version(void) { return STRATA_VERSION_CODE; }

const char* strata_status_name(strata_status_t status) {
  static const char* const kNames[] = {"OK",      "INVALID", "CONFIG",  "NOMEM",       "IO",    "NOSPACE",  "CORRUPT",
                                       "COMM",    "TIMEOUT", "UNSUPPORTED", "STATE", "INTERNAL", "NOT_FOUND"};
  const int i = static_cast<int>(status);
  return i >= 0 && i < static_cast<int>(sizeof kNames / sizeof kNames[0]) ? kNames[i] : "UNKNOWN";
}

const char* strata_last_error(void) { return last_error.c_str(); }

strata_status_t strata_host_memory(uint64_t* bytes_out, int* local_ranks_out) {
  Status s = Guarded([&]() -> Status {
    int local = 1;  // (read first: a refusal leaves both outputs as they were)
    if (local_ranks_out) {
      STRATA_ASSIGN_OR_RETURN(strata::net::RankInfo info, strata::net::RankInfoFromEnv());
      local = info.local_world_size;
    }
    if (bytes_out) *bytes_out = strata::ProbeMachineFacts().host_ram_bytes;
    if (local_ranks_out) *local_ranks_out = local;
    return Status::Ok();
  });
  return s.ok() ? STRATA_OK : Fail("strata_host_memory", s);
}

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
  // In a child of fork the engine is the parent's: its threads are not
  // here to join, and its swap files and trace are the parent's. Nothing is
  // done (the child's copy of its memory goes with the child).
  if (engine != nullptr && engine->pid != ::getpid()) return STRATA_OK;
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

strata_status_t strata_engine_grads_part(strata_engine_t* engine, int group, uint64_t first, uint64_t count,
                                         const void* grads, strata_dtype_t dtype) {
  return GradsPartCall(engine, group, first, count, grads, dtype, /*lend=*/false);
}

strata_status_t strata_engine_grads_part_lend(strata_engine_t* engine, int group, uint64_t first, uint64_t count,
                                              const void* grads, strata_dtype_t dtype) {
  return GradsPartCall(engine, group, first, count, grads, dtype, /*lend=*/true);
}

strata_status_t strata_engine_grads_end(strata_engine_t* engine, int group) {
  return OnEngine("strata_engine_grads_end", engine, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    return engine->rep->GradsEnd(group);
  });
}

strata_status_t strata_engine_grads_view(strata_engine_t* engine, int group, const void** out) {
  return OnEngine("strata_engine_grads_view", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    STRATA_ASSIGN_OR_RETURN(*out, engine->rep->GradsView(group));
    return Status::Ok();
  });
}

strata_status_t strata_engine_grads_lent(strata_engine_t* engine, int group, int* out) {
  return OnEngine("strata_engine_grads_lent", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    STRATA_ASSIGN_OR_RETURN(const bool in_use, engine->rep->LentInUse(group));
    *out = in_use ? 1 : 0;
    return Status::Ok();
  });
}

strata_status_t strata_engine_takes_grad_parts(strata_engine_t* engine, int group, strata_dtype_t dtype, int* out) {
  return OnEngine("strata_engine_takes_grad_parts", engine, [&]() -> Status {
    if (out == nullptr) return strata::InvalidError("out must not be NULL");
    STRATA_RETURN_IF_ERROR(CheckDType(dtype, "takes_grad_parts"));
    STRATA_RETURN_IF_ERROR(CheckGroup(engine, group));
    const std::string why = engine->rep->WhyNoGradParts(group, static_cast<strata::DType>(dtype));
    *out = why.empty() ? 1 : 0;
    if (!why.empty()) last_error = "strata_engine_takes_grad_parts: " + why;
    return Status::Ok();
  });
}

strata_status_t strata_engine_stash(strata_engine_t* engine, const void* src, uint64_t bytes, void* cuda_stream,
                                    uint64_t* handle_out) {
  return OnEngine("strata_engine_stash", engine, [&]() -> Status {
    if (src == nullptr || handle_out == nullptr) return strata::InvalidError("src and handle_out must not be NULL");
    if (!engine->built) return strata::StateError("the engine is not built yet (call strata_engine_build)");
    STRATA_RETURN_IF_ERROR(WaitCallerStream(engine, cuda_stream));
    STRATA_ASSIGN_OR_RETURN(uint64_t h, engine->rep->Stash(src, bytes));
    *handle_out = h;
    return Status::Ok();
  });
}

strata_status_t strata_engine_redeem(strata_engine_t* engine, uint64_t handle, void* dst, uint64_t bytes,
                                     void* cuda_stream) {
  return OnEngine("strata_engine_redeem", engine, [&]() -> Status {
    if (dst == nullptr) return strata::InvalidError("dst must not be NULL");
    if (!engine->built) return strata::StateError("the engine is not built yet (call strata_engine_build)");
    // Work queued on the caller's stream may still read or write dst: done first.
    STRATA_RETURN_IF_ERROR(WaitCallerStream(engine, cuda_stream));
    return engine->rep->Redeem(handle, dst, bytes);
  });
}

strata_status_t strata_engine_drop_stash(strata_engine_t* engine, uint64_t handle) {
  return OnEngine("strata_engine_drop_stash", engine, [&]() -> Status {
    if (!engine->built) return strata::StateError("the engine is not built yet (call strata_engine_build)");
    return engine->rep->DropStash(handle);
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
  const strata_status_t status = OnEngine("strata_engine_step", engine, [&]() -> Status {
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
  // Lent parts are the caller's again whatever step says: where it returned
  // before Engine::Step (refused arguments, a broken engine) or out of it by
  // an exception, the loans end here (after Engine::Step's own: no more).
  if (status != STRATA_OK) EndLoans(engine);
  return status;
}

strata_status_t strata_engine_discard_grads(strata_engine_t* engine) {
  const strata_status_t status = OnEngine("strata_engine_discard_grads", engine, [&]() -> Status {
    if (!engine->built) return strata::StateError("the engine is not built yet (call strata_engine_build)");
    return engine->rep->DiscardGrads();
  });
  if (status != STRATA_OK) EndLoans(engine);  // as step: lent parts are the caller's again
  return status;
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

}  // extern "C"
