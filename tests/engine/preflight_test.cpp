// engine/layout/staging_plan and engine/step/step_checks: what the engine refuses or holds back before it changes
// anything — a config built in code past the storage's limits, a host budget
// too small for Build's staging, non-finite step options and gradients
// (strata.nonfinite) — and what a step does to a group without gradients.
#include <gtest/gtest.h>

#include <spdlog/sinks/ostream_sink.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "base/log.h"
#include "engine/engine.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

Config MustParse(const std::string& json) {
  auto c = ParseConfig(json);
  EXPECT_TRUE(c.ok()) << c.status().ToString() << "\n" << json;
  return c.ok() ? *c : Config{};
}

// Two groups of 64 fp32 parameters each, everything on the (host-arena) device.
std::unique_ptr<Engine> MakeBuilt(const std::string& strata_keys = "", double wd = 0.1) {
  const std::string json = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": )" +
                           std::to_string(wd) + R"(}}, "strata": {"device_budget": "16MiB", "host_budget": "16MiB")" +
                           strata_keys + "}}";
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e = Engine::Create(MustParse(json), eo);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return nullptr;
  std::vector<float> init(64);
  for (size_t i = 0; i < init.size(); ++i) init[i] = 0.5f + 0.01f * static_cast<float>(i);
  for (int g = 0; g < 2; ++g) EXPECT_TRUE((*e)->AddParam(g, "g" + std::to_string(g), 64, init.data()).ok());
  EXPECT_TRUE((*e)->Build().ok());
  return std::move(*e);
}

std::vector<float> Master(Engine& e, int g) {
  std::vector<float> w(e.group_numel(g));
  EXPECT_TRUE(e.ReadMaster(g, w.data()).ok());
  return w;
}

// Gives both groups gradients of 0.1, group `bad` (if >= 0) one NaN among them.
void GiveGrads(Engine& e, int bad) {
  for (int g = 0; g < 2; ++g) {
    std::vector<float> grads(64, 0.1f);
    if (g == bad) grads[7] = std::numeric_limits<float>::quiet_NaN();
    ASSERT_TRUE(e.Grads(g, grads.data(), DType::kF32).ok());
  }
}

// Captures the "strata" logger's output while alive.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) { Logger().sinks().push_back(sink_); }
  ~LogCapture() { Logger().sinks().pop_back(); }
  std::string text() const { return out_.str(); }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

// ---- Create and Build ----

TEST(Preflight, ConfigBuiltInCodeIsHeldToTheParsersLimits) {
  Config c;
  c.aio.queue_depth = 65536;  // the parser refuses it; the storage did too, as INVALID without the key
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e = Engine::Create(c, eo);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), Code::kConfig);
  EXPECT_EQ(e.status().message(), "aio.queue_depth: 65536 is out of range; allowed: from 1 to 4096");
}

// A 2000-element group with W, M, V (and P, with `p_on_nvme`) on NVMe in
// `swap` under a 200 KiB host budget, built: the engine, and Build's status.
std::unique_ptr<Engine> TightBuild(const std::string& swap, bool p_on_nvme, Status* built) {
  const std::string nvme = R"({"device": "nvme", "nvme_path": ")" + swap + R"("})";
  const std::string json = R"({"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3,
      "offload_optimizer": )" + nvme + (p_on_nvme ? R"(, "offload_param": )" + nvme : std::string()) + R"(},
      "strata": {"device_budget": "16MiB", "host_budget": "200KiB"}})";
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e = Engine::Create(MustParse(json), eo);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return nullptr;
  std::vector<float> init(2000, 0.5f);
  EXPECT_TRUE((*e)->AddParam(0, "w", init.size(), init.data()).ok());
  *built = (*e)->Build();
  return std::move(e).value();
}

