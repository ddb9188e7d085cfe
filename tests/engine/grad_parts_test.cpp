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

std::unique_ptr<Engine> Make(const std::string& dir, bool overlap, const std::string& offload = "cpu",
                             const std::string& accum = "fp32") {
  static int made = 0;
  const std::string swap = dir + "/e" + std::to_string(made++);
  std::filesystem::create_directories(swap);
  EngineOptions eo;
  eo.force_no_gpu = true;
  eo.overlap_step = overlap;
  std::vector<std::vector<float>> values(2);
  for (int g = 0; g < 2; ++g) {
    values[g].resize(kNumel[g]);
    for (uint64_t i = 0; i < kNumel[g]; ++i)
      values[g][i] = 0.2f * std::sin(0.01f * static_cast<float>(i * (g + 3) + 1));
  }
  return strata::testing::BuiltEngine(Json(offload, swap, accum), eo, values);
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

}  // namespace
}  // namespace strata
