// engine/: step units (Layout::units). A group whose W, M, V live on NVMe is
// stepped and stored in units of at most zero_optimization.sub_group_size
// elements, each unit's blocks written (copy on write) and committed on its
// own. Checked here on a real io_uring and real swap files:
// - the swap files stay within 1.5x the state they hold, where whole-group
//   copy on write needs room for the largest group's W, M, V;
// - numerics do not depend on the units: bitwise the whole-group run's and
//   the host-homed run's, with and without overlap_step;
// - a step whose writes fail part-way through a group is finished by the next
//   Step, bitwise the clean run (units committed stay so, the rest are redone);
// - a checkpoint saved in units loads into an engine without them, and back;
// - the step's staging comes in unit-sized pieces of its slots (StagingPool):
//   two slots of the largest group where whole groups take buffer_count, and
//   a step that updates after backward reads every unit ahead;
// - write-behind (strata.write_behind): the step returns before its writes
//   land, every read after it sees them (bitwise the run without), and a
//   write that fails then breaks the engine until a checkpoint load; where
//   two slots do not hold the step's pieces, more are added at build from
//   the host budget's rest, and none beyond it; a corrupt swap fails the
//   step that reads it, naming the checksum.
#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "engine/engine.h"
#include "engine/layout/staging.h"
#include "io/fault.h"
#include "kernels/cpu/cast.h"
#include "tests/util/no_uring.h"
#include "tests/util/on_ranks.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using testing::TempDir;

constexpr uint64_t kWhole = 1000000000;

// One large group (an embedding's share of a small model) and a few small ones.
const std::vector<uint64_t> kGroupNumel = {300000, 20000, 20000, 12000};
// The same, four times larger: the swap's fixed 1 MiB beside the state matters less.
const std::vector<uint64_t> kLargeNumel = {1200000, 80000, 80000, 48000};

// `sub_group`: zero_optimization.sub_group_size (kWhole: larger than every
// group here, each stepped whole). `where`: "nvme" or "cpu" for W, M, V.
std::string Json(const std::string& dir, uint64_t sub_group, const std::string& where = "nvme",
                 const std::string& extra = "") {
  // P offloaded beside W (P that is W's bytes): a fetch keeps a cached copy that the step refreshes.
  std::string z = R"("stage": 3, "offload_optimizer": {"device": ")" + where + R"(", "nvme_path": ")" + dir +
                  R"("}, "offload_param": {"device": ")" + where + R"(", "nvme_path": ")" + dir + R"("})";
  z += R"(, "sub_group_size": )" + std::to_string(sub_group);
  return R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}, "gradient_clipping": 0.05,
    "zero_optimization": {)" + z + R"(},
    "strata": {"device_budget": "64MiB", "host_budget": "256MiB", "grad_home": "host")" + extra + "}}";
}

std::vector<float> Values(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng) * 0.1f;
  return v;
}

struct Built {
  std::unique_ptr<Engine> engine;
  std::shared_ptr<FaultPlan> faults = std::make_shared<FaultPlan>();
};

Built Make(const std::string& json, bool overlap = false, const std::vector<uint64_t>& numel = kGroupNumel,
           bool skip_gradless = false) {
  Built r;
  auto c = ParseConfig(json);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (!c.ok()) return r;
  EngineOptions eo;
  eo.faults = r.faults;
  eo.overlap_step = overlap;
  eo.skip_groups_without_grads = skip_gradless;
  auto e = Engine::Create(*c, eo);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return r;
  for (size_t g = 0; g < numel.size(); ++g) {
    const std::vector<float> init = Values(numel[g], 100 + g);
    auto a = (*e)->AddParam(static_cast<int>(g), "g" + std::to_string(g), numel[g], init.data());
    EXPECT_TRUE(a.ok()) << a.status().ToString();
  }
  Status st = (*e)->Build();
  EXPECT_TRUE(st.ok()) << st.ToString();
  if (st.ok()) r.engine = std::move(e).value();
  return r;
}

StepOptions OptionsOf(int step) {
  StepOptions so;
  so.lr = 0.01 * (1.0 + 0.1 * step);
  return so;
}