TEST(Preflight, HostBudgetTooSmallForStagingIsRefusedAtBuildStart) {
  testing::TempDir swap;
  // Validation's lower bound (two slots of a shard's W, M, V, and G) fits in
  // 200 KiB; Build's 4 slots of four 64 KiB-aligned states do not.
  Status st;
  auto e = TightBuild(swap.path(), false, &st);
  ASSERT_TRUE(e);
  ASSERT_EQ(st.code(), Code::kConfig) << st.ToString();
  EXPECT_EQ(st.message().rfind("strata.host_budget: 200.00 KiB is too small for this model; Build needs at least 1.0", 0),
            0u)
      << st.message();
  EXPECT_NE(st.message().find("4 step staging slots of 256.00 KiB"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("offload_optimizer.buffer_count"), std::string::npos) << st.message();
  EXPECT_EQ(e->stats().host.peak, 0u);  // refused before anything was allocated
}

// P on NVMe beside W in fp32 is W's bytes (Layout::PIsW): it has no block,
// and the step's slots hold no region for it (each slot held one of a P
// never staged: 5 states' regions, 320 KiB, where 4 are used).
TEST(Preflight, StepSlotsHoldNoRegionForAPThatIsWsBytes) {
  testing::TempDir swap;
  Status st;
  auto e = TightBuild(swap.path(), true, &st);
  ASSERT_TRUE(e);
  ASSERT_EQ(st.code(), Code::kConfig) << st.ToString();
  EXPECT_NE(st.message().find("4 step staging slots of 256.00 KiB"), std::string::npos) << st.message();
}

// A large frozen group keeps P alone: the create-time lower bound of host
// memory (MinHostBytes) counts W, M, V and G for the largest group that
// trains, not for it, and P at stage 3 as this rank's shard. Before, a
// 64 Mi-element frozen group asked for its fp32 W, M, V and G (about 1 GiB)
// and a budget that held everything (its 128 MiB of bf16 P, the small
// group's state) was refused.
TEST(Preflight, AFrozenGroupIsNotCountedAsTrainingAtBuildStart) {
  auto cfg = ParseConfig(R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 1,
      "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
      "strata": {"device_budget": "256MiB", "host_budget": "256MiB"}})");
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  EngineOptions o;
  o.force_no_gpu = true;
  auto e = Engine::Create(*cfg, o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_TRUE((*e)->AddParam(0, "base", uint64_t{64} << 20, nullptr).ok());
  ASSERT_TRUE((*e)->AddParam(1, "adapter", uint64_t{1} << 20, nullptr).ok());
  ASSERT_TRUE((*e)->FreezeGroup(0).ok());
  Status st = (*e)->Build();
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_LE((*e)->stats().host.peak, (*e)->stats().host.budget);
}

// ---- Step options ----

TEST(Preflight, NonFiniteStepOptionIsRefusedBeforeAnythingChanges) {
  auto e = MakeBuilt();
  ASSERT_TRUE(e);
  const std::vector<float> before = Master(*e, 0);
  for (const char* name : {"lr", "beta1", "beta2", "eps", "weight_decay"}) {
    for (double bad : {kNaN, kInf, -kInf}) {
      StepOptions so;
      double* field = std::string(name) == "lr" ? &so.lr : std::string(name) == "beta1" ? &so.beta1
                    : std::string(name) == "beta2" ? &so.beta2 : std::string(name) == "eps" ? &so.eps
                                                                                          : &so.weight_decay;
      *field = bad;
      const Status prep = e->PrepareStep(so);
      EXPECT_EQ(prep.code(), Code::kInvalid) << name;
      EXPECT_EQ(prep.message().rfind(std::string("prepare_step: step option ") + name + " is ", 0), 0u)
          << prep.message();
      GiveGrads(*e, -1);
      auto r = e->Step(so);
      ASSERT_FALSE(r.ok()) << name;
      EXPECT_EQ(r.status().code(), Code::kInvalid);
      EXPECT_EQ(r.status().message().rfind(std::string("step: step option ") + name + " is ", 0), 0u)
          << r.status().message();
      EXPECT_EQ(e->steps_applied(), 0);
      EXPECT_EQ(Master(*e, 0), before) << name;
      ASSERT_TRUE(e->Step(StepOptions{}).ok());  // the gradients given are still pending: step them away
      ASSERT_TRUE(e->SetStepsApplied(0).ok());
      ASSERT_TRUE(e->WriteState(0, Engine::OptimizerState::kMaster, before.data()).ok());
    }
  }
}

// A finite step option whose float the update cannot take is refused as the
// non-finite ones are: before anything changes, naming it.
TEST(Preflight, StepOptionsBeyondFloatAreRefusedBeforeAnythingChanges) {
  auto e = MakeBuilt();
  ASSERT_TRUE(e);
  const std::vector<float> before = Master(*e, 0);
  const struct {
    double lr, eps, weight_decay;
    const char* says;
  } bad[] = {{1e39, -1, -1, "lr / (1 - beta1^step) at step 1 is 1e+40"},
             {1e20, -1, 1e20, "1 - lr * weight_decay is -1e+40"},
             {-1, 1e39, -1, "eps is 1e+39"},
             {-1, 1e-50, -1, "eps 1e-50 is 0 as a float"}};
  for (const auto& b : bad) {
    StepOptions so;
    so.lr = b.lr, so.eps = b.eps, so.weight_decay = b.weight_decay;
    const Status prep = e->PrepareStep(so);
    EXPECT_EQ(prep.code(), Code::kInvalid) << b.says;
    EXPECT_NE(prep.message().find(b.says), std::string::npos) << prep.ToString();
    GiveGrads(*e, -1);
    auto r = e->Step(so);
    ASSERT_FALSE(r.ok()) << b.says;
    EXPECT_NE(r.status().message().find(b.says), std::string::npos) << r.status().ToString();
    EXPECT_EQ(e->steps_applied(), 0);
    EXPECT_EQ(Master(*e, 0), before) << b.says;
    ASSERT_TRUE(e->Step(StepOptions{}).ok());  // the gradients given are still pending: step them away
    ASSERT_TRUE(e->SetStepsApplied(0).ok());
    ASSERT_TRUE(e->WriteState(0, Engine::OptimizerState::kMaster, before.data()).ok());
  }
  StepOptions zero;  // an eps of 0 asked for (the C API: the least positive double) stays torch's
  zero.eps = 4.9406564584124654e-324;
  EXPECT_TRUE(e->PrepareStep(zero).ok());
}

// Compact state with eps 0 updates by 0/0 where both moments round to 0 in
// their block (the config refuses eps 0 there; a step option may not bring it).
TEST(Preflight, CompactRefusesAStepOptionEpsOfZero) {
  auto cfg = ParseConfig(R"({"bf16": {"enabled": true}, "strata": {"state_format": "compact", "host_budget": "64MiB"}})");
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  EngineOptions o;
  o.force_no_gpu = true;
  auto e = Engine::Create(*cfg, o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_TRUE((*e)->AddParam(0, "w", 4096, nullptr).ok());
  ASSERT_TRUE((*e)->Build().ok());
  StepOptions so;
  // 0, the least positive double (what the C API passes for a 0 asked for),
  // and any eps that is 0 as the kernels' float.
  for (double eps : {0.0, 4.9406564584124654e-324, 1e-50}) {
    so.eps = eps;
    const Status prep = (*e)->PrepareStep(so);
    EXPECT_EQ(prep.code(), Code::kInvalid) << eps << ": " << prep.ToString();
    EXPECT_NE(prep.message().find("(0 as a float) with strata.state_format \"compact\""), std::string::npos)
        << prep.ToString();
  }
  so.eps = 1e-44;  // a float denormal: the update of an element with v and m 0 is 0/1e-44, 0
  EXPECT_TRUE((*e)->PrepareStep(so).ok());
  so.eps = 1e-12;
  EXPECT_TRUE((*e)->PrepareStep(so).ok());
}

// ---- Non-finite gradients: strata.nonfinite ----

TEST(Preflight, NonFiniteGradientsAreSkippedByDefault) {
  auto e = MakeBuilt();
  ASSERT_TRUE(e);
  const std::vector<float> w0 = Master(*e, 0), w1 = Master(*e, 1);
  GiveGrads(*e, 1);
  LogCapture log;
  auto r = e->Step(StepOptions{});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->skipped);
  EXPECT_EQ(e->steps_applied(), 0);
  EXPECT_EQ(Master(*e, 0), w0);
  EXPECT_EQ(Master(*e, 1), w1);
  EXPECT_NE(log.text().find("step: gradients of group 1 are not finite (NaN or infinite); skipped: nothing was "
                            "updated (strata.nonfinite is \"skip\")"),
            std::string::npos)
      << log.text();
  std::vector<float> m(64);  // the moments too
  ASSERT_TRUE(e->ReadState(1, Engine::OptimizerState::kExpAvg, m.data()).ok());
  EXPECT_EQ(m, std::vector<float>(64, 0.0f));
  GiveGrads(*e, -1);  // the next finite step goes ahead
  auto next = e->Step(StepOptions{});
  ASSERT_TRUE(next.ok());
  EXPECT_FALSE(next->skipped);
  EXPECT_EQ(e->steps_applied(), 1);
}

TEST(Preflight, NonFiniteGradientsCanBeAnError) {
  auto e = MakeBuilt(R"(, "nonfinite": "error")");
  ASSERT_TRUE(e);
  const std::vector<float> w0 = Master(*e, 0), w1 = Master(*e, 1);
  GiveGrads(*e, 1);
  auto r = e->Step(StepOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalid);
  EXPECT_EQ(r.status().message(), "step: gradients of group 1 are not finite (NaN or infinite); nothing was updated "
                                  "(strata.nonfinite is \"error\") and this step's gradients were dropped: hand new "
                                  "ones before the next step (a step now updates with none)");
  EXPECT_EQ(e->steps_applied(), 0);
  EXPECT_TRUE(e->SetStepsApplied(0).ok()) << "the message says the gradients were dropped: none is pending";
  EXPECT_EQ(Master(*e, 0), w0);
  EXPECT_EQ(Master(*e, 1), w1);
}

TEST(Preflight, NonFiniteGradientsCanBeApplied) {
  auto e = MakeBuilt(R"(, "nonfinite": "apply")");
  ASSERT_TRUE(e);
  GiveGrads(*e, 1);
  auto r = e->Step(StepOptions{});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->skipped);
  EXPECT_EQ(e->steps_applied(), 1);
  EXPECT_TRUE(std::isnan(Master(*e, 1)[7]));  // the old behaviour, asked for
}

