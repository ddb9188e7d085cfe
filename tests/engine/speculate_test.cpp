// engine/: overlap_step's speculative updates (step/speculation.h). Every
// run here is made twice on the same gradients, with overlap_step and
// without, and must end bitwise equal: masters, both moments, P as fetched,
// the loss scale and every step's result. The overlapped run's stats must
// show what happened to the speculation (committed, replayed, discarded),
// so a run that quietly stopped overlapping fails too. Over: fp32 and
// compact formats, bf16 and fp16 compute, state on the host or NVMe (P
// too), clipping that never, always or sometimes triggers, no clipping,
// fp16 overflows, NaN under strata.nonfinite "skip" and "error", gradient
// accumulation, a speculation room that fits only some groups, options
// changed after prepare_step, skip_groups_without_grads, and a disk that
// fails under the speculation.
#include <gtest/gtest.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include <thread>

#include "engine/engine.h"
#include "engine/step/speculation_policy.h"
#include "io/fault.h"
#include "io/net/comm.h"
#include "io/net/store.h"
#include "tests/engine/engine_test_util.h"
#include "tests/util/on_ranks.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using testing::TempDir;

const std::vector<uint64_t> kSizes = {5000, 12000, 3000, 20000, 7000};

struct Case {
  std::string placement = "host";  // host | nvme (W, M, V, G) | nvme_all (P too)
  std::string format = "fp32";     // strata.state_format
  std::string compute = "bf16";    // bf16 | fp16 | fp32
  std::string nonfinite = "skip";
  std::string extra_strata;        // more "strata" keys (`"k": v, `)
  // strata.speculation: "always" here, so that each case's speculation is
  // what it tests; the policy ("auto") has tests of its own below.
  std::string speculation = "always";
  int stage = 3;
  bool overlap_comm = false;  // several ranks: the reduction's thread calls the accumulation
  int steps = 5;
  int accumulation = 1;
  bool skip_gradless = false;
  // Per step: the step's max_grad_norm (-1: the config's 0), the group
  // (and value) one gradient element of its last micro-batch is poisoned
  // with (-1: none), and a group that gets no gradients (-1: none).
  std::function<double(int)> clip = [](int) { return 1e6; };
  std::function<int(int)> poison = [](int) { return -1; };
  float poison_value = NAN;
  std::function<int(int)> gradless = [](int) { return -1; };
  // Step options given to step when they differ from prepare_step's (lr x this).
  std::function<double(int)> lr_at_step = [](int) { return 1.0; };
};

std::string Json(const Case& c, const std::string& dir) {
  const bool nvme = c.placement != "host";
  std::string j = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},)";
  if (c.compute == "bf16") j += R"("bf16": {"enabled": true},)";
  if (c.compute == "fp16") j += R"("fp16": {"enabled": true, "initial_scale_power": 12, "loss_scale_window": 2},)";
  j += R"("zero_optimization": {"stage": )" + std::to_string(c.stage) + R"(, "reduce_bucket_size": 4000, "overlap_comm": )" +
       (c.overlap_comm ? "true" : "false") +
       R"(, "offload_optimizer": {"device": ")" + std::string(nvme ? "nvme" : "cpu") + R"(", "nvme_path": ")" + dir +
       R"("}, "offload_param": {"device": ")" + std::string(c.placement == "nvme_all" ? "nvme" : "none") +
       R"(", "nvme_path": ")" + dir + R"(", "buffer_size": 1e5}},)";
  // "nvme" puts G beside W, M, V (strata.grad_home; "auto" would keep it in host memory).
  const std::string grad_home =
      nvme && c.extra_strata.find("grad_home") == std::string::npos ? R"("grad_home": "nvme", )" : "";
  // Room for every group (each case tests what speculation does, not its
  // room): "auto" keeps the swap within 1.5x the state, which holds some.
  const std::string disk_room = nvme && c.extra_strata.find("speculation_disk_bytes") == std::string::npos
                                    ? R"("speculation_disk_bytes": "16MiB", )"
                                    : "";
  j += R"("strata": {)" + c.extra_strata + grad_home + disk_room + R"("device_budget": "64MiB", "host_budget": "64MiB", "state_format": ")" +
       c.format + R"(", "nonfinite": ")" + c.nonfinite + R"(", "speculation": ")" + c.speculation + R"("}})";
  return j;
}

struct Outcome {
  std::vector<std::vector<float>> w, m, v;
  std::vector<std::vector<uint8_t>> p;
  std::vector<std::string> results;  // per step: "ok norm skipped scale" or the error's code
  EngineStats stats;
  bool ok = false;
};

StepOptions OptionsOf(const Case& c, int s) {
  StepOptions so;
  so.lr = 0.01 * (1.0 + 0.1 * s);
  so.max_grad_norm = c.clip(s);
  return so;
}

std::vector<float> GradsOf(uint64_t n, int step, int micro, int g, int rank = 0) {
  std::mt19937 rng(static_cast<uint32_t>(1000003 * step + 7919 * micro + g + 101 * rank));
  std::normal_distribution<float> nd(0.0f, 0.01f);
  std::vector<float> out(n);
  for (auto& x : out) x = nd(rng);
  return out;
}

