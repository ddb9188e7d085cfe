// engine/config: DeepSpeed defaults, a real ZeRO-Infinity ds_config.json,
// the leniencies ("auto", 1e8, stage3_ names) and every refusal's message.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "engine/config/config.h"
#include "engine/config/config_reader.h"

namespace strata {
namespace {

constexpr uint64_t kGiB = 1ull << 30;

Config MustParse(const std::string& text) {
  Result<Config> c = ParseConfig(text);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : Config{};
}

// The refusal's message, which must have code kConfig.
std::string Refusal(const std::string& text) {
  Result<Config> c = ParseConfig(text);
  if (c.ok()) return "(accepted)";
  EXPECT_EQ(c.status().code(), Code::kConfig);
  return c.status().message();
}

std::string Refusal(const Status& s) {
  if (s.ok()) return "(accepted)";
  EXPECT_EQ(s.code(), Code::kConfig);
  return s.message();
}

bool Contains(const std::vector<std::string>& list, const std::string& prefix) {
  for (const auto& s : list) if (s.rfind(prefix, 0) == 0) return true;
  return false;
}

TEST(Config, EmptyDocumentHasDeepSpeedDefaults) {
  const Config c = MustParse("{}");
  EXPECT_EQ(c.zero.stage, 0);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(c.zero.offload_param.nvme_path, "");
  EXPECT_FALSE(c.zero.offload_param.pin_memory);
  EXPECT_EQ(c.zero.offload_param.buffer_count, 5u);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 100000000u);
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 1000000000u);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_FALSE(c.zero.offload_optimizer.pin_memory);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4u);
  EXPECT_FALSE(c.zero.offload_optimizer.pipeline_read);
  EXPECT_FALSE(c.zero.offload_optimizer.pipeline_write);
  EXPECT_EQ(c.zero.offload_optimizer.ratio, 1.0);
  EXPECT_EQ(c.zero.prefetch_bucket_size, 50000000u);
  EXPECT_EQ(c.zero.max_live_parameters, 1000000000u);
  EXPECT_EQ(c.zero.max_reuse_distance, 1000000000u);
  EXPECT_EQ(c.zero.param_persistence_threshold, 100000u);
  EXPECT_EQ(c.zero.sub_group_size, 4194304u) << "Strata's default, not DeepSpeed's 1e9";
  EXPECT_EQ(c.aio.block_size, 1048576u);
  EXPECT_EQ(c.aio.queue_depth, 8u);
  EXPECT_EQ(c.aio.thread_count, 1u);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_FALSE(c.bf16);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000u);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_EQ(c.optimizer.type, "adamw");
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(c.optimizer.beta1, 0.9);
  EXPECT_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_TRUE(c.optimizer.bias_correction);
  EXPECT_EQ(c.strata.device_budget, 0u);
  EXPECT_EQ(c.strata.host_budget, 0u);
  EXPECT_TRUE(c.strata.nvme_paths.empty());
  EXPECT_EQ(c.strata.trace_path, "");
  EXPECT_TRUE(c.strata.checksums);
  EXPECT_EQ(c.strata.timeout_s, 300.0);
  EXPECT_EQ(c.strata.io_rings, 1);
  EXPECT_TRUE(c.strata.comm_shared_memory);
  EXPECT_EQ(c.strata.step_io, "alternate");
  EXPECT_EQ(c.strata.write_behind, "auto");
  EXPECT_EQ(c.strata.gpu_optimizer, "auto");
  EXPECT_EQ(c.strata.grad_home, "auto");
  EXPECT_EQ(c.compute_dtype(), DType::kF32);
  EXPECT_TRUE(c.notes.empty());
  EXPECT_TRUE(c.warnings.empty());
  EXPECT_EQ(c, Config{});
}

// A ZeRO-Infinity config as DeepSpeed's tutorials and HF examples write them.
const char* kInfinityConfig = R"({
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 16,
  "steps_per_print": 10,
  "wall_clock_breakdown": false,
  "gradient_clipping": 1.0,
  "bf16": {"enabled": true},
  "optimizer": {
    "type": "AdamW",
    "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 1000}
  },
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": true,
    "overlap_comm": true,
    "reduce_bucket_size": 5e8,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_param_persistence_threshold": 1e5,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "sub_group_size": 1e8,
    "stage3_gather_16bit_weights_on_model_save": true,
    "offload_param": {
      "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
      "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9
    },
    "offload_optimizer": {
      "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
      "buffer_count": 4, "pipeline_read": false, "pipeline_write": false, "fast_init": false
    }
  },
  "aio": {
    "block_size": 1048576, "queue_depth": 16, "thread_count": 2,
    "single_submit": false, "overlap_events": true
  },
  "strata": {"host_budget": "64GiB", "nvme_paths": ["/nvme0/swap", "/nvme1/swap"], "io_rings": 2,
             "step_io": "concurrent", "comm_shared_memory": false, "write_behind": "never"}
})";

