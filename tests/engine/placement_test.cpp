// engine/placement: which GPU a process drives (its local rank, one process
// per GPU), where it binds (the GPU's NUMA node), what the line says, and
// strata.numa_bind's refusals. Runs without a GPU; placement_gpu_test checks
// the same on GPUs.
#include "engine/layout/placement.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "engine/engine.h"

namespace strata {
namespace {

Config MustParse(const std::string& json) {
  auto c = ParseConfig(json);
  EXPECT_TRUE(c.ok()) << c.status().ToString() << "\n" << json;
  return c.ok() ? *c : Config{};
}

std::string Message(const Status& st) { return st.ToString(); }

TEST(ChooseDevice, TheLocalRankSelectsTheGpu) {
  EXPECT_EQ(ChooseDevice(-1, 0, 1, "none").value(), 0);
  EXPECT_EQ(ChooseDevice(-1, 1, 2, "torchrun").value(), 1);
  EXPECT_EQ(ChooseDevice(-1, 3, 8, "slurm").value(), 3);
}

TEST(ChooseDevice, AnExplicitDeviceWinsOverTheLocalRank) {
  EXPECT_EQ(ChooseDevice(0, 3, 1, "torchrun").value(), 0) << "CUDA_VISIBLE_DEVICES gave this process one GPU";
  EXPECT_EQ(ChooseDevice(1, 0, 2, "torchrun").value(), 1);
}

TEST(ChooseDevice, NoGpuIsTheHostArena) {
  EXPECT_EQ(ChooseDevice(-1, 5, 0, "torchrun").value(), -1);
  EXPECT_EQ(ChooseDevice(3, 0, 0, "none").value(), -1);
}

TEST(ChooseDevice, PastTheLastGpuIsRefusedNamingBothNumbers) {
  const auto local = ChooseDevice(-1, 2, 2, "torchrun");
  ASSERT_FALSE(local.ok()) << "local rank 2 must not wrap onto GPU 0 of 2";
  EXPECT_EQ(local.status().code(), Code::kInvalid);
  EXPECT_NE(Message(local.status()).find("LOCAL_RANK is 2 but this process sees 2 GPUs"), std::string::npos)
      << Message(local.status());
  const auto named = ChooseDevice(4, 0, 4, "none");
  ASSERT_FALSE(named.ok());
  EXPECT_NE(Message(named.status()).find("device 4 but this process sees 4 GPUs"), std::string::npos)
      << Message(named.status());
  const auto negative = ChooseDevice(-2, 0, 4, "none");
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(Message(negative.status()).find("device -2"), std::string::npos);
  EXPECT_FALSE(ChooseDevice(-2, 0, 0, "none").ok()) << "a bad option is bad without a GPU too";
}

TEST(ChooseNumaNode, BindsToTheGpusNodeOnSeveralNodes) {
  const NumaChoice c = ChooseNumaNode("auto", 1, 1, 2);
  EXPECT_EQ(c.node, 1);
  EXPECT_EQ(c.why_not, "");
  EXPECT_EQ(ChooseNumaNode("auto", 0, 3, 4).node, 3);
}

TEST(ChooseNumaNode, SaysWhyItDoesNothing) {
  auto expect = [](const NumaChoice& c, const std::string& why) {
    EXPECT_EQ(c.node, -1);
    EXPECT_EQ(c.why_not, why);
  };
  expect(ChooseNumaNode("off", 1, 1, 2), "strata.numa_bind is off");
  expect(ChooseNumaNode("auto", -1, -1, 2), "no GPU");
  expect(ChooseNumaNode("auto", 0, 0, 1), "one NUMA node");
  expect(ChooseNumaNode("auto", 0, -1, 4), "the GPU's NUMA node is unknown");
  expect(ChooseNumaNode("auto", 0, 0, 0), "hwloc sees no NUMA node");
}

TEST(DescribePlacement, OnAGpuBound) {
  Placement p;
  p.rank = 1;
  p.world_size = 4;
  p.device = 1;
  p.device_name = "NVIDIA H200";
  p.gpu_node = 0;
  p.numa_nodes = 2;
  p.cpu_node = 0;
  p.cpus = "0-15";
  p.memory_node = 0;
  p.pinned = true;
  EXPECT_EQ(
      DescribePlacement(p),
      "rank 1/4: GPU 1 (NVIDIA H200, NUMA node 0); cores 0-15 bound to node 0; pinned memory on node 0");
  p.gpu_node = -1;
  p.cpu_node = -1;
  p.no_bind_why = "the GPU's NUMA node is unknown";
  p.memory_node = -1;
  EXPECT_EQ(
      DescribePlacement(p),
      "rank 1/4: GPU 1 (NVIDIA H200, NUMA node unknown); no NUMA binding (the GPU's NUMA node is unknown); "
      "pinned memory not NUMA-bound");
}

TEST(DescribePlacement, WithoutAGpu) {
  Placement p;
  p.no_gpu_why = "built without CUDA";
  p.no_bind_why = "no GPU";
  p.memory_node = 0;
  EXPECT_EQ(
      DescribePlacement(p),
      "rank 0/1: no GPU (built without CUDA): device tier is a host arena; no NUMA binding (no GPU); host "
      "memory on node 0");
}

// An engine on this machine, made to do without a GPU: the host arena, no
// binding, and the line says so.
TEST(EnginePlacement, WithoutAGpu) {
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e = Engine::Create(MustParse("{}"), eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const Placement& p = (*e)->placement();
  EXPECT_EQ(p.device, -1);
  EXPECT_EQ(p.no_gpu_why, "force_no_gpu");
  EXPECT_EQ(p.cpu_node, -1);
  EXPECT_EQ(p.no_bind_why, "no GPU");
  EXPECT_FALSE(p.pinned);
  const std::string line = DescribePlacement(p);
  EXPECT_EQ(
      line.rfind("rank 0/1: no GPU (force_no_gpu): device tier is a host arena; no NUMA binding (no GPU); "
                 "host memory ",
                 0),
      0u)
      << line;
}

TEST(EnginePlacement, NumaBindOffBindsNothing) {
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e = Engine::Create(MustParse(R"({"strata": {"numa_bind": "off"}})"), eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const Placement& p = (*e)->placement();
  EXPECT_EQ(p.no_bind_why, "strata.numa_bind is off");
  EXPECT_EQ(p.memory_node, -1) << "off: the host tier's memory is not bound either";
  EXPECT_NE(DescribePlacement(p).find("host memory not NUMA-bound"), std::string::npos)
      << DescribePlacement(p);
}

// The machine's own answer (no GPU here, or one): a LOCAL_RANK past every GPU
// is refused when there are GPUs, and ignored without one.
TEST(EnginePlacement, LocalRankFromTheEnvironment) {
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  ::setenv("LOCAL_RANK", "0", 1);
  ::setenv("LOCAL_WORLD_SIZE", "1", 1);
  auto e = Engine::Create(MustParse("{}"), {});
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("LOCAL_WORLD_SIZE");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const Placement& p = (*e)->placement();
  EXPECT_EQ(p.rank_source, "torchrun");
  EXPECT_EQ(p.local_rank, 0);
  if (p.device < 0) {
    EXPECT_FALSE(p.no_gpu_why.empty()) << "without a GPU the line says why";
    EXPECT_EQ(p.no_bind_why, "no GPU");
  } else {
    EXPECT_EQ(p.device, 0);
  }
}

TEST(ConfigNumaBind, DefaultsToAutoAndRoundTrips) {
  EXPECT_EQ(MustParse("{}").strata.numa_bind, "auto");
  const Config off = MustParse(R"({"strata": {"numa_bind": "off"}})");
  EXPECT_EQ(off.strata.numa_bind, "off");
  EXPECT_EQ(MustParse(ConfigToJson(off)), off);
  EXPECT_EQ(MustParse(R"({"strata": {"numa_bind": "OFF"}})").strata.numa_bind, "off") << "enums ignore case";
}

TEST(ConfigNumaBind, BadValuesAreRefusedNamingTheKey) {
  auto bad = ParseConfig(R"({"strata": {"numa_bind": "on"}})");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kConfig);
  EXPECT_NE(bad.status().message().find("strata.numa_bind: \"on\" is not one of auto, off"),
            std::string::npos)
      << bad.status().ToString();
  auto typed = ParseConfig(R"({"strata": {"numa_bind": true}})");
  ASSERT_FALSE(typed.ok());
  EXPECT_NE(typed.status().message().find("strata.numa_bind"), std::string::npos)
      << typed.status().ToString();
  auto spelled = ParseConfig(R"({"strata": {"numa_bnd": "off"}})");
  ASSERT_FALSE(spelled.ok());
  EXPECT_NE(spelled.status().message().find("did you mean 'numa_bind'"), std::string::npos)
      << spelled.status().ToString();
  // A Config built in code is held to the same rule at Create.
  Config c;
  c.strata.numa_bind = "sometimes";
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e = Engine::Create(c, eo);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("strata.numa_bind: \"sometimes\" is not one of auto, off"),
            std::string::npos)
      << e.status().ToString();
}

}  // namespace
}  // namespace strata