// An engine on `c`'s config in `dir` with kSizes' groups, built; each
// group starts at random values (fill 0) or all at `fill`. `edit` changes
// the parsed config first. Null, with the failure reported, when a call fails.
std::unique_ptr<Engine> MakeBuilt(const Case& c, const std::string& dir, const EngineOptions& eo, float fill = 0,
                                  const std::function<void(Config&)>& edit = nullptr) {
  auto cfg = ParseConfig(Json(c, dir));
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  if (!cfg.ok()) return nullptr;
  if (edit) edit(*cfg);
  auto made = Engine::Create(*cfg, eo);
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  if (!made.ok()) return nullptr;
  std::unique_ptr<Engine> e = std::move(made).value();
  for (size_t g = 0; g < kSizes.size(); ++g) {
    std::vector<float> init = GradsOf(kSizes[g], -1, 0, static_cast<int>(g));
    for (auto& x : init) x = fill != 0 ? fill : x * 20.0f;
    Status st = e->AddParam(static_cast<int>(g), "p" + std::to_string(g), kSizes[g], init.data()).status();
    EXPECT_TRUE(st.ok()) << st.ToString();
    if (!st.ok()) return nullptr;
  }
  Status b = e->Build();
  EXPECT_TRUE(b.ok()) << b.ToString();
  return b.ok() ? std::move(e) : nullptr;
}

// `resume`: a checkpoint (dir, tag) to load after build, at step `first`.
struct Resume {
  std::string dir;
  int first = 0;
};

Outcome RunCase(const Case& c, bool overlap, std::shared_ptr<FaultPlan> faults = nullptr,
            const std::function<void(int step, FaultPlan&)>& arm = nullptr, net::Communicator* comm = nullptr,
            const Resume& resume = {}) {
  TempDir dir;
  Outcome out;
  EngineOptions eo;
  const int rank = comm ? comm->rank() : 0;
  if (comm) {
    eo.comm = comm;
    eo.rank = rank;
    eo.world_size = comm->world_size();
  }
  eo.overlap_step = overlap;
  eo.grad_accumulation_steps = c.accumulation;
  eo.skip_groups_without_grads = c.skip_gradless;
  eo.faults = faults;
  std::unique_ptr<Engine> made = MakeBuilt(c, dir.path(), eo);
  if (!made) return out;
  Engine& e = *made;
  const int groups = static_cast<int>(kSizes.size());
  if (!resume.dir.empty()) {
    Status ld = e.LoadCheckpoint(resume.dir, "t", nullptr);
    EXPECT_TRUE(ld.ok()) << ld.ToString();
    if (!ld.ok()) return out;
  }
  for (int s = resume.first; s < c.steps; ++s) {
    const StepOptions so = OptionsOf(c, s);
    if (overlap) {
      EXPECT_TRUE(e.PrepareStep(so).ok());
    }
    for (int g = 0; g < groups; ++g) {  // forward
      auto p = e.Fetch(g);
      EXPECT_TRUE(p.ok()) << "step " << s << " fetch " << g << ": " << p.status().ToString();
      EXPECT_TRUE(e.Release(g).ok());
    }
    if (arm && faults) arm(s, *faults);
    const double scale = e.loss_scale();
    for (int micro = 0; micro < c.accumulation; ++micro)
      for (int g = groups - 1; g >= 0; --g) {  // backward, last group first
        if (g == c.gradless(s)) continue;
        std::vector<float> grad = GradsOf(kSizes[static_cast<size_t>(g)], s, micro, g, rank);
        for (auto& x : grad) x = static_cast<float>(x * scale);
        if (micro == c.accumulation - 1 && g == c.poison(s) && rank == 0) grad[17] = c.poison_value;
        Status st = e.Grads(g, grad.data(), DType::kF32);
        for (int retry = 0; retry < 4 && !st.ok() && st.code() == Code::kIo; ++retry)
          st = e.Grads(g, grad.data(), DType::kF32);  // G's store failed: G is as it was
        EXPECT_TRUE(st.ok()) << "step " << s << " grads " << g << ": " << st.ToString();
      }
    StepOptions at_step = so;
    at_step.lr *= c.lr_at_step(s);
    auto r = e.Step(at_step);
    if (faults) faults->Disarm();
    if (!r.ok() && r.status().code() == Code::kIo) r = e.Step(at_step);  // a failed step is finished by the next call
    char line[128];
    if (r.ok()) std::snprintf(line, sizeof line, "ok %.17g %d %.17g", r->grad_norm, r->skipped ? 1 : 0, r->loss_scale);
    else std::snprintf(line, sizeof line, "error %d", static_cast<int>(r.status().code()));
    out.results.push_back(line);
  }
  const auto dt = e.compute_dtype();
  for (int g = 0; g < groups; ++g) {
    const uint64_t n = e.group_numel(g);
    out.w.emplace_back(n);
    out.m.emplace_back(n);
    out.v.emplace_back(n);
    EXPECT_TRUE(e.ReadMaster(g, out.w.back().data()).ok());
    EXPECT_TRUE(e.ReadState(g, Engine::OptimizerState::kExpAvg, out.m.back().data()).ok());
    EXPECT_TRUE(e.ReadState(g, Engine::OptimizerState::kExpAvgSq, out.v.back().data()).ok());
    auto p = e.Fetch(g);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) return out;
    const auto* bytes = static_cast<const uint8_t*>(*p);
    out.p.emplace_back(bytes, bytes + n * DTypeSize(dt));
    EXPECT_TRUE(e.Release(g).ok());
  }
  out.stats = e.stats();
  out.ok = true;
  return out;
}

template <typename T>
void ExpectBitwise(const std::vector<std::vector<T>>& a, const std::vector<std::vector<T>>& b, const char* what,
                   const std::string& name) {
  ASSERT_EQ(a.size(), b.size()) << name;
  for (size_t g = 0; g < a.size(); ++g)
    EXPECT_EQ(0, std::memcmp(a[g].data(), b[g].data(), a[g].size() * sizeof(T)))
        << name << ": " << what << " of group " << g << " differs";
}

