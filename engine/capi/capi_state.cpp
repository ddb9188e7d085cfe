// The C API, continued (capi.cpp says how): state and its counts, the
// engine's facts and stats, trace spans, the standalone Adam step, ranks.
#define STRATA_BUILDING_LIBRARY 1
#include "engine/capi/capi_frame.h"

using namespace strata_capi;  // NOLINT: the frame's helpers

extern "C" {
strata_status_t strata_checkpoint_load(strata_engine_t* engine, const char* dir, const char* tag, void* blob,
                                       uint64_t* blob_bytes) {
  const strata_status_t status = OnEngine("strata_checkpoint_load", engine, [&]() -> Status {
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
  if (status != STRATA_OK) EndLoans(engine);  // (as strata_engine_step)
  return status;
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
    f.speculated_steps = s.speculated_steps;
    f.committed_steps = s.committed_steps;
    f.replayed_steps = s.replayed_steps;
    f.discarded_steps = s.discarded_steps;
    f.early_updates = s.early_updates;
    f.exposed_step_s = s.exposed_step_s;
    f.unspeculated_steps = s.unspeculated_steps;
    f.act_host_bytes = s.act_host_bytes;
    f.act_nvme_bytes = s.act_nvme_bytes;
    f.act_redeemed = s.act_redeemed;
    f.act_prefetch_hits = s.act_prefetch_hits;
    f.act_stalls = s.act_stalls;
    f.act_stall_s = s.act_stall_s;
    f.act_live_bytes = s.act_live_bytes;
    f.p_gathers = s.p_gathers;
    f.step_read_ahead_bytes = s.step_read_ahead_bytes;
    f.write_behind_steps = s.write_behind_steps;
    f.comm_s = s.comm_s;
    f.comm_cpu_s = s.comm_cpu_s;
    f.reduced_bytes = s.reduced_bytes;
    f.gathered_bytes = s.gathered_bytes;
    f.behind_wait_s = s.behind_wait_s;
    f.lent_reduced_bytes = s.lent_reduced_bytes;
    f.cpu_kernel_threads = strata::kernels::CpuKernelThreads();
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