// Step s's gradients (the same for every run), handed group by group
// (the groups below `groups`; all when negative).
void HandGrads(Engine& e, int s, bool prepare = false, int groups = -1) {
  if (prepare) {
    ASSERT_TRUE(e.PrepareStep(OptionsOf(s)).ok());
  }
  for (int g = (groups < 0 ? e.num_groups() : groups) - 1; g >= 0; --g) {
    const std::vector<float> grad = Values(e.group_numel(g), 1000 * (s + 1) + g);
    Status st = e.Grads(g, grad.data(), DType::kF32);
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
}

// W, M, V of every group, one vector each.
std::vector<std::vector<float>> State(Engine& e) {
  std::vector<std::vector<float>> out;
  for (int g = 0; g < e.num_groups(); ++g)
    for (Engine::OptimizerState w : {Engine::OptimizerState::kMaster, Engine::OptimizerState::kExpAvg, Engine::OptimizerState::kExpAvgSq}) {
      out.emplace_back(e.group_numel(g));
      Status st = e.ReadState(g, w, out.back().data());
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
  return out;
}

void ExpectSame(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b,
                const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  ASSERT_FALSE(a.empty()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(0, std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4))
        << what << ": group " << i / 3 << " state " << i % 3 << " differs";
}

// Every group's fetched P (fp32: W's bytes) equals its master: the cached
// copies the step refreshed unit by unit hold the new P.
void ExpectFetchedIsMaster(Engine& e, int step) {
  for (int g = 0; g < e.num_groups(); ++g) {
    std::vector<float> master(e.group_numel(g));
    ASSERT_TRUE(e.ReadMaster(g, master.data()).ok());
    auto p = e.Fetch(g);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(0, std::memcmp(*p, master.data(), master.size() * 4)) << "step " << step << ": group " << g
                                                                    << "'s fetched P is not its master";
    ASSERT_TRUE(e.Release(g).ok());
  }
}

std::vector<std::vector<float>> Train(const std::string& json, int steps, bool overlap = false) {
  Built r = Make(json, overlap);
  if (!r.engine) return {};
  for (int s = 0; s < steps; ++s) {
    HandGrads(*r.engine, s, overlap);
    auto st = r.engine->Step(OptionsOf(s));
    EXPECT_TRUE(st.ok()) << st.status().ToString();
    ExpectFetchedIsMaster(*r.engine, s);
  }
  return State(*r.engine);
}

// The engine's swap files in `dir`.
std::vector<std::filesystem::path> SwapFiles(const std::string& dir) {
  std::vector<std::filesystem::path> out;
  for (const auto& f : std::filesystem::directory_iterator(dir))
    if (f.path().filename().string().rfind("strata-swap", 0) == 0) out.push_back(f.path());
  return out;
}

uint64_t SwapBytes(const std::string& dir) {
  uint64_t total = 0;
  for (const auto& f : SwapFiles(dir)) total += std::filesystem::file_size(f);
  return total;
}

// The state the swap holds: W, M, V of every group, fp32, each shard padded
// to the partition's 2048 elements.
uint64_t StateBytes(const std::vector<uint64_t>& numel) {
  uint64_t n = 0;
  for (uint64_t g : numel) n += (g + 2047) / 2048 * 2048;
  return 3 * 4 * n;
}

TEST(StepUnits, KeepTheSwapWithinHalfTheStateBeyondIt) {
  for (uint64_t sub_group : {kWhole, uint64_t{65536}}) {
    SCOPED_TRACE("sub_group_size " + std::to_string(sub_group));
    TempDir dir;
    Built r = Make(Json(dir.path(), sub_group), false, kLargeNumel);
    ASSERT_TRUE(r.engine);
    for (int s = 0; s < 4; ++s) {
      HandGrads(*r.engine, s);
      ASSERT_TRUE(r.engine->Step(OptionsOf(s)).ok());
    }
    const double ratio = static_cast<double>(SwapBytes(dir.path())) / static_cast<double>(StateBytes(kLargeNumel));
    std::printf("sub_group_size %llu: swap %.3f x the state\n", static_cast<unsigned long long>(sub_group), ratio);
    if (sub_group == kWhole) {
      // Whole groups: the largest group's W, M, V twice over, at least.
      EXPECT_GT(ratio, 1.5) << "the case without units no longer shows what units are for";
    } else {
      EXPECT_LE(ratio, 1.5);
    }
  }
}

TEST(StepUnits, NumericsDoNotDependOnThem) {
  TempDir a, b, c, d, e0, e1, e2;
  const auto whole = Train(Json(a.path(), kWhole), 5);
  const auto units = Train(Json(b.path(), 16384), 5);
  const auto odd = Train(Json(c.path(), 6144), 5);  // units of 3 x 2048, a short last one
  const auto host = Train(Json(d.path(), 16384, "cpu"), 5);
  // Three swap folders: a unit's 8 KiB part takes 3 x 4 KiB stripes on disk,
  // and its parts still lie back to back at 8 KiB in the buffers (read_state
  // and the checkpoint load whole blocks in parts).
  const std::string three = R"(, "nvme_paths": [")" + e0.path() + R"(", ")" + e1.path() + R"(", ")" + e2.path() + R"("])";
  const auto striped = Train(Json(a.path(), 2048, "nvme", three), 5);
  // Three io_uring rings, each request's chunks handed to them in turn (no
  // other test trains through more than one); and two pools of threads with
  // pread and pwrite (the backend where io_uring is refused).
  const auto rings = Train(Json(d.path(), 2048, "nvme", three + R"(, "io_rings": 3)"), 5);
  const auto threads = Train(Json(d.path(), 2048, "nvme", three + R"(, "io_rings": 2, "io_backend": "threads")"), 5);
  ExpectSame(whole, units, "units of 16384 against whole groups");
  ExpectSame(whole, odd, "units of 6144 against whole groups");
  ExpectSame(whole, host, "host-homed state against whole groups on NVMe");
  ExpectSame(whole, striped, "units of 2048 striped over three folders against whole groups");
  ExpectSame(whole, rings, "three io_uring rings, units striped over three folders, against whole groups");
  ExpectSame(whole, threads, "pread and pwrite on threads, units striped over three folders, against whole groups");
}

// FNV-1a over every value's bits, as hex: two runs' state compared across processes.
std::string Digest(const std::vector<std::vector<float>>& state) {
  uint64_t h = 1469598103934665603ull;
  size_t n = 0;
  for (const auto& v : state)
    for (float x : v) {
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof bits);
      for (int k = 0; k < 4; ++k) h = (h ^ ((bits >> (8 * k)) & 0xff)) * 1099511628211ull;
      ++n;
    }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%016llx over %zu values", static_cast<unsigned long long>(h), n);
  return buf;
}

// Where io_uring is refused (a container's seccomp profile, as Docker's
// default; kernel.io_uring_disabled), an engine with its state on NVMe
// trains all the same with strata.io_backend "auto" (the default): pread
// and pwrite on threads, one warning saying so, the state bitwise io_uring's.
// "io_uring" is refused at create, naming why and the way out. The part
// without io_uring runs in a fresh process of this program (seccomp).
TEST(StepUnits, TrainsWhereIoUringIsRefused) {
  if (std::getenv(testing::kNoUringChildEnv)) {  // the child's part
    TempDir d;
    std::printf("state %s\n", Digest(Train(Json(d.path(), 2048), 5)).c_str());
    auto c = ParseConfig(Json(d.path(), 2048, "nvme", R"(, "io_backend": "io_uring")"));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    auto e = Engine::Create(*c, EngineOptions{});
    std::printf("with io_uring required: %s\n", e.ok() ? "created" : e.status().ToString().c_str());
    return;
  }
  TempDir d;
  const std::string want = Digest(Train(Json(d.path(), 2048), 5));
  const auto child = testing::ExecWithoutIoUring(EPERM, "StepUnits.TrainsWhereIoUringIsRefused");
  if (!child.filtered) GTEST_SKIP() << "this machine allows no seccomp filter (nothing to test)";
  ASSERT_TRUE(child.exited) << child.out;
  EXPECT_NE(child.out.find("state " + want + "\n"), std::string::npos) << "want state " << want << "; the child:\n"
                                                                     << child.out;
  EXPECT_NE(child.out.find("pread and pwrite on threads instead"), std::string::npos) << child.out;
  EXPECT_NE(child.out.find("with io_uring required: IO: io_uring is unavailable here"), std::string::npos)
      << child.out;
  EXPECT_NE(child.out.find("io_uring_queue_init: Operation not permitted"), std::string::npos) << child.out;
  EXPECT_NE(child.out.find("strata.io_backend \"threads\""), std::string::npos) << child.out;
}

// bf16 compute with P homed in host memory, W, M, V on NVMe in units: P is
// its own block, updated in place unit by unit by the step (fp32 runs, where
// P is W's bytes, never take that path). The state is bitwise whole groups',
// and every fetched P is its master rounded to bf16, after every step, with
// and without the overlapped step (clipping at 0.05: it clips, so "auto"
// does not speculate; "always" speculates and discards, and is exact too).
std::string Bf16Json(const std::string& dir, uint64_t sub_group, const std::string& speculation = "auto") {
  return R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}, "gradient_clipping": 0.05,
    "bf16": {"enabled": true},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir + R"("}, "sub_group_size": )" +
         std::to_string(sub_group) + R"(},
    "strata": {"device_budget": "64MiB", "host_budget": "256MiB", "grad_home": "host", "speculation": ")" +
         speculation + R"("}})";
}

