// Frozen groups (Engine::FreezeGroup): a frozen group's P never changes and
// is fetched as given (rounded to the compute dtype) from every home; the
// other groups step bitwise as in an engine without it; it takes host and
// NVMe bytes for P alone; grads and the moments are refused; checkpoints
// round-trip it and refuse other frozen flags.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "base/align.h"
#include "base/dtype.h"
#include "engine/engine.h"
#include "tiers/nvme_tier.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using testing::TempDir;

// Sizes that pad and that differ, so that misplaced data shows. The frozen
// group is the largest (as base weights are).
constexpr uint64_t kTrainA = 3001, kTrainB = 2500, kFrozen = 6000;

struct Case {
  std::string placement = "device";  // device | host | nvme_opt | nvme_all
  bool bf16 = true;
  std::string format = "fp32";       // strata.state_format
  std::string extra;                 // more "strata" keys
  double clip = 0.5;                 // gradient_clipping
  bool overlap = false, twin = false;
  int stage = 3;
};

std::string Name(const Case& s) {
  return s.placement + (s.bf16 ? "/bf16" : "/f32") + "/" + s.format + s.extra + (s.overlap ? "/overlap" : "") +
         (s.twin ? "/gpu-twin" : "") + "/stage" + std::to_string(s.stage);
}

