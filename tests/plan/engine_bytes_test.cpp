// The plan's bytes against the engine's own, in both strata.state_format
// values: a small model with P, G, W, M, V on NVMe (no GPU, stage 3), built
// and stepped by the real Engine; the NVMe bytes it holds and moves in its
// optimizer step are what ComputeCapacity and Simulate say. Sizes are
// multiples of the 4 KiB block, so that padding plays no part.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <vector>

#include "engine/engine.h"
#include "tools/plan/capacity.h"
#include "tools/plan/simulator.h"

namespace strata::plan {
namespace {

constexpr int kGroups = 4;
constexpr uint64_t kPerGroup = 64u << 10;  // compact M: 64 Ki + 4 x 2 Ki bytes = 18 blocks

struct EngineBytes {
  uint64_t nvme_used = 0, step_read = 0, step_write = 0;
};

Result<EngineBytes> RunEngine(const Config& cfg) {
  EngineOptions eo;
  eo.force_no_gpu = true;
  STRATA_ASSIGN_OR_RETURN(auto e, Engine::Create(cfg, eo));
  std::vector<float> init(kPerGroup, 0.01f);
  for (int g = 0; g < kGroups; ++g)
    STRATA_RETURN_IF_ERROR(e->AddParam(g, "g" + std::to_string(g), kPerGroup, init.data()).status());
  STRATA_RETURN_IF_ERROR(e->Build());
  std::vector<uint16_t> grads(kPerGroup, 0x3a00);
  EngineBytes b;
  for (int step = 0; step < 2; ++step) {  // the second step is measured
    for (int g = 0; g < kGroups; ++g) STRATA_RETURN_IF_ERROR(e->Grads(g, grads.data(), DType::kBF16));
    const EngineStats before = e->stats();
    STRATA_RETURN_IF_ERROR(e->Step({}).status());
    const EngineStats after = e->stats();
    b.step_read = after.nvme_to_host - before.nvme_to_host;
    b.step_write = after.host_to_nvme - before.host_to_nvme;
    b.nvme_used = after.nvme.used;
  }
  return b;
}

// `variant`: strata.state_format, then ",bf16" for data_types.grad_accum_dtype bf16.
Config Cfg(const std::string& dir, const std::string& variant) {
  const std::string format = variant.substr(0, variant.find(','));
  const std::string accum = variant.find(",bf16") != std::string::npos ? "bf16" : "fp32";
  auto c = ParseConfig(R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW"},
    "data_types": {"grad_accum_dtype": ")" + accum + R"("},
    "zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": ")" +
                       dir + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                       dir + R"("}},
    "strata": {"host_budget": "256MiB", "device_budget": "64MiB", "state_format": ")" +
                       format + R"("}})");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : Config{};
}

class EngineBytesTest : public ::testing::TestWithParam<const char*> {};

TEST_P(EngineBytesTest, MatchThePlan) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("strata-plan-engine-" + std::to_string(::getpid()) + "-" +
                                     std::to_string(std::hash<std::string>()(GetParam())));
  std::filesystem::create_directories(dir);
  const Config cfg = Cfg(dir.string(), GetParam());
  auto got = RunEngine(cfg);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(got.ok()) << got.status().ToString();

  ModelSpec m;
  m.name = "engine-bytes";
  for (int g = 0; g < kGroups; ++g) m.groups.push_back({"g" + std::to_string(g), kPerGroup, false});
  ClusterSpec c = PresetCluster("local").value();
  c.gpus_per_node = 1;
  auto cap = ComputeCapacity(m, c, cfg);
  auto sim = Simulate(m, c, cfg, {.optimizer_only = true});
  ASSERT_TRUE(cap.ok() && sim.ok());
  std::printf("%s: engine nvme %llu B, step read %llu B, write %llu B\n", GetParam(),
              static_cast<unsigned long long>(got->nvme_used),
              static_cast<unsigned long long>(got->step_read),
              static_cast<unsigned long long>(got->step_write));
  EXPECT_EQ(got->nvme_used, cap->ModelStates(TierKind::kNvme)) << GetParam();
  EXPECT_EQ(got->step_read, sim->disk_read_bytes) << GetParam();
  EXPECT_EQ(got->step_write, sim->disk_write_bytes) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(StateFormats, EngineBytesTest,
                         ::testing::Values("fp32", "compact", "fp32,bf16", "compact,bf16"));

