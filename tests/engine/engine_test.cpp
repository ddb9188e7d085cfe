// engine/: placement never changes numerics, budgets hold under random
// schedules, the trace-driven prefetch hits, and refusals name what's wrong.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <climits>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>

#include "base/align.h"
#include "base/sizes.h"
#include "engine/engine.h"
#include "engine/residency/prefetch.h"
#include "engine/step/loss_scaler.h"
#include "kernels/cpu/adam.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/tiny_mlp.h"
#include "tests/util/temp_dir.h"
#include "tiers/nvme_tier.h"

namespace strata {
namespace {

using testing::TempDir;
using testing::TinyMlp;

Config MustParse(const std::string& json) {
  auto c = ParseConfig(json);
  EXPECT_TRUE(c.ok()) << c.status().ToString() << "\n" << json;
  return c.ok() ? *c : Config{};
}

// Placement configs; {dir} is replaced by the swap directory. `optimizer`:
// the "optimizer" section (AdamW by default).
const char* const kAdamW = R"({"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}})";
std::string PlacementJson(const std::string& name, const std::string& dir, const std::string& extra = "",
                          const std::string& optimizer = kAdamW) {
  std::string opt = "none", par = "none", budgets = R"("device_budget": "64MiB", "host_budget": "64MiB")";
  if (name == "host") opt = "cpu";
  if (name == "nvme_opt") opt = "nvme";
  if (name == "nvme_all") {
    opt = par = "nvme";
    // Tight: the device holds 2 of the 4 groups' P, the host little more than the staging slots.
    budgets = R"("device_budget": 20000, "host_budget": "2MiB")";
  }
  return R"({"bf16": {"enabled": true}, "optimizer": )" + optimizer + R"(,
    "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5000,
      "offload_optimizer": {"device": ")" + opt + R"(", "nvme_path": ")" + dir + R"("},
      "offload_param": {"device": ")" + par + R"(", "nvme_path": ")" + dir + R"(", "buffer_size": 1e4}},
    "strata": {)" + budgets + extra + "}}";
}

using strata::testing::StrictDevice;

struct RunResult {
  std::vector<std::vector<float>> master;
  std::vector<double> losses;
  EngineStats stats;
};

// An engine of `json` with `model` registered, built; null (a failure
// reported) when any of that fails.
std::unique_ptr<Engine> BuiltEngine(const std::string& json, const TinyMlp& model, bool overlap) {
  EngineOptions eo;
  eo.overlap_step = overlap;
  auto e = Engine::Create(MustParse(json), eo);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return nullptr;
  Status st = model.Register(**e);
  if (st.ok()) st = (*e)->Build();
  EXPECT_TRUE(st.ok()) << st.ToString();
  return st.ok() ? std::move(*e) : nullptr;
}

// Every group's master weights, in group order.
std::vector<std::vector<float>> ReadMasters(Engine& eng) {
  std::vector<std::vector<float>> master;
  for (int g = 0; g < eng.num_groups(); ++g) {
    master.emplace_back(eng.group_numel(g));
    Status st = eng.ReadMaster(g, master.back().data());
    EXPECT_TRUE(st.ok()) << "group " << g << ": " << st.ToString();
  }
  return master;
}

RunResult Train(const std::string& json, int steps, const TinyMlp& model, bool permute_step_5 = false,
                bool overlap = false) {
  RunResult out;
  std::unique_ptr<Engine> built = BuiltEngine(json, model, overlap);
  if (!built) return out;
  Engine& eng = *built;
  for (int s = 0; s < steps; ++s) {
    StepOptions so;
    so.lr = 0.01 * (1.0 + 0.1 * s);  // changes every step
    if (overlap) {
      EXPECT_TRUE(eng.PrepareStep(so).ok());
    }
    std::vector<int> extra = {2, 0, 3};
    auto loss = model.TrainStep(eng, (permute_step_5 && s == 5) ? &extra : nullptr);
    EXPECT_TRUE(loss.ok()) << loss.status().ToString();
    if (!loss.ok()) return out;
    out.losses.push_back(*loss);
    auto r = eng.Step(so);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_FALSE(r->skipped);
  }
  out.master = ReadMasters(eng);
  out.stats = eng.stats();
  return out;
}

void ExpectBitwiseEqual(const RunResult& a, const RunResult& b, const std::string& what) {
  ASSERT_EQ(a.master.size(), b.master.size()) << what;
  for (size_t g = 0; g < a.master.size(); ++g)
    ASSERT_EQ(0, std::memcmp(a.master[g].data(), b.master[g].data(), a.master[g].size() * 4))
        << what << ": group " << g << " differs";
  ASSERT_EQ(a.losses, b.losses) << what;
}

void ExpectWithinBudgets(const EngineStats& s, const std::string& what) {
  EXPECT_LE(s.device.peak, s.device.budget) << what;
  EXPECT_LE(s.host.peak, s.host.budget) << what;
  EXPECT_LE(s.nvme.peak, s.nvme.budget) << what;
}

// Every placement, both disk schedules and the overlapped step against the
// device run, in one state format (`extra`: more "strata" keys).
RunResult CheckPlacements(const std::string& dir, const TinyMlp& model, const std::string& extra,
                          const std::string& optimizer = kAdamW) {
  auto PlacementJson = [&](const std::string& name, const std::string& d, const std::string& e) {
    return strata::PlacementJson(name, d, e, optimizer);
  };
  const RunResult device = Train(PlacementJson("device", dir, extra), 20, model);
  EXPECT_EQ(device.losses.size(), 20u);
  if (device.losses.size() != 20u) return device;
  EXPECT_LT(device.losses.back(), device.losses.front()) << "the model should learn";
  for (const char* p : {"host", "nvme_opt", "nvme_all"}) {
    const RunResult r = Train(PlacementJson(p, dir, extra), 20, model);
    ExpectBitwiseEqual(device, r, p + extra);
    ExpectWithinBudgets(r.stats, p + extra);
    if (std::string(p) != "host") {
      EXPECT_GT(r.stats.host_to_nvme, 0u) << p;
    }
  }
  // Both disk schedules of the step (strata.step_io; alternate is the default).
  for (const char* p : {"nvme_opt", "nvme_all"}) {
    const RunResult r = Train(PlacementJson(p, dir, extra + R"(, "step_io": "concurrent")"), 20, model);
    ExpectBitwiseEqual(device, r, std::string("concurrent ") + p + extra);
    ExpectWithinBudgets(r.stats, std::string("concurrent ") + p + extra);
  }
  // G's home beside W, M, V on NVMe (strata.grad_home; "auto" picks the
  // host for these small models): on NVMe, written in backward and read by
  // the step, and in host memory.
  for (const char* p : {"nvme_opt", "nvme_all"})
    for (const char* home : {"nvme", "host"}) {
      const std::string e = extra + R"(, "grad_home": ")" + home + "\"";
      const RunResult r = Train(PlacementJson(p, dir, e), 20, model);
      ExpectBitwiseEqual(device, r, p + e);
      ExpectWithinBudgets(r.stats, p + e);
    }
  // The overlapped step: each group updated as its gradients complete.
  for (const char* p : {"device", "nvme_all"}) {
    const RunResult r = Train(PlacementJson(p, dir, extra), 20, model, false, /*overlap=*/true);
    ExpectBitwiseEqual(device, r, std::string("overlapped ") + p + extra);
    ExpectWithinBudgets(r.stats, std::string("overlapped ") + p + extra);
  }
  return device;
}

TEST(Engine, PlacementNeverChangesNumerics) {
  TempDir dir;
  TinyMlp model;
  CheckPlacements(dir.path(), model, "");
}

