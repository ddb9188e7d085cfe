// ParseConfig: DeepSpeed's ds_config.json schema plus the "strata" section,
// section by section; LoadConfigFile; ConfigToJson.
#include "engine/config/config.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "base/log.h"
#include "engine/config/config_reader.h"
#include "io/file_storage.h"

namespace strata {

namespace {

using config_internal::Json;
using config_internal::ObjectReader;

Status ReadDevice(ObjectReader& r, OffloadDevice* out) {
  std::string name = OffloadDeviceName(*out);
  STRATA_RETURN_IF_ERROR(r.Choice("device", &name, {"none", "cpu", "nvme"}));
  *out = name == "nvme" ? OffloadDevice::kNvme : name == "cpu" ? OffloadDevice::kCpu : OffloadDevice::kNone;
  return Status::Ok();
}

Status ReadOffloadParam(ObjectReader r, OffloadParamConfig* p) {
  STRATA_RETURN_IF_ERROR(ReadDevice(r, &p->device));
  STRATA_RETURN_IF_ERROR(r.String("nvme_path", &p->nvme_path));
  STRATA_RETURN_IF_ERROR(r.Bool("pin_memory", &p->pin_memory));
  STRATA_RETURN_IF_ERROR(r.Uint("buffer_count", &p->buffer_count, 1));
  STRATA_RETURN_IF_ERROR(r.Uint("buffer_size", &p->buffer_size, 1));
  STRATA_RETURN_IF_ERROR(r.Uint("max_in_cpu", &p->max_in_cpu));
  return r.CheckUnknownKeys();
}

Status ReadOffloadOptimizer(ObjectReader r, OffloadOptimizerConfig* o, std::vector<std::string>* warnings) {
  STRATA_RETURN_IF_ERROR(ReadDevice(r, &o->device));
  STRATA_RETURN_IF_ERROR(r.String("nvme_path", &o->nvme_path));
  STRATA_RETURN_IF_ERROR(r.Bool("pin_memory", &o->pin_memory));
  STRATA_RETURN_IF_ERROR(r.Uint("buffer_count", &o->buffer_count, 1));
  STRATA_RETURN_IF_ERROR(r.Bool("pipeline_read", &o->pipeline_read));
  STRATA_RETURN_IF_ERROR(r.Bool("pipeline_write", &o->pipeline_write));
  STRATA_RETURN_IF_ERROR(r.Double("ratio", &o->ratio, 0, 1));
  r.Unimplemented({"fast_init", "pipeline"}, warnings);
  return r.CheckUnknownKeys();
}

// Reads `names` (a stage3_ spelling and the bare one) into *out.
// Element counts (bucket sizes, thresholds, live parameters): at most 2^56,
// so that their products with an element's bytes never wrap (a wrapped
// prefetch window silently shrank to one group).
Status ReadAliasedUint(ObjectReader& r, std::initializer_list<std::string_view> names, uint64_t* out) {
  STRATA_ASSIGN_OR_RETURN(std::string key, r.Alias(names));
  return r.Uint(key, out, 0, uint64_t{1} << 56);
}

// DeepSpeed's deprecated booleans: cpu_offload, cpu_offload_param, cpu_offload_use_pin_memory.
Status ReadDeprecatedOffload(ObjectReader& r, Config* c) {
  bool cpu_offload = false, cpu_offload_param = false, pin = false;
  STRATA_RETURN_IF_ERROR(r.Bool("cpu_offload", &cpu_offload));
  STRATA_RETURN_IF_ERROR(r.Bool("cpu_offload_param", &cpu_offload_param));
  STRATA_RETURN_IF_ERROR(r.Bool("cpu_offload_use_pin_memory", &pin));
  ZeroConfig& z = c->zero;
  if (cpu_offload && z.offload_optimizer.device == OffloadDevice::kNone) {
    z.offload_optimizer.device = OffloadDevice::kCpu;
    z.offload_optimizer.pin_memory |= pin;
  }
  if (cpu_offload_param && z.offload_param.device == OffloadDevice::kNone) {
    z.offload_param.device = OffloadDevice::kCpu;
    z.offload_param.pin_memory |= pin;
  }
  for (const char* key : {"cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"}) {
    if (r.Find(key) != nullptr)
      c->warnings.push_back(r.KeyPath(key) + ": deprecated in DeepSpeed; read as offload_optimizer/offload_param");
  }
  return Status::Ok();
}

// DeepSpeed reads offload_param only in stage 3; a ds_config.json that sets
// it with a lower stage runs there with parameters on the GPU. Strata places
// P as the section says at any stage, so the same file behaves differently:
// say so (logged once per process, with the other warnings).
void WarnOffloadParamBelowStage3(Config& c) {
  const OffloadDevice d = c.zero.offload_param.device;
  if (c.zero.stage >= 3 || d == OffloadDevice::kNone) return;
  c.warnings.push_back("zero_optimization.offload_param: DeepSpeed ignores it below stage 3 (stage " +
                       std::to_string(c.zero.stage) + " here) and keeps parameters on the GPU; Strata keeps them on " +
                       OffloadDeviceName(d) + " as it says");
}

Status ReadZero(ObjectReader& top, Config* c) {
  const Json* legacy = top.Find("zero_optimization");
  if (legacy != nullptr && legacy->is_boolean()) {  // DeepSpeed's old form: true = stage 1
    c->zero.stage = legacy->get<bool>() ? 1 : 0;
    c->warnings.push_back("zero_optimization: a boolean is deprecated in DeepSpeed; read as stage " +
                          std::to_string(c->zero.stage));
    return Status::Ok();
  }
  STRATA_ASSIGN_OR_RETURN(ObjectReader r, top.Object("zero_optimization"));
  ZeroConfig& z = c->zero;
  STRATA_RETURN_IF_ERROR(r.IntChoice("stage", &z.stage, {0, 1, 2, 3}));
  STRATA_ASSIGN_OR_RETURN(ObjectReader param, r.Object("offload_param"));
  STRATA_RETURN_IF_ERROR(ReadOffloadParam(param, &z.offload_param));
  STRATA_ASSIGN_OR_RETURN(ObjectReader opt, r.Object("offload_optimizer"));
  STRATA_RETURN_IF_ERROR(ReadOffloadOptimizer(opt, &z.offload_optimizer, &c->warnings));
  STRATA_RETURN_IF_ERROR(ReadAliasedUint(r, {"stage3_prefetch_bucket_size", "prefetch_bucket_size"}, &z.prefetch_bucket_size));
  STRATA_RETURN_IF_ERROR(ReadAliasedUint(r, {"stage3_max_live_parameters", "max_live_parameters"}, &z.max_live_parameters));
  STRATA_RETURN_IF_ERROR(ReadAliasedUint(r, {"stage3_max_reuse_distance", "max_reuse_distance"}, &z.max_reuse_distance));
  STRATA_RETURN_IF_ERROR(ReadAliasedUint(r, {"stage3_param_persistence_threshold", "param_persistence_threshold"},
                                         &z.param_persistence_threshold));
  STRATA_RETURN_IF_ERROR(ReadAliasedUint(r, {"sub_group_size"}, &z.sub_group_size));
  if (z.sub_group_size == 0) return ConfigError(r.KeyPath("sub_group_size") + ": 0 is out of range; allowed: at least 1");
  STRATA_RETURN_IF_ERROR(r.Uint("reduce_bucket_size", &z.reduce_bucket_size, 1));
  z.overlap_comm = z.stage == 3;  // DeepSpeed's default
  STRATA_RETURN_IF_ERROR(r.Bool("overlap_comm", &z.overlap_comm));
  STRATA_RETURN_IF_ERROR(r.Bool("contiguous_gradients", &z.contiguous_gradients));
  if (!z.contiguous_gradients)
    c->warnings.push_back(r.KeyPath("contiguous_gradients") +
                          ": false changes nothing: Strata always copies a group's gradients into one buffer of its "
                          "own before reducing them (the caller's buffer is never written)");
  STRATA_RETURN_IF_ERROR(ReadDeprecatedOffload(r, c));
  WarnOffloadParamBelowStage3(*c);
  r.Unimplemented({"reduce_scatter", "allgather_partitions", "allgather_bucket_size", "use_multi_rank_bucket_allreduce",
                   "round_robin_gradients", "stage3_gather_16bit_weights_on_model_save",
                   "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                   "elastic_checkpoint", "ignore_unused_parameters", "load_from_fp32_weights",
                   "legacy_stage1", "stage3_model_persistence_threshold", "model_persistence_threshold",
                   "stage3_module_granularity_threshold", "module_granularity_threshold",
                   "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
                   "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                   "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
                   "mics_hierarchical_params_gather", "memory_efficient_linear", "pipeline_loading_checkpoint",
                   "override_module_apply", "log_trace_cache_warnings", "offload_optimizer_config"},
                  &c->warnings);
  return r.CheckUnknownKeys();
}

Status ReadAio(ObjectReader r, AioConfig* a, std::vector<std::string>* warnings) {
  STRATA_RETURN_IF_ERROR(r.Uint("block_size", &a->block_size, 4096, StorageOptions::kMaxBlockSize));
  if (a->block_size % 4096 != 0)
    return ConfigError(r.KeyPath("block_size") + ": " + std::to_string(a->block_size) +
                       " is not a multiple of 4096 (O_DIRECT alignment)");
  // The storage's own limit: one number, so the engine never refuses what the config accepted.
  STRATA_RETURN_IF_ERROR(r.Uint("queue_depth", &a->queue_depth, 1, StorageOptions::kMaxQueueDepth));
  STRATA_ASSIGN_OR_RETURN(std::string threads, r.Alias({"intra_op_parallelism", "thread_count"}));
  STRATA_RETURN_IF_ERROR(r.Uint(threads, &a->thread_count, 1, 1024));
  STRATA_RETURN_IF_ERROR(r.Bool("single_submit", &a->single_submit));
  STRATA_RETURN_IF_ERROR(r.Bool("overlap_events", &a->overlap_events));
  r.Unimplemented({"use_gds"}, warnings);
  return r.CheckUnknownKeys();
}

Status ReadFp16(ObjectReader r, Fp16Config* f, std::vector<std::string>* warnings) {
  STRATA_RETURN_IF_ERROR(r.Bool("enabled", &f->enabled));
  STRATA_RETURN_IF_ERROR(r.Double("loss_scale", &f->loss_scale, 0, std::numeric_limits<double>::max()));
  STRATA_RETURN_IF_ERROR(r.Int("initial_scale_power", &f->initial_scale_power, 0, 64));
  STRATA_RETURN_IF_ERROR(r.Uint("loss_scale_window", &f->loss_scale_window, 1, uint64_t{1} << 62));
  STRATA_RETURN_IF_ERROR(r.Int("hysteresis", &f->hysteresis, 1, 1 << 30));
  STRATA_RETURN_IF_ERROR(r.Double("min_loss_scale", &f->min_loss_scale, 0, std::numeric_limits<double>::max()));
  // The step multiplies the gradients by 1/scale in float: a scale halved
  // far enough (min_loss_scale 0) or given that small makes it infinite, and
  // the next finite step writes NaN into every weight. Below 2^-24 (fp16's
  // smallest value) every scaled fp16 gradient is 0 anyway.
  constexpr double kMinScale = 0x1p-24;
  for (const auto& [key, value] : {std::pair<const char*, double>{"min_loss_scale", f->min_loss_scale},
                                   {"loss_scale", f->loss_scale}})
    if (value < kMinScale && !(value == 0 && std::string_view(key) == "loss_scale"))
      return ConfigError(r.KeyPath(key) + ": " + config_internal::BriefJson(Json(value)) + " is below 2^-24 (5.96e-08): the step's "
                         "unscale factor 1/scale would overflow float and write NaN into the weights" +
                         std::string(key[0] == 'l' ? "" : " (DeepSpeed's default is 1)") + "; allowed: 2^-24 or more" +
                         (key[0] == 'l' ? " (0: dynamic)" : ""));
  // Above 2^127 the scale is no float (torch's GradScaler grows it only
  // while it is one): the scaled loss overflows at once, and the unscale
  // factor is below float's.
  for (const auto& [key, value] : {std::pair<const char*, double>{"min_loss_scale", f->min_loss_scale},
                                   {"loss_scale", f->loss_scale}})
    if (value > kMaxLossScale)
      return ConfigError(r.KeyPath(key) + ": " + config_internal::BriefJson(Json(value)) +
                         " is above 2^127 (1.7e+38), the largest scale a float holds as a power of two; allowed: up "
                         "to 2^127");
  r.Unimplemented({"auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"}, warnings);
  return r.CheckUnknownKeys();
}

Status ReadBf16(ObjectReader& top, Config* c) {
  STRATA_ASSIGN_OR_RETURN(std::string key, top.Alias({"bf16", "bfloat16"}));
  STRATA_ASSIGN_OR_RETURN(ObjectReader r, top.Object(key));
  STRATA_RETURN_IF_ERROR(r.Bool("enabled", &c->bf16));
  r.Unimplemented({"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                   "bf16_optimizer_states"},
                  &c->warnings);
  return r.CheckUnknownKeys();
}

// Defaults of DeepSpeed's CPU optimizers, by type.
void SetOptimizerDefaults(OptimizerConfig* o) {
  const std::string type = o->type;
  *o = OptimizerConfig{};
  o->type = type;
  if (type == "adagrad") o->lr = 1e-2, o->eps = 1e-10;
}

Status ReadBetas(ObjectReader& r, OptimizerConfig* o) {
  const Json* v = r.Find("betas");
  if (v == nullptr) return Status::Ok();
  const std::string path = r.KeyPath("betas");
  if (!v->is_array() || v->size() != 2 || !(*v)[0].is_number() || !(*v)[1].is_number())
    return ConfigError(path + ": expected a list of two numbers, got " + config_internal::DescribeJson(*v));
  const double b1 = (*v)[0].get<double>(), b2 = (*v)[1].get<double>();
  if (!(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1))
    return ConfigError(path + ": " + config_internal::BriefJson(*v) + " is out of range; allowed: each in [0, 1)");
  o->beta1 = b1, o->beta2 = b2;
  return Status::Ok();
}

Status ReadOptimizerParams(ObjectReader r, OptimizerConfig* o, std::vector<std::string>* warnings) {
  constexpr double kMax = std::numeric_limits<double>::max();
  STRATA_RETURN_IF_ERROR(r.Double("lr", &o->lr, 0, kMax));
  STRATA_RETURN_IF_ERROR(ReadBetas(r, o));
  STRATA_RETURN_IF_ERROR(r.Double("eps", &o->eps, 0, kMax));
  STRATA_RETURN_IF_ERROR(r.Double("weight_decay", &o->weight_decay, 0, kMax));
  STRATA_RETURN_IF_ERROR(r.Bool("adam_w_mode", &o->adam_w_mode));
  if (o->type == "adamw") o->adam_w_mode = true;  // as in DeepSpeed: AdamW is always decoupled
  STRATA_RETURN_IF_ERROR(r.Bool("bias_correction", &o->bias_correction));
  STRATA_RETURN_IF_ERROR(r.Choice("moment_update", &o->moment_update, {"mul_add", "lerp"}));
  if (o->moment_update != "mul_add" && o->type != "adam" && o->type != "adamw")
    return ConfigError(r.KeyPath("moment_update") + ": \"" + o->moment_update + "\" is Adam's and AdamW's; " +
                       o->type + " has no first moment of that form; allowed: mul_add (or leave it out)");
  // The kernels always correct the bias; false would be ignored, so it is refused.
  if (!o->bias_correction)
    return ConfigError(r.KeyPath("bias_correction") + ": false is not supported (the update always corrects the "
                       "moments' bias); allowed: true");
  bool flag = false;
  STRATA_RETURN_IF_ERROR(r.Bool("amsgrad", &flag));
  if (flag) return ConfigError(r.KeyPath("amsgrad") + ": true is not supported; allowed: false");
  STRATA_RETURN_IF_ERROR(r.Bool("torch_adam", &flag));
  if (flag) warnings->push_back(r.KeyPath("torch_adam") + ": ignored; Strata always steps with its own CPU optimizer");
  return r.CheckUnknownKeys();
}

Status ReadOptimizer(ObjectReader r, OptimizerConfig* o, std::vector<std::string>* warnings) {
  const Json* type = r.Find("type");
  if (type != nullptr && type->is_string()) {
    static const std::set<std::string> kDeepSpeedOnly = {"lamb", "onebitadam", "zerooneadam", "onebitlamb",
                                                         "muadam", "muadamw", "musgd"};
    std::string lower = type->get<std::string>();
    for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (kDeepSpeedOnly.count(lower))
      return ConfigError(r.KeyPath("type") + ": \"" + type->get<std::string>() +
                         "\" is a DeepSpeed optimizer that Strata does not implement; allowed: Adam, AdamW, Lion, Adagrad");
  }
  STRATA_RETURN_IF_ERROR(r.Choice("type", &o->type, {"adam", "adamw", "lion", "adagrad"}));
  SetOptimizerDefaults(o);
  STRATA_ASSIGN_OR_RETURN(ObjectReader params, r.Object("params"));
  STRATA_RETURN_IF_ERROR(ReadOptimizerParams(params, o, warnings));
  r.Unimplemented({"legacy_fusion"}, warnings);
  return r.CheckUnknownKeys();
}

Status ReadStrata(ObjectReader r, StrataConfig* s) {
  STRATA_RETURN_IF_ERROR(r.ByteSize("device_budget", &s->device_budget, 1));
  STRATA_RETURN_IF_ERROR(r.ByteSize("host_budget", &s->host_budget, 1));
  STRATA_RETURN_IF_ERROR(r.StringList("nvme_paths", &s->nvme_paths));
  STRATA_RETURN_IF_ERROR(r.String("trace_path", &s->trace_path));
  STRATA_RETURN_IF_ERROR(r.Bool("checksums", &s->checksums));
  STRATA_RETURN_IF_ERROR(r.Double("timeout", &s->timeout_s, 0.001, 1e7));
  STRATA_RETURN_IF_ERROR(r.Bool("comm_shared_memory", &s->comm_shared_memory));
  STRATA_RETURN_IF_ERROR(r.Int("io_rings", &s->io_rings, 1, 64));
  STRATA_RETURN_IF_ERROR(r.Choice("io_backend", &s->io_backend, {"auto", "io_uring", "threads"}));
  STRATA_RETURN_IF_ERROR(r.Choice("step_io", &s->step_io, {"alternate", "concurrent"}));
  STRATA_RETURN_IF_ERROR(r.Choice("write_behind", &s->write_behind, {"auto", "always", "never"}));
  STRATA_RETURN_IF_ERROR(r.Choice("nonfinite", &s->nonfinite, {"skip", "error", "apply"}));
  STRATA_RETURN_IF_ERROR(r.Choice("grad_reduce", &s->grad_reduce, {"mean", "sum"}));
  STRATA_RETURN_IF_ERROR(r.Choice("state_format", &s->state_format, {"fp32", "compact"}));
  STRATA_RETURN_IF_ERROR(r.Bool("device_pool", &s->device_pool));
  STRATA_RETURN_IF_ERROR(r.Choice("gpu_optimizer", &s->gpu_optimizer, {"auto", "off"}));
  STRATA_RETURN_IF_ERROR(r.Choice("numa_bind", &s->numa_bind, {"auto", "off"}));
  STRATA_RETURN_IF_ERROR(r.Choice("speculation", &s->speculation, {"auto", "always", "never"}));
  STRATA_RETURN_IF_ERROR(r.Choice("grad_home", &s->grad_home, {"auto", "host", "nvme"}));
  STRATA_RETURN_IF_ERROR(r.ByteSize("activation_host_bytes", &s->activation_host_bytes, 0));
  STRATA_RETURN_IF_ERROR(r.ByteSize("activation_nvme_bytes", &s->activation_nvme_bytes, 0));
  STRATA_RETURN_IF_ERROR(r.ByteSize("activation_prefetch_bytes", &s->activation_prefetch_bytes, 0));
  // "auto" (and absent) leave kSpeculationAuto; 0 is "none".
  STRATA_RETURN_IF_ERROR(r.ByteSize("speculation_host_bytes", &s->speculation_host_bytes, 0));
  STRATA_RETURN_IF_ERROR(r.ByteSize("speculation_disk_bytes", &s->speculation_disk_bytes, 0));
  return r.CheckUnknownKeys();
}

Status ReadTop(ObjectReader& top, Config* c) {
  STRATA_RETURN_IF_ERROR(ReadZero(top, c));
  STRATA_ASSIGN_OR_RETURN(ObjectReader aio, top.Object("aio"));
  STRATA_RETURN_IF_ERROR(ReadAio(aio, &c->aio, &c->warnings));
  STRATA_RETURN_IF_ERROR(ReadBf16(top, c));
  STRATA_ASSIGN_OR_RETURN(ObjectReader fp16, top.Object("fp16"));
  STRATA_RETURN_IF_ERROR(ReadFp16(fp16, &c->fp16, &c->warnings));
  STRATA_RETURN_IF_ERROR(top.Double("gradient_clipping", &c->gradient_clipping, 0, std::numeric_limits<double>::max()));
  STRATA_ASSIGN_OR_RETURN(ObjectReader types, top.Object("data_types"));
  STRATA_RETURN_IF_ERROR(types.Choice("grad_accum_dtype", &c->grad_accum_dtype, {"fp32", "bf16"}));
  STRATA_RETURN_IF_ERROR(types.CheckUnknownKeys());
  STRATA_ASSIGN_OR_RETURN(ObjectReader opt, top.Object("optimizer"));
  STRATA_RETURN_IF_ERROR(ReadOptimizer(opt, &c->optimizer, &c->warnings));
  STRATA_ASSIGN_OR_RETURN(ObjectReader strata, top.Object("strata"));
  STRATA_RETURN_IF_ERROR(ReadStrata(strata, &c->strata));
  top.Noted({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "scheduler",
             "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "dump_state",
             "prescale_gradients", "gradient_predivide_factor", "activation_checkpointing", "flops_profiler",
             "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "seed", "dataloader_drop_last",
             "data_efficiency", "curriculum_learning", "sparse_gradients", "autotuning", "elasticity",
             "timers", "monitor_config"},
            &c->notes);
  top.Unimplemented({"amp", "zero_force_ds_cpu_optimizer", "memory_breakdown", "fp32_allreduce",
                     "disable_allgather", "communication_data_type",
                     "seq_parallel_communication_data_type", "sparse_attention", "pipeline", "checkpoint",
                     "compression_training", "quantize_training", "eigenvalue", "progressive_layer_drop",
                     "hybrid_engine", "nebula", "weight_quantization", "compile", "graph_harvesting",
                     "torch_autocast", "use_data_before_expert_parallelism"},
                    &c->warnings);
  return top.CheckUnknownKeys();
}

// Logs each note and warning once per process (a trainer re-reads its config
// on every rank and restart; one line each is enough).
void LogDiagnostics(const Config& c) {
  static std::mutex mu;  // guards `noted`
  static std::set<std::string> noted;
  for (const auto& note : c.notes) {
    std::lock_guard<std::mutex> lock(mu);
    if (noted.insert(note).second) STRATA_LOG_INFO("config: {}: left to the trainer", note);
  }
  for (const auto& warning : c.warnings) WarnOnce("config " + warning, "config: " + warning);
}

}  // namespace

const char* OffloadDeviceName(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
    case OffloadDevice::kNone: break;
  }
  return "none";
}

DType Config::grad_dtype() const { return grad_accum_dtype == "bf16" ? DType::kBF16 : DType::kF32; }

DType Config::compute_dtype() const {
  if (fp16.enabled) return DType::kF16;
  return bf16 ? DType::kBF16 : DType::kF32;
}

std::vector<std::string> Config::ParamSwapPaths() const {
  if (zero.offload_param.device != OffloadDevice::kNvme) return {};
  if (!strata.nvme_paths.empty()) return strata.nvme_paths;
  return {zero.offload_param.nvme_path};
}

std::vector<std::string> Config::OptimizerSwapPaths() const {
  if (zero.offload_optimizer.device != OffloadDevice::kNvme) return {};
  if (!strata.nvme_paths.empty()) return strata.nvme_paths;
  return {zero.offload_optimizer.nvme_path};
}

bool Config::any_pinned() const {
  return (zero.offload_param.device != OffloadDevice::kNone && zero.offload_param.pin_memory) ||
         (zero.offload_optimizer.device != OffloadDevice::kNone && zero.offload_optimizer.pin_memory);
}

bool Config::operator==(const Config& o) const {
  return zero == o.zero && aio == o.aio && bf16 == o.bf16 && fp16 == o.fp16 &&
         gradient_clipping == o.gradient_clipping && grad_accum_dtype == o.grad_accum_dtype &&
         optimizer == o.optimizer && strata == o.strata;
}

// Keys read (and range-checked) so that a ds_config.json loads, but with no
// effect in Strata: set to other than DeepSpeed's default, each is named in
// one warning, never ignored without a word.
void WarnNoEffect(Config* c) {
  const Config d;
  std::vector<std::string> keys;
  auto note = [&](bool differs, const char* key) {
    if (differs) keys.push_back(key);
  };
  const auto &z = c->zero, &dz = d.zero;
  note(z.offload_param.max_in_cpu != dz.offload_param.max_in_cpu, "zero_optimization.offload_param.max_in_cpu");
  note(z.offload_optimizer.pipeline_read, "zero_optimization.offload_optimizer.pipeline_read");
  note(z.offload_optimizer.pipeline_write, "zero_optimization.offload_optimizer.pipeline_write");
  note(z.offload_optimizer.ratio != dz.offload_optimizer.ratio, "zero_optimization.offload_optimizer.ratio");
  note(z.max_live_parameters != dz.max_live_parameters, "zero_optimization.stage3_max_live_parameters");
  note(z.max_reuse_distance != dz.max_reuse_distance, "zero_optimization.stage3_max_reuse_distance");
  note(z.param_persistence_threshold != dz.param_persistence_threshold,
       "zero_optimization.stage3_param_persistence_threshold");
  note(c->aio.thread_count != d.aio.thread_count, "aio.intra_op_parallelism");
  note(c->aio.single_submit != d.aio.single_submit, "aio.single_submit");
  note(c->aio.overlap_events != d.aio.overlap_events, "aio.overlap_events");
  if (keys.empty()) return;
  std::string list;
  for (const auto& k : keys) list += (list.empty() ? "" : ", ") + k;
  c->warnings.push_back(list + ": set, but without effect in Strata (it plans its own groups, prefetch and I/O)");
}

Result<Config> ParseConfig(std::string_view json_text) {
  STRATA_ASSIGN_OR_RETURN(Json doc, config_internal::ParseConfigJson(json_text));
  if (!doc.is_object())
    return ConfigError("config: the top level must be a JSON object, got " + config_internal::DescribeJson(doc));
  Config config;
  ObjectReader top(&doc, "");
  STRATA_RETURN_IF_ERROR(ReadTop(top, &config));
  STRATA_RETURN_IF_ERROR(config_internal::CheckConfigConsistency(config));
  WarnNoEffect(&config);
  LogDiagnostics(config);
  return config;
}

Result<Config> LoadConfigFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    return ConfigError("config file " + path + ": cannot open: " + std::strerror(err));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return ConfigError("config file " + path + ": read failed");
  Result<Config> config = ParseConfig(text.str());
  if (!config.ok()) return config.status().WithContext("config file " + path);
  return config;
}

