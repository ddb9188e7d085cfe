// engine/: a step that fails part-way (the disk returns EIO on reads or on
// writes, from a real io_uring through the storage's fault seam) leaves every
// group wholly old or wholly new; the next Step with the same options
// finishes it, bitwise equal to a clean run. A step whose gradients are lost
// breaks the engine until a checkpoint is loaded; a failed build leaves
// nothing behind.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "engine/engine.h"
#include "io/fault.h"
#include "kernels/cpu/cast.h"
#include "tests/engine/tiny_mlp.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using testing::TempDir;
using testing::TinyMlp;

constexpr int kSteps = 6;
constexpr int kFaultyStep = 3;  // 0-based: the fourth step fails part-way

// `format`: strata.state_format (compact: P's bf16 half is part of the commit).
std::string Json(const std::string& placement, const std::string& dir, const std::string& step_io,
                 const std::string& format = "fp32") {
  const std::string par = placement == "nvme_all" ? "nvme" : "none";
  const std::string budgets = placement == "nvme_all" ? R"("device_budget": 20000, "host_budget": "2MiB")"
                                                      : R"("device_budget": "64MiB", "host_budget": "64MiB")";
  return R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "gradient_clipping": 0.5,
    "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5000,
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir + R"("},
      "offload_param": {"device": ")" + par + R"(", "nvme_path": ")" + dir + R"(", "buffer_size": 1e4}},
    "strata": {)" + budgets + R"(, "grad_home": "nvme", "step_io": ")" + step_io + R"(", "state_format": ")" + format + R"("}})";
}  // G beside W, M, V on NVMe: its faults are the step's too

Config MustParse(const std::string& json) {
  auto c = ParseConfig(json);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : Config{};
}

StepOptions OptionsOf(int step) {
  StepOptions so;
  so.lr = 0.01 * (1.0 + 0.1 * step);
  return so;
}

std::vector<std::vector<float>> Masters(Engine& e) {
  std::vector<std::vector<float>> out;
  for (int g = 0; g < e.num_groups(); ++g) {
    out.emplace_back(e.group_numel(g));
    Status st = e.ReadMaster(g, out.back().data());
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  return out;
}

struct Built {
  std::unique_ptr<Engine> engine;
  std::shared_ptr<FaultPlan> faults = std::make_shared<FaultPlan>();
};

Built Make(const std::string& json, const TinyMlp& model) {
  Built b;
  EngineOptions eo;
  eo.faults = b.faults;
  auto e = Engine::Create(MustParse(json), eo);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return b;
  b.engine = std::move(e).value();
  EXPECT_TRUE(model.Register(*b.engine).ok());
  Status st = b.engine->Build();
  EXPECT_TRUE(st.ok()) << st.ToString();
  if (!st.ok()) b.engine.reset();
  return b;
}

std::vector<std::vector<float>> CleanRun(const std::string& json, const TinyMlp& model) {
  Built b = Make(json, model);
  if (!b.engine) return {};
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_TRUE(model.TrainStep(*b.engine).ok());
    auto r = b.engine->Step(OptionsOf(s));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
  return Masters(*b.engine);
}

struct FaultCase {
  FaultPlan::Ops ops;
  uint64_t skip;  // operations of that kind that succeed first
};

// Runs kSteps, the faulty one failing with EIO from its skip-th read or
// write on, until the disk "comes back". Returns false when the fault never
// fired (the step had fewer operations than `skip`).
bool FaultyRun(const std::string& json, const TinyMlp& model, const FaultCase& fc,
               std::vector<std::vector<float>>* master, std::string* what) {
  Built b = Make(json, model);
  if (!b.engine) return false;
  Engine& e = *b.engine;
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_TRUE(model.TrainStep(e).ok()) << *what;
    if (s != kFaultyStep) {
      auto r = e.Step(OptionsOf(s));
      EXPECT_TRUE(r.ok()) << *what << ": " << r.status().ToString();
      continue;
    }
    const int64_t steps_before = e.steps_applied();
    b.faults->Arm(fc.ops, EIO, fc.skip);
    auto r = e.Step(OptionsOf(s));
    b.faults->Disarm();
    if (b.faults->fired() == 0) {
      EXPECT_TRUE(r.ok()) << *what;
      return false;
    }
    EXPECT_FALSE(r.ok()) << *what << ": the step succeeded although its disk failed";
    if (r.ok()) return false;
    EXPECT_EQ(r.status().code(), Code::kIo) << *what << ": " << r.status().ToString();
    EXPECT_NE(r.status().message().find("call step again"), std::string::npos) << r.status().ToString();
    EXPECT_EQ(e.steps_applied(), steps_before) << *what;
    // While the step is pending, nothing may mix with it.
    std::vector<float> g0(e.group_numel(0), 1.0f);
    EXPECT_EQ(e.Grads(0, g0.data(), DType::kF32).code(), Code::kState) << *what;
    EXPECT_EQ(e.ReadMaster(0, g0.data()).code(), Code::kState) << *what;
    EXPECT_EQ(e.SaveCheckpoint(::testing::TempDir() + "/never", "t", nullptr, 0).code(), Code::kState) << *what;
    StepOptions other = OptionsOf(s);
    other.lr *= 2;
    EXPECT_EQ(e.Step(other).status().code(), Code::kInvalid) << *what;
    auto again = e.Step(OptionsOf(s));
    EXPECT_TRUE(again.ok()) << *what << ": " << again.status().ToString();
    EXPECT_EQ(e.steps_applied(), steps_before + 1) << *what;
  }
  *master = Masters(e);
  return true;
}

