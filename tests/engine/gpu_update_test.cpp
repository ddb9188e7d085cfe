// engine/gpu_update: which groups the step updates on the GPU, the device
// scratch it reserves, and the kernel options both devices share — the
// decisions, tested without a GPU; and, on the CPU, that strata.gpu_optimizer
// never changes a bit (tests/engine/gpu_optimizer_test.cpp runs the GPU).
#include "engine/step/gpu_update.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <functional>

#include "engine/engine.h"
#include "io/fault.h"
#include "tests/engine/tiny_mlp.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using testing::TinyMlp;

GpuUpdateFacts OnGpu(const std::string& optimizer = "adamw") {
  GpuUpdateFacts f;
  f.setting = "auto";
  f.cuda_built = true;
  f.device_on_gpu = true;
  f.optimizer = optimizer;
  f.home.fill(TierKind::kDevice);
  f.home[int(StateKind::kG)] = TierKind::kHost;
  f.used.fill(true);
  f.used[int(StateKind::kV)] = optimizer == "adam" || optimizer == "adamw";
  return f;
}

TEST(GpuUpdateChoice, EveryOptimizerWithATwinOnTheGpu) {
  for (const char* o : {"adam", "adamw", "lion", "adagrad"}) {
    const GpuUpdateChoice c = ChooseGpuUpdate(OnGpu(o));
    EXPECT_TRUE(c.gpu) << o << ": " << c.why;
  }
}

TEST(GpuUpdateChoice, HomesDecide) {
  GpuUpdateFacts f = OnGpu("lion");
  f.home[int(StateKind::kV)] = TierKind::kNvme;  // unused by Lion: no matter
  EXPECT_TRUE(ChooseGpuUpdate(f).gpu);
  f.home[int(StateKind::kP)] = TierKind::kNvme;  // P elsewhere: copied home, the update stays on the GPU
  EXPECT_TRUE(ChooseGpuUpdate(f).gpu);
  for (TierKind elsewhere : {TierKind::kHost, TierKind::kNvme}) {
    GpuUpdateFacts g = OnGpu("adam");
    g.home[int(StateKind::kW)] = g.home[int(StateKind::kM)] = g.home[int(StateKind::kV)] = elsewhere;
    const GpuUpdateChoice c = ChooseGpuUpdate(g);
    EXPECT_FALSE(c.gpu);
    EXPECT_FALSE(c.warn) << c.why;  // the CPU path is the one meant for state off the device
  }
}

TEST(GpuUpdateChoice, CpuWhenNoGpuOffOrNoTwin) {
  GpuUpdateFacts f = OnGpu();
  f.device_on_gpu = false;  // the host arena: the CPU updates it in place
  EXPECT_FALSE(ChooseGpuUpdate(f).gpu);
  EXPECT_FALSE(ChooseGpuUpdate(f).warn);

  f = OnGpu();
  f.setting = "off";
  GpuUpdateChoice c = ChooseGpuUpdate(f);
  EXPECT_FALSE(c.gpu);
  EXPECT_FALSE(c.warn);  // asked for
  EXPECT_NE(c.why.find("strata.gpu_optimizer"), std::string::npos) << c.why;


  f = OnGpu();
  f.cuda_built = false;
  c = ChooseGpuUpdate(f);
  EXPECT_FALSE(c.gpu);
  EXPECT_TRUE(c.warn);

  c = ChooseGpuUpdate(OnGpu("sgd"));
  EXPECT_FALSE(c.gpu);
  EXPECT_NE(c.why.find("sgd"), std::string::npos) << c.why;
}