std::string Json(const Case& s, const std::string& dir) {
  std::string opt = "none", par = "none", budgets = R"("device_budget": "16MiB", "host_budget": "16MiB")";
  if (s.placement == "host") opt = par = "cpu";
  if (s.placement == "nvme_opt") opt = "nvme";
  if (s.placement == "nvme_all") opt = par = "nvme";
  // With W, M, V on NVMe, G beside them (strata.grad_home; "auto" would keep it in host memory).
  const std::string grad_home =
      opt == "nvme" && s.extra.find("grad_home") == std::string::npos ? R"(, "grad_home": "nvme")" : "";
  return std::string(R"({"bf16": {"enabled": )") + (s.bf16 ? "true" : "false") +
         R"(}, "gradient_clipping": )" + std::to_string(s.clip) +
         R"(, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.05}},
    "zero_optimization": {"stage": )" + std::to_string(s.stage) + R"(, "stage3_prefetch_bucket_size": 5000,
      "offload_optimizer": {"device": ")" + opt + R"(", "nvme_path": ")" + dir + R"("},
      "offload_param": {"device": ")" + par + R"(", "nvme_path": ")" + dir + R"("}},
    "strata": {)" + budgets + grad_home + R"(, "state_format": ")" + s.format + "\"" + s.extra + "}}";
}

std::vector<float> Values(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// What a frozen group holds: the values given, in the compute dtype, widened.
std::vector<float> Rounded(const std::vector<float>& v, bool bf16) {
  std::vector<float> r(v);
  if (bf16)
    for (auto& x : r) x = BF16ToF32(F32ToBF16(x));
  return r;
}

std::vector<float> Widen(const void* p, uint64_t n, DType dt) {
  std::vector<float> out(n);
  for (uint64_t i = 0; i < n; ++i)
    out[i] = dt == DType::kF32 ? static_cast<const float*>(p)[i] : BF16ToF32(static_cast<const uint16_t*>(p)[i]);
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// One engine of the comparison: the two trained groups, and (with_frozen)
// the frozen one between them, at group 1.
struct Rig {
  std::unique_ptr<Engine> e;
  bool with_frozen = false;
  int ta = 0, tb = 1, fz = -1;  // group numbers
};

// Each rig swaps to a folder of its own under `dir` (two engines never share one).
Result<Rig> MakeRig(const Case& s, const std::string& dir, bool with_frozen, const std::vector<float>& frozen_init,
                    bool freeze = true) {
  static int rigs = 0;
  const std::string swap = dir + "/rig" + std::to_string(rigs++);
  std::filesystem::create_directories(swap);
  auto cfg = ParseConfig(Json(s, swap));
  if (!cfg.ok()) return cfg.status();
  EngineOptions eo;
  eo.overlap_step = s.overlap;
  eo.gpu_optimizer_twin = s.twin;
  eo.force_no_gpu = true;
  Rig r;
  STRATA_ASSIGN_OR_RETURN(r.e, Engine::Create(*cfg, eo));
  r.with_frozen = with_frozen;
  if (with_frozen) {
    r.fz = 1;
    r.tb = 2;
    if (freeze) STRATA_RETURN_IF_ERROR(r.e->FreezeGroup(r.fz));  // before its tensors: allowed
  }
  const std::vector<float> a = Values(kTrainA, 1), b = Values(kTrainB, 2);
  STRATA_RETURN_IF_ERROR(r.e->AddParam(r.ta, "a.w", 1000, a.data()).status());
  STRATA_RETURN_IF_ERROR(r.e->AddParam(r.ta, "a.b", kTrainA - 1000, a.data() + 1000).status());
  if (with_frozen) {
    STRATA_RETURN_IF_ERROR(r.e->AddShapedParam(r.fz, "base.w", {60, 90}, frozen_init.data()).status());
    STRATA_RETURN_IF_ERROR(r.e->AddParam(r.fz, "base.b", kFrozen - 5400, frozen_init.data() + 5400).status());
  }
  STRATA_RETURN_IF_ERROR(r.e->AddParam(r.tb, "b.w", kTrainB, b.data()).status());
  STRATA_RETURN_IF_ERROR(r.e->Build());
  return r;
}

// Gradients of a trained group: a function of its fetched parameters, the
// frozen values (`base`, as the forward would read them) and the step.
std::vector<float> GradOf(const std::vector<float>& p, const std::vector<float>& base, int step, float scale) {
  std::vector<float> g(p.size());
  for (size_t i = 0; i < p.size(); ++i)
    g[i] = scale * std::sin(3.0f * p[i] + 2.0f * base[i % base.size()] + 0.25f * static_cast<float>(step));
  return g;
}

struct Trace {
  std::vector<double> norms;
  std::vector<float> a, b, a_m, a_v, b_m, b_v;  // after the last step
  std::vector<std::vector<float>> frozen_fetched;  // per step (the rig with the frozen group)
  std::vector<float> frozen_master;
};

// `base`: the frozen values the rig without them computes with; the rig with
// them reads them from its fetch (so a wrong fetch shows in the other groups).
void Train(Rig& r, int steps, const std::vector<float>& base, Trace* t, const Case& s, int first_step = 0) {
  Engine& e = *r.e;
  const DType dt = e.compute_dtype();
  for (int step = first_step; step < first_step + steps; ++step) {
    StepOptions so;
    so.lr = 0.01 * (1 + 0.1 * step);
    if (s.overlap) {
      ASSERT_TRUE(e.PrepareStep(so).ok());
    }
    std::vector<float> fz = base;
    if (r.with_frozen) {
      auto p = e.Fetch(r.fz);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      fz = Widen(*p, kFrozen, dt);
      ASSERT_TRUE(e.Release(r.fz).ok());
      t->frozen_fetched.push_back(fz);
    }
    for (int g : {r.tb, r.ta}) {  // backward order
      auto p = e.Fetch(g);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      const std::vector<float> w = Widen(*p, e.group_numel(g), dt);
      ASSERT_TRUE(e.Release(g).ok());
      const std::vector<float> grad = GradOf(w, fz, step, g == r.ta ? 0.3f : 0.7f);
      Status st = e.Grads(g, grad.data(), DType::kF32);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
    auto res = e.Step(so);
    ASSERT_TRUE(res.ok()) << res.status().ToString();
    ASSERT_FALSE(res->skipped);
    t->norms.push_back(res->grad_norm);
  }
  auto read = [&](int g, Engine::OptimizerState which, std::vector<float>* out) {
    out->resize(e.group_numel(g));
    Status st = e.ReadState(g, which, out->data());
    ASSERT_TRUE(st.ok()) << st.ToString();
  };
  read(r.ta, Engine::OptimizerState::kMaster, &t->a);
  read(r.tb, Engine::OptimizerState::kMaster, &t->b);
  read(r.ta, Engine::OptimizerState::kExpAvg, &t->a_m);
  read(r.tb, Engine::OptimizerState::kExpAvg, &t->b_m);
  read(r.ta, Engine::OptimizerState::kExpAvgSq, &t->a_v);
  read(r.tb, Engine::OptimizerState::kExpAvgSq, &t->b_v);
  if (r.with_frozen) {
    t->frozen_master.resize(kFrozen);
    ASSERT_TRUE(e.ReadMaster(r.fz, t->frozen_master.data()).ok());
  }
}

void ExpectSameTraining(const Trace& with, const Trace& without, const std::string& what) {
  EXPECT_EQ(with.norms, without.norms) << what << ": the gradient norms differ";
  EXPECT_TRUE(SameBits(with.a, without.a)) << what << ": group a's master";
  EXPECT_TRUE(SameBits(with.b, without.b)) << what << ": group b's master";
  EXPECT_TRUE(SameBits(with.a_m, without.a_m) && SameBits(with.a_v, without.a_v)) << what << ": group a's moments";
  EXPECT_TRUE(SameBits(with.b_m, without.b_m) && SameBits(with.b_v, without.b_v)) << what << ": group b's moments";
}

// The core promise, in one setup: the frozen group is fetched as given and
// never changes; the others step as if it were absent.
void CheckSetup(const Case& s) {
  SCOPED_TRACE(Name(s));
  TempDir dir;
  const std::vector<float> init = Values(kFrozen, 9);
  const std::vector<float> held = Rounded(init, s.bf16);
  auto with = MakeRig(s, dir.path(), true, init);
  ASSERT_TRUE(with.ok()) << with.status().ToString();
  auto without = MakeRig(s, dir.path(), false, init);
  ASSERT_TRUE(without.ok()) << without.status().ToString();
  Trace tw, to;
  Train(*with, 4, held, &tw, s);
  Train(*without, 4, held, &to, s);
  ExpectSameTraining(tw, to, Name(s));
  EXPECT_GT(tw.norms.back(), 0.0);
  EXPECT_FALSE(SameBits(tw.a, Values(kTrainA, 1))) << "the trained group did not change: is the step running?";
  ASSERT_EQ(tw.frozen_fetched.size(), 4u);
  for (const auto& f : tw.frozen_fetched) EXPECT_TRUE(SameBits(f, held)) << "a fetch of the frozen group";
  EXPECT_TRUE(SameBits(tw.frozen_master, held)) << "read_master of the frozen group";
  if (!s.bf16) {
    EXPECT_TRUE(SameBits(held, init));  // fp32 keeps the values exactly
  }
  const EngineStats st = with->e->stats();
  EXPECT_LE(st.host.peak, st.host.budget);
  EXPECT_LE(st.nvme.peak, st.nvme.budget);
}

TEST(Frozen, FetchedAsGivenAndOthersStepAsWithoutIt) {
  for (const char* p : {"device", "host", "nvme_opt", "nvme_all"})
    for (bool bf16 : {true, false}) {
      Case s;
      s.placement = p;
      s.bf16 = bf16;
      CheckSetup(s);
    }
}

TEST(Frozen, CompactFormatConcurrentIoAndLowerStages) {
  for (const char* p : {"device", "host", "nvme_opt", "nvme_all"}) {
    Case s;
    s.placement = p;
    s.format = "compact";
    CheckSetup(s);
  }
  Case c;
  c.placement = "nvme_all";
  c.extra = R"(, "step_io": "concurrent")";
  CheckSetup(c);
  for (int stage : {0, 1, 2}) {
    Case s;
    s.placement = stage == 2 ? "nvme_opt" : "host";
    s.stage = stage;
    CheckSetup(s);
  }
}

TEST(Frozen, OverlappedStepAndGpuUpdatePathLeaveItOut) {
  for (const char* p : {"device", "nvme_all"}) {
    Case s;
    s.placement = p;
    s.overlap = true;
    s.clip = 0;  // the overlapped step needs no clipping
    CheckSetup(s);
  }
  for (const char* f : {"fp32", "compact"}) {
    Case s;  // the GPU update's path on the host arena (W, M, V homed on the device)
    s.twin = true;
    s.format = f;
    CheckSetup(s);
  }
}

// The host and NVMe bytes a frozen group takes are its P's (and, with P
// off the host, one staging buffer of it), never a G, W, M or V.
TEST(Frozen, BudgetsCountItsParametersAlone) {
  const std::vector<float> init = Values(kFrozen, 9);
  for (const char* p : {"host", "nvme_all"}) {
    Case s;
    s.placement = p;
    TempDir dir;
    auto with = MakeRig(s, dir.path(), true, init);
    ASSERT_TRUE(with.ok()) << with.status().ToString();
    auto without = MakeRig(s, dir.path(), false, init);
    ASSERT_TRUE(without.ok()) << without.status().ToString();
    const EngineStats a = with->e->stats(), b = without->e->stats();
    const uint64_t p_bytes = AlignUp(kFrozen, 2048) * 2;  // padded to a shard's multiple, bf16
    if (std::string(p) == "host") {
      EXPECT_EQ(a.host.used - b.host.used, AlignUp(p_bytes, 4096)) << p;
      EXPECT_EQ(a.nvme.used, 0u);
    } else {
      const uint64_t on_disk = NvmeTier::PaddedSizeFor(p_bytes, 1);
      EXPECT_EQ(a.nvme.used - b.nvme.used, on_disk) << p;
      EXPECT_EQ(a.nvme.budget - b.nvme.budget, on_disk) << p;
      EXPECT_EQ(a.host.used - b.host.used, AlignUp(on_disk, 4096)) << p << ": its one staging buffer";
    }
    // The same group trained instead takes G, W, M, V too: the frozen flag is what saves them.
    TempDir dir2;
    auto trained = MakeRig(s, dir2.path(), true, init, /*freeze=*/false);
    ASSERT_TRUE(trained.ok()) << trained.status().ToString();
    const EngineStats c = trained->e->stats();
    if (std::string(p) == "host") {
      EXPECT_GE(c.host.used - a.host.used, 4 * 4 * kFrozen) << p << ": G, W, M, V in fp32";
    } else {
      EXPECT_GE(c.nvme.used - a.nvme.used, 4 * 4 * kFrozen) << p << ": G, W, M, V in fp32";
    }
  }
}

TEST(Frozen, GradsMomentsAndLateFreezingAreRefused) {
  TempDir dir;
  Case s;
  s.placement = "host";
  const std::vector<float> init = Values(kFrozen, 9);
  auto r = MakeRig(s, dir.path(), true, init);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  Engine& e = *r->e;
  EXPECT_TRUE(e.group_frozen(1));
  EXPECT_FALSE(e.group_frozen(0));
  EXPECT_FALSE(e.group_frozen(7));
  std::vector<float> g(kFrozen, 1.0f), out(kFrozen);
  Status st = e.Grads(1, g.data(), DType::kF32);
  EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
  EXPECT_NE(st.message().find("group 1"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("frozen"), std::string::npos) << st.message();
  for (auto which : {Engine::OptimizerState::kExpAvg, Engine::OptimizerState::kExpAvgSq}) {
    st = e.ReadState(1, which, out.data());
    EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
    EXPECT_NE(st.message().find("group 1 is frozen"), std::string::npos) << st.message();
    st = e.WriteState(1, which, out.data());
    EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
    EXPECT_NE(st.message().find("group 1 is frozen"), std::string::npos) << st.message();
  }
  st = e.FreezeGroup(0);
  EXPECT_EQ(st.code(), Code::kState) << st.ToString();
  EXPECT_FALSE(e.group_frozen(0));
  EXPECT_EQ(e.FreezeGroup(-1).code(), Code::kInvalid);

  // A frozen group without tensors fails the build, naming it; the build
  // may then be tried again with the group filled.
  auto cfg = ParseConfig(Json(s, dir.path()));
  ASSERT_TRUE(cfg.ok());
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e2 = Engine::Create(*cfg, eo);
  ASSERT_TRUE(e2.ok());
  ASSERT_TRUE((*e2)->AddParam(0, "x", 100, nullptr).ok());
  ASSERT_TRUE((*e2)->FreezeGroup(1).ok());
  ASSERT_TRUE((*e2)->FreezeGroup(1).ok());  // twice: nothing more
  st = (*e2)->Build();
  EXPECT_EQ(st.code(), Code::kState) << st.ToString();
  EXPECT_NE(st.message().find("group 1 is frozen"), std::string::npos) << st.message();
  ASSERT_TRUE((*e2)->AddParam(1, "y", 100, nullptr).ok());
  st = (*e2)->Build();
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE((*e2)->group_frozen(1));
}

// write_state(master) is how a trainer's load_state_dict reaches a frozen
// group: its P is set (rounded), fetched so, and kept through steps.
TEST(Frozen, WriteMasterSetsItsParameters) {
  for (const char* p : {"host", "nvme_all", "device"}) {
    SCOPED_TRACE(p);
    TempDir dir;
    Case s;
    s.placement = p;
    const std::vector<float> init = Values(kFrozen, 9), next = Values(kFrozen, 10);
    auto r = MakeRig(s, dir.path(), true, init);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    Engine& e = *r->e;
    Trace t;
    Train(*r, 1, {}, &t, s);  // fetched once: a stale device copy would show below
    Status st = e.WriteState(1, Engine::OptimizerState::kMaster, next.data());
    ASSERT_TRUE(st.ok()) << st.ToString();
    Trace t2;
    Train(*r, 2, {}, &t2, s, 1);
    const std::vector<float> held = Rounded(next, true);
    for (const auto& f : t2.frozen_fetched) EXPECT_TRUE(SameBits(f, held));
    EXPECT_TRUE(SameBits(t2.frozen_master, held));
  }
}

class FrozenCheckpoint : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (std::string(GetParam()) == "copy") ::setenv("STRATA_CHECKPOINT_COPY", "1", 1);
  }
  void TearDown() override { ::unsetenv("STRATA_CHECKPOINT_COPY"); }
};

// Saved from one placement, loaded into another (its frozen group given
// other values at add_param): the load sets them, and training resumes
// exactly as it went on uninterrupted.
TEST_P(FrozenCheckpoint, RoundTripResumesExactly) {
  const std::vector<float> init = Values(kFrozen, 9), other = Values(kFrozen, 11);
  const std::vector<float> held = Rounded(init, true);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"nvme_all", "nvme_all"}, {"host", "nvme_all"}, {"nvme_all", "device"}, {"device", "host"}}) {
    for (const char* format : {"fp32", "compact"}) {
      SCOPED_TRACE(from + " -> " + to + " " + format);
      TempDir dir, ckpt;
      Case s1, s2;
      s1.placement = from;
      s2.placement = to;
      s1.format = s2.format = format;
      auto a = MakeRig(s1, dir.path(), true, init);
      ASSERT_TRUE(a.ok()) << a.status().ToString();
      Trace t;
      Train(*a, 2, {}, &t, s1);
      Status st = a->e->SaveCheckpoint(ckpt.path(), "s2", nullptr, 0);
      ASSERT_TRUE(st.ok()) << st.ToString();
      st = a->e->SaveCheckpoint(ckpt.path(), "s2", nullptr, 0);  // the same state again: only `latest`
      ASSERT_TRUE(st.ok()) << st.ToString();
      Trace cont;
      Train(*a, 2, {}, &cont, s1, 2);

      auto b = MakeRig(s2, dir.path(), true, other);
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      std::vector<uint8_t> blob;
      st = b->e->LoadCheckpoint(ckpt.path(), "", &blob);
      ASSERT_TRUE(st.ok()) << st.ToString();
      std::vector<float> fm(kFrozen);
      ASSERT_TRUE(b->e->ReadMaster(1, fm.data()).ok());
      EXPECT_TRUE(SameBits(fm, held)) << "the loaded frozen group";
      Trace resumed;
      Train(*b, 2, {}, &resumed, s2, 2);
      ExpectSameTraining(resumed, cont, "resumed");
      for (const auto& f : resumed.frozen_fetched) EXPECT_TRUE(SameBits(f, held));
    }
  }
}