// Runs both and compares; returns the overlapped run.
Outcome Compare(const Case& c, const std::string& name) {
  const Outcome plain = RunCase(c, false), over = RunCase(c, true);
  EXPECT_TRUE(plain.ok && over.ok) << name;
  if (!plain.ok || !over.ok) return over;
  ExpectBitwise(plain.w, over.w, "the master", name);
  ExpectBitwise(plain.m, over.m, "exp_avg", name);
  ExpectBitwise(plain.v, over.v, "exp_avg_sq", name);
  ExpectBitwise(plain.p, over.p, "P", name);
  EXPECT_EQ(plain.results, over.results) << name;
  EXPECT_EQ(plain.stats.steps, over.stats.steps) << name;
  EXPECT_EQ(plain.stats.skipped_steps, over.stats.skipped_steps) << name;
  EXPECT_EQ(plain.stats.speculated_steps, 0u) << name;
  // The rooms come out of the budgets, which hold.
  EXPECT_LE(over.stats.host.peak, over.stats.host.budget) << name;
  EXPECT_LE(over.stats.nvme.peak, over.stats.nvme.budget) << name;
  EXPECT_LE(over.stats.device.peak, over.stats.device.budget) << name;
  EXPECT_EQ(plain.stats.early_updates, 0u) << name;
  EXPECT_EQ(over.stats.speculated_steps,
            over.stats.committed_steps + over.stats.replayed_steps + over.stats.discarded_steps)
      << name;
  return over;
}

struct Named {
  std::string name;
  Case c;
};

std::vector<Named> Sweep() {
  std::vector<Named> out;
  for (std::string placement : {"host", "nvme", "nvme_all"})
    for (std::string format : {"fp32", "compact"}) {
      Case c;
      c.placement = placement;
      c.format = format;
      out.push_back({placement + "/" + format, c});
    }
  return out;
}

// Clipping that never triggers: every step speculated and committed; every
// group updated before the end of backward.
TEST(Speculation, ClippingThatNeverTriggersCommitsEveryStep) {
  for (const auto& [name, c] : Sweep()) {
    const Outcome o = Compare(c, name + " never clipped");
    EXPECT_EQ(o.stats.committed_steps, static_cast<uint64_t>(c.steps)) << name;
    EXPECT_EQ(o.stats.early_updates, static_cast<uint64_t>(c.steps) * kSizes.size()) << name;
  }
}

// The policy (strata.speculation "auto"), on its own: no evidence, then one
// kept step; a clipped or skipped step stops it; more than one miss in the
// last 4 keeps it stopped; "always" and "never" do not look.
TEST(SpeculationPolicy, DecidesFromTheRecentSteps) {
  SpeculationPolicy p;
  std::string why;
  EXPECT_FALSE(p.Decide(&why));
  EXPECT_NE(why.find("no step"), std::string::npos) << why;
  p.Record(true);
  EXPECT_TRUE(p.Decide(nullptr));
  p.Record(false);
  EXPECT_FALSE(p.Decide(&why));
  EXPECT_NE(why.find("last step"), std::string::npos) << why;
  p.Record(true);  // one miss in the last 8: speculates again
  EXPECT_TRUE(p.Decide(nullptr));
  p.Record(false);
  p.Record(true);  // two misses in the last 4: not yet
  EXPECT_FALSE(p.Decide(&why));
  EXPECT_NE(why.find("more than one"), std::string::npos) << why;
  p.Record(true);  // the first miss left the window: one in the last 4
  EXPECT_TRUE(p.Decide(nullptr));
  SpeculationPolicy always(SpeculationPolicy::Mode::kAlways), never(SpeculationPolicy::Mode::kNever);
  always.Record(false);
  never.Record(true);
  EXPECT_TRUE(always.Decide(nullptr));
  EXPECT_FALSE(never.Decide(nullptr));
  SpeculationPolicy::Mode m;
  EXPECT_FALSE(SpeculationPolicy::ParseMode("sometimes", &m));
  // Declined (speculation cannot pay where the engine runs): "auto" never
  // speculates, whatever the steps say, and names the reason; "always" does.
  SpeculationPolicy declined;
  declined.Record(true);
  declined.Decline("the reason");
  EXPECT_FALSE(declined.Decide(&why));
  EXPECT_EQ(why, "the reason");
  SpeculationPolicy forced(SpeculationPolicy::Mode::kAlways);
  forced.Decline("the reason");
  EXPECT_TRUE(forced.Decide(nullptr));
}