// Write-behind's step staging (engine/step.cpp GrowStagingBehind): at one
// rank, with W, M, V on NVMe stepped in units, the engine adds step slots
// until every unit's W, M, V fits them at once, where the host budget has
// that much left. The plan's host bytes are the engine's host tier's, with
// the growth, without it (write_behind "never", a budget too small for it,
// speculation "always" with the overlapped step) and with it cut short.
Result<uint64_t> EngineHostUsed(const Config& cfg, const std::vector<uint64_t>& groups, bool overlap) {
  EngineOptions eo;
  eo.force_no_gpu = true;
  eo.overlap_step = overlap;
  STRATA_ASSIGN_OR_RETURN(auto e, Engine::Create(cfg, eo));
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<float> init(groups[g], 0.01f);
    STRATA_RETURN_IF_ERROR(
        e->AddParam(static_cast<int>(g), "g" + std::to_string(g), groups[g], init.data()).status());
  }
  STRATA_RETURN_IF_ERROR(e->Build());
  return e->stats().host.used;
}

struct BehindCase {
  const char* write_behind;
  const char* host_budget;
  const char* speculation;
  bool overlap;
  bool grows;  // the engine adds slots
};

class WriteBehindTest : public ::testing::TestWithParam<BehindCase> {};

TEST_P(WriteBehindTest, HostBytesAreTheEngines) {
  const BehindCase& k = GetParam();
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("strata-plan-behind-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  // Twelve groups of four units: their W, M, V (36 MiB) are six times the
  // two slots of a group's that PlanStaging gives the pieces.
  const std::vector<uint64_t> groups(12, 262144);
  auto c = ParseConfig(R"({"optimizer": {"type": "AdamW"},
    "zero_optimization": {"stage": 3, "sub_group_size": 65536,
      "offload_param": {"device": "nvme", "nvme_path": ")" + dir.string() + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.string() + R"("}},
    "strata": {"host_budget": ")" + std::string(k.host_budget) + R"(", "device_budget": "64MiB",
               "write_behind": ")" + k.write_behind + R"(", "speculation": ")" + k.speculation + R"("}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto got = EngineHostUsed(*c, groups, k.overlap);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(got.ok()) << got.status().ToString();

  ModelSpec m;
  m.name = "behind";
  for (size_t g = 0; g < groups.size(); ++g) m.groups.push_back({"g" + std::to_string(g), groups[g], false});
  ClusterSpec cl = PresetCluster("local").value();
  cl.gpus_per_node = 1;
  auto cap = ComputeCapacity(m, cl, *c, k.overlap);
  ASSERT_TRUE(cap.ok()) << cap.status().ToString();
  std::printf("write_behind %s, host_budget %s, speculation %s%s: engine host %llu B, plan %llu B (%d slots added)\n",
              k.write_behind, k.host_budget, k.speculation, k.overlap ? ", overlapped" : "",
              static_cast<unsigned long long>(*got), static_cast<unsigned long long>(cap->Used(TierKind::kHost)),
              cap->write_behind_slots);
  EXPECT_EQ(*got, cap->Used(TierKind::kHost));
  // G (12 MiB) and two 3 MiB slots (a group's W, M, V; its P is W's bytes
  // and has no region), and with the growth ten more: the 48 units' W, M, V
  // pieces (768 KiB), cut in order, four to a slot, fill twelve.
  EXPECT_EQ(*got, (12u + 6u + (k.grows ? 30u : 0u)) << 20);
  EXPECT_EQ(cap->write_behind_slots, k.grows ? 10 : 0);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, WriteBehindTest,
    ::testing::Values(BehindCase{"auto", "256MiB", "auto", false, true},
                      BehindCase{"always", "256MiB", "auto", true, true},
                      BehindCase{"never", "256MiB", "auto", false, false},
                      BehindCase{"auto", "40MiB", "auto", false, false},  // 22 MiB left of the 30 it needs
                      BehindCase{"auto", "256MiB", "always", true, false}));

}  // namespace
}  // namespace strata::plan