// Compact: on the GPU (Adam, AdamW, Lion) when P, whose slice is the
// master's bf16 half, is homed on the device with W, M, V; else on the CPU,
// said once.
TEST(GpuUpdateChoice, CompactOnTheGpuWithPOnTheDevice) {
  for (const char* o : {"adam", "adamw", "lion"}) {
    GpuUpdateFacts f = OnGpu(o);
    f.compact = true;
    const GpuUpdateChoice c = ChooseGpuUpdate(f);
    EXPECT_TRUE(c.gpu) << o << ": " << c.why;
  }
  for (TierKind elsewhere : {TierKind::kHost, TierKind::kNvme}) {
    GpuUpdateFacts f = OnGpu("adamw");
    f.compact = true;
    f.home[int(StateKind::kP)] = elsewhere;
    const GpuUpdateChoice c = ChooseGpuUpdate(f);
    EXPECT_FALSE(c.gpu);
    EXPECT_TRUE(c.warn);
    EXPECT_NE(c.why.find("compact"), std::string::npos) << c.why;
  }
  GpuUpdateFacts f = OnGpu("adagrad");  // refused by the config; no compact kernel either
  f.compact = true;
  const GpuUpdateChoice c = ChooseGpuUpdate(f);
  EXPECT_FALSE(c.gpu);
  EXPECT_NE(c.why.find("adagrad"), std::string::npos) << c.why;
}

StateBlock Block(TierKind home, uint64_t charged) {
  StateBlock b;
  b.home = home;
  b.alloc.charged = charged;
  return b;
}

TEST(GpuUpdateChoice, GroupsWhoseStateIsOnTheDevice) {
  std::array<StateBlock, kNumStates> b;
  EXPECT_FALSE(OptimizerStateOnDevice(b));  // nothing allocated
  b[int(StateKind::kP)] = Block(TierKind::kHost, 256);
  b[int(StateKind::kW)] = Block(TierKind::kDevice, 256);
  b[int(StateKind::kM)] = Block(TierKind::kDevice, 256);
  b[int(StateKind::kG)] = Block(TierKind::kHost, 256);
  EXPECT_TRUE(OptimizerStateOnDevice(b));             // Lion or Adagrad: no V
  b[int(StateKind::kV)] = Block(TierKind::kNvme, 0);  // not kept: ignored
  EXPECT_TRUE(OptimizerStateOnDevice(b));
  b[int(StateKind::kV)] = Block(TierKind::kHost, 256);
  EXPECT_FALSE(OptimizerStateOnDevice(b));
  b[int(StateKind::kV)] = Block(TierKind::kDevice, 256);
  EXPECT_TRUE(OptimizerStateOnDevice(b));
  b[int(StateKind::kM)] = Block(TierKind::kNvme, 256);
  EXPECT_FALSE(OptimizerStateOnDevice(b));
}

TEST(GpuScratch, HoldsOneShardsGradientsAndParametersHomedElsewhere) {
  GpuScratchPlan p = PlanGpuScratch(1000, DType::kF32, DType::kBF16, /*p_on_device=*/true);
  EXPECT_EQ(p.g_bytes, 4000u);
  EXPECT_EQ(p.p_bytes, 0u);
  EXPECT_EQ(p.total, 4096u);
  p = PlanGpuScratch(1000, DType::kF32, DType::kBF16, false);
  EXPECT_EQ(p.p_offset, 4096u);
  EXPECT_EQ(p.p_bytes, 2000u);
  EXPECT_EQ(p.total, 4096u + 2048u);
  p = PlanGpuScratch(1000, DType::kBF16, DType::kF16, false);
  EXPECT_EQ(p.g_bytes, 2000u);
  EXPECT_EQ(p.p_offset, 2048u);
  EXPECT_EQ(p.total, 2048u + 2048u);
  p = PlanGpuScratch(1000, DType::kF32, DType::kF32, false);  // fp32 P is copied from W
  EXPECT_EQ(p.p_bytes, 0u);
  EXPECT_EQ(p.total, 4096u);
}