// Steps [first, last) of Train's run, from checkpoint `load` (in `ckpt`,
// when given) and saved as `save` at the end (when given).
RunResult TrainSpan(const std::string& json, int first, int last, const TinyMlp& model, const std::string& ckpt,
                    const std::string& load, const std::string& save) {
  RunResult out;
  std::unique_ptr<Engine> built = BuiltEngine(json, model, false);
  if (!built) return out;
  Engine& eng = *built;
  if (!load.empty()) {
    Status st = eng.LoadCheckpoint(ckpt, load, nullptr);
    EXPECT_TRUE(st.ok()) << st.ToString();
    if (!st.ok()) return out;
  }
  for (int s = first; s < last; ++s) {
    StepOptions so;
    so.lr = 0.01 * (1.0 + 0.1 * s);  // as Train's
    auto loss = model.TrainStep(eng, nullptr);
    EXPECT_TRUE(loss.ok()) << loss.status().ToString();
    if (!loss.ok()) return out;
    out.losses.push_back(*loss);
    auto r = eng.Step(so);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
  if (!save.empty()) {
    Status st = eng.SaveCheckpoint(ckpt, save, nullptr, 0);
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  out.master = ReadMasters(eng);
  return out;
}

// A checkpoint saved in one placement and loaded into another trains on
// bitwise as the run that never stopped (the save's paths differ by
// placement: a linked snapshot of the swap or a copy; the load writes
// into host or NVMe homes and drops the kept copies of P), in fp32 and
// compact state.
TEST(Engine, ACheckpointMovesBetweenPlacementsExactly) {
  TinyMlp model;
  for (const char* format : {"", R"(, "state_format": "compact")"}) {
    TempDir dir, ckpt;
    const RunResult whole = Train(PlacementJson("device", dir.path(), format), 20, model);
    ASSERT_EQ(whole.losses.size(), 20u);
    const char* places[] = {"device", "host", "nvme_opt", "nvme_all"};
    for (const char* from : places) {
      const std::string tag = std::string("from_") + from;
      const RunResult first = TrainSpan(PlacementJson(from, dir.path(), format), 0, 10, model, ckpt.path(), "", tag);
      for (const char* to : places) {
        if (std::string(from) == to) continue;
        RunResult second = TrainSpan(PlacementJson(to, dir.path(), format), 10, 20, model, ckpt.path(), tag, "");
        RunResult joined{second.master, first.losses, {}};
        joined.losses.insert(joined.losses.end(), second.losses.begin(), second.losses.end());
        ExpectBitwiseEqual(whole, joined, std::string("saved in ") + from + ", loaded in " + to + format);
      }
    }
  }
}

// The other optimizers, whose state differs (Lion and Adagrad keep no V:
// the layout's used states, the staging slots' regions, the speculation's
// backups and the units' parts all skip it): the same placement parity.
TEST(Engine, EveryOptimizersPlacementNeverChangesNumerics) {
  TempDir dir;
  TinyMlp model;
  for (const char* opt : {R"({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01}})",
                          R"({"type": "Lion", "params": {"lr": 0.001, "weight_decay": 0.01}})",
                          R"({"type": "Adagrad", "params": {"lr": 0.05}})"}) {
    SCOPED_TRACE(opt);
    CheckPlacements(dir.path(), model, "", opt);
  }
}

// strata.state_format "compact": the same placement parity, the same
// learning as fp32 within the format's precision, and fewer bytes on the disk.
TEST(Engine, CompactPlacementNeverChangesNumerics) {
  TempDir dir;
  TinyMlp model;
  const RunResult compact = CheckPlacements(dir.path(), model, R"(, "state_format": "compact")");
  const RunResult fp32 = Train(PlacementJson("device", dir.path()), 20, model);
  ASSERT_EQ(compact.losses.size(), fp32.losses.size());
  for (size_t i = 0; i < fp32.losses.size(); ++i)
    EXPECT_NEAR(compact.losses[i], fp32.losses[i], 0.02 * fp32.losses[i]) << "step " << i;
  bool differs = false;  // the format is not a no-op: the masters are rounded
  for (size_t g = 0; g < fp32.master.size(); ++g)
    differs = differs || std::memcmp(fp32.master[g].data(), compact.master[g].data(), fp32.master[g].size() * 4) != 0;
  EXPECT_TRUE(differs) << "compact gave fp32's bits exactly: is the format used?";
  const RunResult nvme32 = Train(PlacementJson("nvme_opt", dir.path()), 3, model);
  const RunResult nvmec = Train(PlacementJson("nvme_opt", dir.path(), R"(, "state_format": "compact")"), 3, model);
  // W, M, V written each step: 12 bytes a parameter against 5.25 (plus G's 4 and P's 2 in both).
  EXPECT_LT(static_cast<double>(nvmec.stats.host_to_nvme), 0.65 * static_cast<double>(nvme32.stats.host_to_nvme));
}

// 2000 small groups on NVMe: the swap reservation is their state plus the
// disk's 4 KiB alignment and the copy-on-write spare, not 64 KiB a block
// (which made 82 MB of state reserve 738 MB).
TEST(Engine, SmallGroupsPackOnTheDisk) {
  TempDir dir;
  auto e = Engine::Create(MustParse(R"({"optimizer": {"type": "AdamW"},
      "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.path() + R"("}},
      "strata": {"device_budget": "64MiB", "host_budget": "64MiB"}})"), {});
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  constexpr int kGroups = 2000;
  constexpr uint64_t kNumel = 3000;  // 12 KB of fp32 a state
  for (int g = 0; g < kGroups; ++g) ASSERT_TRUE((*e)->AddParam(g, "p" + std::to_string(g), kNumel, nullptr).ok());
  ASSERT_TRUE((*e)->Build().ok());
  const uint64_t state = uint64_t{kGroups} * 4 * kNumel * 4;  // W, M, V, G
  uint64_t reserved = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir.path())) reserved += f.file_size();
  EXPECT_LE((*e)->stats().nvme.budget, state * 14 / 10) << "state " << state;
  EXPECT_LE(reserved, state * 14 / 10 + 8 * kMiB) << "state " << state;
  EXPECT_GE(reserved, state);
}

// strata.grad_home with W, M, V on NVMe: G's blocks are on NVMe ("nvme") or
// in host memory ("host"; "auto" when the host budget holds them beside the
// staging, else NVMe); "host" past the host budget is refused at build.
TEST(Engine, GradHomeFollowsTheSetting) {
  TempDir dir;
  constexpr uint64_t kNumel = 3000;  // 12 KB of fp32 a state: a 12 KiB block on disk, 3 pages in memory
  auto build = [&](int groups, const std::string& home, const std::string& host_budget) -> Result<EngineStats> {
    auto e = Engine::Create(MustParse(R"({"optimizer": {"type": "AdamW"},
        "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.path() + R"("}},
        "strata": {"device_budget": "64MiB", "host_budget": )" + host_budget + R"(, "grad_home": ")" + home + R"("}})"), {});
    if (!e.ok()) return e.status();
    for (int g = 0; g < groups; ++g)
      if (auto a = (*e)->AddParam(g, "p" + std::to_string(g), kNumel, nullptr); !a.ok()) return a.status();
    STRATA_RETURN_IF_ERROR((*e)->Build());
    return (*e)->stats();
  };
  auto on_nvme = build(4, "nvme", "\"64MiB\""), on_host = build(4, "host", "\"64MiB\""),
       automatic = build(4, "auto", "\"64MiB\"");
  ASSERT_TRUE(on_nvme.ok() && on_host.ok() && automatic.ok());
  // G's 4 blocks leave the disk: at least their 12000 bytes each.
  EXPECT_GE(on_nvme->nvme.budget, on_host->nvme.budget + 4 * 12000);
  // In memory they take less than the G regions of the step's slots and
  // G's staging buffer they replace.
  EXPECT_LT(on_host->host.used, on_nvme->host.used);
  EXPECT_EQ(automatic->nvme.budget, on_host->nvme.budget) << "auto with room: G in host memory";
  EXPECT_EQ(automatic->host.used, on_host->host.used);
  // 40 groups, with a host budget 64 KiB above what G on NVMe needs (its
  // region in each of the 4 step slots, 64 KiB, and a staging buffer): in
  // host memory G's 40 blocks take about 200 KiB more than that, so "auto"
  // puts G on NVMe and "host" is refused.
  auto roomy_nvme = build(40, "nvme", "\"64MiB\"");
  ASSERT_TRUE(roomy_nvme.ok()) << roomy_nvme.status().ToString();
  const std::string tight = std::to_string(roomy_nvme->host.used + 64 * kKiB);
  auto tight_auto = build(40, "auto", tight), tight_nvme = build(40, "nvme", tight);
  ASSERT_TRUE(tight_auto.ok()) << tight_auto.status().ToString();
  ASSERT_TRUE(tight_nvme.ok()) << tight_nvme.status().ToString();
  EXPECT_EQ(tight_auto->nvme.budget, tight_nvme->nvme.budget) << "auto without room: G on NVMe";
  auto tight_host = build(40, "host", tight);
  ASSERT_FALSE(tight_host.ok());
  EXPECT_EQ(tight_host.status().code(), Code::kConfig) << tight_host.status().ToString();
  EXPECT_NE(tight_host.status().message().find("strata.host_budget"), std::string::npos) << tight_host.status().ToString();
}

// P on NVMe with room on the device: the step hands each group's new P to
// its cached copy (a host arena here), so a step reads W, M, V from the
// disk and never P back; the run stays bitwise the device run.
TEST(Engine, TheStepsNewPIsNotReadBack) {
  TempDir dir;
  const TinyMlp model;
  const std::string json = PlacementJson("nvme_opt", dir.path()).replace(
      PlacementJson("nvme_opt", dir.path()).find(R"("offload_param": {"device": "none")"),
      std::string(R"("offload_param": {"device": "none")").size(), R"("offload_param": {"device": "nvme")");
  auto e = Engine::Create(MustParse(json), {});
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& eng = **e;
  ASSERT_TRUE(model.Register(eng).ok());
  ASSERT_TRUE(eng.Build().ok());
  uint64_t wmv = 0;  // a step's reads: W, M, V of every group (fp32, padded to 2048 elements and 4 KiB)
  for (int g = 0; g < eng.num_groups(); ++g)
    wmv += 3 * NvmeTier::PaddedSizeFor(AlignUp(eng.group_numel(g), 2048) * 4, 1);
  std::vector<uint64_t> read;
  for (int s = 0; s < 5; ++s) {
    const uint64_t before = eng.stats().nvme_to_host;
    ASSERT_TRUE(model.TrainStep(eng).ok());
    StepOptions so;
    so.lr = 0.01 * (1.0 + 0.1 * s);  // Train's schedule
    ASSERT_TRUE(eng.Step(so).ok());
    read.push_back(eng.stats().nvme_to_host - before);
  }
  EXPECT_GT(read[0], wmv) << "the first forward reads P";
  for (int s = 1; s < 5; ++s) EXPECT_EQ(read[static_cast<size_t>(s)], wmv) << "step " << s;
  const RunResult device = Train(PlacementJson("device", dir.path()), 5, model);
  std::vector<std::vector<float>> master;
  for (int g = 0; g < eng.num_groups(); ++g) {
    master.emplace_back(eng.group_numel(g));
    ASSERT_TRUE(eng.ReadMaster(g, master.back().data()).ok());
  }
  EXPECT_EQ(master, device.master);
}

// A speculated step's new P goes into the cached copies too (one rank, the
// device tier a host arena), forgotten if the speculation is discarded. After
// each step a pass that fetches every group reads nothing of P from NVMe:
// - committed at every step (clipping that never triggers; nothing is
//   abandoned, so the step's reads are exact too: W, M, V);
// - discarded and replayed at every step (clipping that always triggers):
//   the replay's P refreshes the copies again;
// - undone by a fetch of the group backward completes first: the fetch
//   hands out the restored P (the master it reads back), not the
//   speculative one (then the pass after that step reads P again).
// Each run is bitwise the same run on the device without overlap. No
// assertion depends on the overlap thread's timing.
TEST(Engine, ASpeculatedStepsNewPIsNotReadBack) {
  TempDir dir;
  const TinyMlp model;
  auto json = [&](bool nvme, double clip) {
    const std::string dev = nvme ? "nvme" : "none";
    return R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "gradient_clipping": )" + std::to_string(clip) + R"(,
      "zero_optimization": {"stage": 3,
        "offload_optimizer": {"device": ")" + dev + R"(", "nvme_path": ")" + dir.path() + R"("},
        "offload_param": {"device": ")" + dev + R"(", "nvme_path": ")" + dir.path() + R"("}},
      "strata": {"device_budget": "64MiB", "host_budget": "64MiB", "speculation": "always"}})";
  };
  const uint64_t group_bytes = AlignUp(static_cast<uint64_t>(model.dim * model.dim + model.dim), 2048) * 4;
  const uint64_t wmv = 4 * 3 * NvmeTier::PaddedSizeFor(group_bytes, 1);  // 4 groups' W, M, V, fp32
  for (double clip : {1e6, 1e-3}) {
    const bool clips = clip < 1;
    const std::string what = clips ? "discarded and replayed" : "committed";
    const RunResult device = Train(json(false, clip), 6, model);
    ASSERT_EQ(device.losses.size(), 6u) << what;
    std::unique_ptr<Engine> built = BuiltEngine(json(true, clip), model, /*overlap=*/true);
    ASSERT_TRUE(built) << what;
    Engine& eng = *built;
    RunResult r;
    for (int s = 0; s < 6; ++s) {
      StepOptions so;
      so.lr = 0.01 * (1.0 + 0.1 * s);  // Train's schedule
      const uint64_t read0 = eng.stats().nvme_to_host;
      ASSERT_TRUE(eng.PrepareStep(so).ok());
      auto loss = model.TrainStep(eng);
      ASSERT_TRUE(loss.ok()) << loss.status().ToString();
      r.losses.push_back(*loss);
      if (s == 3) {  // group 3's gradients came first: a fetch of it undoes the speculation
        auto p = eng.Fetch(3);
        ASSERT_TRUE(p.ok()) << p.status().ToString();
        std::vector<float> master(eng.group_numel(3));
        ASSERT_TRUE(eng.ReadMaster(3, master.data()).ok());
        EXPECT_EQ(0, std::memcmp(*p, master.data(), master.size() * 4))
            << what << ": the fetch after the undo hands out the restored P";
        ASSERT_TRUE(eng.Release(3).ok());
      }
      auto st = eng.Step(so);
      ASSERT_TRUE(st.ok()) << st.status().ToString();
      const uint64_t step_read = eng.stats().nvme_to_host - read0, pass0 = eng.stats().nvme_to_host;
      for (int g = 0; g < eng.num_groups(); ++g) {
        ASSERT_TRUE(eng.Fetch(g).ok());
        ASSERT_TRUE(eng.Release(g).ok());
      }
      const uint64_t pass_read = eng.stats().nvme_to_host - pass0;
      // (Not under the strict device tier: a separate device, whose copies
      // no step refreshes.)
      if (StrictDevice()) continue;
      if (s != 3) {
        EXPECT_EQ(pass_read, 0u) << what << ", after step " << s << ": P not read back";
      }
      if (!clips && s != 0 && s != 3) {  // (0: the first forward reads P; 3: the undone step's replay)
        EXPECT_EQ(step_read, wmv) << what << ", step " << s << ": W, M, V alone";
      }
    }
    r.master = ReadMasters(eng);
    ExpectBitwiseEqual(device, r, what);
    EXPECT_EQ(eng.stats().speculated_steps, 6u) << what;
    EXPECT_EQ(eng.stats().replayed_steps, clips ? 6u : 1u) << what << " (and the undone step 3)";
  }
}