void ExpectSame(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b,
                const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t g = 0; g < a.size(); ++g)
    ASSERT_EQ(0, std::memcmp(a[g].data(), b[g].data(), a[g].size() * 4)) << what << ": group " << g << " differs";
}

class ResumedStep : public ::testing::TestWithParam<std::tuple<std::string, std::string, std::string>> {};

TEST_P(ResumedStep, EqualsTheCleanRunBitwise) {
  const auto& [placement, step_io, format] = GetParam();
  TempDir dir;
  TinyMlp model;
  const std::string json = Json(placement, dir.path(), step_io, format);
  const auto clean = CleanRun(json, model);
  ASSERT_FALSE(clean.empty());
  int fired = 0;
  for (FaultPlan::Ops ops : {FaultPlan::Ops::kReads, FaultPlan::Ops::kWrites}) {
    for (uint64_t skip : {0, 1, 2, 3, 5, 8, 11, 14, 19}) {
      std::string what = placement + " " + step_io + " " + format + (ops == FaultPlan::Ops::kReads ? " reads" : " writes") +
                         " fail after " + std::to_string(skip);
      std::vector<std::vector<float>> master;
      if (!FaultyRun(json, model, {ops, skip}, &master, &what)) continue;
      ++fired;
      ExpectSame(clean, master, what);
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_GE(fired, 8) << "too few fault points fell inside the step";
}

INSTANTIATE_TEST_SUITE_P(Placements, ResumedStep,
                         ::testing::Combine(::testing::Values("nvme_opt", "nvme_all"),
                                            ::testing::Values("alternate", "concurrent"),
                                            ::testing::Values("fp32", "compact")));

// write_state of the master where P's store then fails (P on NVMe): the call
// fails, and P is marked, so that the next fetch is refused (STATE) rather
// than reading the old P beside the new master; a write_state again
// rewrites it. Before, the fetch returned the old P, silently.
TEST(WriteState, APStoreThatFailsIsNotReadBesideTheNewMaster) {
  for (const char* format : {"fp32", "compact"}) {
    SCOPED_TRACE(format);
    TempDir dir;
    TinyMlp model;
    Built b = Make(Json("nvme_all", dir.path(), "alternate", format), model);
    ASSERT_TRUE(b.engine);
    Engine& e = *b.engine;
    std::vector<float> w(e.group_numel(0));
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.001f * static_cast<float>(i % 97) - 0.05f;
    // The master's store is the first write (compact: P's bf16 half goes
    // with it, and a failure part-way breaks the engine until a load).
    b.faults->Arm(FaultPlan::Ops::kWrites, EIO, /*skip=*/1, /*count=*/1000);
    Status st = e.WriteState(0, Engine::OptimizerState::kMaster, w.data());
    b.faults->Disarm();
    ASSERT_FALSE(st.ok()) << "no write after the master's failed";
    ASSERT_GT(b.faults->fired(), 0);
    auto p = e.Fetch(0);
    ASSERT_FALSE(p.ok()) << "the fetch read P that does not follow the new master";
    EXPECT_EQ(p.status().code(), Code::kState) << p.status().ToString();
    if (std::string(format) == "compact") continue;  // broken: only a load brings it back
    ASSERT_TRUE(e.WriteState(0, Engine::OptimizerState::kMaster, w.data()).ok());
    auto again = e.Fetch(0);
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    std::vector<uint16_t> want(w.size());
    ASSERT_TRUE(kernels::Cast(DType::kF32, w.data(), DType::kBF16, want.data(), w.size()).ok());
    EXPECT_EQ(0, std::memcmp(*again, want.data(), want.size() * 2)) << "P is not bf16(master)";
    ASSERT_TRUE(e.Release(0).ok());
  }
}

// A fault that fires once and goes away (a transient EIO) on every write of
// the step in turn: each time, the retried step gives the clean result.
TEST(ResumedStep, EveryWriteOfTheStepFailingOnce) {
  for (const char* format : {"fp32", "compact"}) {
  SCOPED_TRACE(format);
  TempDir dir;
  TinyMlp model(3, 32);
  const std::string json = Json("nvme_all", dir.path(), "alternate", format);
  const auto clean = CleanRun(json, model);
  ASSERT_FALSE(clean.empty());
  for (uint64_t skip = 0;; ++skip) {
    Built b = Make(json, model);
    ASSERT_TRUE(b.engine);
    Engine& e = *b.engine;
    bool fired = false;
    for (int s = 0; s < kSteps; ++s) {
      ASSERT_TRUE(model.TrainStep(e).ok());
      if (s == kFaultyStep) b.faults->Arm(FaultPlan::Ops::kWrites, EIO, skip, 1);
      auto r = e.Step(OptionsOf(s));
      if (s == kFaultyStep) {
        fired = b.faults->fired() > 0;
        b.faults->Disarm();
        if (fired) {
          ASSERT_FALSE(r.ok()) << "write " << skip;
          r = e.Step(OptionsOf(s));
        }
      }
      ASSERT_TRUE(r.ok()) << "write " << skip << ": " << r.status().ToString();
    }
    if (!fired) {
      EXPECT_GT(skip, 6u) << "the step wrote too little to test";
      break;
    }
    ExpectSame(clean, Masters(e), "write " + std::to_string(skip) + " failing once");
    if (HasFatalFailure()) return;
  }
  }
}

// Gradients that cannot be read back (their swap blocks corrupted): the
// step cannot be finished. The engine says so and why, refuses everything
// but a checkpoint load, and after the load trains on.
TEST(ResumedStep, LostGradientsBreakTheEngineUntilALoad) {
  TempDir dir, ckpt;
  TinyMlp model;
  setenv("STRATA_CHECKPOINT_COPY", "1", 1);  // the checkpoint must not share the swap file we corrupt
  Built b = Make(Json("nvme_opt", dir.path(), "alternate"), model);
  ASSERT_TRUE(b.engine);
  Engine& e = *b.engine;
  ASSERT_TRUE(model.TrainStep(e).ok());
  ASSERT_TRUE(e.Step(OptionsOf(0)).ok());
  ASSERT_TRUE(e.SaveCheckpoint(ckpt.path(), "one", nullptr, 0).ok());
  const auto saved = Masters(e);
  ASSERT_TRUE(model.TrainStep(e).ok());
  // Garbage over every swap file: G (and everything else) fails its checksum.
  int corrupted = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir.path())) {
    if (f.path().filename().string().rfind("strata-swap", 0) != 0) continue;
    std::fstream io(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    const std::string junk(static_cast<size_t>(std::filesystem::file_size(f.path())), '\x5a');
    io.write(junk.data(), static_cast<std::streamsize>(junk.size()));
    ++corrupted;
  }
  ASSERT_GT(corrupted, 0);
  auto r = e.Step(OptionsOf(1));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kState) << r.status().ToString();
  EXPECT_NE(r.status().message().find("gradients"), std::string::npos) << r.status().ToString();
  EXPECT_NE(r.status().message().find("checkpoint"), std::string::npos) << r.status().ToString();
  EXPECT_EQ(e.Step(OptionsOf(1)).status().code(), Code::kState);
  EXPECT_EQ(e.Fetch(0).status().code(), Code::kState);
  std::vector<float> out(e.group_numel(0));
  EXPECT_EQ(e.ReadMaster(0, out.data()).code(), Code::kState);
  Status ld = e.LoadCheckpoint(ckpt.path(), "one", nullptr);
  ASSERT_TRUE(ld.ok()) << ld.ToString();
  ExpectSame(saved, Masters(e), "after the load");
  ASSERT_TRUE(model.TrainStep(e).ok());
  auto after = e.Step(OptionsOf(1));
  EXPECT_TRUE(after.ok()) << after.status().ToString();
  unsetenv("STRATA_CHECKPOINT_COPY");
}