TEST(GpuScratch, FitsOnlyWithinTheBudgetLeft) {
  const GpuScratchPlan p = PlanGpuScratch(1000, DType::kF32, DType::kBF16, true);  // 4096
  EXPECT_TRUE(GpuScratchFits(4096, p, 0));
  EXPECT_FALSE(GpuScratchFits(4095, p, 0));
  EXPECT_TRUE(GpuScratchFits(8192, p, 4096));  // room for a fetch's copy of the largest group too
  EXPECT_FALSE(GpuScratchFits(8191, p, 4096));
  EXPECT_FALSE(GpuScratchFits(0, p, 0));
  EXPECT_FALSE(GpuScratchFits(1 << 20, GpuScratchPlan{}, 0));  // nothing to hold: no shard
}

TEST(StepKernelOptions, OneSetForEveryKernel) {
  const StepHyper h{0.01, 0.8, 0.95, 1e-6, 0.1, 0.5, 7};
  StepKernelOptions o = MakeStepKernelOptions("adam", /*adamw=*/false, h, DType::kBF16, DType::kF16);
  EXPECT_EQ(o.type, "adam");
  EXPECT_EQ(o.adam.mode, kernels::AdamMode::kAdam);
  EXPECT_EQ(o.adam.lr, 0.01);
  EXPECT_EQ(o.adam.beta1, 0.8);
  EXPECT_EQ(o.adam.beta2, 0.95);
  EXPECT_EQ(o.adam.eps, 1e-6);
  EXPECT_EQ(o.adam.weight_decay, 0.1);
  EXPECT_EQ(o.adam.grad_scale, 0.5);
  EXPECT_EQ(o.adam.step, 7);
  EXPECT_EQ(o.adam.grad_dtype, DType::kBF16);
  EXPECT_EQ(o.adam.param_copy_dtype, DType::kF16);
  EXPECT_EQ(o.lion.beta2, 0.95);
  EXPECT_EQ(o.lion.weight_decay, 0.1);
  EXPECT_EQ(o.lion.grad_scale, 0.5);
  EXPECT_EQ(o.lion.param_copy_dtype, DType::kF16);
  EXPECT_EQ(o.adagrad.eps, 1e-6);
  EXPECT_EQ(o.adagrad.step, 7);
  EXPECT_EQ(o.adagrad.lr_decay, 0.0);
  EXPECT_EQ(o.adagrad.grad_dtype, DType::kBF16);
  o = MakeStepKernelOptions("adamw", true, h, DType::kF32, DType::kBF16);
  EXPECT_EQ(o.adam.mode, kernels::AdamMode::kAdamW);
}

TEST(StepKernelOptions, RefusedBeforeAnyLaunch) {
  StepHyper h{0.01, 0.9, 0.999, 1e-8, 0.0, 1.0, 1};
  EXPECT_TRUE(
      ValidateStepKernelOptions(MakeStepKernelOptions("adam", false, h, DType::kF32, DType::kBF16)).ok());
  h.beta1 = 1.0;
  for (const char* o : {"adam", "adamw", "lion"})
    EXPECT_EQ(ValidateStepKernelOptions(MakeStepKernelOptions(o, false, h, DType::kF32, DType::kBF16)).code(),
              Code::kInvalid)
        << o;
  h.beta1 = 0.9;
  h.step = 0;
  EXPECT_EQ(
      ValidateStepKernelOptions(MakeStepKernelOptions("adagrad", false, h, DType::kF32, DType::kBF16)).code(),
      Code::kInvalid);
}

// Masters and fetched parameters of every group.
struct Weights {
  std::vector<std::vector<float>> w;
  std::vector<std::vector<uint8_t>> p;
};

Weights WeightsOf(Engine& e) {
  Weights out;
  for (int g = 0; g < e.num_groups(); ++g) {
    out.w.emplace_back(e.group_numel(g));
    EXPECT_TRUE(e.ReadMaster(g, out.w.back().data()).ok());
    auto p = e.Fetch(g);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) continue;
    const auto* bytes = static_cast<const uint8_t*>(*p);
    out.p.emplace_back(bytes, bytes + e.group_numel(g) * DTypeSize(e.compute_dtype()));
    EXPECT_TRUE(e.Release(g).ok());
  }
  return out;
}