// fp32 compute with W and P on NVMe: P is W's bytes (Layout::PIsW), so a
// step writes W, M, V and not P, and a device copy is read from W's block:
// with a device budget of two groups' P (copies evicted and read again every
// pass) and with room for all, plain and overlapped, each run is bitwise the
// run with everything on the device, and a step writes exactly W, M, V.
TEST(Engine, FP32PIsReadFromWAndNeverWrittenByTheStep) {
  TempDir dir;
  const TinyMlp model;
  auto json = [&](const std::string& place, const std::string& budget) {
    const std::string dev = place == "device" ? "none" : "nvme";
    return R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5000,
        "offload_optimizer": {"device": ")" + dev + R"(", "nvme_path": ")" + dir.path() + R"("},
        "offload_param": {"device": ")" + dev + R"(", "nvme_path": ")" + dir.path() + R"(", "buffer_size": 1e4}},
      "strata": {"device_budget": )" + budget + R"(, "host_budget": "64MiB"}})";
  };
  const RunResult device = Train(json("device", R"("64MiB")"), 6, model);
  ASSERT_EQ(device.losses.size(), 6u);
  const uint64_t group_bytes = AlignUp(static_cast<uint64_t>(model.dim * model.dim + model.dim), 2048) * 4;
  const uint64_t wmv = 4 * 3 * NvmeTier::PaddedSizeFor(group_bytes, 1);  // 4 groups' W, M, V, fp32
  for (const char* budget : {"40000", R"("64MiB")"})
    for (bool overlap : {false, true}) {
      const std::string what = std::string("budget ") + budget + (overlap ? ", overlapped" : "");
      auto e = Engine::Create(MustParse(json("nvme", budget)), [&] {
        EngineOptions eo;
        eo.overlap_step = overlap;
        return eo;
      }());
      ASSERT_TRUE(e.ok()) << e.status().ToString();
      Engine& eng = **e;
      ASSERT_TRUE(model.Register(eng).ok());
      ASSERT_TRUE(eng.Build().ok());
      ASSERT_EQ(eng.num_groups(), 4);
      RunResult r;
      for (int s = 0; s < 6; ++s) {
        StepOptions so;
        so.lr = 0.01 * (1.0 + 0.1 * s);  // Train's schedule
        if (overlap) {
          ASSERT_TRUE(eng.PrepareStep(so).ok());
        }
        auto loss = model.TrainStep(eng);
        ASSERT_TRUE(loss.ok()) << loss.status().ToString();
        r.losses.push_back(*loss);
        const uint64_t before = eng.stats().host_to_nvme;
        auto st = eng.Step(so);
        ASSERT_TRUE(st.ok()) << st.status().ToString();
        if (!overlap) {  // (overlapped, part of the writes land in backward)
          EXPECT_EQ(eng.stats().host_to_nvme - before, wmv) << what << ", step " << s << ": W, M, V alone";
        }
      }
      r.master = ReadMasters(eng);
      ExpectBitwiseEqual(device, r, what);
      const EngineStats st = eng.stats();
      ExpectWithinBudgets(st, what);
      EXPECT_EQ(st.nvme.used, wmv) << what << ": the NVMe tier holds W, M, V (P has no block of its own)";
      if (std::string(budget) == "40000") {
        EXPECT_GT(st.nvme_to_host, 6 * wmv) << what << ": evicted copies were read again (from W's blocks)";
      }
    }
}