// overlap_step updates each group during backward, on the engine's own
// thread: a read failing there fails the step, and the next Step finishes
// the groups left, bitwise as the clean overlapped run.
TEST(ResumedStep, OverlappedUpdatesToo) {
  TempDir dir;
  TinyMlp model;
  const std::string json = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.path() + R"("}},
    "strata": {"device_budget": "64MiB", "host_budget": "64MiB"}})";
  auto run = [&](int fail_after) {
    EngineOptions eo;
    eo.overlap_step = true;
    eo.faults = std::make_shared<FaultPlan>();
    auto e = Engine::Create(MustParse(json), eo);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    Engine& eng = **e;
    EXPECT_TRUE(model.Register(eng).ok());
    EXPECT_TRUE(eng.Build().ok());
    bool fired = false;
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_TRUE(eng.PrepareStep(OptionsOf(s)).ok());
      if (s == kFaultyStep && fail_after >= 0) eo.faults->Arm(FaultPlan::Ops::kReads, EIO, static_cast<uint64_t>(fail_after));
      EXPECT_TRUE(model.TrainStep(eng).ok());  // the updates' reads fail on their own thread
      auto r = eng.Step(OptionsOf(s));
      if (s == kFaultyStep && fail_after >= 0) {
        eo.faults->Disarm();
        fired = eo.faults->fired() > 0;
        if (fired) {
          EXPECT_EQ(r.status().code(), Code::kIo) << "the disk failed: " << r.status().ToString();
          r = eng.Step(OptionsOf(s));
        }
      }
      EXPECT_TRUE(r.ok()) << s << ": " << r.status().ToString();
    }
    EXPECT_TRUE(fail_after < 0 || fired) << "the fault never fired";
    return Masters(eng);
  };
  const auto clean = run(-1);
  for (int after : {0, 2, 5}) ExpectSame(clean, run(after), "overlapped, reads failing after " + std::to_string(after));
}