std::vector<std::vector<float>> TrainBf16(const std::string& json, int steps, bool overlap) {
  Built r = Make(json, overlap);
  if (!r.engine) return {};
  Engine& e = *r.engine;
  for (int s = 0; s < steps; ++s) {
    HandGrads(e, s, overlap);
    auto st = e.Step(OptionsOf(s));
    EXPECT_TRUE(st.ok()) << st.status().ToString();
    for (int g = 0; g < e.num_groups(); ++g) {
      const uint64_t n = e.group_numel(g);
      std::vector<float> master(n);
      EXPECT_TRUE(e.ReadMaster(g, master.data()).ok());
      std::vector<uint16_t> want(n);
      EXPECT_TRUE(kernels::Cast(DType::kF32, master.data(), DType::kBF16, want.data(), n).ok());
      auto p = e.Fetch(g);
      if (!p.ok()) {
        ADD_FAILURE() << p.status().ToString();
        return {};
      }
      EXPECT_EQ(0, std::memcmp(*p, want.data(), n * 2)) << "step " << s << ": group " << g
                                                         << "'s fetched P is not its master in bf16";
      EXPECT_TRUE(e.Release(g).ok());
    }
  }
  return State(e);
}

TEST(StepUnits, Bf16PInItsOwnBlockFollowsTheMasterUnitByUnit) {
  TempDir a, b, c, d, f;
  const auto whole = TrainBf16(Bf16Json(a.path(), kWhole), 5, false);
  const auto units = TrainBf16(Bf16Json(b.path(), 16384), 5, false);
  const auto odd = TrainBf16(Bf16Json(c.path(), 6144), 5, false);
  const auto overlapped = TrainBf16(Bf16Json(d.path(), 16384), 5, true);
  const auto speculated = TrainBf16(Bf16Json(f.path(), 16384, "always"), 5, true);
  ExpectSame(whole, units, "bf16, units of 16384 against whole groups");
  ExpectSame(whole, odd, "bf16, units of 6144 against whole groups");
  ExpectSame(whole, overlapped, "bf16, units, overlap_step against whole groups");
  ExpectSame(whole, speculated, "bf16, units, speculation always against whole groups");
}

TEST(StepUnits, OverlappedStepsAreTheSame) {
  TempDir a, b, c;
  const auto plain = Train(Json(a.path(), 16384), 5);
  const auto overlapped = Train(Json(b.path(), 16384), 5, /*overlap=*/true);
  ExpectSame(plain, overlapped, "overlap_step with units");
  // Speculating at every step (the run clips at every step: each speculation
  // is replayed), small groups speculated beside large ones stepped in units.
  Built r = Make(Json(c.path(), 16384, "nvme", R"(, "speculation": "always")"), /*overlap=*/true);
  ASSERT_TRUE(r.engine);
  for (int s = 0; s < 5; ++s) {
    HandGrads(*r.engine, s, /*prepare=*/true);
    ASSERT_TRUE(r.engine->Step(OptionsOf(s)).ok());
  }
  EXPECT_GT(r.engine->stats().replayed_steps, 0u) << "nothing was speculated and replayed: the case is off";
  ExpectSame(plain, State(*r.engine), "overlap_step with units, speculation always (replayed)");
}

// Every write of step 3 failing in turn, once: the step fails, the next Step
// call finishes it, and the run ends bitwise the clean one.
TEST(StepUnits, AStepFailingPartWayThroughAGroupIsFinishedExactly) {
  for (const char* step_io : {"alternate", "concurrent"}) {
    SCOPED_TRACE(step_io);
    TempDir clean_dir;
    // (Without write-behind: a failed write fails its step, which stays pending.)
    const std::string extra = std::string(R"(, "write_behind": "never", "step_io": ")") + step_io + "\"";
    const auto clean = Train(Json(clean_dir.path(), 16384, "nvme", extra), 5);
    ASSERT_FALSE(clean.empty());
    int fired = 0, partial = 0;
    for (uint64_t skip = 0;; ++skip) {
      TempDir dir;
      Built r = Make(Json(dir.path(), 16384, "nvme", extra));
      ASSERT_TRUE(r.engine);
      Engine& e = *r.engine;
      bool hit = false;
      for (int s = 0; s < 5; ++s) {
        HandGrads(e, s);
        if (s == 3) r.faults->Arm(FaultPlan::Ops::kWrites, EIO, skip, 1);
        auto st = e.Step(OptionsOf(s));
        if (s == 3) {
          hit = r.faults->fired() > 0;
          r.faults->Disarm();
          if (hit) {
            ASSERT_FALSE(st.ok()) << "write " << skip;
            EXPECT_EQ(st.status().code(), Code::kIo) << st.status().ToString();
            // Group 0 (19 units) part-way: some of its units are new already.
            if (st.status().message().find("(0 of") != std::string::npos) ++partial;
            st = e.Step(OptionsOf(s));
          }
        }
        ASSERT_TRUE(st.ok()) << "write " << skip << ": " << st.status().ToString();
      }
      if (!hit) break;
      ++fired;
      ExpectSame(clean, State(e), "write " + std::to_string(skip) + " failing once");
      if (HasFatalFailure()) return;
    }
    // Group 0 alone is 19 units of 3 blocks: most faults land inside it.
    EXPECT_GE(fired, 57) << "the step wrote fewer blocks than its units have";
    EXPECT_GE(partial, 40) << "too few faults fell inside the large group";
  }
}