// fp32 with W and P both in host memory (offload_optimizer and offload_param
// "cpu"): P is W's bytes (Layout::PIsW), so the host tier holds no block for
// P (its use equals the same run's with P on the device); plain, overlapped,
// and overlapped with every speculation discarded and replayed (clipped at
// every step, strata.speculation "always"), each run is bitwise the device
// run (under the strict device tier too).
TEST(Engine, FP32PInHostMemoryIsW) {
  const TinyMlp model;
  auto json = [&](const std::string& par, const std::string& extra) {
    return R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "gradient_clipping": 0.001,
      "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5000,
        "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": ")" + par + R"("}},
      "strata": {"device_budget": "64MiB", "host_budget": "64MiB")" + extra + "}}";
  };
  const RunResult device = Train(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "gradient_clipping": 0.001, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5000},
      "strata": {"device_budget": "64MiB", "host_budget": "64MiB"}})", 6, model);
  ASSERT_EQ(device.losses.size(), 6u);
  for (bool overlap : {false, true})
    for (const std::string extra : {"", R"(, "speculation": "always")"}) {
      if (!overlap && !extra.empty()) continue;
      const std::string what = std::string(overlap ? "overlapped" : "plain") + extra;
      const RunResult host = Train(json("cpu", extra), 6, model, false, overlap);
      const RunResult p_on_device = Train(json("none", extra), 6, model, false, overlap);
      ExpectBitwiseEqual(device, host, what);
      ExpectBitwiseEqual(device, p_on_device, what + ", P on the device");
      ExpectWithinBudgets(host.stats, what);
      // (Not under the strict device tier: a separate device adds host
      // staging where P is on the device, which the host-homed run lacks.)
      if (!StrictDevice()) {
        EXPECT_EQ(host.stats.host.used, p_on_device.stats.host.used) << what << ": P has no host block of its own";
      }
      if (!extra.empty()) {
        EXPECT_GT(host.stats.replayed_steps, 0u) << what << ": speculations were discarded and replayed";
      }
    }
}

// A step that does not speculate (clipping, strata.speculation "never")
// reads its first groups' W, M, V during backward, at prepare_step, into the
// idle step slots; the step itself reads the rest. With 3 slots for 4
// groups, anything between prepare_step and step that needs a slot
// (write_state, read_state) takes them back instead of waiting on them, and
// the step reads every group. With 8 slots, all 4 groups are read ahead and
// a write_state of group 0's master after its read began makes that read
// stale: the step reads that block again. A checkpoint save between them
// goes through. Each run is bitwise the same run without overlap (no read-ahead).
// In step units (sub_group_size 2048: two a group), the step's staging is in
// pieces of a unit's size: all 8 units are read ahead and a slot stays whole,
// so read_state and write_state take nothing back (as with 8 whole slots).
TEST(Engine, AStepThatDoesNotSpeculateReadsAheadInBackward) {
  for (auto [slots, units] : {std::pair{3, false}, std::pair{8, false}, std::pair{8, true}}) {
  SCOPED_TRACE(std::to_string(slots) + " slots" + (units ? ", units" : ""));
  TempDir dir;
  const TinyMlp model;
  const std::string json = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "gradient_clipping": 0.05,
      "zero_optimization": {"stage": 3, "sub_group_size": )" + std::string(units ? "2048" : "1e9") + R"(,
        "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.path() + R"(", "buffer_count": )" + std::to_string(slots) + R"(},
        "offload_param": {"device": "nvme", "nvme_path": ")" + dir.path() + R"("}},
      "strata": {"device_budget": "64MiB", "host_budget": "64MiB", "speculation": "never"}})";
  const uint64_t group_bytes = AlignUp(static_cast<uint64_t>(model.dim * model.dim + model.dim), 2048) * 4;
  const uint64_t wmv_group = 3 * NvmeTier::PaddedSizeFor(group_bytes, 1);
  auto run = [&](bool overlap, std::vector<uint64_t>* ahead_bytes, std::vector<uint64_t>* step_bytes) {
    RunResult out;
    std::unique_ptr<Engine> built = BuiltEngine(json, model, overlap);
    if (!built) return out;
    Engine& eng = *built;
    for (int s = 0; s < 6; ++s) {
      StepOptions so;
      so.lr = 0.01 * (1.0 + 0.1 * s);
      const uint64_t r0 = eng.stats().nvme_to_host;
      if (overlap) {
        EXPECT_TRUE(eng.PrepareStep(so).ok());
      }
      const uint64_t r1 = eng.stats().nvme_to_host;
      if (s == 2) {  // the master of group 0 changes after its read ahead started
        std::vector<float> w(eng.group_numel(0));
        EXPECT_TRUE(eng.ReadState(0, Engine::OptimizerState::kMaster, w.data()).ok());
        for (float& x : w) x *= 0.5f;
        EXPECT_TRUE(eng.WriteState(0, Engine::OptimizerState::kMaster, w.data()).ok());
      }
      if (s == 4) {  // a read through a staging slot: the pool is lent out, so it takes the slots back
        std::vector<float> m(eng.group_numel(3));
        EXPECT_TRUE(eng.ReadState(3, Engine::OptimizerState::kExpAvg, m.data()).ok());
      }
      if (s == 5) {  // never waits on them
        const std::string ck = dir.path() + (overlap ? "/ck1" : "/ck0");
        EXPECT_TRUE(eng.SaveCheckpoint(ck, "t", nullptr, 0).ok());
      }
      const uint64_t r2 = eng.stats().nvme_to_host;
      auto loss = model.TrainStep(eng);
      EXPECT_TRUE(loss.ok()) << loss.status().ToString();
      if (!loss.ok()) return out;
      out.losses.push_back(*loss);
      auto r = eng.Step(so);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (ahead_bytes) ahead_bytes->push_back(r1 - r0);
      if (step_bytes) step_bytes->push_back(eng.stats().nvme_to_host - r2);
    }
    out.master = ReadMasters(eng);
    out.stats = eng.stats();
    return out;
  };
  std::vector<uint64_t> ahead, during;
  const RunResult plain = run(false, nullptr, nullptr);
  const RunResult read_ahead = run(true, &ahead, &during);
  ExpectBitwiseEqual(plain, read_ahead, "read ahead against no overlap");
  ASSERT_EQ(ahead.size(), 6u);
  EXPECT_EQ(read_ahead.stats.speculated_steps, 0u);
  const uint64_t w_block = wmv_group / 3;
  for (int s = 0; s < 6; ++s)
    EXPECT_EQ(ahead[static_cast<size_t>(s)], (slots == 3 ? 3 : 4) * wmv_group) << "step " << s << ": read ahead";
  if (slots == 3) {  // every slot lent: a read_state or write_state takes them all back
    for (int s : {1, 3}) EXPECT_EQ(during[static_cast<size_t>(s)], wmv_group) << "step " << s << ": the fourth group";
    // (write_state also drops the device copies: step 2's forward reads all 4 again, from W's blocks)
    EXPECT_EQ(during[2], 4 * wmv_group + 4 * w_block) << "step 2: slots taken back";
    EXPECT_EQ(during[4], 4 * wmv_group) << "step 4: slots taken back";
  } else {
    for (int s : {1, 3, 4}) EXPECT_EQ(during[static_cast<size_t>(s)], 0u) << "step " << s << ": all read ahead";
    EXPECT_EQ(during[2], w_block + 4 * w_block) << "step 2: group 0's W written after its read began, read again";
  }
  }
}