// Copy on write needs a free extent for every block in flight: groups of
// very different sizes, stepped many times under both disk schedules, never
// run out of swap (best fit over the spare the engine reserves) and never
// pass the NVMe budget.
// Every option the kernels refuse is refused before anything is touched:
// nothing pending, and the next valid step goes ahead, bitwise the clean run.
TEST(RefusedStep, LeavesNothingPending) {
  TempDir dir, clean_dir;
  const TinyMlp model;
  const auto clean = CleanRun(Json("host", clean_dir.path(), "alternate"), model);
  Built b = Make(Json("host", dir.path(), "alternate"), model);
  ASSERT_TRUE(b.engine);
  Engine& e = *b.engine;
  struct Bad {
    const char* name;
    double StepOptions::*field;
    double value;
  };
  const Bad bad[] = {{"beta1", &StepOptions::beta1, 1.5}, {"beta2", &StepOptions::beta2, 1.0},
                     {"beta1", &StepOptions::beta1, 1.0}, {"eps", &StepOptions::eps, 1e300 * 1e300}};
  for (int s = 0; s < kSteps; ++s) {
    ASSERT_TRUE(model.TrainStep(e).ok());
    if (s == kFaultyStep) {
      for (const Bad& x : bad) {
        StepOptions so = OptionsOf(s);
        so.*x.field = x.value;
        const int64_t before = e.steps_applied();
        EXPECT_FALSE(e.PrepareStep(so).ok()) << x.name << " " << x.value;
        auto r = e.Step(so);
        ASSERT_FALSE(r.ok()) << x.name << " " << x.value << " was accepted";
        EXPECT_EQ(r.status().code(), Code::kInvalid) << r.status().ToString();
        EXPECT_NE(r.status().message().find(x.name), std::string::npos) << r.status().ToString();
        EXPECT_EQ(r.status().message().find("pending"), std::string::npos) << r.status().ToString();
        EXPECT_EQ(e.steps_applied(), before);
      }
    }
    auto r = e.Step(OptionsOf(s));
    ASSERT_TRUE(r.ok()) << "step " << s << " after refused options: " << r.status().ToString();
  }
  ExpectSame(Masters(e), clean, "a run with refused steps against the clean run");
}

TEST(CopyOnWrite, MixedGroupSizesNeverRunOutOfSwap) {
  const uint64_t sizes[] = {100, 200000, 3000, 70000, 1, 150000, 4096, 99999, 12, 180000, 5000, 60000};
  for (const std::string io : {"alternate", "concurrent", "alternate, G on NVMe"}) {
    TempDir dir;
    const std::string grad_home = io.find("G on NVMe") != std::string::npos ? "nvme" : "auto";
    auto e = Engine::Create(MustParse(R"({"optimizer": {"type": "AdamW"},
        "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.path() + R"(",
                                                    "buffer_count": 3}},
        "strata": {"device_budget": "64MiB", "host_budget": "64MiB", "grad_home": ")" + grad_home +
                                      R"(", "step_io": ")" + io.substr(0, io.find(',')) + R"("}})"), {});
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    Engine& eng = **e;
    int g = 0;
    for (uint64_t n : sizes) ASSERT_TRUE(eng.AddParam(g++, "p", n, nullptr).ok());
    ASSERT_TRUE(eng.Build().ok());
    for (int step = 0; step < 25; ++step) {
      for (int k = 0; k < eng.num_groups(); ++k) {
        std::vector<float> grads(eng.group_numel(k), 0.001f * static_cast<float>(step + k));
        ASSERT_TRUE(eng.Grads(k, grads.data(), DType::kF32).ok());
      }
      auto r = eng.Step({});
      ASSERT_TRUE(r.ok()) << io << " step " << step << ": " << r.status().ToString();
    }
    const EngineStats st = eng.stats();
    EXPECT_LE(st.nvme.peak, st.nvme.budget) << io;
  }
}