std::string ConfigToJson(const Config& c) {
  const auto& p = c.zero.offload_param;
  const auto& o = c.zero.offload_optimizer;
  const auto budget = [](uint64_t b) { return b == 0 ? Json("auto") : Json(b); };
  const auto speculation = [](uint64_t b) { return b == StrataConfig::kSpeculationAuto ? Json("auto") : Json(b); };
  Json doc = {
      {"zero_optimization",
       {{"stage", c.zero.stage},
        {"offload_param",
         {{"device", OffloadDeviceName(p.device)}, {"nvme_path", p.nvme_path}, {"pin_memory", p.pin_memory},
          {"buffer_count", p.buffer_count}, {"buffer_size", p.buffer_size}, {"max_in_cpu", p.max_in_cpu}}},
        {"offload_optimizer",
         {{"device", OffloadDeviceName(o.device)}, {"nvme_path", o.nvme_path}, {"pin_memory", o.pin_memory},
          {"buffer_count", o.buffer_count}, {"pipeline_read", o.pipeline_read},
          {"pipeline_write", o.pipeline_write}, {"ratio", o.ratio}}},
        {"stage3_prefetch_bucket_size", c.zero.prefetch_bucket_size},
        {"stage3_max_live_parameters", c.zero.max_live_parameters},
        {"stage3_max_reuse_distance", c.zero.max_reuse_distance},
        {"stage3_param_persistence_threshold", c.zero.param_persistence_threshold},
        {"sub_group_size", c.zero.sub_group_size},
        {"reduce_bucket_size", c.zero.reduce_bucket_size},
        {"overlap_comm", c.zero.overlap_comm},
        {"contiguous_gradients", c.zero.contiguous_gradients}}},
      {"aio",
       {{"block_size", c.aio.block_size}, {"queue_depth", c.aio.queue_depth},
        {"intra_op_parallelism", c.aio.thread_count}, {"single_submit", c.aio.single_submit},
        {"overlap_events", c.aio.overlap_events}}},
      {"bf16", {{"enabled", c.bf16}}},
      {"fp16",
       {{"enabled", c.fp16.enabled}, {"loss_scale", c.fp16.loss_scale},
        {"initial_scale_power", c.fp16.initial_scale_power}, {"loss_scale_window", c.fp16.loss_scale_window},
        {"hysteresis", c.fp16.hysteresis}, {"min_loss_scale", c.fp16.min_loss_scale}}},
      {"gradient_clipping", c.gradient_clipping},
      {"data_types", {{"grad_accum_dtype", c.grad_accum_dtype}}},
      {"optimizer",
       {{"type", c.optimizer.type},
        {"params",
         {{"lr", c.optimizer.lr}, {"betas", {c.optimizer.beta1, c.optimizer.beta2}}, {"eps", c.optimizer.eps},
          {"weight_decay", c.optimizer.weight_decay}, {"adam_w_mode", c.optimizer.adam_w_mode},
          {"bias_correction", c.optimizer.bias_correction}, {"moment_update", c.optimizer.moment_update}}}}},
      {"strata",
       {{"device_budget", budget(c.strata.device_budget)}, {"host_budget", budget(c.strata.host_budget)},
        {"nvme_paths", c.strata.nvme_paths}, {"trace_path", c.strata.trace_path},
        {"checksums", c.strata.checksums}, {"timeout", c.strata.timeout_s},
        {"comm_shared_memory", c.strata.comm_shared_memory}, {"io_rings", c.strata.io_rings},
        {"io_backend", c.strata.io_backend},
        {"step_io", c.strata.step_io}, {"write_behind", c.strata.write_behind}, {"nonfinite", c.strata.nonfinite},
        {"grad_reduce", c.strata.grad_reduce}, {"state_format", c.strata.state_format},
        {"device_pool", c.strata.device_pool},
        {"gpu_optimizer", c.strata.gpu_optimizer},
        {"numa_bind", c.strata.numa_bind},
        {"speculation", c.strata.speculation},
        {"grad_home", c.strata.grad_home},
        {"activation_host_bytes", c.strata.activation_host_bytes},
        {"activation_nvme_bytes", c.strata.activation_nvme_bytes},
        {"activation_prefetch_bytes", c.strata.activation_prefetch_bytes},
        {"speculation_host_bytes", speculation(c.strata.speculation_host_bytes)},
        {"speculation_disk_bytes", speculation(c.strata.speculation_disk_bytes)}}},
  };
  return doc.dump(2, ' ', false, Json::error_handler_t::replace);  // a Config built in code may hold any bytes
}

}  // namespace strata