// overlap_step's swap room for speculation (strata.speculation_disk_bytes
// "auto"): "always" reserves it at build, "never" not at all, "auto" when
// its policy first speculates (a run clipped at every step never pays for
// it). The room shares the step's own room for its writes in flight, and
// "auto" sizes it to keep the swap files within 1.5x the state: the groups
// beyond it update after backward. The three runs are bitwise the same.
TEST(Engine, SpeculationRoomIsReservedWhenItIsUsed) {
  const TinyMlp model(8, 512);  // 24 MiB of W, M, V: the room beyond the step's is more than the 1 MiB rounding
  struct Run {
    uint64_t at_build = 0, after = 0, speculated = 0;
    uint64_t state = 0, early = 0;  // the NVMe tier's blocks (its budget, less its 1 MiB); early updates
    uint64_t host_at_build = 0, host_after = 0;  // the host tier's use (its arena for host-homed W, M, V)
    std::vector<std::vector<float>> master;
  };
  auto swap_bytes = [](const std::string& dir) {
    uint64_t n = 0;
    for (const auto& f : std::filesystem::directory_iterator(dir))
      if (f.path().filename().string().rfind("strata-swap", 0) == 0) n += f.file_size();
    return n;
  };
  auto run = [&](const std::string& mode, const char* placement) {
    Run out;
    TempDir dir;
    EngineOptions eo;
    eo.overlap_step = true;
    auto e = Engine::Create(MustParse(PlacementJson(placement, dir.path(), R"(, "speculation": ")" + mode + "\"")), eo);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    if (!e.ok()) return out;
    Engine& eng = **e;
    EXPECT_TRUE(model.Register(eng).ok());
    EXPECT_TRUE(eng.Build().ok());
    out.at_build = swap_bytes(dir.path());
    out.host_at_build = eng.stats().host.used;
    for (int s = 0; s < 4; ++s) {
      StepOptions so;
      so.lr = 0.01;
      EXPECT_TRUE(eng.PrepareStep(so).ok());
      EXPECT_TRUE(model.TrainStep(eng).ok());
      auto r = eng.Step(so);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
    }
    out.after = swap_bytes(dir.path());
    out.state = eng.stats().nvme.budget - kMiB;
    out.early = eng.stats().early_updates;
    out.host_after = eng.stats().host.used;
    out.speculated = eng.stats().speculated_steps;
    out.master = ReadMasters(eng);
    return out;
  };
  const Run never = run("never", "nvme_opt"), always = run("always", "nvme_opt"), automatic = run("auto", "nvme_opt");
  EXPECT_EQ(never.speculated, 0u);
  EXPECT_EQ(never.after, never.at_build);
  EXPECT_GT(always.at_build, never.at_build) << "always: the room at build";
  EXPECT_EQ(always.after, always.at_build);
  EXPECT_EQ(automatic.at_build, never.at_build) << "auto: nothing at build";
  EXPECT_GT(automatic.speculated, 0u);
  EXPECT_GE(automatic.after, always.at_build) << "auto: the room once it speculates";
  EXPECT_LE(automatic.after, always.at_build + kMiB) << "(each reservation rounds to whole MiB)";
  EXPECT_EQ(automatic.master, never.master);
  EXPECT_EQ(always.master, never.master);
  // Within 1.5x the state (plus each reservation's rounding to whole MiB),
  // so that not every group fits: some update after backward.
  EXPECT_LE(always.after, always.state * 3 / 2 + 2 * kMiB);
  EXPECT_LE(automatic.after, automatic.state * 3 / 2 + 2 * kMiB);
  EXPECT_GT(always.early, 0u);
  EXPECT_LT(always.early, 4u * 8u) << "every group speculated: the room is not capped";
  // W, M, V in host memory: the backups' arena, the same way where a device
  // of its own (a GPU; here the strict arena standing in for one) runs
  // backward. Without one, "auto" never speculates there (the backups would
  // cost what the update does) and never takes the arena.
  const Run h_never = run("never", "host"), h_always = run("always", "host"), h_auto = run("auto", "host");
  const uint64_t arena = 3 * 8 * 4 * (512 * 512 + 512);  // fp32 W, M, V of the 8 layers
  EXPECT_EQ(h_never.speculated, 0u);
  EXPECT_EQ(h_never.host_after, h_never.host_at_build);
  EXPECT_GE(h_always.host_at_build, h_never.host_at_build + arena) << "always: the arena at build";
  EXPECT_GT(h_always.speculated, 0u);
  EXPECT_EQ(h_auto.host_at_build, h_never.host_at_build) << "auto: nothing at build";
  if (StrictDevice()) {
    EXPECT_GT(h_auto.speculated, 0u);
    EXPECT_EQ(h_auto.host_after, h_always.host_at_build) << "auto: the arena once it speculates";
  } else {
    EXPECT_EQ(h_auto.speculated, 0u) << "auto, no GPU, W, M, V in host memory: speculation cannot pay";
    EXPECT_EQ(h_auto.host_after, h_auto.host_at_build) << "auto: no arena, never speculating";
  }
  EXPECT_EQ(h_auto.master, never.master);
  EXPECT_EQ(h_always.master, never.master);
}

// pin_memory: true (as in every Hugging Face ZeRO-3 example) with the
// default 8 MiB memlock limit: without a GPU pinning has no effect, so the
// engine builds and trains; it used to be refused at build.
TEST(Engine, PinMemoryNeverBlocksARunWithoutAGpu) {
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &old), 0);
  rlimit low = old;
  low.rlim_cur = std::min<rlim_t>(old.rlim_max, 8ull << 20);
  ASSERT_EQ(setrlimit(RLIMIT_MEMLOCK, &low), 0);
  TempDir dir;
  TinyMlp model;
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e = Engine::Create(MustParse(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "offload_param": {"device": "cpu", "pin_memory": true}},
      "strata": {"device_budget": "64MiB", "host_budget": "256MiB"}})"), eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_TRUE(model.Register(**e).ok());
  Status b = (*e)->Build();
  EXPECT_TRUE(b.ok()) << b.ToString();
  if (b.ok()) {
    EXPECT_TRUE(model.TrainStep(**e).ok());
    EXPECT_TRUE((*e)->Step({}).ok());
  }
  e->reset();
  setrlimit(RLIMIT_MEMLOCK, &old);
}

// Early updates that nothing could change (no clipping, no fp16, non-finite
// gradients applied) are committed as they land: other options at the step
// are refused. (Speculative ones are redone: speculate_test.cpp.)
TEST(Engine, OverlapRefusesLateFetchesAndChangedOptions) {
  TinyMlp model(2, 16);
  EngineOptions eo;
  eo.overlap_step = true;
  auto e = Engine::Create(MustParse(R"({"strata": {"nonfinite": "apply"}})"), eo);
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE(model.Register(**e).ok());
  ASSERT_TRUE((*e)->Build().ok());
  StepOptions so;
  so.lr = 0.5;
  ASSERT_TRUE((*e)->PrepareStep(so).ok());
  ASSERT_TRUE(model.TrainStep(**e).ok());
  EXPECT_EQ((*e)->Fetch(0).status().code(), Code::kState);
  // A group already updated takes no more gradients in this step.
  std::vector<float> g((*e)->group_numel(1), 1.0f);
  Status late = (*e)->Grads(1, g.data(), DType::kF32);
  EXPECT_EQ(late.code(), Code::kState) << late.ToString();
  EXPECT_NE(late.message().find("call step first"), std::string::npos) << late.ToString();
  StepOptions other = so;
  other.lr = 0.25;
  auto r = (*e)->Step(other);
  EXPECT_EQ(r.status().code(), Code::kInvalid);
  EXPECT_NE(r.status().message().find("prepare_step"), std::string::npos);
  EXPECT_TRUE((*e)->Step(so).ok());
}

TEST(Engine, TightBudgetsHoldAndPrefetchHits) {
  TempDir dir;
  TinyMlp model;
  const RunResult r = Train(PlacementJson("nvme_all", dir.path()), 12, model);
  ExpectWithinBudgets(r.stats, "nvme_all");
  EXPECT_GT(r.stats.nvme_to_host, 0u);
  ASSERT_GT(r.stats.fetches, 0u);
  EXPECT_GE(r.stats.prefetch_hit_rate(), 0.95) << r.stats.prefetch_hits << " of " << r.stats.fetches;
}

TEST(Engine, AStepInAnotherOrderStaysCorrect) {
  TempDir dir;
  TinyMlp model;
  const RunResult plain = Train(PlacementJson("nvme_all", dir.path()), 8, model);
  const RunResult permuted = Train(PlacementJson("nvme_all", dir.path()), 8, model, /*permute_step_5=*/true);
  ExpectBitwiseEqual(plain, permuted, "permuted fetch order in step 5");
}

// Random fetch/release/grads/step schedules: budgets hold, nothing breaks,
// in both state formats (seeds 13..18: compact, whose blocks are padded).
TEST(Engine, BudgetsHoldUnderRandomSchedules) {
  TempDir dir;
  TinyMlp model(6, 40);
  for (uint64_t seed = 1; seed <= 18; ++seed) {
    const std::string format = seed > 12 ? R"(, "state_format": "compact")" : "";
    auto e = Engine::Create(MustParse(PlacementJson("nvme_all", dir.path(), format)), {});
    ASSERT_TRUE(e.ok());
    Engine& eng = **e;
    ASSERT_TRUE(model.Register(eng).ok());
    ASSERT_TRUE(eng.Build().ok());
    std::mt19937_64 rng(seed);
    std::vector<int> pinned;
    std::vector<float> grads(40 * 40 + 40, 1e-3f);
    for (int op = 0; op < 150; ++op) {
      const int g = static_cast<int>(rng() % 6);
      switch (rng() % 5) {
        case 0: case 1:
          if (pinned.size() < 2) {  // the device holds two groups
            auto p = eng.Fetch(g);
            ASSERT_TRUE(p.ok()) << "seed " << seed << ": " << p.status().ToString();
            pinned.push_back(g);
          }
          break;
        case 2:
          if (!pinned.empty()) {
            ASSERT_TRUE(eng.Release(pinned.back()).ok());
            pinned.pop_back();
          }
          break;
        case 3: ASSERT_TRUE(eng.Grads(g, grads.data(), DType::kF32).ok()); break;
        case 4: {
          auto r = eng.Step({});
          if (pinned.empty()) {
            ASSERT_TRUE(r.ok()) << r.status().ToString();
          } else {
            EXPECT_EQ(r.status().code(), Code::kState) << "step with a fetched group must refuse";
          }
          break;
        }
      }
      const EngineStats s = eng.stats();
      ASSERT_LE(s.device.used, s.device.budget);
      ASSERT_LE(s.host.used, s.host.budget);
    }
    ExpectWithinBudgets(eng.stats(), "seed " + std::to_string(seed));
  }
}

TEST(Engine, GroupLargerThanDeviceBudgetIsRefusedAtBuild) {
  TempDir dir;
  TinyMlp model;
  auto e = Engine::Create(MustParse(PlacementJson("nvme_all", dir.path()).replace(
                              PlacementJson("nvme_all", dir.path()).find("20000"), 5, "4000")),
                          {});
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_TRUE(model.Register(**e).ok());
  Status st = (*e)->Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("device"), std::string::npos) << st.ToString();
  // The engine is not built: parameters may still be added (not "already
  // built"), and the next build fails for the same reason, not another.
  auto off = (*e)->AddParam(static_cast<int>((*e)->num_groups()), "late", 10, nullptr);
  EXPECT_TRUE(off.ok()) << off.status().ToString();
  st = (*e)->Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("device"), std::string::npos) << st.ToString();
}

