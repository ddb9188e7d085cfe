// The plan's host bytes against the engine's own with several ranks: two
// real ranks (threads of this process, each with a Gloo communicator and
// its own Engine) build a small model; rank 0's host tier is what
// ComputeCapacity counts for a rank.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <vector>

#include "engine/engine.h"
#include "tests/util/on_ranks.h"
#include "tools/plan/capacity.h"

namespace strata::plan {
namespace {

// The host memory rank 0's engine takes at build (both ranks' are printed)
// is what the plan counts for a rank, its staging as the engine sizes it
// (the step's slots, G's and the reduction's buffers), for stages 1-3, W,
// M, V in host memory or on NVMe, with and without overlap_comm.
struct RanksCase {
  int stage;
  const char* opt;  // offload_optimizer.device
  bool overlap_comm;
};

class RanksHostTest : public ::testing::TestWithParam<RanksCase> {};

TEST_P(RanksHostTest, HostBytesAreTheEngines) {
  const RanksCase& k = GetParam();
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("strata-plan-ranks-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::vector<uint64_t> groups = {393216, 131072, 131072, 65536};
  auto c = ParseConfig(R"({"optimizer": {"type": "AdamW"},
    "zero_optimization": {"stage": )" + std::to_string(k.stage) + R"(, "overlap_comm": )" +
                       (k.overlap_comm ? "true" : "false") + R"(,
      "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": ")" + k.opt + R"(", "nvme_path": ")" + dir.string() + R"("}},
    "strata": {"host_budget": "256MiB", "device_budget": "64MiB"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  std::vector<uint64_t> used(2, 0);
  testing::OnRanks(2, [&](int rank, net::Communicator& comm) {
    EngineOptions eo;
    eo.force_no_gpu = true;
    eo.comm = &comm;
    eo.rank = rank;
    eo.world_size = 2;
    auto e = Engine::Create(*c, eo);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    for (size_t g = 0; g < groups.size(); ++g) {
      std::vector<float> init(groups[g], 0.01f);
      ASSERT_TRUE((*e)->AddParam(static_cast<int>(g), "g" + std::to_string(g), groups[g], init.data()).ok());
    }
    Status st = (*e)->Build();
    ASSERT_TRUE(st.ok()) << st.ToString();
    used[static_cast<size_t>(rank)] = (*e)->stats().host.used;
  });
  std::filesystem::remove_all(dir);
  ModelSpec m;
  m.name = "ranks";
  for (size_t g = 0; g < groups.size(); ++g) m.groups.push_back({"g" + std::to_string(g), groups[g], false});
  ClusterSpec cl = PresetCluster("local").value();
  cl.gpus_per_node = 2;
  auto cap = ComputeCapacity(m, cl, *c);
  ASSERT_TRUE(cap.ok()) << cap.status().ToString();
  std::printf("stage %d, W, M, V on %s, overlap_comm %d: engine host %llu / %llu B, plan %llu B\n", k.stage, k.opt,
              int(k.overlap_comm), static_cast<unsigned long long>(used[0]), static_cast<unsigned long long>(used[1]),
              static_cast<unsigned long long>(cap->Used(TierKind::kHost)));
  EXPECT_EQ(used[0], cap->Used(TierKind::kHost));
}

INSTANTIATE_TEST_SUITE_P(Cases, RanksHostTest,
                         ::testing::Values(RanksCase{1, "cpu", true}, RanksCase{2, "cpu", true},
                                           RanksCase{3, "cpu", true}, RanksCase{3, "cpu", false},
                                           RanksCase{3, "nvme", true}, RanksCase{2, "nvme", false}));

}  // namespace
}  // namespace strata::plan