TEST(Config, ZeroInfinityDsConfigParses) {
  const Config c = MustParse(kInfinityConfig);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.zero.offload_param.nvme_path, "/local_nvme");
  EXPECT_TRUE(c.zero.offload_param.pin_memory);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 100000000u);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.zero.sub_group_size, 100000000u);
  EXPECT_EQ(c.aio.queue_depth, 16u);
  EXPECT_EQ(c.aio.thread_count, 2u);
  EXPECT_TRUE(c.bf16);
  EXPECT_EQ(c.compute_dtype(), DType::kBF16);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.optimizer.type, "adamw");
  EXPECT_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_EQ(c.strata.host_budget, 64 * kGiB);
  EXPECT_EQ(c.strata.io_rings, 2);
  EXPECT_EQ(c.strata.step_io, "concurrent");
  EXPECT_EQ(c.strata.write_behind, "never");
  EXPECT_FALSE(c.strata.comm_shared_memory);
  EXPECT_EQ(c.ParamSwapPaths(), (std::vector<std::string>{"/nvme0/swap", "/nvme1/swap"}));
  EXPECT_EQ(c.OptimizerSwapPaths(), c.ParamSwapPaths());
  EXPECT_EQ(c.notes, (std::vector<std::string>{"train_batch_size", "train_micro_batch_size_per_gpu",
                                               "gradient_accumulation_steps", "scheduler", "steps_per_print",
                                               "wall_clock_breakdown"}));
  EXPECT_TRUE(c.zero.overlap_comm);  // implemented now: gradients reduced on a communication thread
  EXPECT_FALSE(Contains(c.warnings, "overlap_comm"));
  EXPECT_TRUE(Contains(c.warnings, "zero_optimization.offload_optimizer.fast_init"));
  EXPECT_TRUE(Contains(c.warnings, "zero_optimization.stage3_gather_16bit_weights_on_model_save"));
}

TEST(Config, GradientReductionKeys) {
  Config c = MustParse(R"({"zero_optimization": {"stage": 3}})");
  EXPECT_TRUE(c.zero.overlap_comm);  // DeepSpeed's default at stage 3
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000u);
  c = MustParse(R"({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7}})");
  EXPECT_FALSE(c.zero.overlap_comm);  // and below it
  EXPECT_EQ(c.zero.reduce_bucket_size, 50000000u);
  c = MustParse(R"({"zero_optimization": {"stage": 3, "overlap_comm": false, "contiguous_gradients": false}})");
  EXPECT_FALSE(c.zero.overlap_comm);
  EXPECT_TRUE(Contains(c.warnings, "zero_optimization.contiguous_gradients: false changes nothing"));
  auto bad = ParseConfig(R"({"zero_optimization": {"reduce_bucket_size": 0}})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("zero_optimization.reduce_bucket_size"), std::string::npos)
      << bad.status().message();
  bad = ParseConfig(R"({"zero_optimization": {"overlap_comm": "yes"}})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("zero_optimization.overlap_comm"), std::string::npos);
  // The JSON the engine writes reads back to the same config.
  const Config back = MustParse(ConfigToJson(c));
  EXPECT_EQ(back.zero, c.zero);
}

TEST(Config, UnimplementedDeepSpeedKeyIsAWarningNotAnError) {
  const Config c = MustParse(R"({"zero_optimization": {"round_robin_gradients": true}, "amp": {"enabled": false}})");
  ASSERT_EQ(c.warnings.size(), 2u);
  EXPECT_EQ(c.warnings[0],
            "zero_optimization.round_robin_gradients: a DeepSpeed key that Strata does not implement; ignored");
  EXPECT_EQ(c.warnings[1], "amp: a DeepSpeed key that Strata does not implement; ignored");
}

TEST(Config, Stage3AndBareNamesBothWork) {
  const Config a = MustParse(R"({"zero_optimization": {"stage3_max_live_parameters": 123,
      "stage3_prefetch_bucket_size": 7, "stage3_max_reuse_distance": 8, "stage3_param_persistence_threshold": 9}})");
  const Config b = MustParse(R"({"zero_optimization": {"max_live_parameters": 123,
      "prefetch_bucket_size": 7, "max_reuse_distance": 8, "param_persistence_threshold": 9}})");
  EXPECT_EQ(a.zero.max_live_parameters, 123u);
  EXPECT_EQ(a.zero.prefetch_bucket_size, 7u);
  EXPECT_EQ(a.zero.max_reuse_distance, 8u);
  EXPECT_EQ(a.zero.param_persistence_threshold, 9u);
  EXPECT_EQ(a, b);
  // Both spellings with one value are fine; with two values they contradict.
  EXPECT_EQ(MustParse(R"({"zero_optimization": {"max_live_parameters": 5, "stage3_max_live_parameters": 5}})")
                .zero.max_live_parameters, 5u);
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"stage3_max_live_parameters": 5, "max_live_parameters": 6}})"),
            "zero_optimization.max_live_parameters: 6 contradicts zero_optimization.stage3_max_live_parameters: "
            "5 (two spellings of one key; give one)");
  EXPECT_EQ(MustParse(R"({"aio": {"intra_op_parallelism": 4}})").aio.thread_count, 4u);
}

TEST(Config, AutoAndNullMeanTheDefault) {
  const Config c = MustParse(R"({"zero_optimization": {"stage": "auto", "offload_param": "auto",
      "stage3_prefetch_bucket_size": "auto", "offload_optimizer": {"device": "auto"}},
      "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", "loss_scale": null},
      "gradient_clipping": "auto", "train_batch_size": "auto",
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}},
      "strata": {"device_budget": "auto", "host_budget": "auto", "timeout": "auto"}})");
  Config expected;
  EXPECT_EQ(c, expected);
  EXPECT_TRUE(c.notes.empty());  // an "auto" trainer key says nothing
}

TEST(Config, ExponentNumbersAreIntegersWhenWhole) {
  const Config c = MustParse(R"({"zero_optimization": {"offload_param": {"buffer_size": 2.5e8,
      "max_in_cpu": 1e10}, "sub_group_size": 1E9}, "aio": {"block_size": 2.62144e5}})");
  EXPECT_EQ(c.zero.offload_param.buffer_size, 250000000u);
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 10000000000u);
  EXPECT_EQ(c.zero.sub_group_size, 1000000000u);
  EXPECT_EQ(c.aio.block_size, 262144u);
}