TEST(Engine, CallsOutOfOrderAreRefused) {
  auto e = Engine::Create(MustParse("{}"), {});
  ASSERT_TRUE(e.ok());
  EXPECT_EQ((*e)->Fetch(0).status().code(), Code::kState);
  EXPECT_EQ((*e)->Step({}).status().code(), Code::kState);
  EXPECT_EQ((*e)->Build().code(), Code::kState) << "no parameters";
  ASSERT_TRUE((*e)->AddParam(0, "a", 10, nullptr).ok());
  EXPECT_EQ((*e)->AddParam(0, "a", 10, nullptr).status().code(), Code::kInvalid);
  EXPECT_EQ((*e)->AddParam(2, "b", 10, nullptr).status().code(), Code::kOk);
  EXPECT_EQ((*e)->Build().code(), Code::kState) << "group 1 is missing";
}

TEST(Engine, Fp16OverflowSkipsTheStepAndLowersTheScale) {
  TempDir dir;
  TinyMlp model(2, 16);
  auto e = Engine::Create(MustParse(R"({"fp16": {"enabled": true, "hysteresis": 1},
      "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.path() + R"("}},
      "strata": {"device_budget": "16MiB", "host_budget": "16MiB"}})"),
                          {});
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& eng = **e;
  ASSERT_TRUE(model.Register(eng).ok());
  ASSERT_TRUE(eng.Build().ok());
  std::vector<float> before(eng.group_numel(0)), after(before.size());
  ASSERT_TRUE(eng.ReadMaster(0, before.data()).ok());
  ASSERT_TRUE(model.TrainStep(eng, nullptr, 65536.0).ok());
  std::vector<float> inf_grads(eng.group_numel(1), INFINITY);
  ASSERT_TRUE(eng.Grads(1, inf_grads.data(), DType::kF32).ok());  // accumulates: now non-finite
  auto r = eng.Step({});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->skipped);
  EXPECT_EQ(r->loss_scale, 32768.0);
  ASSERT_TRUE(eng.ReadMaster(0, after.data()).ok());
  EXPECT_EQ(0, std::memcmp(before.data(), after.data(), before.size() * 4)) << "a skipped step changes nothing";
  ASSERT_TRUE(model.TrainStep(eng, nullptr, 32768.0).ok());
  r = eng.Step({});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->skipped);
  EXPECT_TRUE(std::isfinite(r->grad_norm));
  ASSERT_TRUE(eng.ReadMaster(0, after.data()).ok());
  EXPECT_NE(0, std::memcmp(before.data(), after.data(), before.size() * 4));
}

// DeepSpeed's DynamicLossScaler (runtime/fp16/loss_scaler.py): hysteresis
// counts down the first overflows only; from then on every overflow halves,
// until a doubling gives the counter back. (The counter was refilled at each
// halving: a burst of overflows halved on every second one.)
TEST(LossScaler, AfterHysteresisEveryOverflowHalvesUntilADoubling) {
  Fp16Config dyn;
  dyn.enabled = true;
  dyn.hysteresis = 2;
  dyn.loss_scale_window = 3;
  LossScaler s;
  s.Init(dyn);
  std::vector<double> scales;
  for (int i = 0; i < 6; ++i) {
    s.Update(true);
    scales.push_back(s.scale());
  }
  EXPECT_EQ(scales, (std::vector<double>{65536, 32768, 16384, 8192, 4096, 2048}));
  for (int i = 0; i < 3; ++i) s.Update(false);
  EXPECT_EQ(s.scale(), 4096.0) << "3 clean steps (the window) double it";
  s.Update(true);
  EXPECT_EQ(s.scale(), 4096.0) << "the doubling gave the counter back: the next overflow counts down";
  s.Update(true);
  EXPECT_EQ(s.scale(), 2048.0);
}

// The scale grows only while a float holds it (torch's GradScaler): at 2^127
// it stays, where doubling on went to inf (every later step an overflow,
// halving inf to inf: skipped for good), as does a checkpoint's above it.
TEST(LossScaler, GrowsNoFurtherThanAFloatHolds) {
  Fp16Config dyn;
  dyn.enabled = true;
  dyn.initial_scale_power = 64;
  dyn.loss_scale_window = 1;
  LossScaler s;
  s.Init(dyn);
  for (int i = 0; i < 100; ++i) s.Update(false);
  EXPECT_EQ(s.scale(), 0x1p127);
  s.Update(true);
  s.Update(true);
  EXPECT_EQ(s.scale(), 0x1p126) << "an overflow (after the hysteresis) halves it";
  ASSERT_TRUE(s.Restore({1e300, 2, 0}, true));
  EXPECT_EQ(s.scale(), 0x1p127) << "a checkpoint's scale above a float's, bounded";
}

// A checkpoint's scaler state is taken only by a dynamic fp16 scaler and only
// from an fp16 checkpoint, with its counters bounded by this config: a saved
// hysteresis of INT32_MAX would otherwise never let the scale halve again.
TEST(LossScalerRestore, OnlyDynamicFromFp16AndBounded) {
  Fp16Config dyn;
  dyn.enabled = true;
  dyn.hysteresis = 2;
  dyn.loss_scale_window = 4;
  dyn.min_loss_scale = 8;
  LossScaler s;
  s.Init(dyn);
  EXPECT_FALSE(s.Restore({4, 2, 0}, /*saved_fp16=*/false)) << "a bf16/fp32 checkpoint's scale is no fp16 state";
  EXPECT_EQ(s.scale(), 65536.0);  // 2^16, the config's initial scale
  ASSERT_TRUE(s.Restore({1024, INT32_MAX, INT64_MAX}, true));
  EXPECT_EQ(s.scale(), 1024.0);
  s.Update(true);
  s.Update(true);
  EXPECT_EQ(s.scale(), 512.0) << "two overflows (this config's hysteresis) halve it";
  ASSERT_TRUE(s.Restore({1024, 2, INT64_MAX}, true));
  s.Update(false);
  EXPECT_EQ(s.scale(), 2048.0) << "the saved clean steps are bounded by this config's window";
  ASSERT_TRUE(s.Restore({1, 2, 0}, true));
  EXPECT_EQ(s.scale(), 8.0) << "not below min_loss_scale";
  for (double fixed : {0.0, 128.0}) {
    Fp16Config c;
    c.enabled = fixed > 0;
    c.loss_scale = fixed;
    LossScaler f;
    f.Init(c);
    EXPECT_FALSE(f.Restore({65536, 2, 0}, true));
    EXPECT_EQ(f.scale(), fixed > 0 ? fixed : 1.0) << "a static scale, or none, is the config's";
  }
}

// DiscardGrads drops the gradients given since the last step, as torch's
// zero_grad: a run that discards a batch ends bitwise as one that never saw
// it, step count and loss scale as they were; with overlap_step its
// speculative early updates are undone. Where the early updates are final
// (no clipping, no fp16, nonfinite "apply") it is STATE, and the step goes on.
TEST(Engine, DiscardGradsIsAStepThatNeverSawThem) {
  struct Case {
    const char* name;
    bool overlap;
    const char* extra;  // more top-level keys
    bool refused;
  };
  const Case cases[] = {{"plain", false, "", false},
                        {"fp16", false, R"("fp16": {"enabled": true, "initial_scale_power": 8},)", false},
                        {"overlap, clipping: speculative", true, R"("gradient_clipping": 1.0, "strata": {"speculation": "always"},)", false},
                        {"overlap, nonfinite apply: final", true, R"("strata": {"nonfinite": "apply"},)", true}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TinyMlp model(3, 32);
    auto make = [&]() {
      EngineOptions eo;
      eo.overlap_step = c.overlap;
      auto e = Engine::Create(MustParse(std::string("{") + c.extra +
                                        R"("optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})"),
                              eo);
      EXPECT_TRUE(e.ok()) << e.status().ToString();
      EXPECT_TRUE(model.Register(**e).ok());
      EXPECT_TRUE((*e)->Build().ok());
      return std::move(e).value();
    };
    auto train = [&](Engine& e) {
      if (c.overlap) {
        ASSERT_TRUE(e.PrepareStep({}).ok());
      }
      ASSERT_TRUE(model.TrainStep(e, nullptr, e.loss_scale()).ok());
      ASSERT_TRUE(e.Step({}).ok());
    };
    auto twin = make(), e = make();
    train(*twin);
    train(*twin);
    train(*e);
    const double scale = e->loss_scale();
    if (c.overlap) {
      ASSERT_TRUE(e->PrepareStep({}).ok());
    }
    for (int g = e->num_groups() - 1; g >= 0; --g) {  // a batch to drop, last group first (as backward)
      std::vector<float> junk(e->group_numel(g), 3.0f);
      ASSERT_TRUE(e->Grads(g, junk.data(), DType::kF32).ok());
    }
    Status st = e->DiscardGrads();
    if (c.refused) {
      EXPECT_EQ(st.code(), Code::kState) << st.ToString();
      EXPECT_NE(st.message().find("updated early by the overlapped step"), std::string::npos) << st.ToString();
      EXPECT_TRUE(e->Step({}).ok()) << "the step goes on after the refusal";
      continue;
    }
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(e->steps_applied(), 1);
    EXPECT_EQ(e->loss_scale(), scale);
    train(*e);
    for (int g = 0; g < e->num_groups(); ++g) {
      std::vector<float> a(e->group_numel(g)), b(a.size());
      ASSERT_TRUE(e->ReadMaster(g, a.data()).ok());
      ASSERT_TRUE(twin->ReadMaster(g, b.data()).ok());
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "group " << g;
    }
    EXPECT_EQ(e->steps_applied(), twin->steps_applied());
    EXPECT_EQ(e->loss_scale(), twin->loss_scale());
  }
}