// Four steps of `model` under `json`, on the CPU optimizer or (`twin`) the
// GPU optimizer's CPU twin; at step 2 `arm` (a skip count) sets the faults,
// and a step that fails then is called again, which must finish it. Adds 1
// to *fired when a fault fired.
Weights RunFaultedAtStep2(const std::string& json, const TinyMlp& model, bool twin,
                          const std::function<void(FaultPlan&)>& arm, int* fired) {
  EngineOptions eo;
  eo.force_no_gpu = true;
  eo.gpu_optimizer_twin = twin;
  eo.faults = std::make_shared<FaultPlan>();
  auto e = Engine::Create(*ParseConfig(json), eo);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_TRUE(model.Register(**e).ok());
  EXPECT_TRUE((*e)->Build().ok());
  for (int s = 0; s < 4; ++s) {
    EXPECT_TRUE(model.TrainStep(**e).ok());
    StepOptions so;
    so.lr = 0.01 * (1 + s);
    if (s == 2 && arm) arm(*eo.faults);
    auto r = (*e)->Step(so);
    eo.faults->Disarm();
    if (s == 2 && eo.faults->fired() > 0) {
      ++*fired;
      EXPECT_FALSE(r.ok()) << "the faulted step returned OK";
      r = (*e)->Step(so);  // finishes the step: P rewritten from the committed W
    }
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
  return WeightsOf(**e);
}

std::vector<std::vector<float>> TrainOnCpu(const std::string& optimizer, const std::string& setting) {
  // clang-format off
  const std::string json = R"({"bf16": {"enabled": true}, "optimizer": {"type": ")" + optimizer +
                           R"(", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}},
      "strata": {"device_budget": "64MiB", "host_budget": "64MiB", "gpu_optimizer": ")" + setting + R"("}})";
  // clang-format on
  EXPECT_TRUE(ParseConfig(json).ok()) << ParseConfig(json).status().ToString();
  int none = 0;
  return RunFaultedAtStep2(json, TinyMlp(3, 24), /*twin=*/false, nullptr, &none).w;
}

// Without a GPU both settings take the CPU path over the same kernel options.
TEST(GpuOptimizerSetting, NeverChangesABitOnTheCpu) {
  for (const char* o : {"adam", "adamw", "lion", "adagrad"}) {
    const auto a = TrainOnCpu(o, "auto"), b = TrainOnCpu(o, "off");
    ASSERT_EQ(a.size(), b.size());
    for (size_t g = 0; g < a.size(); ++g)
      EXPECT_EQ(std::memcmp(a[g].data(), b[g].data(), a[g].size() * 4), 0) << o << " group " << g;
  }
}

// The GPU optimizer's path without a GPU (EngineOptions.gpu_optimizer_twin:
// G through a device scratch, P through it or written in place, the commit
// without stores) gives the CPU path's W, M, V and P bit for bit.
struct TwinRun {
  std::vector<std::vector<float>> w, m, v;
  std::vector<std::vector<uint8_t>> p;
  EngineStats stats;
};

struct TwinCase {
  std::string optimizer = "adamw", param = "none", grad_accum = "fp32";
  std::string dtype = "bf16";  // compute: bf16, fp16 or fp32
  std::string format = "fp32";  // strata.state_format
  bool overlap = false;
  std::string Name() const {
    return optimizer + " P:" + param + " " + dtype + " G:" + grad_accum + " " + format + (overlap ? " overlap" : "");
  }
};

