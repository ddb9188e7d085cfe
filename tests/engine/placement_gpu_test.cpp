// engine/placement on GPUs: the local rank's GPU is the one the engine
// allocates on and makes current, on the caller's thread and on its own; a
// local rank past the last GPU is refused; with several NUMA nodes the
// process is bound to the GPU's. Exits 77 ("skipped", on stderr) without a
// GPU; the checks on GPU 1 need two.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "engine/engine.h"
#include "engine/layout/placement.h"
#include "tiers/gpu.h"

namespace strata {
namespace {

// torchrun's variables for local rank `local` of `local_world` on one node.
class LaunchVars {
 public:
  LaunchVars(int local, int local_world) {
    Set("RANK", local);
    Set("WORLD_SIZE", local_world);
    Set("LOCAL_RANK", local);
    Set("LOCAL_WORLD_SIZE", local_world);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", "29500", 1);
  }
  ~LaunchVars() {
    for (const char* v :
         {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
      ::unsetenv(v);
  }

 private:
  static void Set(const char* name, int v) { ::setenv(name, std::to_string(v).c_str(), 1); }
};

Result<std::unique_ptr<Engine>> MakeEngine() {
  // world_size 1: this test is one process standing in for one rank (several
  // ranks with a GPU are refused by this release's engine).
  // P homed on the host: every fetch allocates a device copy through the
  // device tier, on the thread that fetches (and on the prefetch thread).
  auto c = ParseConfig(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
      "strata": {"device_budget": "64MiB", "host_budget": "64MiB"}})");
  if (!c.ok()) return c.status();
  return Engine::Create(*c, EngineOptions{});
}

int CurrentDevice() {
  int d = -1;
  return cudaGetDevice(&d) == cudaSuccess ? d : -1;
}

int DeviceOfPointer(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) return -2;
  return a.type == cudaMemoryTypeDevice ? a.device : -1;
}

// Builds one group, fetches it (through the engine's device tier, whose
// allocations must be on `device`) and checks the caller's thread and a new
// thread of the engine's.
void ExpectEngineOn(Engine& e, int device) {
  std::vector<float> w(4096, 1.0f);
  for (int g = 0; g < 3; ++g) ASSERT_TRUE(e.AddParam(g, "w", w.size(), w.data()).ok());
  ASSERT_TRUE(e.Build().ok());
  EXPECT_EQ(CurrentDevice(), device) << "the creating thread works on the engine's GPU";
  for (int g = 0; g < 2; ++g) {
    auto p = e.Fetch(g);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(DeviceOfPointer(*p), device) << "group " << g;
    ASSERT_TRUE(e.Release(g).ok());
  }
  // A thread that never chose a device starts on GPU 0; the engine's calls
  // from it still act on its GPU.
  std::thread t([&] {
    auto p = e.Fetch(2);  // not fetched before: allocated from this thread
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(DeviceOfPointer(*p), device);
    EXPECT_TRUE(e.Release(2).ok());
  });
  t.join();
}

TEST(PlacementGpu, WithoutALauncherGpu0) {
  auto e = MakeEngine();
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const Placement& p = (*e)->placement();
  std::fprintf(stderr, "%s\n", DescribePlacement(p).c_str());
  EXPECT_EQ(p.device, 0);
  EXPECT_FALSE(p.device_name.empty());
  EXPECT_EQ((*e)->stats().device.budget, 64ull << 20);
  ExpectEngineOn(**e, 0);
}

TEST(PlacementGpu, LocalRankPastTheLastGpuIsRefused) {
  const int count = gpu::DeviceCount();
  LaunchVars vars(count, count + 1);
  auto e = MakeEngine();
  ASSERT_FALSE(e.ok()) << "LOCAL_RANK " << count << " with " << count << " GPUs";
  EXPECT_NE(e.status().message().find("LOCAL_RANK is " + std::to_string(count) + " but this process sees " +
                                      std::to_string(count) + (count == 1 ? " GPU" : " GPUs")),
            std::string::npos)
      << e.status().ToString();
}

TEST(PlacementGpu, LocalRankOneDrivesGpuOne) {
  if (gpu::DeviceCount() < 2) GTEST_SKIP() << "needs two GPUs";
  LaunchVars vars(1, 2);
  auto e = MakeEngine();
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const Placement& p = (*e)->placement();
  std::fprintf(stderr, "%s\n", DescribePlacement(p).c_str());
  EXPECT_EQ(p.device, 1);
  EXPECT_EQ(p.local_rank, 1);
  ExpectEngineOn(**e, 1);
}

TEST(PlacementGpu, BindsToTheGpusNode) {
  auto e = MakeEngine();
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const Placement& p = (*e)->placement();
  std::fprintf(stderr, "%s\n", DescribePlacement(p).c_str());
  if (p.numa_nodes < 2 || p.gpu_node < 0)
    GTEST_SKIP() << "one NUMA node, or the GPU's unknown: " << p.no_bind_why;
  EXPECT_EQ(p.cpu_node, p.gpu_node) << p.no_bind_why;
  EXPECT_FALSE(p.cpus.empty());
  EXPECT_EQ(p.memory_node, p.gpu_node);
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  std::string why;
  if (strata::gpu::DeviceCount(&why) == 0) {
    std::fprintf(stderr, "skipped: no GPU (%s)\n", why.c_str());
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