// Clipping to a norm far below eps makes the update far smaller than without.
TEST(Engine, ClippingBoundsTheUpdate) {
  TinyMlp model(2, 16);
  auto change = [&](const char* clip, double* norm) {
    auto e = Engine::Create(MustParse(std::string(R"({"gradient_clipping": )") + clip + "}"), {});
    EXPECT_TRUE(e.ok());
    EXPECT_TRUE(model.Register(**e).ok());
    EXPECT_TRUE((*e)->Build().ok());
    std::vector<float> w0((*e)->group_numel(0)), w1(w0.size());
    EXPECT_TRUE((*e)->ReadMaster(0, w0.data()).ok());
    EXPECT_TRUE(model.TrainStep(**e).ok());
    auto r = (*e)->Step({});
    EXPECT_TRUE(r.ok());
    *norm = r->grad_norm;
    EXPECT_TRUE((*e)->ReadMaster(0, w1.data()).ok());
    double d = 0;
    for (size_t i = 0; i < w0.size(); ++i) d += std::fabs(w1[i] - w0[i]);
    return d;
  };
  double n1 = 0, n2 = 0;
  const double free_change = change("0", &n1);
  const double clipped_change = change("1e-10", &n2);
  EXPECT_EQ(n1, n2) << "the reported norm is the unclipped one";
  EXPECT_GT(n1, 1e-6);
  EXPECT_LT(clipped_change, 0.1 * free_change);
}

// strata.grad_reduce: "mean" divides the sum of a step's grads calls (and
// of the ranks) by their count, so k calls of g step as one call of g; "sum"
// steps as one call of k*g. The norm and clipping follow the reduced gradient.
TEST(Engine, GradReduceMeanAveragesAccumulationCalls) {
  TinyMlp model(2, 16);
  struct Out {
    std::vector<float> w;
    double norm = 0;  // of the first step
  };
  auto run = [&](const char* reduce, int calls, float factor, const char* clip) {
    Out out;
    EngineOptions eo;
    eo.grad_accumulation_steps = calls;
    // A large eps: Adam's update then depends on the gradient's scale.
    auto e = Engine::Create(MustParse(std::string(R"({"gradient_clipping": )") + clip +
                                      R"(, "optimizer": {"type": "AdamW", "params": {"eps": 0.1}})" +
                                      R"(, "strata": {"grad_reduce": ")" + reduce + R"("}})"),
                            eo);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    if (!e.ok()) return out;
    Engine& eng = **e;
    EXPECT_TRUE(model.Register(eng).ok());
    EXPECT_TRUE(eng.Build().ok());
    for (int s = 0; s < 3; ++s) {
      for (int g = 0; g < eng.num_groups(); ++g) {
        auto p = eng.Fetch(g);
        EXPECT_TRUE(p.ok());
        if (!p.ok()) return out;
        // A gradient that depends on the weights, so that every step differs.
        std::vector<float> grad(eng.group_numel(g));
        for (size_t i = 0; i < grad.size(); ++i)
          grad[i] = factor * (static_cast<const float*>(*p)[i] - 0.25f * static_cast<float>(i % 5));
        EXPECT_TRUE(eng.Release(g).ok());
        for (int c = 0; c < calls; ++c) EXPECT_TRUE(eng.Grads(g, grad.data(), DType::kF32).ok());
      }
      auto r = eng.Step({});
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (r.ok() && s == 0) out.norm = r->grad_norm;  // the runs' weights part after the first step
    }
    for (int g = 0; g < eng.num_groups(); ++g) {
      std::vector<float> w(eng.group_numel(g));
      EXPECT_TRUE(eng.ReadMaster(g, w.data()).ok());
      out.w.insert(out.w.end(), w.begin(), w.end());
    }
    return out;
  };
  for (const char* clip : {"0", "0.5"}) {
    SCOPED_TRACE(std::string("gradient_clipping ") + clip);
    const Out one = run("mean", 1, 1.0f, clip);
    // 2 calls: g + g is exact, so the comparisons can be bitwise.
    const Out mean2 = run("mean", 2, 1.0f, clip);
    const Out sum2 = run("sum", 2, 1.0f, clip);
    const Out sum1x2 = run("sum", 1, 2.0f, clip);
    ASSERT_FALSE(one.w.empty());
    EXPECT_EQ(mean2.w, one.w) << "2 calls of g, averaged, step as 1 call of g";
    EXPECT_EQ(mean2.norm, one.norm);
    EXPECT_EQ(sum2.w, sum1x2.w) << "2 calls of g, summed, step as 1 call of 2g";
    EXPECT_EQ(sum2.norm, sum1x2.norm);
    EXPECT_NE(sum2.w, one.w) << "the two reductions must differ here (eps makes Adam scale-sensitive)";
    EXPECT_EQ(sum1x2.norm, 2 * one.norm);
  }
}

// optimizer.params.moment_update reaches the kernels. From a state with
// non-zero moments (where the formulas part on the first step), 3 steps
// with "lerp" are bitwise AdamStep's lerp and not its mul_add, and the
// default is bitwise its mul_add, in both lerp weight branches (beta1 0.9:
// w = 0.1; 0.3: w = 0.7). The compact format takes it too (its steps differ
// by it; kernels_compact_test shows the compact lerp is the fp32 one). It is
// an option, not state: 1 step, a checkpoint, 2 steps after loading it is
// the 3 steps. A value that is not one of them is refused naming the key.
TEST(Engine, MomentUpdateReachesTheKernel) {
  using OS = Engine::OptimizerState;
  const size_t n = 1031;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> w0(n), m0(n), v0(n);
  std::vector<std::vector<float>> grads(3, std::vector<float>(n));
  for (size_t i = 0; i < n; ++i) {
    w0[i] = u(rng);
    m0[i] = 0.05f * u(rng);
    const float g = u(rng);
    v0[i] = 1e-3f * g * g + 1e-6f;
  }
  for (auto& g : grads)
    for (float& x : g) x = u(rng);
  struct Out {
    std::vector<float> w, m, v;
  };
  // The engine's steps [from, 3) (from the checkpoint `load` when given, else
  // from w0, m0, v0), then a checkpoint to `save` when given; `moment`: the
  // key's value, or none for no key.
  auto run = [&](double beta1, const char* moment, const std::string& extra, int from = 0,
                 const std::string& load = "", const std::string& save = "", int to = 3) {
    Out out;
    std::string params = R"("lr": 0.01, "weight_decay": 0.01, "betas": [)" + std::to_string(beta1) + ", 0.999]";
    if (moment) params += std::string(R"(, "moment_update": ")") + moment + "\"";
    auto e = Engine::Create(MustParse(R"({"optimizer": {"type": "AdamW", "params": {)" + params + "}}" + extra + "}"),
                            {});
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    if (!e.ok()) return out;
    Engine& eng = **e;
    EXPECT_TRUE(eng.AddParam(0, "w", n, w0.data()).ok());
    EXPECT_TRUE(eng.Build().ok());
    if (load.empty()) {
      EXPECT_TRUE(eng.WriteState(0, OS::kExpAvgSq, v0.data()).ok());
      EXPECT_TRUE(eng.WriteState(0, OS::kExpAvg, m0.data()).ok());
    } else {
      std::vector<uint8_t> blob;
      const Status st = eng.LoadCheckpoint(load, "", &blob);
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
    for (int t = from; t < to; ++t) {
      EXPECT_TRUE(eng.Fetch(0).ok());
      EXPECT_TRUE(eng.Release(0).ok());
      EXPECT_TRUE(eng.Grads(0, grads[static_cast<size_t>(t)].data(), DType::kF32).ok());
      auto r = eng.Step({});
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (!r.ok()) return out;
      EXPECT_FALSE(r->skipped);
    }
    if (!save.empty()) {
      EXPECT_TRUE(eng.SaveCheckpoint(save, "t", nullptr, 0).ok());
    }
    out.w.resize(n), out.m.resize(n), out.v.resize(n);
    EXPECT_TRUE(eng.ReadState(0, OS::kMaster, out.w.data()).ok());
    EXPECT_TRUE(eng.ReadState(0, OS::kExpAvg, out.m.data()).ok());
    EXPECT_TRUE(eng.ReadState(0, OS::kExpAvgSq, out.v.data()).ok());
    return out;
  };
  // The kernel's 3 steps from the same state.
  auto reference = [&](double beta1, kernels::MomentUpdate mu) {
    Out out{w0, m0, v0};
    for (int t = 1; t <= 3; ++t) {
      kernels::AdamOptions o;
      o.lr = 0.01, o.weight_decay = 0.01, o.beta1 = beta1, o.beta2 = 0.999, o.eps = 1e-8, o.step = t;
      o.mode = kernels::AdamMode::kAdamW;
      o.moment_update = mu;
      EXPECT_TRUE(kernels::AdamStepOn(kernels::CpuIsa::kScalar, o, n, out.w.data(), out.m.data(), out.v.data(),
                                      grads[static_cast<size_t>(t - 1)].data(), nullptr)
                      .ok());
    }
    return out;
  };
  auto same = [](const Out& a, const Out& b) {
    return a.w.size() == b.w.size() && a.w == b.w && a.m == b.m && a.v == b.v;  // no NaN here
  };
  for (double beta1 : {0.9, 0.3}) {
    SCOPED_TRACE("beta1 " + std::to_string(beta1));
    const Out mul_ref = reference(beta1, kernels::MomentUpdate::kMulAdd);
    const Out lerp_ref = reference(beta1, kernels::MomentUpdate::kLerp);
    ASSERT_FALSE(same(mul_ref, lerp_ref)) << "the two formulas must differ on this data";
    const Out lerp = run(beta1, "lerp", "");
    EXPECT_TRUE(same(lerp, lerp_ref)) << "\"lerp\" is not the kernel's lerp";
    EXPECT_TRUE(same(run(beta1, "mul_add", ""), mul_ref)) << "\"mul_add\" is not the kernel's mul_add";
    EXPECT_TRUE(same(run(beta1, nullptr, ""), mul_ref)) << "the default is not mul_add";
    // Host-homed and NVMe-homed state: the same kernel options through the staged step.
    TempDir dir;
    const std::string nvme = R"(, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", )"
                             R"("nvme_path": ")" + dir.path() + R"("}})";
    EXPECT_TRUE(same(run(beta1, "lerp", nvme), lerp_ref)) << "nvme";
    // Resume: 1 step, checkpoint, load, 2 steps.
    TempDir ckpt;
    run(beta1, "lerp", "", 0, "", ckpt.path(), 1);
    EXPECT_TRUE(same(run(beta1, "lerp", "", 1, ckpt.path()), lerp_ref)) << "resumed from a checkpoint";
    // Compact state: the key reaches its kernel too.
    const std::string compact = R"(, "bf16": {"enabled": true}, "strata": {"state_format": "compact"})";
    const Out c_mul = run(beta1, "mul_add", compact), c_lerp = run(beta1, "lerp", compact);
    ASSERT_EQ(c_lerp.m.size(), n);
    EXPECT_FALSE(same(c_mul, c_lerp)) << "compact: lerp and mul_add steps must differ";
  }
  auto bad = ParseConfig(R"({"optimizer": {"type": "AdamW", "params": {"moment_update": "lerp_"}}})");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "optimizer.params.moment_update: \"lerp_\" is not one of mul_add, lerp");
}