// write_state stores a group in units one at a time, each published as it
// is written. A write failing at the first unit changes nothing: the error,
// and the old state whole. One failing after some units were written leaves
// the state part new, part old: every later call is refused (STATE, naming
// it) until a checkpoint is loaded. Before, the calls after it returned OK
// on the mixed state.
TEST(StepUnits, AWriteStateFailingPartWayThroughUnitsBreaksTheEngine) {
  TempDir dir, ckpt;
  Built r = Make(Json(dir.path(), 16384));  // group 0: 19 units
  ASSERT_TRUE(r.engine);
  Engine& e = *r.engine;
  HandGrads(e, 0);
  ASSERT_TRUE(e.Step(OptionsOf(0)).ok());
  ASSERT_TRUE(e.SaveCheckpoint(ckpt.path(), "before", nullptr, 0).ok());
  const auto before = State(e);
  const std::vector<float> fresh = Values(e.group_numel(0), 77);
  // The first unit's write fails: nothing changed, nothing broken.
  r.faults->Arm(FaultPlan::Ops::kWrites, EIO, /*skip=*/0, 1);
  Status st = e.WriteState(0, Engine::OptimizerState::kMaster, fresh.data());
  ASSERT_GT(r.faults->fired(), 0u);
  r.faults->Disarm();
  EXPECT_EQ(st.code(), Code::kIo) << st.ToString();
  ExpectSame(before, State(e), "a write_state that failed at its first unit");
  // The sixth unit's write fails: five are new.
  r.faults->Arm(FaultPlan::Ops::kWrites, EIO, /*skip=*/5, 1);
  st = e.WriteState(0, Engine::OptimizerState::kMaster, fresh.data());
  ASSERT_GT(r.faults->fired(), 0u);
  r.faults->Disarm();
  EXPECT_EQ(st.code(), Code::kIo) << st.ToString();
  std::vector<float> w(e.group_numel(0));
  st = e.ReadMaster(0, w.data());
  ASSERT_EQ(st.code(), Code::kState) << "a master part new, part old was read: " << st.ToString();
  EXPECT_NE(st.message().find("failed after 5 of its 19 units"), std::string::npos) << st.message();
  const std::vector<float> grad = Values(e.group_numel(0), 5);
  EXPECT_EQ(e.Grads(0, grad.data(), DType::kF32).code(), Code::kState) << "a broken engine took gradients";
  ASSERT_TRUE(e.LoadCheckpoint(ckpt.path(), "before", nullptr).ok());
  ExpectSame(before, State(e), "the checkpoint loaded after a write_state failed part-way");
}

// Two ranks: rank 1's write_state fails after some units; both engines are
// broken at once (STATE on every rank, none left waiting in a collective
// for the other). Before, rank 1 alone was broken: its next call refused
// while rank 0 went into the collective and waited out strata.timeout.
TEST(StepUnits, AWriteStateFailingPartWayOnOneRankBreaksEveryRank) {
  TempDir dir;
  std::vector<Status> wrote(2), read(2);
  testing::OnRanks(2, [&](int rank, net::Communicator& comm) {
    TempDir mine;
    auto c = ParseConfig(Json(mine.path(), 16384));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EngineOptions eo;
    eo.comm = &comm;
    eo.force_no_gpu = true;
    auto faults = std::make_shared<FaultPlan>();
    eo.faults = faults;
    auto e = Engine::Create(*c, eo);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    for (size_t g = 0; g < kGroupNumel.size(); ++g) {
      const std::vector<float> init = Values(kGroupNumel[g], 100 + g);
      ASSERT_TRUE((*e)->AddParam(static_cast<int>(g), "g" + std::to_string(g), kGroupNumel[g], init.data()).ok());
    }
    ASSERT_TRUE((*e)->Build().ok());
    const std::vector<float> fresh = Values((*e)->group_numel(0), 77);
    if (rank == 1) faults->Arm(FaultPlan::Ops::kWrites, EIO, /*skip=*/3, 1);
    wrote[static_cast<size_t>(rank)] = (*e)->WriteState(0, Engine::OptimizerState::kExpAvg, fresh.data());
    faults->Disarm();
    std::vector<float> m((*e)->group_numel(0));
    read[static_cast<size_t>(rank)] = (*e)->ReadState(0, Engine::OptimizerState::kExpAvg, m.data());
  }, /*timeout_s=*/20);
  EXPECT_EQ(wrote[1].code(), Code::kIo) << wrote[1].ToString();
  EXPECT_FALSE(wrote[0].ok()) << "rank 0's write_state returned OK beside rank 1's failure";
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(read[static_cast<size_t>(r)].code(), Code::kState) << "rank " << r << ": " << read[static_cast<size_t>(r)].ToString();
    EXPECT_NE(read[static_cast<size_t>(r)].message().find("part"), std::string::npos) << read[static_cast<size_t>(r)].message();
  }
}

// Ranks that registered groups of different sizes are refused at build on
// every rank, naming the group and both sizes. (The broadcast of the initial
// values caught it by its byte count; it now sends only rank 0's values.)
TEST(StepUnits, RanksWithGroupsOfDifferentSizesAreRefusedAtBuildByName) {
  std::vector<Status> built(2);
  testing::OnRanks(2, [&](int rank, net::Communicator& comm) {
    auto c = ParseConfig(R"({"zero_optimization": {"stage": 2}, "strata": {"device_budget": "64MiB", "host_budget": "64MiB"}})");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EngineOptions eo;
    eo.comm = &comm;
    eo.force_no_gpu = true;
    auto e = Engine::Create(*c, eo);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    ASSERT_TRUE((*e)->AddParam(0, "w", 4096 + static_cast<uint64_t>(rank), nullptr).ok());
    built[static_cast<size_t>(rank)] = (*e)->Build();
  }, /*timeout_s=*/20);
  EXPECT_EQ(built[1].code(), Code::kInvalid) << built[1].ToString();
  EXPECT_NE(built[1].message().find("group 0 holds 4097 elements on rank 1 but 4096 on rank 0"), std::string::npos)
      << built[1].message();
  EXPECT_FALSE(built[0].ok()) << "rank 0 built beside rank 1's refusal";
}