TEST(Config, StrataBudgetsTakeSizesOrNumbers) {
  const Config c = MustParse(R"({"strata": {"device_budget": "8GiB", "host_budget": 1e9,
      "trace_path": "/tmp/t.json", "checksums": false, "timeout": 2.5}})");
  EXPECT_EQ(c.strata.device_budget, 8 * kGiB);
  EXPECT_EQ(c.strata.host_budget, 1000000000u);
  EXPECT_EQ(c.strata.trace_path, "/tmp/t.json");
  EXPECT_FALSE(c.strata.checksums);
  EXPECT_EQ(c.strata.timeout_s, 2.5);
}

TEST(Config, OptimizerTypesAndDeepSpeedAdamSemantics) {
  EXPECT_EQ(MustParse(R"({"optimizer": {"type": "Adam"}})").optimizer.adam_w_mode, true);
  const Config adam_l2 = MustParse(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false,
      "torch_adam": false, "bias_correction": true}}})");
  EXPECT_EQ(adam_l2.optimizer.type, "adam");
  EXPECT_FALSE(adam_l2.optimizer.adam_w_mode);
  EXPECT_TRUE(adam_l2.optimizer.bias_correction);  // false is refused: BiasCorrectionOffIsRefusedNotIgnored
  EXPECT_TRUE(MustParse(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})")
                  .optimizer.adam_w_mode);
  const Config adagrad = MustParse(R"({"optimizer": {"type": "Adagrad"}})");
  EXPECT_EQ(adagrad.optimizer.lr, 1e-2);
  EXPECT_EQ(adagrad.optimizer.eps, 1e-10);
  EXPECT_EQ(MustParse(R"({"optimizer": {"type": "lion"}})").optimizer.type, "lion");
  EXPECT_EQ(Refusal(R"({"optimizer": {"type": "Lamb"}})"),
            "optimizer.type: \"Lamb\" is a DeepSpeed optimizer that Strata does not implement; "
            "allowed: Adam, AdamW, Lion, Adagrad");
  EXPECT_EQ(Refusal(R"({"optimizer": {"type": "sgdd"}})"),
            "optimizer.type: \"sgdd\" is not one of adam, adamw, lion, adagrad");
  EXPECT_EQ(Refusal(R"({"optimizer": {"params": {"betas": [0.9]}}})"),
            "optimizer.params.betas: expected a list of two numbers, got array [0.9]");
  EXPECT_EQ(Refusal(R"({"optimizer": {"params": {"amsgrad": true}}})"),
            "optimizer.params.amsgrad: true is not supported; allowed: false");
}

TEST(Config, DeprecatedDeepSpeedFormsAreRead) {
  const Config c = MustParse(R"({"zero_optimization": {"stage": 2, "cpu_offload": true}})");
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_FALSE(c.warnings.empty());
  EXPECT_EQ(MustParse(R"({"zero_optimization": true})").zero.stage, 1);
  EXPECT_TRUE(MustParse(R"({"bfloat16": {"enabled": true}})").bf16);
}

TEST(ConfigRefusal, BiasCorrectionOffIsRefusedNotIgnored) {
  EXPECT_EQ(Refusal(R"({"optimizer": {"type": "Adam", "params": {"bias_correction": false}}})"),
            "optimizer.params.bias_correction: false is not supported (the update always corrects the moments' "
            "bias); allowed: true");
  EXPECT_TRUE(MustParse(R"({"optimizer": {"type": "Adam", "params": {"bias_correction": true}}})")
                  .optimizer.bias_correction);
}

TEST(Config, KeysWithoutEffectAreNamedWhenSet) {
  EXPECT_TRUE(MustParse(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e9}})").warnings.empty())
      << "DeepSpeed's default values say nothing";
  const Config c = MustParse(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e8,
      "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "aio": {"single_submit": true}})");
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_EQ(c.warnings[0],
            "zero_optimization.offload_optimizer.ratio, aio.single_submit: set, "
            "but without effect in Strata (it plans its own groups, prefetch and I/O)")
      << "sub_group_size bounds the step's units (step_units_test): not a key without effect";
}

TEST(Config, GradReduceDefaultsToTheMean) {
  EXPECT_EQ(MustParse("{}").strata.grad_reduce, "mean");
  const Config sum = MustParse(R"({"strata": {"grad_reduce": "sum"}})");
  EXPECT_EQ(sum.strata.grad_reduce, "sum");
  EXPECT_EQ(MustParse(ConfigToJson(sum)), sum);
  Config bad;
  bad.strata.grad_reduce = "median";
  Status st = ValidateConfig(bad, ConfigFacts{});
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("strata.grad_reduce"), std::string::npos) << st.ToString();
}

TEST(Config, GpuOptimizerIsAutoOrOff) {
  const Config off = MustParse(R"({"strata": {"gpu_optimizer": "OFF"}})");
  EXPECT_EQ(off.strata.gpu_optimizer, "off");
  EXPECT_EQ(MustParse(ConfigToJson(off)), off);
  EXPECT_EQ(MustParse(R"({"strata": {"gpu_optimizer": "auto"}})").strata.gpu_optimizer, "auto");
  Config bad;
  bad.strata.gpu_optimizer = "cuda";
  const Status st = ValidateConfig(bad, ConfigFacts{});
  EXPECT_EQ(st.message(), "strata.gpu_optimizer: \"cuda\" is not one of auto, off") << st.ToString();
}