// The device pool: with P evicted and fetched again all the time (the
// device holds 2 of the 4 groups' P) and every copy dropped after each step,
// no device allocation happens after the first step; the numerics are those
// of the unpooled placements (PlacementNeverChangesNumerics).
TEST(Engine, DevicePoolAllocatesNothingAfterWarmUp) {
  TempDir dir;
  TinyMlp model;
  auto e = Engine::Create(MustParse(PlacementJson("nvme_all", dir.path())), {});
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& eng = **e;
  ASSERT_TRUE(model.Register(eng).ok());
  ASSERT_TRUE(eng.Build().ok());
  uint64_t after_warm_up = 0, hits_then = 0;
  for (int s = 0; s < 6; ++s) {
    ASSERT_TRUE(model.TrainStep(eng).ok());
    ASSERT_TRUE(eng.Step({}).ok());
    const EngineStats st = eng.stats();
    EXPECT_LE(st.device.peak, st.device.budget);
    if (s == 1) {
      after_warm_up = st.device_raw_allocs;
      hits_then = st.device_pool_hits;
    }
    if (s > 1) {
      EXPECT_EQ(st.device_raw_allocs, after_warm_up) << "step " << s;
    }
  }
  EXPECT_GT(after_warm_up, 0u);
  EXPECT_GT(eng.stats().device_pool_hits, hits_then + 8) << "fetches after warm-up come from the pool";
}

TEST(Engine, WritesAChromeTrace) {
  TempDir dir;
  TinyMlp model(2, 16);
  const std::string trace = dir.path() + "/trace.json";
  {
    const RunResult r = Train(PlacementJson("nvme_opt", dir.path(), R"(, "trace_path": ")" + trace + "\""), 2, model);
    ASSERT_EQ(r.losses.size(), 2u);
  }
  std::FILE* f = std::fopen(trace.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string text(1 << 20, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), f));
  std::fclose(f);
  EXPECT_NE(text.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(text.find("cpu optimizer"), std::string::npos);
  EXPECT_NE(text.find("\"ph\":\"b\""), std::string::npos) << "async I/O events";
}

// NextUse (the eviction order) against a plain scan of the trace, on traces
// where groups repeat (a tied embedding is fetched twice a step).
TEST(PrefetchSchedule, NextUseMatchesAScanOfTheTrace) {
  std::mt19937 rng(7);
  for (int round = 0; round < 20; ++round) {
    std::vector<int> trace(1 + rng() % 40);
    for (int& g : trace) g = static_cast<int>(rng() % 12);
    PrefetchSchedule s;
    for (int g : trace) s.OnFetch(g);
    s.OnStep();
    ASSERT_TRUE(s.has_trace());
    for (size_t pos = 0; pos <= trace.size(); ++pos) {
      for (int g = 0; g < 14; ++g) {
        uint64_t want = UINT64_MAX / 2;
        for (size_t k = 0; k < trace.size() && want == UINT64_MAX / 2; ++k) {
          const size_t i = (pos + k) % trace.size();
          if (trace[i] == g) want = k;
        }
        ASSERT_EQ(s.NextUse(g), want) << "round " << round << " position " << pos << " group " << g;
      }
      if (pos < trace.size()) {
        ASSERT_TRUE(s.OnFetch(trace[pos]));
      }
    }
    s.OnStep();
  }
}

// An eval pass (forward only) between training steps, or an extra pass,
// starts again from the trace's first fetch: the schedule follows it and
// keeps the recorded trace; a fetch that is neither next nor first departs.
// Fetches without steps (evaluation only, for days) are held in a bounded
// list: it grew by every fetch until the next step, which never came.
TEST(PrefetchSchedule, FetchesWithoutStepsAreHeldBounded) {
  PrefetchSchedule s;
  for (int g : {0, 1, 2}) s.OnFetch(g);
  s.OnStep();
  for (int pass = 0; pass < 400000; ++pass)
    for (int g : {0, 1, 2}) EXPECT_TRUE(s.OnFetch(g) || pass == 0);
  EXPECT_LE(s.held(), PrefetchSchedule::kMinHeld);
  EXPECT_TRUE(s.has_trace());
  PrefetchSchedule r;  // recording, never stepped
  for (int i = 0; i < 1000000; ++i) r.OnFetch(i % 7);
  EXPECT_LE(r.held(), PrefetchSchedule::kMinHeld);
  r.OnStep();  // what was held becomes the trace
  EXPECT_TRUE(r.has_trace());
}

TEST(PrefetchSchedule, APassFromTheStartIsNoDeparture) {
  const std::vector<int> train = {0, 1, 2, 2, 1, 0};
  PrefetchSchedule s;
  for (int g : train) s.OnFetch(g);
  s.OnStep();
  for (int step = 0; step < 3; ++step) {
    for (int g : {0, 1, 2}) EXPECT_TRUE(s.OnFetch(g)) << "eval pass, step " << step;
    EXPECT_EQ(s.NextUse(2), 0u);
    for (int g : train) EXPECT_TRUE(s.OnFetch(g)) << "training pass, step " << step;
    EXPECT_EQ(s.NextUse(0), 0u) << "the next step starts with group 0";
    EXPECT_EQ(s.NextUse(1), 1u);
    s.OnStep();
    ASSERT_TRUE(s.has_trace());
  }
  EXPECT_TRUE(s.OnFetch(0));
  EXPECT_FALSE(s.OnFetch(2)) << "1 was next and 0 is first: a departure";
  EXPECT_FALSE(s.has_trace()) << "a departure records again";

  // A GPT with a tied head: the first group comes again at the forward's end
  // and at the backward's start, so an eval pass ends where the trace goes
  // on with the first group, and the training pass after it starts with it.
  const std::vector<int> gpt = {0, 1, 2, 0, 0, 2, 1};
  PrefetchSchedule t;
  for (int g : gpt) t.OnFetch(g);
  t.OnStep();
  for (int step = 0; step < 3; ++step) {
    for (int g : {0, 1, 2, 0}) EXPECT_TRUE(t.OnFetch(g)) << "eval pass, step " << step;
    for (int g : gpt) EXPECT_TRUE(t.OnFetch(g)) << "training pass, step " << step;
    EXPECT_EQ(t.NextUse(0), 0u);
    t.OnStep();
    ASSERT_TRUE(t.has_trace());
  }
}

}  // namespace
}  // namespace strata
