// One grads call given in parts (Engine::GradsPart, GradsEnd): each part
// straight into G, the call then bitwise one Grads of the gradient the parts
// make (zeros where none gave, a part given again added) — the global norm,
// the clipping and every update — with or without the overlapped step; the
// caller's errors refused, naming them, before anything is written; and
// GradsView reading G as the step will.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "engine/engine.h"
#include "tests/engine/engine_test_util.h"
#include "kernels/cpu/parallel.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using testing::TempDir;

constexpr uint64_t T = kernels::kReduceTile;
// Group 0 spans tiles (parts crossing and filling them, a short last tile),
// group 1 is smaller than one tile.
const uint64_t kNumel[2] = {3 * T + 5001, 4000};

std::string Json(const std::string& offload, const std::string& swap, const std::string& accum) {
  const std::string grad_home = offload == "nvme" ? R"(, "grad_home": "nvme")" : "";
  return R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.05}},
    "data_types": {"grad_accum_dtype": ")" + accum + R"("},
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": ")" + offload + R"(", "nvme_path": ")" + swap + R"("},
      "offload_param": {"device": "cpu"}},
    "strata": {"host_budget": "64MiB", "device_budget": "64MiB")" + grad_home + "}}";
}

// The two groups' initial values.
std::vector<std::vector<float>> Values() {
  std::vector<std::vector<float>> values(2);
  for (int g = 0; g < 2; ++g) {
    values[g].resize(kNumel[g]);
    for (uint64_t i = 0; i < kNumel[g]; ++i)
      values[g][i] = 0.2f * std::sin(0.01f * static_cast<float>(i * (g + 3) + 1));
  }
  return values;
}

// A fresh swap folder under `dir` for each engine.
std::string Swap(const std::string& dir, const char* prefix) {
  static int made = 0;
  const std::string swap = dir + "/" + prefix + std::to_string(made++);
  std::filesystem::create_directories(swap);
  return swap;
}

std::unique_ptr<Engine> Make(const std::string& dir, bool overlap, const std::string& offload = "cpu",
                             const std::string& accum = "fp32") {
  const std::string swap = Swap(dir, "e");
  EngineOptions eo;
  eo.force_no_gpu = true;
  eo.overlap_step = overlap;
  return strata::testing::BuiltEngine(Json(offload, swap, accum), eo, Values());
}

std::vector<float> GradOf(Engine& e, int g, int k) { return strata::testing::GradOfFetched(e, g, k); }

struct Part {
  uint64_t first, count;
  bool twice;  // given again (added)
};

// Group 0's parts: unaligned, one over several tiles whole, one ending a
// tile, a gap left (zeros), the group's last elements, one given twice.
std::vector<Part> Parts0() {
  return {{T * 2 + 100, T + 4901, false},  // to the end: the short last tile summed while copied
          {0, 777, false},
          {777, 2 * T - 777 + 3, true},  // crosses tile 1 whole; ends 3 into tile 2
          {2 * T + 3, 60, false}};       // [2T+63, 2T+100): no part: zeros
}
std::vector<Part> Parts1() { return {{1000, 3000, false}, {0, 999, true}}; }  // element 999: zero

// What the parts make as one gradient: gaps zero, a twice-given part added
// to itself in fp32 (as G adds).
std::vector<float> Assembled(const std::vector<float>& grad, const std::vector<Part>& parts) {
  std::vector<float> out(grad.size(), 0.0f);
  for (const Part& p : parts)
    for (uint64_t i = p.first; i < p.first + p.count; ++i) out[i] = p.twice ? grad[i] + grad[i] : grad[i];
  return out;
}