void TrainTwinInto(const TwinCase& k, bool twin, const std::string& dir, TwinRun* out) {
  // clang-format off
  const std::string json = std::string("{") + (k.dtype == "fp32" ? "" : "\"" + k.dtype + "\": {\"enabled\": true},") + R"(
      "optimizer": {"type": ")" + k.optimizer + R"(", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "data_types": {"grad_accum_dtype": ")" + k.grad_accum + R"("},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"},
        "offload_param": {"device": ")" + k.param + R"(", "nvme_path": ")" + dir + R"("}},
      "strata": {"device_budget": "64MiB", "host_budget": "64MiB", "state_format": ")" + k.format + R"("}})";
  // clang-format on
  auto config = ParseConfig(json);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EngineOptions eo;
  eo.force_no_gpu = true;
  eo.gpu_optimizer_twin = twin;
  eo.overlap_step = k.overlap;
  auto e = Engine::Create(*config, eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& eng = **e;
  TinyMlp model(3, 24);
  ASSERT_TRUE(model.Register(eng).ok());
  const Status built = eng.Build();
  ASSERT_TRUE(built.ok()) << built.ToString();
  for (int s = 0; s < 4; ++s) {
    StepOptions so;
    so.lr = 0.01 * (1 + s);
    if (k.overlap) {
      ASSERT_TRUE(eng.PrepareStep(so).ok());
    }
    ASSERT_TRUE(model.TrainStep(eng).ok());
    auto r = eng.Step(so);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  const bool adam = k.optimizer == "adam" || k.optimizer == "adamw";
  for (int g = 0; g < eng.num_groups(); ++g) {
    const uint64_t n = eng.group_numel(g);
    out->w.emplace_back(n);
    out->m.emplace_back(n);
    out->v.emplace_back(adam ? n : 0);
    ASSERT_TRUE(eng.ReadMaster(g, out->w.back().data()).ok());
    ASSERT_TRUE(eng.ReadState(g, Engine::OptimizerState::kExpAvg, out->m.back().data()).ok());
    if (adam) {
      ASSERT_TRUE(eng.ReadState(g, Engine::OptimizerState::kExpAvgSq, out->v.back().data()).ok());
    }
    auto p = eng.Fetch(g);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    const auto* bytes = static_cast<const uint8_t*>(*p);
    out->p.emplace_back(bytes, bytes + n * DTypeSize(eng.compute_dtype()));
    ASSERT_TRUE(eng.Release(g).ok());
  }
  out->stats = eng.stats();
}

void CheckTwin(const TwinCase& k) {
  testing::TempDir dir;
  TwinRun twin, cpu;
  TrainTwinInto(k, true, dir.path(), &twin);
  TrainTwinInto(k, false, dir.path(), &cpu);
  ASSERT_EQ(twin.w.size(), cpu.w.size()) << k.Name();
  for (size_t g = 0; g < cpu.w.size(); ++g) {
    EXPECT_EQ(twin.w[g], cpu.w[g]) << k.Name() << ": W of group " << g;
    EXPECT_EQ(twin.m[g], cpu.m[g]) << k.Name() << ": M of group " << g;
    EXPECT_EQ(twin.v[g], cpu.v[g]) << k.Name() << ": V of group " << g;
    EXPECT_EQ(twin.p[g], cpu.p[g]) << k.Name() << ": P of group " << g;
  }
  // The twin took the GPU path: G went to the device tier each step.
  EXPECT_GT(twin.stats.host_to_device, cpu.stats.host_to_device) << k.Name();
  EXPECT_LE(twin.stats.device.peak, twin.stats.device.budget) << k.Name();
}

TEST(GpuOptimizerTwin, EveryOptimizerAndHomeOfP) {
  for (const char* o : {"adam", "adamw", "lion", "adagrad"})
    for (const char* param : {"none", "cpu", "nvme"}) {
      TwinCase k;
      k.optimizer = o;
      k.param = param;
      CheckTwin(k);
    }
}

TEST(GpuOptimizerTwin, Fp32AndFp16ComputeBf16GradientsAndOverlap) {
  for (const char* param : {"none", "cpu", "nvme"}) {
    TwinCase k;
    k.dtype = "fp32";
    k.param = param;
    CheckTwin(k);
  }
  for (const char* param : {"none", "cpu"}) {  // fp16: the kernels write an f16 copy
    TwinCase k;
    k.dtype = "fp16";
    k.param = param;
    CheckTwin(k);
  }
  TwinCase k;
  k.optimizer = "lion";
  k.grad_accum = "bf16";
  CheckTwin(k);
  k.optimizer = "adam";
  k.param = "cpu";
  k.overlap = true;
  CheckTwin(k);
}

// Compact state (P's slice the master's bf16 half, W's corrections, M and V
// codes and scales) homed on the device: the twin updates all of it in place
// with the CPU compact kernel standing in for the CUDA one, bit for bit the
// CPU path's; also with bf16 gradient accumulation and an overlapped step.
TEST(GpuOptimizerTwin, CompactStateWithPOnTheDevice) {
  for (const char* o : {"adam", "adamw", "lion"}) {
    TwinCase k;
    k.optimizer = o;
    k.format = "compact";
    CheckTwin(k);
  }
  TwinCase k;
  k.format = "compact";
  k.optimizer = "lion";
  k.grad_accum = "bf16";
  CheckTwin(k);
  k.optimizer = "adam";
  k.overlap = true;
  CheckTwin(k);
}

// Compact with P homed elsewhere stays on the CPU path (the twin does not
// take it: no gradients go to the device), with the same bits.
TEST(GpuOptimizerTwin, CompactWithPElsewhereIsUpdatedOnTheCpu) {
  for (const char* param : {"cpu", "nvme"}) {
    TwinCase k;
    k.format = "compact";
    k.param = param;
    testing::TempDir dir;
    TwinRun twin, cpu;
    TrainTwinInto(k, true, dir.path(), &twin);
    TrainTwinInto(k, false, dir.path(), &cpu);
    ASSERT_EQ(twin.w.size(), cpu.w.size()) << k.Name();
    for (size_t g = 0; g < cpu.w.size(); ++g) {
      EXPECT_EQ(twin.w[g], cpu.w[g]) << k.Name() << ": W of group " << g;
      EXPECT_EQ(twin.p[g], cpu.p[g]) << k.Name() << ": P of group " << g;
    }
    EXPECT_EQ(twin.stats.host_to_device, cpu.stats.host_to_device) << k.Name();
  }
}


// Faulted twin runs, for skips 0, 1, 2, end as the clean CPU run, bit for bit.
int ExpectFaultedRunsAsClean(const std::string& json, const TinyMlp& model,
                             const std::function<void(FaultPlan&, int skip)>& arm) {
  int none = 0, fired = 0;
  const Weights clean = RunFaultedAtStep2(json, model, false, nullptr, &none);
  for (int skip : {0, 1, 2}) {
    SCOPED_TRACE("skip " + std::to_string(skip));
    const Weights faulty = RunFaultedAtStep2(json, model, true, [&](FaultPlan& f) { arm(f, skip); }, &fired);
    EXPECT_EQ(faulty.w.size(), clean.w.size());
    for (size_t g = 0; g < clean.w.size() && g < faulty.w.size(); ++g) {
      EXPECT_EQ(faulty.w[g], clean.w[g]) << "W of group " << g;
      EXPECT_EQ(faulty.p[g], clean.p[g]) << "P of group " << g;
    }
  }
  return fired;
}

// W, M, V updated in place on the (twin) GPU are committed before P's store
// to NVMe: when that store fails the step fails resumably, and calling it
// again rewrites P from W; the run ends as the clean CPU run, bit for bit.
TEST(GpuOptimizerTwin, AFailedStoreOfPIsRewrittenFromW) {
  testing::TempDir dir;
  const TinyMlp model(3, 24);
  // clang-format off
  const std::string json = R"({"bf16": {"enabled": true}, "optimizer": {"type": "adamw", "params": {"lr": 0.01}},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"},
        "offload_param": {"device": "nvme", "nvme_path": ")" + dir.path() + R"("}},
      "strata": {"device_budget": "64MiB", "host_budget": "64MiB"}})";
  // clang-format on
  const int fired = ExpectFaultedRunsAsClean(json, model, [](FaultPlan& f, int skip) {
    f.Arm(FaultPlan::Ops::kWrites, EIO, static_cast<uint64_t>(skip), 1);
  });
  EXPECT_EQ(fired, 3);  // three groups, one P store each: every skip hit one
}