// "auto" through the engine, bitwise the plain step in every case:
//  - clipped at every step: nothing is speculated, nothing replayed (the
//    step costs what the plain one does);
//  - never clipped: every step but the first speculates and commits;
//  - clipped at steps 2 and 3 of 8: step 0 waits for evidence, 1 commits,
//    2 replays, 3 and 4 do not speculate (the last step clipped), 5 and 6
//    do not either (two misses in the last 4), 7 commits;
// with W, M, V on NVMe, or a device of its own (the strict arena standing in
// for a GPU). In host memory without one it never speculates, clipped or
// not, and takes no more host memory than "never": its backups would cost
// what the update does.
TEST(Speculation, AutoPolicyAvoidsReplaysAndComesBack) {
  for (auto [name, c] : Sweep()) {
    c.speculation = "auto";
    if (c.placement == "host" && !strata::testing::StrictDevice()) {
      const Outcome o = Compare(c, name + " auto, host memory, never clipped");
      EXPECT_EQ(o.stats.speculated_steps, 0u) << name;
      EXPECT_EQ(o.stats.early_updates, 0u) << name;
      EXPECT_EQ(o.stats.unspeculated_steps, static_cast<uint64_t>(c.steps)) << name;
      Case never = c;
      never.speculation = "never";
      EXPECT_EQ(o.stats.host.peak, Compare(never, name + " never, host memory").stats.host.peak) << name;
      continue;
    }
    c.clip = [](int) { return 1e-3; };
    Outcome o = Compare(c, name + " auto, always clipped");
    EXPECT_EQ(o.stats.speculated_steps, 0u) << name;
    EXPECT_EQ(o.stats.replayed_steps, 0u) << name;
    EXPECT_EQ(o.stats.early_updates, 0u) << name;
    EXPECT_EQ(o.stats.unspeculated_steps, static_cast<uint64_t>(c.steps)) << name;
    c.clip = [](int) { return 1e6; };
    o = Compare(c, name + " auto, never clipped");
    EXPECT_EQ(o.stats.committed_steps, static_cast<uint64_t>(c.steps - 1)) << name;
    EXPECT_EQ(o.stats.unspeculated_steps, 1u) << name;
    c.steps = 8;
    c.clip = [](int s) { return s == 2 || s == 3 ? 1e-3 : 1e6; };
    o = Compare(c, name + " auto, clipped at steps 2 and 3");
    EXPECT_EQ(o.stats.committed_steps, 2u) << name;
    EXPECT_EQ(o.stats.replayed_steps, 1u) << name;
    EXPECT_EQ(o.stats.unspeculated_steps, 5u) << name;
  }
  Case c;
  c.speculation = "never";
  const Outcome o = Compare(c, "never");
  EXPECT_EQ(o.stats.speculated_steps, 0u);
  EXPECT_EQ(o.stats.unspeculated_steps, static_cast<uint64_t>(c.steps));
}

// G on NVMe: the early updates take G from the copy kept at its last grads
// call, so the overlapped run reads less from the disk than the plain one.
TEST(Speculation, EarlyUpdatesUseTheCopyOfG) {
  Case c;
  c.placement = "nvme";
  const Outcome plain = RunCase(c, false), over = Compare(c, "nvme copies of G");
  ASSERT_TRUE(plain.ok && over.ok);
  EXPECT_LT(over.stats.nvme_to_host, plain.stats.nvme_to_host);
}

// Clipping every step: every speculation is discarded and redone with the
// coefficient.
TEST(Speculation, ClippingEveryStepReplaysEveryStep) {
  for (auto [name, c] : Sweep()) {
    c.clip = [](int) { return 1e-3; };
    const Outcome o = Compare(c, name + " always clipped");
    EXPECT_EQ(o.stats.replayed_steps, static_cast<uint64_t>(c.steps)) << name;
    EXPECT_EQ(o.stats.committed_steps, 0u) << name;
  }
}

// Clipping on some steps (steps 1 and 3): those replay, the others commit.
TEST(Speculation, ClippingOnSomeStepsReplaysThoseOnly) {
  for (auto [name, c] : Sweep()) {
    c.clip = [](int s) { return s % 2 == 1 ? 1e-3 : 1e6; };
    const Outcome o = Compare(c, name + " sometimes clipped");
    EXPECT_EQ(o.stats.replayed_steps, 2u) << name;
    EXPECT_EQ(o.stats.committed_steps, 3u) << name;
  }
}

// No clipping, strata.nonfinite "skip": still speculative (a NaN would hold
// the step back), and committed.
TEST(Speculation, NoClippingStillSpeculatesUnderSkip) {
  Case c;
  c.clip = [](int) { return -1.0; };  // the config's: 0
  const Outcome o = Compare(c, "no clipping");
  EXPECT_EQ(o.stats.committed_steps, static_cast<uint64_t>(c.steps));
}

// With strata.nonfinite "apply" and no clipping nothing can change an early
// update: committed as it lands, not speculated.
TEST(Speculation, NothingToWaitForCommitsAtOnce) {
  Case c;
  c.clip = [](int) { return -1.0; };
  c.nonfinite = "apply";
  const Outcome o = Compare(c, "apply, no clipping");
  EXPECT_EQ(o.stats.speculated_steps, 0u);
  EXPECT_EQ(o.stats.early_updates, static_cast<uint64_t>(c.steps) * kSizes.size());
}

// A NaN in step 2's gradients (the first group of backward, so that later
// groups would still speculate if they could): the step is skipped and its
// speculation discarded; with "error", the step fails and the next goes on.
TEST(Speculation, NonFiniteGradientsDiscardTheSpeculation) {
  for (std::string policy : {"skip", "error"})
    for (std::string placement : {"host", "nvme"})
      for (int poisoned : {4, 0}) {
        Case c;
        c.placement = placement;
        c.nonfinite = policy;
        c.clip = [](int s) { return s == 3 ? 1e-3 : 1e6; };
        c.poison = [poisoned](int s) { return s == 2 ? poisoned : -1; };
        const std::string name = policy + "/" + placement + " NaN in group " + std::to_string(poisoned);
        const Outcome o = Compare(c, name);
        EXPECT_EQ(o.stats.discarded_steps, poisoned == 0 ? 1u : 0u) << name;  // group 4 comes first: nothing speculated after it
        EXPECT_EQ(o.stats.replayed_steps, 1u) << name;
        EXPECT_EQ(o.results[2].rfind(policy == "skip" ? "ok" : "error", 0), 0u) << name << ": " << o.results[2];
      }
}