void Hand(Engine& e, int g, const std::vector<float>& grad, const std::vector<Part>& parts) {
  for (const Part& p : parts) {
    ASSERT_TRUE(e.GradsPart(g, p.first, p.count, grad.data() + p.first, DType::kF32).ok());
    if (p.twice) {
      const Status st = e.GradsPart(g, p.first, p.count, grad.data() + p.first, DType::kF32);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
  }
  const Status st = e.GradsEnd(g);
  ASSERT_TRUE(st.ok()) << st.ToString();
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

std::vector<float> Read(Engine& e, int g, Engine::OptimizerState s) {
  std::vector<float> out(e.group_numel(g));
  EXPECT_TRUE(e.ReadState(g, s, out.data()).ok());
  return out;
}

class GradParts : public ::testing::TestWithParam<bool> {};  // overlap_step

// Four steps, clipped (max_grad_norm below the norm, so the coefficient
// depends on every bit of it), in parts (after a first whole one) and
// whole: G, the norm Step reports and every state bitwise equal.
TEST_P(GradParts, BitwiseOneGradsCallOfTheAssembledGradient) {
  TempDir dir;
  auto parts = Make(dir.path(), GetParam()), whole = Make(dir.path(), GetParam());
  ASSERT_TRUE(parts && whole);
  for (int g = 0; g < 2; ++g) EXPECT_EQ(parts->WhyNoGradParts(g, DType::kF32), "");
  StepOptions so;
  so.max_grad_norm = 0.75;
  for (int k = 0; k < 4; ++k) {
    if (GetParam()) {
      ASSERT_TRUE(parts->PrepareStep(so).ok());
      ASSERT_TRUE(whole->PrepareStep(so).ok());
    }
    for (int g : {1, 0}) {
      const std::vector<Part> ps = g == 0 ? Parts0() : Parts1();
      const std::vector<float> gp = GradOf(*parts, g, k), gw = GradOf(*whole, g, k);
      ASSERT_TRUE(SameBits(gp, gw)) << "step " << k << ": the engines' parameters differ before it";
      // Step 0 hands the whole gradient to both: G then holds values where
      // the later steps' parts leave gaps, which must read as zeros.
      const std::vector<float> a = k == 0 ? gw : Assembled(gw, ps);
      if (k == 0) {
        ASSERT_TRUE(parts->Grads(g, gp.data(), DType::kF32).ok());
      } else {
        Hand(*parts, g, gp, ps);
      }
      ASSERT_TRUE(whole->Grads(g, a.data(), DType::kF32).ok());
      auto view = parts->GradsView(g);
      ASSERT_TRUE(view.ok()) << view.status().ToString();
      EXPECT_EQ(std::memcmp(*view, a.data(), a.size() * 4), 0) << "G of group " << g << " after step " << k;
    }
    auto np = parts->GradNorm(), nw = whole->GradNorm();
    ASSERT_TRUE(np.ok() && nw.ok());
    EXPECT_EQ(*np, *nw) << "step " << k;
    auto rp = parts->Step(so), rw = whole->Step(so);
    ASSERT_TRUE(rp.ok()) << rp.status().ToString();
    ASSERT_TRUE(rw.ok()) << rw.status().ToString();
    EXPECT_EQ(rp->grad_norm, rw->grad_norm) << "step " << k;
    EXPECT_GT(rp->grad_norm, so.max_grad_norm) << "the test means the step to clip";
  }
  for (int g = 0; g < 2; ++g)
    for (auto s : {Engine::OptimizerState::kMaster, Engine::OptimizerState::kExpAvg,
                   Engine::OptimizerState::kExpAvgSq})
      EXPECT_TRUE(SameBits(Read(*parts, g, s), Read(*whole, g, s))) << "group " << g << " state " << int(s);
}

INSTANTIATE_TEST_SUITE_P(Overlap, GradParts, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "overlap" : "plain"; });

bool Says(const Status& st, Code code, const std::string& what) {
  return st.code() == code && st.message().find(what) != std::string::npos;
}

// The caller's errors are refused, naming them, and leave the hand as it
// was: the step after them is the clean run's.
TEST(GradParts, RefusesTheCallersErrorsAndTheStepWhileOpen) {
  TempDir dir;
  auto e = Make(dir.path(), false), clean = Make(dir.path(), false);
  ASSERT_TRUE(e && clean);
  const std::vector<float> g0 = GradOf(*e, 0, 0), g1 = GradOf(*e, 1, 0);
  const uint64_t n0 = kNumel[0];
  EXPECT_TRUE(Says(e->GradsEnd(0), Code::kState, "no grads call in parts open"));
  EXPECT_TRUE(Says(e->GradsView(0).status(), Code::kState, "no gradients this step"));
  ASSERT_TRUE(e->GradsPart(0, 10, 100, g0.data() + 10, DType::kF32).ok());
  EXPECT_TRUE(Says(e->GradsPart(0, 50, 100, g0.data() + 50, DType::kF32), Code::kInvalid, "overlap the part [10, 110)"));
  EXPECT_TRUE(Says(e->GradsPart(0, 0, 11, g0.data(), DType::kF32), Code::kInvalid, "overlap the part [10, 110)"));
  EXPECT_TRUE(Says(e->GradsPart(0, n0 - 5, 6, g0.data(), DType::kF32), Code::kInvalid, "outside group 0"));
  EXPECT_TRUE(Says(e->GradsPart(0, 200, 10, g0.data() + 200, DType::kBF16), Code::kInvalid, "bf16"));
  EXPECT_TRUE(Says(e->Grads(0, g0.data(), DType::kF32), Code::kInvalid, "group 0 has a grads call in parts open"));
  EXPECT_TRUE(Says(e->GradsView(0).status(), Code::kInvalid, "parts open"));
  EXPECT_TRUE(Says(e->GradNorm().status(), Code::kInvalid, "group 0 has a grads call in parts open"));
  EXPECT_TRUE(Says(e->Step(StepOptions{}).status(), Code::kInvalid, "group 0 has a grads call in parts open"));
  // As the C guide says: INVALID naming the open call, and named as the call made.
  EXPECT_TRUE(Says(e->PrepareStep(StepOptions{}), Code::kInvalid, "prepare_step: group 0 has a grads call in parts open"));
  EXPECT_TRUE(Says(e->DiscardGrads(), Code::kInvalid, "discard_grads: group 0 has a grads call in parts open"));
  // The calls made between steps only: an open call is a step's gradients
  // pending, as a whole grads call is (they went through).
  TempDir ckpt;
  EXPECT_TRUE(Says(e->SaveCheckpoint(ckpt.path(), "t", nullptr, 0), Code::kInvalid, "parts open"));
  const std::vector<float> w = Read(*e, 1, Engine::OptimizerState::kMaster);
  EXPECT_TRUE(Says(e->WriteState(1, Engine::OptimizerState::kMaster, w.data()), Code::kInvalid, "parts open"));
  EXPECT_TRUE(Says(e->SetStepsApplied(7), Code::kState, "pending"));
  double one = 1;
  EXPECT_TRUE(Says(e->SumOverRanks(&one, 1), Code::kState, "pending"));
  ASSERT_TRUE(e->GradsPart(0, 0, 10, g0.data(), DType::kF32).ok());
  ASSERT_TRUE(e->GradsPart(0, 110, n0 - 110, g0.data() + 110, DType::kF32).ok());
  ASSERT_TRUE(e->GradsEnd(0).ok());
  EXPECT_TRUE(Says(e->GradsPart(0, 0, 10, g0.data(), DType::kF32), Code::kInvalid, "already has gradients"));
  ASSERT_TRUE(e->Grads(1, g1.data(), DType::kF32).ok());
  ASSERT_TRUE(clean->Grads(0, g0.data(), DType::kF32).ok());
  ASSERT_TRUE(clean->Grads(1, g1.data(), DType::kF32).ok());
  auto r = e->Step(StepOptions{}), rc = clean->Step(StepOptions{});
  ASSERT_TRUE(r.ok() && rc.ok());
  EXPECT_EQ(r->grad_norm, rc->grad_norm);
  EXPECT_TRUE(SameBits(Read(*e, 0, Engine::OptimizerState::kMaster), Read(*clean, 0, Engine::OptimizerState::kMaster)));
}

// A load abandons a grads call in parts left open (a backward that raised
// part-way, or an engine broken mid-backward: the load is its way out), as
// it abandons a failed step; the engine then takes gradients whole again.
TEST(GradParts, ALoadAbandonsAnOpenCall) {
  TempDir dir, ckpt;
  auto e = Make(dir.path(), false);
  ASSERT_TRUE(e);
  const std::vector<float> g0 = GradOf(*e, 0, 0), g1 = GradOf(*e, 1, 0);
  ASSERT_TRUE(e->SaveCheckpoint(ckpt.path(), "t", nullptr, 0).ok());
  ASSERT_TRUE(e->GradsPart(0, 10, 100, g0.data() + 10, DType::kF32).ok());
  const Status load = e->LoadCheckpoint(ckpt.path(), "t", nullptr);
  ASSERT_TRUE(load.ok()) << load.ToString();
  ASSERT_TRUE(e->Grads(0, g0.data(), DType::kF32).ok());
  ASSERT_TRUE(e->Grads(1, g1.data(), DType::kF32).ok());
  EXPECT_TRUE(e->Step(StepOptions{}).ok());
}

// Where G is not host memory of the parts' dtype, the group says why and a
// part is refused with it (grads takes the group whole).
TEST(GradParts, SaysWhyAGroupTakesNoParts) {
  TempDir dir;
  auto bf = Make(dir.path(), false, "cpu", "bf16");
  ASSERT_TRUE(bf);
  EXPECT_EQ(bf->WhyNoGradParts(0, DType::kBF16), "");
  EXPECT_NE(bf->WhyNoGradParts(0, DType::kF32).find("accumulator of bf16"), std::string::npos);
  EXPECT_NE(bf->WhyNoGradParts(7, DType::kBF16).find("group 7 is not in 0..1"), std::string::npos);
  const std::vector<float> g0(kNumel[0], 0.25f);
  EXPECT_TRUE(Says(bf->GradsPart(0, 0, 4, g0.data(), DType::kF32), Code::kInvalid, "grads takes the group whole"));
  auto nvme = Make(dir.path(), false, "nvme");  // G homed on NVMe (strata.grad_home)
  ASSERT_TRUE(nvme);
  EXPECT_NE(nvme->WhyNoGradParts(0, DType::kF32).find("not in host memory"), std::string::npos);
  EXPECT_TRUE(Says(nvme->GradsPart(0, 0, 4, g0.data(), DType::kF32), Code::kInvalid, "not in host memory"));
  ASSERT_TRUE(nvme->Grads(0, g0.data(), DType::kF32).ok());
  EXPECT_TRUE(Says(nvme->GradsView(0).status(), Code::kInvalid, "not in host memory"));
}

// ---- Parts lent (GradsPart with lend): read where the caller has them ----------

// An engine for lending: W, M, V host-homed ("cpu": parts lent), or on
// NVMe in units that cut across the parts ("nvme", G in host memory: parts
// copied).
std::unique_ptr<Engine> MakeLend(const std::string& dir, bool overlap, const std::string& offload,
                                 const std::string& extra = "") {
  const std::string swap = Swap(dir, "l");
  EngineOptions eo;
  eo.force_no_gpu = true;
  eo.overlap_step = overlap;
  const std::string json = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.05}},
    "zero_optimization": {"stage": 3, "sub_group_size": 50000,
      "offload_optimizer": {"device": ")" + offload + R"(", "nvme_path": ")" + swap + R"("},
      "offload_param": {"device": "cpu"}},
    "strata": {"host_budget": "64MiB", "device_budget": "64MiB", "grad_home": "host", "write_behind": "never")" + extra + "}}";
  return strata::testing::BuiltEngine(json, eo, Values());
}