// A build that fails after its swap files exist leaves none behind, nor
// their locks: building again fails for the same reason, and another engine
// may use the folder.
TEST(FailedBuild, LeavesNothingBehind) {
  TempDir dir;
  TinyMlp model;
  const std::string bad = R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.path() + R"("}},
    "strata": {"device_budget": 12000, "host_budget": "64MiB"}})";
  auto e = Engine::Create(MustParse(bad), {});
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_TRUE(model.Register(**e).ok());
  Status first = (*e)->Build();
  ASSERT_FALSE(first.ok()) << "the device budget holds one group's parameters, not four";
  int swap_files = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir.path())) swap_files += f.is_regular_file();
  EXPECT_EQ(swap_files, 0) << "a failed build left its swap files";
  Status second = (*e)->Build();
  EXPECT_EQ(second.code(), first.code()) << second.ToString();
  EXPECT_EQ(second.message().find("another Strata engine"), std::string::npos) << second.ToString();
  Built other = Make(Json("nvme_opt", dir.path(), "alternate"), model);
  EXPECT_TRUE(other.engine) << "the folder is still held by the failed engine";
}

// A build that fails in its last steps, after the initial state was written
// (here the overlapped step's room, more than the host budget), may be
// called again too: it fails the same way, from the initial values it kept
// (before, it had let them go, and the second build read a freed vector).
TEST(FailedBuild, InItsLastStepsMayBeCalledAgain) {
  TinyMlp model;
  const std::string json = R"({"optimizer": {"type": "AdamW"},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    "strata": {"host_budget": "64MiB", "speculation": "always", "speculation_host_bytes": "1GiB"}})";
  EngineOptions eo;
  eo.overlap_step = true;
  auto e = Engine::Create(MustParse(json), eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_TRUE(model.Register(**e).ok());
  Status first = (*e)->Build();
  ASSERT_FALSE(first.ok()) << "the host budget cannot hold a 1 GiB room";
  EXPECT_NE(first.message().find("speculation"), std::string::npos) << first.ToString();
  Status second = (*e)->Build();
  EXPECT_EQ(second.code(), first.code()) << second.ToString();
  EXPECT_EQ(second.message(), first.message());
}

// A C++ exception inside build (an allocation failing: std::bad_alloc,
// injected here at the overlapped step's room, after the swap files exist)
// is undone as a failed status is: NOMEM, nothing charged, no swap file
// left, and the build called again succeeds. The half-built engine kept its
// swap files locked: the next build waited, then failed "in use by another
// Strata engine".
TEST(FailedBuild, ByAnExceptionLeavesNothingBehind) {
  TempDir dir;
  TinyMlp model;
  const std::string json = R"({"optimizer": {"type": "AdamW"}, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.path() + R"("}},
    "strata": {"host_budget": "64MiB", "speculation": "always", "speculation_host_bytes": "1MiB"}})";
  EngineOptions eo;
  eo.overlap_step = true;
  eo.faults = std::make_shared<FaultPlan>();
  auto e = Engine::Create(MustParse(json), eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_TRUE(model.Register(**e).ok());
  eo.faults->ArmHostAllocations(1 << 20, 1, /*throws=*/true);
  const Status first = (*e)->Build();
  ASSERT_EQ(eo.faults->fired(), 1) << "the room's allocation was not reached: the case is not made";
  EXPECT_EQ(first.code(), Code::kNoMem) << first.ToString();
  EXPECT_EQ((*e)->stats().host.used, 0u) << "the failed build left host memory charged";
  int swap_files = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir.path())) swap_files += f.is_regular_file();
  EXPECT_EQ(swap_files, 0) << "the failed build left its swap files";
  const Status second = (*e)->Build();
  EXPECT_TRUE(second.ok()) << second.ToString();
}

}  // namespace
}  // namespace strata