// fp16 with dynamic loss scaling: an overflow (an infinite gradient) skips
// the step, lowers the scale and discards the speculation; the scale's
// growth after the window is the same too.
TEST(Speculation, Fp16OverflowDiscardsAndLowersTheScale) {
  for (std::string placement : {"host", "nvme"}) {
    Case c;
    c.placement = placement;
    c.compute = "fp16";
    c.steps = 6;
    c.poison = [](int s) { return s == 1 || s == 4 ? 0 : -1; };
    c.poison_value = INFINITY;
    c.clip = [](int s) { return s == 2 ? 1e-3 : 1e6; };
    const Outcome o = Compare(c, placement + " fp16");
    EXPECT_EQ(o.stats.skipped_steps, 2u) << placement;
    EXPECT_EQ(o.stats.discarded_steps, 2u) << placement;
    EXPECT_EQ(o.stats.replayed_steps, 1u) << placement;
  }
}

// fp16's loss scale, skipped steps, clipping and accumulation give the same
// bits in every placement (each test above compares overlapped with plain
// within one): the plain runs against each other, and the overlapped step
// where P is f16 on NVMe too (nvme_all).
TEST(Speculation, Fp16SkipsClipsAndAccumulationAreTheSameInEveryPlacement) {
  std::vector<Named> cases;
  {
    Case c;
    c.compute = "fp16";
    c.steps = 6;
    c.poison = [](int s) { return s == 1 || s == 4 ? 0 : -1; };
    c.poison_value = INFINITY;
    c.clip = [](int s) { return s == 2 ? 1e-3 : 1e6; };
    cases.push_back({"fp16 overflow and a clip", c});
  }
  {
    Case c;
    c.poison = [](int s) { return s == 2 ? 1 : -1; };
    cases.push_back({"bf16, a NaN skipped", c});
  }
  {
    Case c;
    c.accumulation = 2;
    c.clip = [](int s) { return s % 2 ? 1e-3 : 1e6; };
    cases.push_back({"accumulation 2, clipping every other step", c});
  }
  for (const Named& n : cases) {
    Case c = n.c;
    const Outcome host = RunCase(c, false);
    ASSERT_TRUE(host.ok) << n.name;
    // (The cases do what they say: the overflows and the NaN skip steps.)
    const uint64_t skips = n.name.find("overflow") != std::string::npos ? 2 : n.name.find("NaN") != std::string::npos ? 1 : 0;
    EXPECT_EQ(host.stats.skipped_steps, skips) << n.name;
    for (std::string placement : {"nvme", "nvme_all"}) {
      c.placement = placement;
      const std::string name = n.name + ", " + placement + " against host";
      const Outcome o = RunCase(c, false);
      ASSERT_TRUE(o.ok) << name;
      ExpectBitwise(host.w, o.w, "the master", name);
      ExpectBitwise(host.m, o.m, "exp_avg", name);
      ExpectBitwise(host.v, o.v, "exp_avg_sq", name);
      ExpectBitwise(host.p, o.p, "P", name);
      EXPECT_EQ(host.results, o.results) << name;
    }
    Compare(c, n.name + ", nvme_all overlapped");  // (c.placement is nvme_all here)
  }
}

// Gradient accumulation: only the last micro-batch's gradients complete a
// group, and the updates are still exact.
TEST(Speculation, GradientAccumulation) {
  for (std::string placement : {"host", "nvme"}) {
    Case c;
    c.placement = placement;
    c.accumulation = 2;
    c.clip = [](int s) { return s == 1 ? 1e-3 : 1e6; };
    const Outcome o = Compare(c, placement + " accumulation 2");
    EXPECT_EQ(o.stats.replayed_steps, 1u) << placement;
    EXPECT_EQ(o.stats.committed_steps, 4u) << placement;
  }
}

// Every ZeRO stage on one rank, fp32 compute (P a copy of W).
TEST(Speculation, EveryStageAndFp32Compute) {
  for (int stage = 0; stage <= 3; ++stage) {
    Case c;
    c.stage = stage;
    c.compute = stage % 2 ? "fp32" : "bf16";
    c.clip = [](int s) { return s == 2 ? 1e-3 : 1e6; };
    const Outcome o = Compare(c, "stage " + std::to_string(stage));
    EXPECT_EQ(o.stats.replayed_steps, 1u) << stage;
  }
}

// A room for about two groups: the rest update after backward; still exact.
TEST(Speculation, ARoomTooSmallSpeculatesSomeGroups) {
  for (std::string placement : {"host", "nvme"}) {
    Case c;
    c.placement = placement;
    c.extra_strata = placement == "host" ? R"("speculation_host_bytes": 300000, )" : R"("speculation_disk_bytes": 300000, )";
    c.clip = [](int s) { return s == 1 ? 1e-3 : 1e6; };
    const Outcome o = Compare(c, placement + " small room");
    EXPECT_GT(o.stats.early_updates, 0u) << placement;
    EXPECT_LT(o.stats.early_updates, static_cast<uint64_t>(c.steps) * kSizes.size()) << placement;
  }
  Case none;
  none.extra_strata = R"("speculation_host_bytes": 0, )";
  const Outcome o = Compare(none, "no room");
  EXPECT_EQ(o.stats.early_updates, 0u);
}