// ---- A group without gradients (documented at strata_engine_step) ----

TEST(Preflight, GroupWithoutGradientsIsUpdatedAsWithZeroGradients) {
  auto e = MakeBuilt("", 0.1);
  ASSERT_TRUE(e);
  const std::vector<float> w1 = Master(*e, 1);
  std::vector<float> grads(64, 0.1f);
  ASSERT_TRUE(e->Grads(0, grads.data(), DType::kF32).ok());  // group 1 gets none
  ASSERT_TRUE(e->Step(StepOptions{}).ok());
  const std::vector<float> after = Master(*e, 1);
  for (size_t i = 0; i < after.size(); ++i)  // AdamW with g = 0, m = v = 0: only the decay, w * (1 - lr * wd)
    EXPECT_FLOAT_EQ(after[i], w1[i] * (1.0f - 0.01f * 0.1f)) << i;
}

// ---- STRATA_CPU_ISA (registered again with STRATA_CPU_ISA=garbage) ----

TEST(PreflightIsa, UnknownCpuIsaIsRefusedAtCreate) {
  const char* env = std::getenv("STRATA_CPU_ISA");
  if (env == nullptr || std::string(env) != "garbage") GTEST_SKIP() << "runs with STRATA_CPU_ISA=garbage";
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e = Engine::Create(Config{}, eo);  // used to succeed, and Build to leave every parameter zero
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), Code::kConfig);
  EXPECT_EQ(e.status().message(), "STRATA_CPU_ISA: CPU ISA 'garbage' is not one of scalar, avx2, avx512");
}

}  // namespace
}  // namespace strata