// A checkpoint loads only into an engine that freezes the same groups; a
// save over a tag whose frozen group holds other values is refused.
TEST_P(FrozenCheckpoint, OtherFrozenFlagsAreRefused) {
  const std::vector<float> init = Values(kFrozen, 9);
  TempDir dir, ckpt;
  Case s;
  s.placement = "nvme_all";
  auto a = MakeRig(s, dir.path(), true, init);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  Trace t;
  Train(*a, 1, {}, &t, s);
  ASSERT_TRUE(a->e->SaveCheckpoint(ckpt.path(), "s1", nullptr, 0).ok());

  auto same_layout_unfrozen = MakeRig(s, dir.path(), true, init, /*freeze=*/false);
  ASSERT_TRUE(same_layout_unfrozen.ok());
  std::vector<float> before(kFrozen), after(kFrozen);
  ASSERT_TRUE(same_layout_unfrozen->e->ReadMaster(1, before.data()).ok());
  Status st = same_layout_unfrozen->e->LoadCheckpoint(ckpt.path(), "s1", nullptr);
  EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
  EXPECT_NE(st.message().find("group 1 is frozen in"), std::string::npos) << st.message();
  ASSERT_TRUE(same_layout_unfrozen->e->ReadMaster(1, after.data()).ok());
  EXPECT_TRUE(SameBits(before, after)) << "a refused load changed the engine";

  // Group 0 frozen too: refused, naming group 0.
  auto cfg = ParseConfig(Json(s, dir.path()));
  ASSERT_TRUE(cfg.ok());
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e = Engine::Create(*cfg, eo);
  ASSERT_TRUE(e.ok());
  const std::vector<float> a0 = Values(kTrainA, 1), b0 = Values(kTrainB, 2);
  ASSERT_TRUE((*e)->AddParam(0, "a.w", 1000, a0.data()).ok());
  ASSERT_TRUE((*e)->AddParam(0, "a.b", kTrainA - 1000, a0.data() + 1000).ok());
  ASSERT_TRUE((*e)->AddShapedParam(1, "base.w", {60, 90}, init.data()).ok());
  ASSERT_TRUE((*e)->AddParam(1, "base.b", kFrozen - 5400, init.data() + 5400).ok());
  ASSERT_TRUE((*e)->AddParam(2, "b.w", kTrainB, b0.data()).ok());
  ASSERT_TRUE((*e)->FreezeGroup(0).ok() && (*e)->FreezeGroup(1).ok());
  ASSERT_TRUE((*e)->Build().ok());
  st = (*e)->LoadCheckpoint(ckpt.path(), "s1", nullptr);
  EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
  EXPECT_NE(st.message().find("group 0 is not frozen in"), std::string::npos) << st.message();

  // The saved tag again after the frozen group changed: not the same state.
  ASSERT_TRUE(a->e->WriteState(1, Engine::OptimizerState::kMaster, Values(kFrozen, 12).data()).ok());
  st = a->e->SaveCheckpoint(ckpt.path(), "s1", nullptr, 0);
  EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
  EXPECT_NE(st.message().find("P of group 1"), std::string::npos) << st.message();
}