// A group touched after its gradients were complete (read_state, a fetch,
// more gradients: torch-style accumulation, a forward before the step)
// undoes the step's speculation: the call sees the old values and goes on,
// the step updates every group after backward, and the result is the
// run without overlap making the same calls. Where the early updates were
// final (nothing could change them), such a call is STATE.
TEST(Speculation, TouchingATakenGroupUndoesTheSpeculation) {
  for (std::string placement : {"host", "nvme"}) {
    Case c;
    c.placement = placement;
    std::vector<std::vector<float>> masters[2];
    EngineStats stats[2];
    for (int overlap = 0; overlap < 2; ++overlap) {
      TempDir dir;
      EngineOptions eo;
      eo.overlap_step = overlap == 1;
      std::unique_ptr<Engine> made = MakeBuilt(c, dir.path(), eo, 0.25f);
      ASSERT_TRUE(made);
      Engine& e = *made;
      for (int s = 0; s < 3; ++s) {
        if (overlap) {
          ASSERT_TRUE(e.PrepareStep(OptionsOf(c, s)).ok());
        }
        for (int g = 4; g >= 0; --g) {
          std::vector<float> grad = GradsOf(kSizes[static_cast<size_t>(g)], s, 0, g);
          ASSERT_TRUE(e.Grads(g, grad.data(), DType::kF32).ok());
          if (g != 2) continue;
          // Groups 4..2 are taken (or being updated) by now.
          std::vector<float> before(kSizes[4]);
          if (s == 0) {
            ASSERT_TRUE(e.ReadMaster(4, before.data()).ok());
            EXPECT_EQ(before[0], 0.25f) << placement << ": read_state saw a speculative update";
          } else if (s == 1) {
            auto p = e.Fetch(3);
            ASSERT_TRUE(p.ok()) << p.status().ToString();
            ASSERT_TRUE(e.Release(3).ok());
          } else {
            const std::vector<float> more = GradsOf(kSizes[4], s, 1, 4);
            ASSERT_TRUE(e.Grads(4, more.data(), DType::kF32).ok());  // one more backward's worth
          }
        }
        auto r = e.Step(OptionsOf(c, s));
        ASSERT_TRUE(r.ok()) << r.status().ToString();
      }
      for (int g = 0; g < 5; ++g) {
        masters[overlap].emplace_back(kSizes[static_cast<size_t>(g)]);
        ASSERT_TRUE(e.ReadMaster(g, masters[overlap].back().data()).ok());
      }
      stats[overlap] = e.stats();
    }
    ExpectBitwise(masters[0], masters[1], "the master", placement);
    EXPECT_EQ(stats[1].speculated_steps, 3u) << placement;
    EXPECT_EQ(stats[1].replayed_steps, 3u) << placement;
  }
  // Final early updates: STATE, and the step goes on.
  Case c;
  c.nonfinite = "apply";
  c.clip = [](int) { return -1.0; };
  TempDir dir;
  EngineOptions eo;
  eo.overlap_step = true;
  auto made = Engine::Create(*ParseConfig(Json(c, dir.path())), eo);
  ASSERT_TRUE(made.ok());
  Engine& e = **made;
  std::vector<float> init(kSizes[0], 0.25f), out(kSizes[0]);
  ASSERT_TRUE(e.AddParam(0, "p0", kSizes[0], init.data()).ok());
  ASSERT_TRUE(e.Build().ok());
  ASSERT_TRUE(e.PrepareStep(OptionsOf(c, 0)).ok());
  std::vector<float> grad = GradsOf(kSizes[0], 0, 0, 0);
  ASSERT_TRUE(e.Grads(0, grad.data(), DType::kF32).ok());
  EXPECT_EQ(e.ReadMaster(0, out.data()).code(), Code::kState);
  EXPECT_EQ(e.Fetch(0).status().code(), Code::kState);
  Status more = e.Grads(0, grad.data(), DType::kF32);
  EXPECT_EQ(more.code(), Code::kState);
  EXPECT_NE(more.message().find("call step first"), std::string::npos) << more.ToString();
  EXPECT_TRUE(e.Step(OptionsOf(c, 0)).ok());
}

// Options changed after prepare_step (an LR schedule stepped late): the
// speculation is redone with step's options.
TEST(Speculation, OtherOptionsAtTheStepReplay) {
  Case c;
  c.lr_at_step = [](int s) { return s == 2 ? 0.5 : 1.0; };
  const Outcome o = Compare(c, "lr changed at step 2");
  EXPECT_EQ(o.stats.replayed_steps, 1u);
  EXPECT_EQ(o.stats.committed_steps, 4u);
}

// skip_groups_without_grads: each group's own update count (bias correction).
TEST(Speculation, GroupsWithoutGradients) {
  Case c;
  c.skip_gradless = true;
  c.gradless = [](int s) { return s % 3; };
  c.clip = [](int s) { return s == 4 ? 1e-3 : 1e6; };
  const Outcome o = Compare(c, "gradless groups");
  EXPECT_EQ(o.stats.replayed_steps, 1u);
}

// A disk that fails under the speculation (its reads, or its writes, from
// the k-th on, during backward and the step): the speculation of the groups
// it hit is undone, the step redoes them (failing, then finished by the
// next call while the disk is bad through the step), and the result is the
// clean run's, bitwise.
TEST(Speculation, ADiskFaultDuringSpeculationStaysExact) {
  Case c;
  c.placement = "nvme";
  c.clip = [](int s) { return s == 3 ? 1e-3 : 1e6; };
  const Outcome clean = RunCase(c, false);
  ASSERT_TRUE(clean.ok);
  int fired = 0;
  for (FaultPlan::Ops ops : {FaultPlan::Ops::kReads, FaultPlan::Ops::kWrites})
    for (uint64_t skip : {0, 3, 9}) {
      auto faults = std::make_shared<FaultPlan>();
      auto arm = [&](int s, FaultPlan& f) {
        if (s == 2) f.Arm(ops, EIO, skip, /*count=*/2);
      };
      const Outcome o = RunCase(c, true, faults, arm);
      ASSERT_TRUE(o.ok);
      fired += faults->fired() > 0;
      const std::string name = std::string(ops == FaultPlan::Ops::kReads ? "reads" : "writes") + " from " +
                               std::to_string(skip);
      ExpectBitwise(clean.w, o.w, "the master", name);
      ExpectBitwise(clean.m, o.m, "exp_avg", name);
      ExpectBitwise(clean.p, o.p, "P", name);
    }
  EXPECT_GE(fired, 4) << "too few faults fired";
}