// optimizer.params.moment_update: Adam/AdamW's first-moment arithmetic,
// "mul_add" (torch 1.x, the default) or "lerp" (torch >= 2.0).
TEST(Config, MomentUpdateIsMulAddOrLerp) {
  EXPECT_EQ(Config{}.optimizer.moment_update, "mul_add");
  EXPECT_EQ(MustParse("{}").optimizer.moment_update, "mul_add");
  for (const char* type : {"Adam", "AdamW"}) {
    const Config c = MustParse(std::string(R"({"optimizer": {"type": ")") + type +
                               R"(", "params": {"moment_update": "LERP"}}})");
    EXPECT_EQ(c.optimizer.moment_update, "lerp") << type;
    EXPECT_EQ(MustParse(ConfigToJson(c)), c) << type;  // the resolved config keeps it
  }
  EXPECT_EQ(MustParse(R"({"optimizer": {"params": {"moment_update": "mul_add"}}})").optimizer.moment_update,
            "mul_add");
  EXPECT_EQ(Refusal(R"({"optimizer": {"params": {"moment_update": "fma"}}})"),
            "optimizer.params.moment_update: \"fma\" is not one of mul_add, lerp");
  EXPECT_EQ(Refusal(R"({"optimizer": {"params": {"moment_update": 1}}})").rfind("optimizer.params.moment_update: ", 0),
            0u);
  EXPECT_EQ(Refusal(R"({"optimizer": {"type": "Lion", "params": {"moment_update": "lerp"}}})"),
            "optimizer.params.moment_update: \"lerp\" is Adam's and AdamW's; lion has no first moment of that form; "
            "allowed: mul_add (or leave it out)");
  EXPECT_EQ(MustParse(R"({"optimizer": {"type": "Adagrad", "params": {"moment_update": "mul_add"}}})")
                .optimizer.moment_update,
            "mul_add");
  Config bad;
  bad.optimizer.moment_update = "Lerp";  // built in code: held to the parse rules
  EXPECT_EQ(Refusal(ValidateConfig(bad, ConfigFacts{})),
            "optimizer.params.moment_update: \"Lerp\" is not one of mul_add, lerp");
  bad.optimizer.moment_update = "lerp";
  bad.optimizer.type = "adagrad";
  EXPECT_EQ(Refusal(ValidateConfig(bad, ConfigFacts{})).rfind("optimizer.params.moment_update: \"lerp\" is Adam's", 0),
            0u);
}

TEST(Config, ToJsonRoundTrips) {
  Config c = MustParse(kInfinityConfig);
  const Config back = MustParse(ConfigToJson(c));
  EXPECT_EQ(back, c);
  EXPECT_EQ(MustParse(ConfigToJson(Config{})), Config{});
}

// ---- Refusals at parse time ----

TEST(ConfigRefusal, UnknownKeyNamesTheNearestValidKey) {
  EXPECT_EQ(Refusal(R"({"zero_optimisation": {}})"), "zero_optimisation: unknown key; did you mean 'zero_optimization'?");
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"offload_optimizer": {"devce": "cpu"}}})"),
            "zero_optimization.offload_optimizer.devce: unknown key; did you mean 'device'?");
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"stage3_max_live_params": 1}})"),
            "zero_optimization.stage3_max_live_params: unknown key; did you mean 'stage3_max_live_parameters'?");
  EXPECT_EQ(Refusal(R"({"strata": {"host_budgit": "1GiB"}})"),
            "strata.host_budgit: unknown key; did you mean 'host_budget'?");
  EXPECT_EQ(Refusal(R"({"aio": {"queue_dept": 8}})"), "aio.queue_dept: unknown key; did you mean 'queue_depth'?");
}

TEST(ConfigRefusal, BadEnumNamesWhatIsAllowed) {
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"stage": 5}})"), "zero_optimization.stage: 5 is not one of 0, 1, 2, 3");
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"offload_param": {"device": "disk"}}})"),
            "zero_optimization.offload_param.device: \"disk\" is not one of none, cpu, nvme");
  EXPECT_EQ(Refusal(R"({"strata": {"step_io": "mixed"}})"),
            "strata.step_io: \"mixed\" is not one of alternate, concurrent");
  EXPECT_EQ(Refusal(R"({"strata": {"grad_reduce": "avg"}})"),
            "strata.grad_reduce: \"avg\" is not one of mean, sum");
  EXPECT_EQ(Refusal(R"({"strata": {"gpu_optimizer": "on"}})"),
            "strata.gpu_optimizer: \"on\" is not one of auto, off");
  EXPECT_EQ(Refusal(R"({"strata": {"grad_home": "disk"}})"),
            "strata.grad_home: \"disk\" is not one of auto, host, nvme");
  // G beside W, M, V: on NVMe only when they are.
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "strata": {"grad_home": "nvme"}})"),
            "strata.grad_home: \"nvme\" needs zero_optimization.offload_optimizer.device \"nvme\" (G lives beside W, "
            "M, V; with them on the host or the device it is host memory)");
}

TEST(ConfigRefusal, BadTypeNamesTheKeyAndTheType) {
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"offload_param": {"pin_memory": "yes"}}})"),
            "zero_optimization.offload_param.pin_memory: expected true or false, got string \"yes\"");
  EXPECT_EQ(Refusal(R"({"bf16": {"enabled": 1}})"), "bf16.enabled: expected true or false, got number 1");
  EXPECT_EQ(Refusal(R"({"aio": {"queue_depth": "8"}})"),
            "aio.queue_depth: expected a non-negative integer, got string \"8\"");
  EXPECT_EQ(Refusal(R"({"aio": []})"), "aio: expected an object, got array []");
  EXPECT_EQ(Refusal(R"({"strata": {"nvme_paths": "/nvme"}})"),
            "strata.nvme_paths: expected a list of strings, got string \"/nvme\"");
  EXPECT_EQ(Refusal(R"({"strata": {"nvme_paths": ["/a", 3]}})"),
            "strata.nvme_paths[1]: expected a non-empty string, got number 3");
  EXPECT_EQ(Refusal("[1, 2]"), "config: the top level must be a JSON object, got array [1,2]");
}