// The parts of `grad`, lent from `buf` (a copy the test owns, as a caller's
// tensor), a part given twice lent again.
void Lend(Engine& e, int g, std::vector<float>& buf, const std::vector<float>& grad, const std::vector<Part>& parts) {
  buf = grad;
  for (const Part& p : parts) {
    for (int k = 0; k < (p.twice ? 2 : 1); ++k) {
      const Status st = e.GradsPart(g, p.first, p.count, buf.data() + p.first, DType::kF32, /*lend=*/true);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
  }
  const Status st = e.GradsEnd(g);
  ASSERT_TRUE(st.ok()) << st.ToString();
}

void ExpectSameState(Engine& a, Engine& b, const std::string& what) {
  for (int g = 0; g < 2; ++g)
    for (auto s : {Engine::OptimizerState::kMaster, Engine::OptimizerState::kExpAvg,
                   Engine::OptimizerState::kExpAvgSq})
      EXPECT_TRUE(SameBits(Read(a, g, s), Read(b, g, s))) << what << ": group " << g << " state " << int(s);
}

// The group's parts, none given twice (a part given again copies the
// group's lent parts in: none would be left for the step to read).
std::vector<Part> Once(int g) {
  std::vector<Part> ps = g == 0 ? Parts0() : Parts1();
  for (Part& p : ps) p.twice = false;
  return ps;
}

struct LendCase {
  std::string offload;
  bool overlap;
};

class LentParts : public ::testing::TestWithParam<LendCase> {};

// Four clipped steps, lent against copied: the norm and every state
// bitwise; each step's lent buffers are scribbled over once it returns (the
// engine reads none of them after); G read through GradsView before the
// step, a part given again and a second grads call copy them in first.
TEST_P(LentParts, BitwiseTheCopiedPartsRun) {
  TempDir dir;
  const LendCase& c = GetParam();
  auto lent = MakeLend(dir.path(), c.overlap, c.offload), copied = MakeLend(dir.path(), c.overlap, c.offload);
  ASSERT_TRUE(lent && copied);
  StepOptions so;
  so.max_grad_norm = 0.75;
  std::vector<float> bufs[2];
  for (int k = 0; k < 4; ++k) {
    if (c.overlap) {
      ASSERT_TRUE(lent->PrepareStep(so).ok());
      ASSERT_TRUE(copied->PrepareStep(so).ok());
    }
    for (int g : {1, 0}) {
      // Steps 0 and 2 leave parts lent for the step to read; 1 and 3 give a
      // part again; 1 and 2 read G through GradsView; 0 adds a second grads
      // call (plain step only: overlapped, it would undo early updates).
      const std::vector<Part> ps = k % 2 == 0 ? Once(g) : g == 0 ? Parts0() : Parts1();
      const std::vector<float> gl = GradOf(*lent, g, k), gc = GradOf(*copied, g, k);
      ASSERT_TRUE(SameBits(gl, gc)) << "step " << k << ": the engines' parameters differ before it";
      Lend(*lent, g, bufs[g], gl, ps);
      Hand(*copied, g, gc, ps);
      if (k == 1 || k == 2) {
        auto view = lent->GradsView(g);
        ASSERT_TRUE(view.ok()) << view.status().ToString();
        const std::vector<float> a = Assembled(gc, ps);
        EXPECT_EQ(std::memcmp(*view, a.data(), a.size() * 4), 0) << "G of group " << g << " as lent";
      }
      if (k == 0 && !c.overlap) {  // a second grads call adds to G: the lent parts first copied in
        const std::vector<float> more(kNumel[g], 0.125f);
        ASSERT_TRUE(lent->Grads(g, more.data(), DType::kF32).ok());
        ASSERT_TRUE(copied->Grads(g, more.data(), DType::kF32).ok());
      }
    }
    auto rl = lent->Step(so), rc = copied->Step(so);
    ASSERT_TRUE(rl.ok()) << rl.status().ToString();
    ASSERT_TRUE(rc.ok()) << rc.status().ToString();
    EXPECT_EQ(rl->grad_norm, rc->grad_norm) << "step " << k;
    EXPECT_GT(rl->grad_norm, so.max_grad_norm) << "the test means the step to clip";
    for (auto& b : bufs) std::fill(b.begin(), b.end(), std::nanf(""));
    ExpectSameState(*lent, *copied, "after step " + std::to_string(k));
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, LentParts,
                         ::testing::Values(LendCase{"cpu", false}, LendCase{"cpu", true}, LendCase{"nvme", false},
                                           LendCase{"nvme", true}),
                         [](const auto& info) {
                           return info.param.offload + (info.param.overlap ? "_overlap" : "_plain");
                         });

// The step reads a lent part where it is: a buffer changed between the
// hand and the step (which the contract forbids) changes the update. Where
// the group is updated early (the overlapped step without clipping: final
// updates), the parts are copied at the hand and the change does nothing.
TEST(LentParts, TheStepReadsThemWhereTheyAreUnlessUpdatedEarly) {
  TempDir dir;
  for (const bool overlap : {false, true}) {
    // No clipping and non-finite gradients applied: with overlap_step the
    // early updates are final (not speculative) ...
    const std::string apply = R"(, "nonfinite": "apply")";
    auto lent = MakeLend(dir.path(), overlap, "cpu", apply), copied = MakeLend(dir.path(), overlap, "cpu", apply);
    ASSERT_TRUE(lent && copied);
    StepOptions so;
    so.max_grad_norm = 0;
    for (int k = 0; k < 2; ++k) {  // ... from the second step (the first is not overlapped)
      if (overlap) {
        ASSERT_TRUE(lent->PrepareStep(so).ok());
        ASSERT_TRUE(copied->PrepareStep(so).ok());
      }
      std::vector<float> bufs[2];
      for (int g = 0; g < 2; ++g) {
        const std::vector<Part> ps = Once(g);
        const std::vector<float> grad = GradOf(*copied, g, k);
        Lend(*lent, g, bufs[g], grad, ps);
        Hand(*copied, g, grad, ps);
        if (k == 1)
          for (float& x : bufs[g]) x = -x;  // after the hand, before the step
      }
      ASSERT_TRUE(lent->Step(so).ok());
      ASSERT_TRUE(copied->Step(so).ok());
    }
    const bool same = SameBits(Read(*lent, 0, Engine::OptimizerState::kMaster),
                               Read(*copied, 0, Engine::OptimizerState::kMaster));
    EXPECT_EQ(same, overlap) << "overlap " << overlap << ": " << (overlap ? "updated early: the parts were copied at the hand"
                                         : "the step read the lent parts where they were");
  }
}

// Calls that return without having used the lent parts copy them into G
// first: a step refused (a group still fetched) and a checkpoint load that
// changed nothing. The caller scribbles over its buffers after each, and
// the step then finishes bitwise as the run that lent nothing.
TEST(LentParts, CallsThatReturnWithoutUsingThemKeepNone) {
  TempDir dir;
  auto lent = MakeLend(dir.path(), false, "cpu"), clean = MakeLend(dir.path(), false, "cpu");
  ASSERT_TRUE(lent && clean);
  StepOptions so;
  so.max_grad_norm = 0.75;
  for (int k = 0; k < 3; ++k) {
    std::vector<float> bufs[2];
    for (int g : {1, 0}) {
      const std::vector<Part> ps = Once(g);
      const std::vector<float> grad = GradOf(*clean, g, k);
      Lend(*lent, g, bufs[g], grad, ps);
      Hand(*clean, g, grad, ps);
    }
    if (k == 1) {
      ASSERT_TRUE(lent->Fetch(0).ok());
      auto refused = lent->Step(so);
      ASSERT_FALSE(refused.ok());
      EXPECT_NE(refused.status().message().find("fetched and not released"), std::string::npos)
          << refused.status().ToString();
      ASSERT_TRUE(lent->Release(0).ok());
      for (auto& b : bufs) std::fill(b.begin(), b.end(), std::nanf(""));
    }
    if (k == 2) {
      std::vector<uint8_t> blob;
      EXPECT_FALSE(lent->LoadCheckpoint(dir.path() + "/no-such-checkpoint", "", &blob).ok());
      for (auto& b : bufs) std::fill(b.begin(), b.end(), std::nanf(""));
    }
    auto rl = lent->Step(so), rc = clean->Step(so);
    ASSERT_TRUE(rl.ok()) << rl.status().ToString();
    ASSERT_TRUE(rc.ok()) << rc.status().ToString();
    EXPECT_EQ(rl->grad_norm, rc->grad_norm) << "step " << k;
    ExpectSameState(*lent, *clean, "step " + std::to_string(k));
  }
}

// With W, M, V on NVMe the parts are copied (the caller's gradients need not
// stay in host memory through the step's I/O): a lent buffer changed after
// the hand changes nothing.
TEST(LentParts, StateOnNvmeCopiesThem) {
  TempDir dir;
  auto lent = MakeLend(dir.path(), false, "nvme"), copied = MakeLend(dir.path(), false, "nvme");
  ASSERT_TRUE(lent && copied);
  std::vector<float> bufs[2];
  for (int g = 0; g < 2; ++g) {
    const std::vector<float> grad = GradOf(*copied, g, 0);
    Lend(*lent, g, bufs[g], grad, Once(g));
    Hand(*copied, g, grad, Once(g));
    for (float& x : bufs[g]) x = -x;
  }
  ASSERT_TRUE(lent->Step(StepOptions{}).ok());
  ASSERT_TRUE(copied->Step(StepOptions{}).ok());
  ExpectSameState(*lent, *copied, "nvme");
}

}  // namespace
}  // namespace strata