// P in host memory, W, M, V on the (twin) GPU: when the copy of a group's new
// P home fails after its kernel ran, the step fails resumably and calling it
// again rewrites P from the committed W; the run ends as the clean CPU run.
// Before, the store bookkeeping cleared the mark (P "at home"), the retry
// returned OK and the next forward read the old P.
TEST(GpuOptimizerTwin, AFailedCopyOutOfPIsRewrittenFromW) {
  const TinyMlp model(3, 24);
  const std::string json = R"({"bf16": {"enabled": true}, "optimizer": {"type": "adamw", "params": {"lr": 0.01}},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "cpu"}},
      "strata": {"device_budget": "64MiB", "host_budget": "64MiB"}})";
  const int fired = ExpectFaultedRunsAsClean(json, model, [](FaultPlan& f, int skip) {
    f.ArmDeviceCopies(/*to_device=*/false, static_cast<uint64_t>(skip), 1);
  });
  EXPECT_GE(fired, 1) << "no copy out failed: the case tests nothing";
}

// The scratch comes out of the device budget the home blocks left: with one
// byte too few the step falls back to the CPU path (same bits), never past
// the budget.
TEST(GpuOptimizerTwin, ScratchFitsTheDeviceBudgetOrTheCpuUpdates) {
  const TinyMlp model(3, 24);
  auto make = [&](bool twin, uint64_t device_budget) {
    // clang-format off
    const std::string json = R"({"bf16": {"enabled": true}, "optimizer": {"type": "adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}},
        "strata": {"device_budget": )" + std::to_string(device_budget) + R"(, "host_budget": "64MiB"}})";
    // clang-format on
    EngineOptions eo;
    eo.force_no_gpu = true;
    eo.gpu_optimizer_twin = twin;
    auto e = Engine::Create(*ParseConfig(json), eo);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    EXPECT_TRUE(model.Register(**e).ok());
    const Status st = (*e)->Build();
    EXPECT_TRUE(st.ok()) << st.ToString();
    return std::move(e).value();
  };
  auto train = [&](Engine& e) {
    for (int s = 0; s < 3; ++s) {
      EXPECT_TRUE(model.TrainStep(e).ok());
      EXPECT_TRUE(e.Step({}).ok());
    }
    return WeightsOf(e);
  };
  const uint64_t homes = make(false, 64 << 20)->stats().device.used;
  const uint64_t scratch = make(true, 64 << 20)->stats().device.used - homes;
  ASSERT_GT(scratch, 0u);
  auto cpu = make(false, homes + scratch);
  const Weights want = train(*cpu);
  for (uint64_t budget : {homes + scratch, homes + scratch - 1}) {
    auto twin = make(true, budget);
    const Weights got = train(*twin);
    EXPECT_EQ(got.w, want.w) << budget;
    EXPECT_EQ(got.p, want.p) << budget;
    const EngineStats st = twin->stats();
    EXPECT_LE(st.device.peak, st.device.budget);
    if (budget == homes + scratch)
      EXPECT_GT(st.host_to_device, cpu->stats().host_to_device);  // the GPU path
    else
      EXPECT_EQ(st.host_to_device, cpu->stats().host_to_device);  // the CPU path
  }
}

}  // namespace
}  // namespace strata