TEST(ConfigRefusal, NegativeAndFractionalIntegers) {
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"offload_param": {"buffer_count": -1}}})"),
            "zero_optimization.offload_param.buffer_count: -1 is negative; expected a non-negative integer");
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"offload_param": {"buffer_size": 2.5}}})"),
            "zero_optimization.offload_param.buffer_size: 2.5 is not a whole number; expected a non-negative integer");
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"offload_param": {"buffer_count": 0}}})"),
            "zero_optimization.offload_param.buffer_count: 0 is out of range; allowed: at least 1");
  EXPECT_EQ(Refusal(R"({"gradient_clipping": -1.0})"),
            "gradient_clipping: -1.0 is out of range; allowed: at least 0.0");
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})"),
            "zero_optimization.offload_optimizer.ratio: 1.5 is out of range; allowed: from 0.0 to 1.0");
  EXPECT_EQ(Refusal(R"({"aio": {"block_size": 1000000}})"),
            "aio.block_size: 1000000 is not a multiple of 4096 (O_DIRECT alignment)");
  // A byte size given as a number is below 2^63, as a size string must be:
  // 2^64 - 1 was taken silently as "auto" (its sentinel).
  EXPECT_NE(Refusal(R"({"strata": {"speculation_host_bytes": 18446744073709551615}})")
                .find("strata.speculation_host_bytes: 18446744073709551615 is out of range"),
            std::string::npos);
  EXPECT_NE(Refusal(R"({"strata": {"device_budget": 1e19}})").find("strata.device_budget"), std::string::npos);
  // A loss-scale window of 2^63 or more was taken, and read as negative: the
  // scale doubled at every clean step.
  const std::string window = Refusal(R"({"fp16": {"enabled": true, "loss_scale_window": 1e19}})");
  EXPECT_NE(window.find("fp16.loss_scale_window: "), std::string::npos) << window;
  EXPECT_NE(window.find("out of range"), std::string::npos) << window;
  // Element counts at most 2^56: their bytes never wrap (the prefetch window did).
  EXPECT_NE(Refusal(R"({"zero_optimization": {"stage3_prefetch_bucket_size": 9223372036854775808}})")
                .find("zero_optimization.stage3_prefetch_bucket_size: 9223372036854775808 is out of range"),
            std::string::npos);
}

TEST(ConfigRefusal, NvmeWithoutPath) {
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})"),
            "zero_optimization.offload_param.nvme_path: required when zero_optimization.offload_param.device "
            "is \"nvme\" (or list swap folders in strata.nvme_paths)");
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ""}}})"),
            "zero_optimization.offload_optimizer.nvme_path: required when zero_optimization.offload_optimizer.device "
            "is \"nvme\" (or list swap folders in strata.nvme_paths)");
  // strata.nvme_paths stands in for the per-section path.
  const Config c = MustParse(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}},
      "strata": {"nvme_paths": ["/nvme0"]}})");
  EXPECT_EQ(c.OptimizerSwapPaths(), std::vector<std::string>{"/nvme0"});
}

TEST(ConfigRefusal, BadByteSizeString) {
  EXPECT_EQ(Refusal(R"({"strata": {"host_budget": "8 gigs"}})"),
            "strata.host_budget: byte size '8 gigs' has an unknown unit 'gigs' (use B, KB, KiB, MB, MiB, GB, GiB, TB, TiB)");
  EXPECT_EQ(Refusal(R"({"strata": {"device_budget": 0}})"),
            "strata.device_budget: 0 is too small; allowed: at least 1 bytes, or \"auto\"");
  EXPECT_EQ(Refusal(R"({"strata": {"device_budget": true}})"),
            "strata.device_budget: expected a byte size (a number of bytes or a string like \"8GiB\") or \"auto\", "
            "got boolean true");
}

// overlap_step's speculation rooms: "auto" (the default), 0 (none) and a
// size are three different things, and survive the round trip.
TEST(Config, SpeculationRooms) {
  const Config dflt = MustParse("{}");
  EXPECT_EQ(dflt.strata.speculation_host_bytes, StrataConfig::kSpeculationAuto);
  EXPECT_EQ(dflt.strata.speculation_disk_bytes, StrataConfig::kSpeculationAuto);
  const Config set = MustParse(R"({"strata": {"speculation_host_bytes": 0, "speculation_disk_bytes": "3GiB"}})");
  EXPECT_EQ(set.strata.speculation_host_bytes, 0u);
  EXPECT_EQ(set.strata.speculation_disk_bytes, 3 * kGiB);
  EXPECT_EQ(MustParse(ConfigToJson(set)), set);
  const Config autos = MustParse(R"({"strata": {"speculation_host_bytes": "auto"}})");
  EXPECT_EQ(autos.strata.speculation_host_bytes, StrataConfig::kSpeculationAuto);
  EXPECT_EQ(MustParse(ConfigToJson(autos)), autos);
  EXPECT_EQ(Refusal(R"({"strata": {"speculation_disk_bytes": "lots"}})").rfind("strata.speculation_disk_bytes: ", 0), 0u);
  EXPECT_EQ(Refusal(R"({"strata": {"speculation_host_bytes": -1}})").rfind("strata.speculation_host_bytes", 0), 0u);
}