TEST(StepUnits, CheckpointsMoveBetweenUnitsAndWholeGroups) {
  TempDir a, b, ckpt;
  Built units = Make(Json(a.path(), 16384));
  ASSERT_TRUE(units.engine);
  for (int s = 0; s < 3; ++s) {
    HandGrads(*units.engine, s);
    ASSERT_TRUE(units.engine->Step(OptionsOf(s)).ok());
  }
  Status st = units.engine->SaveCheckpoint(ckpt.path(), "u", nullptr, 0);
  ASSERT_TRUE(st.ok()) << st.ToString();
  const auto saved = State(*units.engine);
  Built whole = Make(Json(b.path(), kWhole));
  ASSERT_TRUE(whole.engine);
  st = whole.engine->LoadCheckpoint(ckpt.path(), "u", nullptr);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ExpectSame(saved, State(*whole.engine), "units' checkpoint in whole groups");
  // And on: both take step 3 alike, and the whole groups' save loads into units.
  for (Engine* e : {units.engine.get(), whole.engine.get()}) {
    HandGrads(*e, 3);
    ASSERT_TRUE(e->Step(OptionsOf(3)).ok());
  }
  ExpectSame(State(*units.engine), State(*whole.engine), "step 3 after the load");
  ASSERT_TRUE(whole.engine->SaveCheckpoint(ckpt.path(), "w", nullptr, 0).ok());
  st = units.engine->LoadCheckpoint(ckpt.path(), "w", nullptr);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ExpectSame(State(*whole.engine), State(*units.engine), "whole groups' checkpoint in units");
}

// The pools' own tests' host tier: 64 MiB, unpinned.
HostTierOptions PoolHost() {
  HostTierOptions ho;
  ho.budget = 64 * 1024 * 1024;
  ho.pin = false;
  ho.numa_bind = false;
  return ho;
}

