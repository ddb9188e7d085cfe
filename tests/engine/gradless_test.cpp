// EngineOptions::skip_groups_without_grads: a group that got no gradients
// in a step is left bitwise untouched and counts its own updates for bias
// correction, so it trains exactly as an engine of that group alone stepped
// only when it has gradients (torch's rule for a parameter whose .grad is
// None); the counts survive checkpoints. Without the option such a group
// is stepped as with zero gradients (DeepSpeed's rule), as before.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "engine/engine.h"
#include "tests/engine/engine_test_util.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using testing::TempDir;

constexpr uint64_t kA = 3001, kB = 2500;
const std::set<int> kStepsWithB = {0, 2, 3, 5};  // group B gets gradients in these steps only
constexpr int kSteps = 6;

struct Case {
  std::string placement = "host";  // device | host | nvme_all
  std::string format = "fp32";
  bool overlap = false, twin = false;
};

std::string Name(const Case& c) {
  return c.placement + "/" + c.format + (c.overlap ? "/overlap" : "") + (c.twin ? "/gpu-twin" : "");
}

std::string Json(const Case& c, const std::string& swap) {
  const std::string opt = c.placement == "device" ? "none" : c.placement == "host" ? "cpu" : "nvme";
  const std::string par = c.placement == "nvme_all" ? "nvme" : c.placement == "host" ? "cpu" : "none";
  return R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.05}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": ")" + opt + R"(", "nvme_path": ")" + swap +
         R"("}, "offload_param": {"device": ")" + par + R"(", "nvme_path": ")" + swap + R"("}},
    "strata": {"device_budget": "16MiB", "host_budget": "16MiB", "state_format": ")" + c.format + R"("}})";
}