// A loss scale whose reciprocal overflows float would write NaN into every
// weight at the next finite step (min_loss_scale 0 lets a run of overflows
// halve the scale that far); compact with eps 0 updates by 0/0 where both
// moments round to 0 in their block.
TEST(ConfigRefusal, NumbersThatMakeNaNOfFiniteSteps) {
  EXPECT_NE(Refusal(R"({"fp16": {"enabled": true, "min_loss_scale": 0}})").find("fp16.min_loss_scale: 0.0 is below 2^-24"),
            std::string::npos);
  EXPECT_NE(Refusal(R"({"fp16": {"enabled": true, "loss_scale": 1e-30}})").find("fp16.loss_scale: 1e-30 is below"),
            std::string::npos);
  EXPECT_EQ(MustParse(R"({"fp16": {"enabled": true, "min_loss_scale": 5.9604644775390625e-08}})").fp16.min_loss_scale,
            0x1p-24);
  EXPECT_EQ(MustParse(R"({"fp16": {"enabled": true, "loss_scale": 0}})").fp16.loss_scale, 0.0) << "0: dynamic";
  EXPECT_NE(Refusal(R"({"fp16": {"enabled": true, "loss_scale": 1e300}})").find("fp16.loss_scale: 1e+300 is above 2^127"),
            std::string::npos)
      << "its unscale factor is 0 as a float: no learning";
  EXPECT_NE(Refusal(R"({"fp16": {"enabled": true, "min_loss_scale": 1e39}})").find("fp16.min_loss_scale: 1e+39 is above"),
            std::string::npos);
  EXPECT_EQ(MustParse(R"({"fp16": {"enabled": true, "loss_scale": 1.7014118346046923e38}})").fp16.loss_scale, 0x1p127);
  const std::string compact = R"({"bf16": {"enabled": true}, "strata": {"state_format": "compact"}, )";
  EXPECT_NE(Refusal(compact + R"("optimizer": {"type": "AdamW", "params": {"eps": 0}}})").find("optimizer.params.eps: 0"),
            std::string::npos);
  EXPECT_NE(Refusal(compact + R"("optimizer": {"type": "AdamW", "params": {"eps": 1e-50}}})")
                .find("optimizer.params.eps: 1e-50 (0 as a float)"),
            std::string::npos)
      << "an eps the kernels' float rounds to 0 is 0";
  EXPECT_EQ(MustParse(compact + R"("optimizer": {"type": "AdamW", "params": {"eps": 1e-44}}})").optimizer.eps, 1e-44);
  EXPECT_EQ(MustParse(compact + R"("optimizer": {"type": "Lion", "params": {"eps": 0}}})").optimizer.type, "lion")
      << "Lion has no eps";
  EXPECT_EQ(MustParse(R"({"optimizer": {"type": "AdamW", "params": {"eps": 0}}})").optimizer.eps, 0.0) << "fp32 keeps m, v";
}

// The update computes in float: a hyperparameter whose float the kernels
// cannot take (beyond float's range: undefined, inf in practice, every
// master inf or NaN with OK; an eps asked for that is 0 as a float) is
// refused at create, naming it, in every state format and optimizer.
TEST(ConfigRefusal, HyperparametersTheFloatUpdateCannotTake) {
  const struct {
    const char* optimizer;
    const char* says;
  } refused[] = {
      {R"("AdamW", "params": {"lr": 1e39})", "optimizer.params: Adam: lr / (1 - beta1^step) at step 1 is 1e+40, "
                                             "beyond float's range"},
      {R"("AdamW", "params": {"lr": 1e38})", "lr / (1 - beta1^step) at step 1 is 1e+39"},  // lr alone is a float
      {R"("AdamW", "params": {"lr": 1e-3, "weight_decay": 1e300})", "Adam: 1 - lr * weight_decay is -1e+297"},
      {R"("Adam", "params": {"weight_decay": 1e39, "adam_w_mode": false})", "Adam: weight_decay is 1e+39"},
      {R"("AdamW", "params": {"eps": 1e39})", "Adam: eps is 1e+39"},
      {R"("AdamW", "params": {"eps": 1e-50})", "Adam: eps 1e-50 is 0 as a float"},
      {R"("Lion", "params": {"lr": 1e39})", "Lion: lr is 1e+39"},
      {R"("Lion", "params": {"lr": 1, "weight_decay": 1e39})", "Lion: 1 - lr * weight_decay is -1e+39"},
      {R"("Adagrad", "params": {"weight_decay": 1e39})", "Adagrad: weight_decay is 1e+39"},
      {R"("Adagrad", "params": {"eps": 1e-50})", "Adagrad: eps 1e-50 is 0 as a float"},
      {R"("Adagrad", "params": {"lr": 1e39})", "Adagrad: lr / (1 + (step - 1) * lr_decay) at step 1 is 1e+39"},
  };
  for (const auto& r : refused) {
    const std::string json = std::string(R"({"optimizer": {"type": )") + r.optimizer + "}}";
    const std::string why = Refusal(json);
    EXPECT_NE(why.find(r.says), std::string::npos) << json << ": " << why;
  }
  // At the edges: taken.
  EXPECT_EQ(MustParse(R"({"optimizer": {"type": "AdamW", "params": {"lr": 3e37}}})").optimizer.lr, 3e37);
  EXPECT_EQ(MustParse(R"({"optimizer": {"type": "AdamW", "params": {"eps": 1.5e-45}}})").optimizer.eps, 1.5e-45);
  EXPECT_EQ(MustParse(R"({"optimizer": {"type": "Lion", "params": {"lr": 3e38}}})").optimizer.lr, 3e38);
  EXPECT_EQ(MustParse(R"({"optimizer": {"type": "AdamW", "params": {"lr": 1, "weight_decay": 3e38}}})")
                .optimizer.weight_decay,
            3e38);
}