// A speculative update whose W, M or V store fails after it wrote P in
// place (P in host memory, a copy of W), in a step that is then skipped (a
// NaN in the group handed last): P must be rewritten from the restored W.
// Before, the failed update's P stayed while W, M, V were the old ones, and
// the next forward read parameters of an update that never happened.
TEST(Speculation, AFailedSpeculationBeforeASkippedStepLeavesPAsW) {
  Case c;
  c.placement = "nvme";  // W, M, V on NVMe (their stores fail), P in host memory
  c.steps = 3;
  c.poison = [](int s) { return s == 2 ? 0 : -1; };  // group 0, handed last: the step is skipped
  const Outcome clean = RunCase(c, false);
  ASSERT_TRUE(clean.ok);
  ASSERT_EQ(clean.results.back().rfind("ok ", 0), 0u) << clean.results.back();
  int fired = 0;
  // G is on NVMe too: a failed G store is retried by RunCase; the writes of
  // the speculation (W, M, V of the groups handed first) fail among them.
  for (uint64_t skip : {1, 2, 3, 4, 6}) {
    auto faults = std::make_shared<FaultPlan>();
    auto arm = [&](int s, FaultPlan& f) {
      if (s == 2) f.Arm(FaultPlan::Ops::kWrites, EIO, skip, /*count=*/3);
    };
    const Outcome o = RunCase(c, true, faults, arm);
    ASSERT_TRUE(o.ok);
    fired += faults->fired() > 0;
    const std::string name = "writes from " + std::to_string(skip);
    EXPECT_NE(o.results.back().find(" 1 "), std::string::npos) << name << ": the last step is skipped: "
                                                                << o.results.back();
    ExpectBitwise(clean.w, o.w, "the master", name);
    ExpectBitwise(clean.p, o.p, "P", name);
  }
  EXPECT_GE(fired, 1) << "no speculative write failed: the case tests nothing";
}

using testing::OnRanks;

// Several ranks (Gloo): each rank speculates on its shard once that
// shard's reduction is complete; the norm and finiteness are agreed over the
// ranks, so every rank commits, replays or discards together, and each rank
// ends bitwise as without overlap. A NaN on one rank's gradients reaches
// the shard of some rank only; the others learn it from the agreed sum.
TEST(Speculation, SeveralRanks) {
  struct RankCase {
    int world, stage;
    std::string placement;
    bool overlap_comm;
  };
  const std::vector<RankCase> cases = {{2, 0, "host", false}, {2, 1, "nvme", true},  {2, 2, "host", true},
                                       {2, 3, "nvme", false}, {2, 3, "host", true},  {4, 1, "host", false},
                                       {4, 2, "nvme", true},  {4, 3, "host", true}};
  for (const RankCase& rc : cases) {
    Case c;
    c.stage = rc.stage;
    c.placement = rc.placement;
    c.overlap_comm = rc.overlap_comm;
    c.steps = 5;
    c.clip = [](int s) { return s == 1 ? 1e-3 : 1e6; };
    c.poison = [](int s) { return s == 3 ? 1 : -1; };
    const std::string name = std::to_string(rc.world) + " ranks, stage " + std::to_string(rc.stage) + " " +
                             rc.placement + (rc.overlap_comm ? " overlap_comm" : "");
    std::vector<Outcome> plain(static_cast<size_t>(rc.world)), over(static_cast<size_t>(rc.world));
    OnRanks(rc.world, [&](int, net::Communicator& comm) {
      plain[static_cast<size_t>(comm.rank())] = RunCase(c, false, nullptr, nullptr, &comm);
    });
    OnRanks(rc.world, [&](int, net::Communicator& comm) {
      over[static_cast<size_t>(comm.rank())] = RunCase(c, true, nullptr, nullptr, &comm);
    });
    for (int r = 0; r < rc.world; ++r) {
      const Outcome& a = plain[static_cast<size_t>(r)];
      const Outcome& b = over[static_cast<size_t>(r)];
      const std::string who = name + " rank " + std::to_string(r);
      ASSERT_TRUE(a.ok && b.ok) << who;
      ExpectBitwise(a.w, b.w, "the master", who);
      ExpectBitwise(a.m, b.m, "exp_avg", who);
      ExpectBitwise(a.v, b.v, "exp_avg_sq", who);
      ExpectBitwise(a.p, b.p, "P", who);
      EXPECT_EQ(a.results, b.results) << who;
      EXPECT_EQ(b.stats.replayed_steps, 1u) << who;
      EXPECT_EQ(b.stats.committed_steps, 3u) << who;
      EXPECT_EQ(b.stats.skipped_steps, 1u) << who;
      EXPECT_GT(b.stats.early_updates, 0u) << who;
    }
  }
}