std::vector<float> Values(uint64_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = 0.3f * std::sin(0.013f * static_cast<float>(i * seed + 1));
  return v;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// An engine of the groups named ("a", "b" or both, in that order), each
// swapping to a folder of its own.
std::unique_ptr<Engine> Make(const Case& c, const std::string& dir, const std::vector<std::string>& groups, bool skip) {
  static int made = 0;
  const std::string swap = dir + "/e" + std::to_string(made++);
  std::filesystem::create_directories(swap);
  EngineOptions eo;
  eo.force_no_gpu = true;
  eo.overlap_step = c.overlap;
  eo.gpu_optimizer_twin = c.twin;
  eo.skip_groups_without_grads = skip;
  std::vector<std::vector<float>> values;
  for (const std::string& name : groups) values.push_back(Values(name == "a" ? kA : kB, name == "a" ? 3 : 7));
  return strata::testing::BuiltEngine(Json(c, swap), eo, values, groups);
}

// The gradient of a group's k-th update: a function of its parameters as
// fetched, so that a wrong update shows in every later one.
std::vector<float> GradOf(Engine& e, int g, int k) { return strata::testing::GradOfFetched(e, g, k); }

struct State {
  std::vector<float> w, m, v, p;
};

State Read(Engine& e, int g) {
  State s;
  const uint64_t n = e.group_numel(g);
  s.w.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  EXPECT_TRUE(e.ReadState(g, Engine::OptimizerState::kMaster, s.w.data()).ok());
  EXPECT_TRUE(e.ReadState(g, Engine::OptimizerState::kExpAvg, s.m.data()).ok());
  EXPECT_TRUE(e.ReadState(g, Engine::OptimizerState::kExpAvgSq, s.v.data()).ok());
  auto p = e.Fetch(g);
  EXPECT_TRUE(p.ok());
  s.p.resize(n);
  for (uint64_t i = 0; p.ok() && i < n; ++i) s.p[i] = BF16ToF32(static_cast<const uint16_t*>(*p)[i]);
  EXPECT_TRUE(e.Release(g).ok());
  return s;
}

bool Same(const State& x, const State& y) {
  return SameBits(x.w, y.w) && SameBits(x.m, y.m) && SameBits(x.v, y.v) && SameBits(x.p, y.p);
}

// One step of the two-group engine (a = 0, b = 1): A always gets
// gradients, B in kStepsWithB; `b_updates` counts B's so far.
void Step(Engine& e, int step, int* b_updates, const Case& c) {
  StepOptions so;  // the config's lr: B's k-th update has the same lr as the oracle's
  if (c.overlap) {
    ASSERT_TRUE(e.PrepareStep(so).ok());
  }
  const std::vector<float> ga = GradOf(e, 0, step);
  if (kStepsWithB.count(step)) {
    const std::vector<float> gb = GradOf(e, 1, (*b_updates)++);
    ASSERT_TRUE(e.Grads(1, gb.data(), DType::kF32).ok());
  }
  ASSERT_TRUE(e.Grads(0, ga.data(), DType::kF32).ok());
  auto r = e.Step(so);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_FALSE(r->skipped);
}

// A one-group engine stepped `updates` times, gradients as the two-group
// engine gives that group (B: its k-th update's; A: every step's).
State Oracle(const Case& c, const std::string& dir, const std::string& group, int updates) {
  auto e = Make(c, dir, {group}, false);
  if (!e) return {};
  for (int k = 0; k < updates; ++k) {
    if (c.overlap) {
      EXPECT_TRUE(e->PrepareStep({}).ok());
    }
    const std::vector<float> g = GradOf(*e, 0, k);
    EXPECT_TRUE(e->Grads(0, g.data(), DType::kF32).ok());
    auto r = e->Step({});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
  return Read(*e, 0);
}

void CheckCase(const Case& c) {
  SCOPED_TRACE(Name(c));
  TempDir dir;
  auto x = Make(c, dir.path(), {"a", "b"}, /*skip=*/true);
  ASSERT_NE(x, nullptr);
  int b_updates = 0;
  for (int step = 0; step < kSteps; ++step) {
    const State before = Read(*x, 1);
    Step(*x, step, &b_updates, c);
    if (!kStepsWithB.count(step)) {
      EXPECT_TRUE(Same(Read(*x, 1), before)) << "step " << step << " touched B";
    }
  }
  EXPECT_EQ(x->steps_applied(), kSteps);
  EXPECT_EQ(*x->GroupSteps(0), kSteps);
  EXPECT_EQ(*x->GroupSteps(1), static_cast<int64_t>(kStepsWithB.size()));
  EXPECT_TRUE(Same(Read(*x, 1), Oracle(c, dir.path(), "b", static_cast<int>(kStepsWithB.size()))))
      << "B is not as stepped alone, only when it had gradients";
  EXPECT_TRUE(Same(Read(*x, 0), Oracle(c, dir.path(), "a", kSteps))) << "A is not as stepped alone";
}

TEST(Gradless, UntouchedAndCountingItsOwnSteps) {
  for (const char* p : {"host", "device", "nvme_all"}) {
    Case c;
    c.placement = p;
    CheckCase(c);
  }
  Case compact;
  compact.placement = "nvme_all";
  compact.format = "compact";
  CheckCase(compact);
}

TEST(Gradless, OverlappedStepAndGpuUpdatePath) {
  for (const char* p : {"device", "nvme_all"}) {
    Case c;
    c.placement = p;
    c.overlap = true;
    CheckCase(c);
  }
  Case twin;
  twin.placement = "device";
  twin.twin = true;
  CheckCase(twin);
}

// Without the option (the default) a group without gradients is stepped as
// with zeros: it moves, and its count is the engine's.
TEST(Gradless, DefaultStepsItAsWithZeros) {
  TempDir dir;
  Case c;
  auto x = Make(c, dir.path(), {"a", "b"}, /*skip=*/false);
  ASSERT_NE(x, nullptr);
  int b_updates = 0;
  Step(*x, 0, &b_updates, c);
  const State before = Read(*x, 1);
  Step(*x, 1, &b_updates, c);  // no gradients for B
  const State after = Read(*x, 1);
  EXPECT_FALSE(SameBits(before.w, after.w)) << "weight decay should have moved B";
  EXPECT_FALSE(SameBits(before.m, after.m)) << "B's first moment should have decayed";
  EXPECT_EQ(*x->GroupSteps(1), 2);
  Status st = x->SetGroupSteps(1, 5);
  EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
  EXPECT_NE(st.message().find("skip_groups_without_grads"), std::string::npos) << st.message();
}

// The counts are saved: a run resumed from a checkpoint taken after B
// skipped a step goes on bitwise as the run that was not interrupted.
TEST(Gradless, CountsSurviveCheckpointsAndSetSteps) {
  for (const char* p : {"host", "nvme_all"}) {
    SCOPED_TRACE(p);
    TempDir dir, ckpt;
    Case c;
    c.placement = p;
    auto x = Make(c, dir.path(), {"a", "b"}, true);
    ASSERT_NE(x, nullptr);
    int b_updates = 0;
    Step(*x, 0, &b_updates, c);
    Step(*x, 1, &b_updates, c);  // B skipped: its count 1, A's 2
    ASSERT_TRUE(x->SaveCheckpoint(ckpt.path(), "s2", nullptr, 0).ok());
    ASSERT_TRUE(x->SaveCheckpoint(ckpt.path(), "s2", nullptr, 0).ok());  // the same state: the counts agree
    auto y = Make(c, dir.path(), {"a", "b"}, true);
    ASSERT_NE(y, nullptr);
    Status st = y->LoadCheckpoint(ckpt.path(), "", nullptr);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(*y->GroupSteps(0), 2);
    EXPECT_EQ(*y->GroupSteps(1), 1);
    int y_updates = b_updates;
    for (int step = 2; step < kSteps; ++step) {
      Step(*x, step, &b_updates, c);
      Step(*y, step, &y_updates, c);
    }
    EXPECT_TRUE(Same(Read(*x, 0), Read(*y, 0)));
    EXPECT_TRUE(Same(Read(*x, 1), Read(*y, 1))) << "B resumed with another step count";
    // The saved tag again, with another count: not the same state.
    ASSERT_TRUE(y->SetGroupSteps(1, 9).ok());
    EXPECT_EQ(*y->GroupSteps(1), 9);
    auto z = Make(c, dir.path(), {"a", "b"}, true);
    ASSERT_NE(z, nullptr);
    ASSERT_TRUE(z->LoadCheckpoint(ckpt.path(), "s2", nullptr).ok());
    ASSERT_TRUE(z->SetGroupSteps(1, 3).ok());
    st = z->SaveCheckpoint(ckpt.path(), "s2", nullptr, 0);
    EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
    EXPECT_NE(st.message().find("group 1 has 1 updates there"), std::string::npos) << st.message();
    // set_steps sets every group's count.
    ASSERT_TRUE(z->SetStepsApplied(4).ok());
    EXPECT_EQ(*z->GroupSteps(0), 4);
    EXPECT_EQ(*z->GroupSteps(1), 4);
    EXPECT_EQ(z->SetGroupSteps(1, -1).code(), Code::kInvalid);
  }
}

}  // namespace
}  // namespace strata