TEST(ConfigRefusal, Bf16AndFp16Together) {
  EXPECT_EQ(Refusal(R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})"),
            "bf16.enabled and fp16.enabled: both true; enable at most one");
}

TEST(ConfigRefusal, InvalidJsonNamesThePosition) {
  const std::string message = Refusal("{\n  \"zero_optimization\": {\"stage\": 3,}\n}");
  EXPECT_EQ(message.rfind("invalid JSON at line 2, column 36 (byte 37): ", 0), 0u) << message;
  EXPECT_NE(message.find("syntax error"), std::string::npos) << message;
}

TEST(ConfigRefusal, FileNotFoundNamesThePath) {
  Result<Config> c = LoadConfigFile("/nonexistent/strata/ds_config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kConfig);
  EXPECT_EQ(c.status().message(),
            "config file /nonexistent/strata/ds_config.json: cannot open: No such file or directory");
}

TEST(Config, LoadConfigFileReadsAndNamesThePathOnErrors) {
  const std::string path = ::testing::TempDir() + "/strata_config_test.json";
  {
    std::ofstream out(path);
    out << kInfinityConfig;
  }
  Result<Config> good = LoadConfigFile(path);
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_EQ(good->zero.stage, 3);
  {
    std::ofstream out(path);
    out << R"({"zero_optimization": {"stage": 7}})";
  }
  Result<Config> bad = LoadConfigFile(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "config file " + path + ": zero_optimization.stage: 7 is not one of 0, 1, 2, 3");
  std::remove(path.c_str());
}

// ---- Refusals at engine creation ----

ConfigFacts Facts(uint64_t numel) {
  ConfigFacts f;
  f.largest_group_numel = numel;
  f.host_ram_bytes = 128 * kGiB;
  f.memlock_limit_bytes = std::numeric_limits<uint64_t>::max();
  f.has_gpu = true;
  return f;
}

TEST(ConfigValidate, ZeroInfinityConfigPassesOnABigMachine) {
  const Config c = MustParse(kInfinityConfig);
  EXPECT_TRUE(ValidateConfig(c, Facts(50'000'000)).ok());
}

TEST(ConfigValidate, ParamBufferSmallerThanLargestGroup) {
  const Config c = MustParse(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
      "nvme_path": "/nvme", "buffer_size": 1000}}})");
  EXPECT_TRUE(ValidateConfig(c, Facts(1000)).ok());
  EXPECT_EQ(Refusal(ValidateConfig(c, Facts(5000))),
            "zero_optimization.offload_param.buffer_size: 1000 elements is smaller than the largest parameter "
            "group (5000 elements); set it to at least 5000");
}

TEST(ConfigValidate, HostBudgetAboveRam) {
  const Config c = MustParse(R"({"strata": {"host_budget": "256GiB"}})");
  EXPECT_EQ(Refusal(ValidateConfig(c, Facts(1000))),
            "strata.host_budget: 256.00 GiB is above this machine's RAM (128.00 GiB)");
}

// pin_memory never blocks a run: without a GPU it has no effect (no limit
// applies); with one, a low memlock limit is a warning and pages that cannot
// be pinned stay unpinned. (HF's ZeRO-3 examples all set pin_memory: true.)
TEST(ConfigValidate, PinnedMemoryAboveMemlockNeverRefuses) {
  const std::string text = R"({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": true}},
      "strata": {"host_budget": "8GiB"}})";
  ConfigFacts f = Facts(1000);
  f.memlock_limit_bytes = 64ull << 20;
  EXPECT_TRUE(ValidateConfig(MustParse(text), f).ok());
  f.has_gpu = true;
  EXPECT_TRUE(ValidateConfig(MustParse(text), f).ok());
  const Config c = MustParse(R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": true, "buffer_size": 2e8}}})");
  ConfigFacts g = Facts(200'000'000);
  g.has_gpu = true;
  g.memlock_limit_bytes = 64ull << 20;
  EXPECT_TRUE(ValidateConfig(c, g).ok());
}

TEST(ConfigValidate, DeviceBudgetTooSmallForLargestGroup) {
  const Config c = MustParse(R"({"bf16": {"enabled": true}, "strata": {"device_budget": "1MiB"}})");
  EXPECT_TRUE(ValidateConfig(c, Facts(1 << 19)).ok());  // 1 MiB of bf16
  EXPECT_EQ(Refusal(ValidateConfig(c, Facts(1 << 20))),
            "strata.device_budget: 1.00 MiB is too small for the largest parameter group: its 1048576 bf16 "
            "parameters need 2.00 MiB on the device");
}

TEST(ConfigValidate, HostBudgetTooSmallForLargestGroup) {
  const Config c = MustParse(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
      "strata": {"host_budget": "16MiB"}})");
  ConfigFacts f = Facts(1 << 20);  // W, M, V, G of a 1 Mi-element shard: 16 MiB
  EXPECT_TRUE(ValidateConfig(c, f).ok());
  f.largest_group_numel = 2 << 20;
  EXPECT_EQ(Refusal(ValidateConfig(c, f)),
            "strata.host_budget: 16.00 MiB is too small for the largest parameter group: it needs at least "
            "32.00 MiB of host memory (swap buffers, P, and fp32 W, M, V, G of a shard)");
  f.world_size = 2;  // each rank steps half the group
  EXPECT_TRUE(ValidateConfig(c, f).ok());
}