INSTANTIATE_TEST_SUITE_P(SaveKinds, FrozenCheckpoint, ::testing::Values("snapshot", "copy"));

// Every group frozen: an engine that only serves parameters. Steps change
// nothing and count; checkpoints hold P alone.
TEST(Frozen, EveryGroupFrozen) {
  TempDir dir, ckpt;
  Case s;
  s.placement = "nvme_all";
  auto cfg = ParseConfig(Json(s, dir.path()));
  ASSERT_TRUE(cfg.ok());
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e = Engine::Create(*cfg, eo);
  ASSERT_TRUE(e.ok());
  const std::vector<float> v = Values(kFrozen, 3);
  ASSERT_TRUE((*e)->AddParam(0, "p", kFrozen, v.data()).ok());
  ASSERT_TRUE((*e)->FreezeGroup(0).ok());
  Status st = (*e)->Build();
  ASSERT_TRUE(st.ok()) << st.ToString();
  auto r = (*e)->Step({});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->grad_norm, 0.0);
  EXPECT_EQ((*e)->steps_applied(), 1);
  std::vector<float> out(kFrozen);
  ASSERT_TRUE((*e)->ReadMaster(0, out.data()).ok());
  EXPECT_TRUE(SameBits(out, Rounded(v, true)));
  st = (*e)->SaveCheckpoint(ckpt.path(), "t", nullptr, 0);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_TRUE((*e)->WriteState(0, Engine::OptimizerState::kMaster, Values(kFrozen, 4).data()).ok());
  st = (*e)->LoadCheckpoint(ckpt.path(), "t", nullptr);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_TRUE((*e)->ReadMaster(0, out.data()).ok());
  EXPECT_TRUE(SameBits(out, Rounded(v, true)));
}

}  // namespace
}  // namespace strata