// The pool's pieces: cut from one buffer after another, never overlapping,
// of the sizes asked (4096 multiples); a buffer comes back whole (to
// Acquire) only once every piece of it is back; the reclaim runs before a
// piece wait.
TEST(StagingPieces, CutInOrderAndComeBackWhole) {
  HostTier host(PoolHost());
  StagingPool pool;
  constexpr uint64_t kB = 5 * 65536;
  ASSERT_TRUE(pool.Init(&host, 2, kB).ok());
  pool.SetPieces();
  EXPECT_EQ(pool.TryAcquirePiece(kB + 1), nullptr) << "a piece larger than a buffer";
  // 2 x 128 KiB fit a 320 KiB buffer; the third goes to the other buffer.
  std::vector<char*> lent;
  for (int i = 0; i < 4; ++i) {
    void* p = pool.TryAcquirePiece(2 * 65536 - 100);  // (rounded up to 4096s)
    ASSERT_NE(p, nullptr) << "piece " << i;
    lent.push_back(static_cast<char*>(p));
  }
  EXPECT_EQ(lent[1] - lent[0], 2 * 65536) << "pieces are not cut in order from one buffer";
  EXPECT_EQ(lent[3] - lent[2], 2 * 65536);
  EXPECT_TRUE(lent[2] < lent[0] || lent[2] >= lent[0] + kB) << "the third piece is not from the other buffer";
  EXPECT_EQ(pool.TryAcquirePiece(2 * 65536), nullptr) << "more than two buffers hold";
  void* small = pool.TryAcquirePiece(4096);  // the tail of the current buffer
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(static_cast<char*>(small), lent[3] + 2 * 65536);
  EXPECT_EQ(pool.TryAcquire(), nullptr) << "a whole buffer while both are cut";
  // One piece of the first buffer back: still none whole.
  pool.ReleasePiece(lent[0]);
  EXPECT_EQ(pool.TryAcquire(), nullptr) << "a buffer came back whole with a piece still lent";
  EXPECT_EQ(pool.TryAcquirePiece(65536), nullptr) << "a lent buffer's freed room was cut again";
  // A whole Acquire waits for the last piece of a buffer.
  std::atomic<bool> done{false};
  void* whole = nullptr;
  std::thread t([&] {
    whole = pool.Acquire();
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(done.load()) << "Acquire returned a buffer whose pieces are lent";
  pool.ReleasePiece(lent[1]);
  t.join();
  EXPECT_EQ(static_cast<char*>(whole), lent[0]) << "the whole buffer is not where its pieces were";
  pool.Release(whole);
  // The reclaim runs when nothing fits, before waiting.
  std::vector<void*> held = {lent[2], lent[3], small};
  void* first = pool.TryAcquirePiece(kB);  // the whole free buffer, as one piece
  ASSERT_NE(first, nullptr);
  int reclaims = 0;
  pool.SetReclaim([&] {
    ++reclaims;
    for (void* q : held) pool.ReleasePiece(q);
    held.clear();
  });
  void* p = pool.AcquirePiece(65536);
  EXPECT_EQ(reclaims, 1);
  EXPECT_NE(p, nullptr);
  pool.ReleasePiece(p);
  pool.ReleasePiece(first);
  void* a = pool.TryAcquire();
  void* b = pool.TryAcquire();
  EXPECT_TRUE(a && b) << "both buffers whole again";
  pool.Release(a);
  pool.Release(b);
}

// Cuts `run`'s pieces in order (TryAcquirePiece) until one fails; those cut
// in `cut`. Whether all were.
bool CutAll(StagingPool& pool, const std::vector<uint64_t>& run, std::vector<void*>* cut) {
  for (uint64_t b : run) {
    void* p = pool.TryAcquirePiece(b);
    if (!p) return false;
    cut->push_back(p);
  }
  return true;
}

// What the pool says of a run of pieces before it is cut is what cutting
// does: BuffersForPieces is the buffers an idle pool's cuts open, in order;
// HoldsInOrder, from any state (a buffer part cut, pieces of an earlier
// run still lent), is whether every cut succeeds. Random runs, against the
// pool itself.
TEST(StagingPieces, TheCountIsTheCutting) {
  HostTier host(PoolHost());
  constexpr uint64_t kB = 10 * 4096;
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<uint64_t> size(1, kB);
  std::uniform_int_distribution<int> len(1, 12), count(1, 6), coin(0, 1);
  int fitted = 0, refused = 0;
  for (int trial = 0; trial < 400; ++trial) {
    StagingPool pool;
    const int buffers = count(rng);
    ASSERT_TRUE(pool.Init(&host, buffers, kB).ok());
    pool.SetPieces();
    // An earlier run: some pieces cut, some of them given back.
    std::vector<void*> earlier;
    for (int i = len(rng) % 4; i > 0; --i)
      if (void* p = pool.TryAcquirePiece(size(rng))) earlier.push_back(p);
    for (void*& p : earlier)
      if (coin(rng)) {
        pool.ReleasePiece(p);
        p = nullptr;
      }
    std::vector<uint64_t> run(static_cast<size_t>(len(rng)));
    for (auto& b : run) b = size(rng);
    const bool holds = pool.HoldsInOrder(run);
    std::vector<void*> cut;
    const bool all = CutAll(pool, run, &cut);
    ASSERT_EQ(holds, all) << "trial " << trial << ": HoldsInOrder said " << holds;
    (holds ? fitted : refused)++;
    for (void* p : cut) pool.ReleasePiece(p);
    for (void* p : earlier) pool.ReleasePiece(p);
  }
  EXPECT_GT(fitted, 50);
  EXPECT_GT(refused, 50) << "the random runs do not test a refusal";
  // An idle pool of enough buffers: the count is the buffers the cuts open.
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<uint64_t> run(static_cast<size_t>(len(rng)));
    for (auto& b : run) b = size(rng);
    const int64_t n = BuffersForPieces(run, kB);
    ASSERT_GE(n, 1);
    StagingPool pool;
    ASSERT_TRUE(pool.Init(&host, static_cast<int>(n), kB).ok());
    pool.SetPieces();
    EXPECT_TRUE(pool.HoldsInOrder(run));
    std::vector<void*> cut;
    ASSERT_TRUE(CutAll(pool, run, &cut)) << "trial " << trial << ": " << n << " buffers do not hold the run";
    StagingPool fewer;
    if (n > 1) {
      ASSERT_TRUE(fewer.Init(&host, static_cast<int>(n - 1), kB).ok());
      fewer.SetPieces();
      EXPECT_FALSE(fewer.HoldsInOrder(run));
      std::vector<void*> got;
      EXPECT_FALSE(CutAll(fewer, run, &got)) << "trial " << trial << ": " << n - 1 << " buffers hold the run: the count is high";
      for (void* p : got) fewer.ReleasePiece(p);
    }
    for (void* p : cut) pool.ReleasePiece(p);
  }
  EXPECT_EQ(BuffersForPieces({kB + 1}, kB), -1) << "a piece larger than a buffer";
  EXPECT_EQ(BuffersForPieces({kB / 2 + 1, kB / 2 + 1, 1}, kB), 2) << "next fit: the third piece after the second";
}

// Whole groups take buffer_count (4) slots of the largest group's W, M, V
// (and P); units take 2 of them, lent in pieces: the host tier holds two
// slots less. The same run, bitwise (NumericsDoNotDependOnThem): here its
// host memory.
TEST(StepUnits, TheStepStagesUnitsInPiecesOfTwoSlots) {
  TempDir a, b;
  Built whole = Make(Json(a.path(), kWhole), false, kLargeNumel);
  Built units = Make(Json(b.path(), 65536), false, kLargeNumel);
  ASSERT_TRUE(whole.engine && units.engine);
  for (int s = 0; s < 2; ++s)
    for (Engine* e : {whole.engine.get(), units.engine.get()}) {
      HandGrads(*e, s);
      ASSERT_TRUE(e->Step(OptionsOf(s)).ok());
    }
  const uint64_t largest_wmv = StateBytes({kLargeNumel[0]});
  const uint64_t used_whole = whole.engine->stats().host.used, used_units = units.engine->stats().host.used;
  std::printf("host tier: whole groups %llu bytes, units %llu bytes\n", static_cast<unsigned long long>(used_whole),
              static_cast<unsigned long long>(used_units));
  EXPECT_GE(used_whole, used_units + 2 * largest_wmv) << "units do not stage in pieces of fewer slots";
  EXPECT_LT(used_whole, used_units + 4 * largest_wmv) << "units hold less than two slots: the check is off";
}

// A step that updates after backward (speculation "never") reads its W, M,
// V ahead during backward into free staging. In pieces, every unit's: with
// whole slots, 4 units (a slot each) at most.
TEST(StepUnits, AStepAfterBackwardReadsEveryUnitAhead) {
  TempDir dir;
  Built r = Make(Json(dir.path(), 65536, "nvme", R"(, "speculation": "never")"), /*overlap=*/true, kLargeNumel);
  ASSERT_TRUE(r.engine);
  uint64_t before = 0;
  for (int s = 0; s < 3; ++s) {
    HandGrads(*r.engine, s, /*prepare=*/true);
    auto st = r.engine->Step(OptionsOf(s));
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    const uint64_t now = r.engine->stats().step_read_ahead_bytes;
    EXPECT_EQ(now - before, StateBytes(kLargeNumel)) << "step " << s << " did not read all of W, M, V ahead";
    before = now;
  }
}

// The writes go on after the step returns (held back 20 ms each here, so
// that they are still in flight): whatever reads next waits for them (the
// block I/O's gate), and every step's state, read at once, is bitwise the
// run's without write-behind; fetched P is the master.
TEST(StepUnits, WritesGoOnBehindTheStepAndLandBeforeAnyRead) {
  TempDir a, b;
  Built ref = Make(Json(a.path(), 65536, "nvme", R"(, "write_behind": "never")"), false, kLargeNumel);
  Built wb = Make(Json(b.path(), 65536), false, kLargeNumel);
  ASSERT_TRUE(ref.engine && wb.engine);
  wb.faults->SlowWrites(10);
  for (int s = 0; s < 4; ++s) {
    for (Engine* e : {ref.engine.get(), wb.engine.get()}) {
      HandGrads(*e, s);
      auto st = e->Step(OptionsOf(s));
      ASSERT_TRUE(st.ok()) << st.status().ToString();
    }
    EXPECT_EQ(wb.engine->stats().write_behind_steps, static_cast<uint64_t>(s + 1));
    ExpectSame(State(*ref.engine), State(*wb.engine), "step " + std::to_string(s) + ", read as it returned");
    ExpectFetchedIsMaster(*wb.engine, s);
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(ref.engine->stats().write_behind_steps, 0u);
  // (How long a read waited for the writes, behind_wait_s, is a time: the
  // benchmark strata-offload-step prints it, offload_step_behind.)
  wb.faults->SlowWrites(0);
}

// A step that updates after backward (speculation "never") reads its
// pieces ahead during backward, then writes behind: the run cuts only what
// the read-ahead did not. Groups of 3, 2 and 1 units: a slot holds three
// units' pieces (a slot is W, M, V of the largest group; P is W's bytes and
// has no region), so the two slots hold the step's six pieces cut in order,
// [3][3], and nothing more. Every step reads all six ahead and writes
// behind, bitwise the run without.
TEST(StepUnits, AStepReadAheadInTwoSlotsStillWritesBehind) {
  const std::vector<uint64_t> numel = {196608, 131072, 65536};
  TempDir a, b;
  Built ref = Make(Json(a.path(), 65536, "nvme", R"(, "write_behind": "never")"), false, numel);
  Built wb = Make(Json(b.path(), 65536, "nvme", R"(, "speculation": "never")"), /*overlap=*/true, numel);
  ASSERT_TRUE(ref.engine && wb.engine);
  const uint64_t base = ref.engine->stats().host.used;
  EXPECT_EQ(wb.engine->stats().host.used, base) << "the two slots should hold the step: nothing grows";
  for (int s = 0; s < 4; ++s) {
    HandGrads(*ref.engine, s);
    HandGrads(*wb.engine, s, /*prepare=*/true);
    for (Engine* e : {ref.engine.get(), wb.engine.get()}) {
      auto st = e->Step(OptionsOf(s));
      ASSERT_TRUE(st.ok()) << st.status().ToString();
    }
  }
  EXPECT_EQ(wb.engine->stats().step_read_ahead_bytes, 4 * StateBytes(numel)) << "not every piece was read ahead";
  EXPECT_EQ(wb.engine->stats().write_behind_steps, 4u) << "a step wrote before it returned";
  ExpectSame(State(*ref.engine), State(*wb.engine), "read ahead, then written behind");
}

// skip_groups_without_grads: group 2 gets no gradients, so from step 1 on it
// lags (no update yet, the others one or more) and comes first in
// StepOrder. Groups of 3, 1 and 2 units (163840, 49152 and 106496
// elements): their pieces (768 + 768 + 384, 576, 768 + 480 KiB), cut in
// index order, fill the two slots (1920 KiB: W, M, V of group 0),
// [g0 g0 g0 | g1 g2 g2]; with group 2 first they would need a third. The
// read-ahead cuts in index order, the order the build counted, so the
// steps of groups 0 and 1 all write behind, bitwise the run without.
TEST(StepUnits, AStepWithALaggingGroupStillWritesBehind) {
  const std::vector<uint64_t> numel = {163840, 49152, 106496};
  TempDir a, b;
  Built ref = Make(Json(a.path(), 65536, "nvme", R"(, "write_behind": "never")"), false, numel, /*skip_gradless=*/true);
  Built wb = Make(Json(b.path(), 65536, "nvme", R"(, "speculation": "never")"), /*overlap=*/true, numel, true);
  ASSERT_TRUE(ref.engine && wb.engine);
  EXPECT_EQ(wb.engine->stats().host.used, ref.engine->stats().host.used) << "the two slots should hold the step";
  for (int s = 0; s < 4; ++s) {
    HandGrads(*ref.engine, s, false, /*groups=*/2);
    HandGrads(*wb.engine, s, /*prepare=*/true, /*groups=*/2);
    for (Engine* e : {ref.engine.get(), wb.engine.get()}) {
      auto st = e->Step(OptionsOf(s));
      ASSERT_TRUE(st.ok()) << st.status().ToString();
    }
  }
  EXPECT_EQ(wb.engine->stats().write_behind_steps, 4u) << "a step with a lagging group wrote before it returned";
  ExpectSame(State(*ref.engine), State(*wb.engine), "a lagging group, written behind");
}

// Never clipped, overlap_step's "auto" speculates after a clean step; not
// where the step writes behind: its writes are hidden there without the
// room. The two runs end bitwise alike.
TEST(StepUnits, AutoDoesNotSpeculateWhereTheStepWritesBehind) {
  std::map<std::string, std::vector<std::vector<float>>> states;
  for (const char* wb : {"auto", "never"}) {
    SCOPED_TRACE(wb);
    TempDir dir;
    std::string json = Json(dir.path(), 65536, "nvme", std::string(R"(, "write_behind": ")") + wb + "\"");
    json.replace(json.find("\"gradient_clipping\": 0.05"), 25, "\"gradient_clipping\": 1e9 ");
    Built r = Make(json, /*overlap=*/true, kLargeNumel);
    ASSERT_TRUE(r.engine);
    for (int s = 0; s < 5; ++s) {
      HandGrads(*r.engine, s, /*prepare=*/true);
      auto st = r.engine->Step(OptionsOf(s));
      ASSERT_TRUE(st.ok()) << st.status().ToString();
    }
    const EngineStats stats = r.engine->stats();
    if (std::string(wb) == "auto") {
      EXPECT_EQ(stats.speculated_steps, 0u) << "speculated where the step writes behind";
      EXPECT_EQ(stats.write_behind_steps, 5u);
    } else {
      EXPECT_GT(stats.speculated_steps, 0u) << "the case without write-behind no longer speculates: the check is off";
      EXPECT_EQ(stats.write_behind_steps, 0u);
    }
    states[wb] = State(*r.engine);
  }
  ExpectSame(states["auto"], states["never"], "write-behind against speculation");
}

// Four equal groups (a model of equal layers): two slots of the largest
// group's W, M, V hold less than half the step's pieces. "auto" adds slots
// at build from the host budget's rest, so that the step writes behind;
// with no room left in the budget nothing grows and the step writes before
// it returns. All three runs end bitwise alike.
TEST(StepUnits, StagingGrowsForWriteBehindWithinTheHostBudget) {
  const std::vector<uint64_t> equal = {200000, 200000, 200000, 200000};
  TempDir a, b, c;
  Built never = Make(Json(a.path(), 65536, "nvme", R"(, "write_behind": "never")"), false, equal);
  ASSERT_TRUE(never.engine);
  const uint64_t base = never.engine->stats().host.used;
  Built grown = Make(Json(b.path(), 65536), false, equal);
  std::string tight_json = Json(c.path(), 65536);
  tight_json.replace(tight_json.find("\"256MiB\""), 8, std::to_string(base));  // the budget the two slots fill
  Built tight = Make(tight_json, false, equal);
  ASSERT_TRUE(grown.engine && tight.engine);
  // A slot holds a group's W, M, V (each at a multiple of 64 KiB: 3 x 832
  // KiB; P is W's bytes, with no region); a group's pieces are three units'
  // W, M, V of 768 KiB and one of 48 KiB, 2352 KiB. The sixteen pieces, cut
  // in the step's order, fill four slots (a group each: the next group's
  // first piece does not fit in the 144 KiB left): two more than the two.
  const uint64_t slot = 3 * 832 * 1024;
  EXPECT_EQ(grown.engine->stats().host.used, base + 2 * slot) << "\"auto\" did not grow the step's staging by two slots";
  EXPECT_EQ(tight.engine->stats().host.used, base) << "the staging grew with no room in the host budget";
  EXPECT_LE(tight.engine->stats().host.peak, tight.engine->stats().host.budget);
  for (int s = 0; s < 3; ++s)
    for (Engine* e : {never.engine.get(), grown.engine.get(), tight.engine.get()}) {
      HandGrads(*e, s);
      auto st = e->Step(OptionsOf(s));
      ASSERT_TRUE(st.ok()) << st.status().ToString();
    }
  EXPECT_EQ(grown.engine->stats().write_behind_steps, 3u) << "the grown staging does not hold the step at once";
  EXPECT_EQ(tight.engine->stats().write_behind_steps, 0u);
  EXPECT_EQ(never.engine->stats().write_behind_steps, 0u);
  ExpectSame(State(*never.engine), State(*grown.engine), "grown staging, writing behind");
  ExpectSame(State(*never.engine), State(*tight.engine), "no room to grow");
}

// The step verifies each unit's W, M, V as read (their checksums, on both
// cores at once): a swap file overwritten between steps fails the next
// step with CORRUPT, naming the mismatch.
TEST(StepUnits, AStepReadingACorruptSwapFailsNamingTheChecksum) {
  TempDir dir;
  Built r = Make(Json(dir.path(), 65536), false, kLargeNumel);
  ASSERT_TRUE(r.engine);
  for (int s = 0; s < 2; ++s) {
    HandGrads(*r.engine, s);
    ASSERT_TRUE(r.engine->Step(OptionsOf(s)).ok());
  }
  State(*r.engine);  // (waits for the writes behind)
  const std::vector<std::filesystem::path> files = SwapFiles(dir.path());
  ASSERT_FALSE(files.empty()) << "no swap file to corrupt";
  for (const auto& f : files) {
    const uint64_t size = std::filesystem::file_size(f);
    FILE* out = std::fopen(f.c_str(), "r+b");
    ASSERT_NE(out, nullptr);
    const std::vector<char> junk(size, static_cast<char>(0xAB));
    ASSERT_EQ(std::fwrite(junk.data(), 1, size, out), size);
    ASSERT_EQ(std::fclose(out), 0);
  }
  HandGrads(*r.engine, 2);
  auto st = r.engine->Step(OptionsOf(2));
  ASSERT_FALSE(st.ok()) << "a step read corrupt W, M, V and succeeded";
  EXPECT_EQ(st.status().code(), Code::kCorrupt) << st.status().ToString();
  EXPECT_NE(st.status().message().find("checksum mismatch"), std::string::npos) << st.status().ToString();
  EXPECT_EQ(r.engine->stats().write_behind_steps, 2u);
}

// A write behind step 3 fails: step 3 has returned, so the next step is
// refused, naming the lost write, and so is anything else but a load; the
// checkpoint of step 2 loads, and steps 3 and 4 again end bitwise the clean run.
TEST(StepUnits, AWriteFailingBehindTheStepBreaksTheEngineUntilALoad) {
  TempDir clean_dir, dir, ckpt;
  const auto clean = Train(Json(clean_dir.path(), 16384, "nvme", R"(, "write_behind": "never")"), 5);
  ASSERT_FALSE(clean.empty());
  Built r = Make(Json(dir.path(), 16384));
  ASSERT_TRUE(r.engine);
  Engine& e = *r.engine;
  for (int s = 0; s < 3; ++s) {
    HandGrads(e, s);
    ASSERT_TRUE(e.Step(OptionsOf(s)).ok());
  }
  Status saved = e.SaveCheckpoint(ckpt.path(), "c", nullptr, 0);
  ASSERT_TRUE(saved.ok()) << saved.ToString();
  HandGrads(e, 3);
  r.faults->SlowWrites(5);  // (the fault lands after the step returned)
  r.faults->Arm(FaultPlan::Ops::kWrites, EIO, 7, 1);
  auto st = e.Step(OptionsOf(3));
  ASSERT_TRUE(st.ok()) << "step 3 waited for its writes: " << st.status().ToString();
  HandGrads(e, 4);
  st = e.Step(OptionsOf(4));
  r.faults->SlowWrites(0);
  EXPECT_EQ(r.faults->fired(), 1);
  ASSERT_FALSE(st.ok()) << "a step after a lost write went ahead";
  EXPECT_EQ(st.status().code(), Code::kState) << st.status().ToString();
  EXPECT_NE(st.status().message().find("write_behind"), std::string::npos) << st.status().ToString();
  std::vector<float> w(e.group_numel(0));
  EXPECT_FALSE(e.ReadState(0, Engine::OptimizerState::kMaster, w.data()).ok()) << "read_state of a broken engine";
  r.faults->Disarm();
  Status loaded = e.LoadCheckpoint(ckpt.path(), "c", nullptr);
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  for (int s = 3; s < 5; ++s) {
    HandGrads(e, s);
    st = e.Step(OptionsOf(s));
    ASSERT_TRUE(st.ok()) << st.status().ToString();
  }
  ExpectSame(clean, State(e), "after the load, steps 3 and 4 again");
}

}  // namespace
}  // namespace strata