// The create-time bound is a lower bound of Build's plan: it never refuses a
// budget the engine fits in. Lion keeps no V; fp32 P beside W on the host
// is W's bytes; NVMe-homed state in units streams through two slots.
TEST(ConfigValidate, HostBudgetBoundIsNoMoreThanBuildNeeds) {
  ConfigFacts f = Facts(1 << 20);
  f.has_gpu = false;
  // Lion, W and M on NVMe in units: two slots of W, M (8 MiB each) and G (4 MiB).
  const Config lion = MustParse(R"({"optimizer": {"type": "Lion"}, "zero_optimization": {"stage": 1,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}, "strata": {"host_budget": "20MiB"}})");
  EXPECT_TRUE(ValidateConfig(lion, f).ok()) << Refusal(ValidateConfig(lion, f));
  // AdamW, fp32, P and W, M, V, G on the host: P is W's bytes (16 MiB in all).
  const Config host = MustParse(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"},
      "offload_param": {"device": "cpu"}}, "strata": {"host_budget": "16MiB"}})");
  EXPECT_TRUE(ValidateConfig(host, f).ok()) << Refusal(ValidateConfig(host, f));
  // bf16 gradients: G is 2 bytes an element (14 MiB with W, M, V on the host).
  const Config bf16g = MustParse(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
      "data_types": {"grad_accum_dtype": "bf16"}, "bf16": {"enabled": true}, "strata": {"host_budget": "14MiB"}})");
  EXPECT_TRUE(ValidateConfig(bf16g, f).ok()) << Refusal(ValidateConfig(bf16g, f));
}

TEST(ConfigValidate, NoGpuArenaMustFitInRam) {
  const Config c = MustParse(R"({"strata": {"device_budget": "100GiB", "host_budget": "100GiB"}})");
  ConfigFacts f = Facts(1000);
  EXPECT_TRUE(ValidateConfig(c, f).ok());
  f.has_gpu = false;
  EXPECT_EQ(Refusal(ValidateConfig(c, f)),
            "strata.device_budget + strata.host_budget: 200.00 GiB is above this machine's RAM (128.00 GiB); "
            "without a GPU the device tier lives in host memory: lower strata.device_budget or "
            "strata.host_budget");
}

// Without a GPU an "auto" host budget takes what the device arenas leave of
// RAM (AutoHostBudget: the engine's and the check's), not half of it beside
// them; where that is too little for the largest group, the config is refused.
TEST(ConfigValidate, NoGpuAutoHostBudgetTakesWhatTheArenasLeave) {
  ConfigFacts f = Facts(1 << 20);  // 128 GiB of RAM; the largest group needs 16 MiB
  f.has_gpu = false;
  EXPECT_EQ(AutoHostBudget(f, 0), 64 * kGiB);
  EXPECT_EQ(AutoHostBudget(f, 32 * kGiB), 64 * kGiB);   // 32 + 64 fit
  EXPECT_EQ(AutoHostBudget(f, 100 * kGiB), 28 * kGiB);  // what 100 leaves
  EXPECT_EQ(AutoHostBudget(f, 128 * kGiB), 0u);
  f.ranks_on_host = 2;  // 2 x 50 GiB of arenas leave 28 GiB: 14 each
  EXPECT_EQ(AutoHostBudget(f, 50 * kGiB), 14 * kGiB);
  f.ranks_on_host = 1;
  auto with_device = [](const char* budget) {  // W, M, V on the CPU: the host tier holds a shard's state
    return MustParse(std::string(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        "strata": {"device_budget": ")") + budget + "\"}}");
  };
  EXPECT_TRUE(ValidateConfig(with_device("100GiB"), f).ok());
  EXPECT_TRUE(ValidateConfig(with_device("131055MiB"), f).ok());  // leaves 17 MiB: enough
  EXPECT_EQ(Refusal(ValidateConfig(with_device("131057MiB"), f)),  // leaves 15 MiB
            "strata.device_budget: 127.99 GiB leaves 15.00 MiB of this machine's RAM (128.00 GiB) to an \"auto\" "
            "strata.host_budget, too little for the largest parameter group: it needs 16.00 MiB; without a GPU the "
            "device tier lives in host memory: lower strata.device_budget");
  EXPECT_EQ(Refusal(ValidateConfig(with_device("128GiB"), f)).rfind("strata.device_budget: 128.00 GiB leaves 0 B", 0),
            0u);
  f.has_gpu = true;  // the device budget is the GPU's: "auto" is half the RAM
  EXPECT_EQ(AutoHostBudget(f, 128 * kGiB), 64 * kGiB);
  EXPECT_TRUE(ValidateConfig(with_device("128GiB"), f).ok());
}

TEST(ConfigValidate, ConfigBuiltInCodeIsHeldToTheParseRules) {
  Config c;
  c.zero.offload_param.device = OffloadDevice::kNvme;
  EXPECT_EQ(Refusal(ValidateConfig(c, Facts(0))).rfind("zero_optimization.offload_param.nvme_path: required", 0), 0u);
}

TEST(ConfigValidate, ProbeMachineFactsSeesRam) {
  const ConfigFacts f = ProbeMachineFacts();
  EXPECT_GT(f.host_ram_bytes, 0u);
  EXPECT_GT(f.memlock_limit_bytes, 0u);
}

TEST(ConfigReader, EditDistance) {
  using config_internal::EditDistance;
  EXPECT_EQ(EditDistance("devce", "device"), 1u);
  EXPECT_EQ(EditDistance("kitten", "sitting"), 3u);
  EXPECT_EQ(EditDistance("", "abc"), 3u);
  EXPECT_EQ(EditDistance("Stage", "stage"), 0u);
}

}  // namespace
}  // namespace strata