// A peer lost in the middle of a speculated backward (stage 2, the
// reduction on its own thread, state on NVMe): the survivor fails loudly,
// naming what it waited for, within the timeout, and goes down with its
// speculation held (nothing of it published); a restart of both ranks from
// the checkpoint before that step ends bitwise as a run that never failed.
TEST(Speculation, ALostPeerMidBackwardThenARestartIsExact) {
  Case c;
  c.stage = 2;
  c.placement = "nvme";
  c.overlap_comm = true;
  c.clip = [](int s) { return s == 1 ? 1e-3 : 1e6; };
  TempDir ckpt;
  std::vector<Outcome> clean(2), resumed(2);
  OnRanks(2, [&](int, net::Communicator& comm) { clean[static_cast<size_t>(comm.rank())] = RunCase(c, false, nullptr, nullptr, &comm); });
  std::vector<std::string> failures(2);
  OnRanks(2, [&](int, net::Communicator& comm) {
    const int rank = comm.rank();
    TempDir dir;
    EngineOptions eo;
    eo.overlap_step = true;
    eo.comm = &comm;
    eo.rank = rank;
    eo.world_size = 2;
    std::unique_ptr<Engine> made = MakeBuilt(c, dir.path(), eo, 0, [](Config& cfg) { cfg.strata.timeout_s = 20; });
    ASSERT_TRUE(made);
    Engine& e = *made;
    const int groups = static_cast<int>(kSizes.size());
    for (int s = 0; s < 3; ++s) {
      ASSERT_TRUE(e.PrepareStep(OptionsOf(c, s)).ok());
      for (int g = 0; g < groups; ++g) {
        ASSERT_TRUE(e.Fetch(g).ok());
        ASSERT_TRUE(e.Release(g).ok());
      }
      Status first_error;
      for (int g = groups - 1; g >= 0; --g) {
        if (s == 2 && rank == 1 && g == 2) return;  // lost: its engine and communicator go
        std::vector<float> grad = GradsOf(kSizes[static_cast<size_t>(g)], s, 0, g, rank);
        Status st = e.Grads(g, grad.data(), DType::kF32);
        if (first_error.ok() && !st.ok()) first_error = st;
      }
      auto r = e.Step(OptionsOf(c, s));
      if (s < 2) {
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        if (s == 1) {
          ASSERT_TRUE(e.SaveCheckpoint(ckpt.path(), "t", nullptr, 0).ok());
        }
        continue;
      }
      EXPECT_FALSE(r.ok()) << "rank 0 stepped without its peer";
      failures[0] = (first_error.ok() ? r.status() : first_error).ToString();
      EXPECT_GT(e.stats().early_updates, 0u);
    }
  }, /*timeout_s=*/20);  // also bounds the rendezvous and steps 0-1: generous for a loaded machine
  EXPECT_TRUE(failures[0].find("COMM") != std::string::npos || failures[0].find("TIMEOUT") != std::string::npos)
      << failures[0];
  EXPECT_NE(failures[0].find("rank"), std::string::npos) << failures[0];
  OnRanks(2, [&](int, net::Communicator& comm) {
    resumed[static_cast<size_t>(comm.rank())] = RunCase(c, true, nullptr, nullptr, &comm, {ckpt.path(), 2});
  });
  for (int r = 0; r < 2; ++r) {
    const std::string who = "rank " + std::to_string(r);
    ASSERT_TRUE(clean[static_cast<size_t>(r)].ok && resumed[static_cast<size_t>(r)].ok) << who;
    ExpectBitwise(clean[static_cast<size_t>(r)].w, resumed[static_cast<size_t>(r)].w, "the master", who);
    ExpectBitwise(clean[static_cast<size_t>(r)].m, resumed[static_cast<size_t>(r)].m, "exp_avg", who);
    ExpectBitwise(clean[static_cast<size_t>(r)].p, resumed[static_cast<size_t>(r)].p, "P", who);
  }
}

// An engine destroyed with its speculation held (mid-backward, or after a
// failed step) undoes it while its blocks still exist, and the swap folder
// serves the next engine.
TEST(Speculation, DestroyedWithASpeculationHeld) {
  for (std::string placement : {"host", "nvme"}) {
    TempDir dir;
    Case c;
    c.placement = placement;
    for (int round = 0; round < 2; ++round) {
      EngineOptions eo;
      eo.overlap_step = true;
      std::unique_ptr<Engine> made = MakeBuilt(c, dir.path(), eo, 0.5f);
      ASSERT_TRUE(made);
      Engine& e = *made;
      ASSERT_TRUE(e.PrepareStep(OptionsOf(c, 0)).ok());
      for (int g = 4; g >= 2; --g) {
        std::vector<float> grad = GradsOf(kSizes[static_cast<size_t>(g)], 0, 0, g);
        ASSERT_TRUE(e.Grads(g, grad.data(), DType::kF32).ok());
      }
      made.reset();  // groups 4..2 speculated (or being), never stepped
    }
  }
}

// A room larger than the host budget has left is refused at build, naming the key.
TEST(Speculation, ARoomBeyondTheHostBudgetIsRefused) {
  TempDir dir;
  Case c;
  c.extra_strata = R"("speculation_host_bytes": "1GiB", )";
  EngineOptions eo;
  eo.overlap_step = true;
  auto cfg = ParseConfig(Json(c, dir.path()));
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  auto e = Engine::Create(*cfg, eo);
  ASSERT_TRUE(e.ok());
  std::vector<float> init(1000, 0.5f);
  ASSERT_TRUE((*e)->AddParam(0, "p", 1000, init.data()).ok());
  Status b = (*e)->Build();
  EXPECT_FALSE(b.ok());
  EXPECT_NE(b.message().find("strata.speculation_host_bytes"), std::string::npos) << b.ToString();
}

}  // namespace
}  // namespace strata
