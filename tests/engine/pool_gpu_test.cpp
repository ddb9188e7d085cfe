// The device pool on a GPU: with P offloaded to the host and a device budget
// that holds 2 of the 4 groups' copies, every step evicts and fetches again;
// after the first step no cudaMalloc runs (stats.device_raw_allocs stays
// put, hits grow). With strata.device_pool false the same run allocates on
// every fetch that misses, which shows the count can move. Skipped (77)
// without a GPU.
#include <cstdio>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "tiers/gpu.h"
#if STRATA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

using namespace strata;

namespace {

int failures = 0;
void Expect(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what.c_str());
  if (!ok) ++failures;
}

// Raw device allocations after step 1 and after step 5 (-1 on error).
std::pair<long, long> Run(bool pool) {
  constexpr uint64_t kNumel = 1 << 20;  // 4 MiB of fp32 P a group
  const std::string json = std::string(R"({"zero_optimization": {"offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "cpu"}},
      "strata": {"device_budget": "10MiB", "host_budget": "512MiB", "device_pool": )") +
                           (pool ? "true" : "false") + "}}";
  auto cfg = ParseConfig(json);
  if (!cfg.ok()) return {-1, -1};
  auto e = Engine::Create(*cfg, {});
  if (!e.ok()) {
    std::printf("FAILED: create: %s\n", e.status().ToString().c_str());
    return {-1, -1};
  }
  Engine& eng = **e;
  for (int g = 0; g < 4; ++g)
    if (!eng.AddParam(g, "w" + std::to_string(g), kNumel, nullptr).ok()) return {-1, -1};
  if (!eng.Build().ok()) return {-1, -1};
  void* grads = nullptr;
#if STRATA_HAVE_CUDA
  if (cudaMalloc(&grads, kNumel * 4) != cudaSuccess || cudaMemset(grads, 0, kNumel * 4) != cudaSuccess)
    return {-1, -1};
#endif
  long after1 = -1, after5 = -1;
  for (int s = 0; s < 5; ++s) {
    for (int g = 0; g < 4; ++g) {  // forward
      if (!eng.Fetch(g).ok() || !eng.Release(g).ok()) return {-1, -1};
    }
    for (int g = 3; g >= 0; --g) {  // backward
      if (!eng.Fetch(g).ok() || !eng.Grads(g, grads, DType::kF32).ok() || !eng.Release(g).ok()) return {-1, -1};
    }
    auto r = eng.Step({});
    if (!r.ok()) {
      std::printf("FAILED: step: %s\n", r.status().ToString().c_str());
      return {-1, -1};
    }
    const EngineStats st = eng.stats();
    if (st.device.peak > st.device.budget) Expect(false, "device peak within the budget");
    if (s == 0) after1 = static_cast<long>(st.device_raw_allocs);
    if (s == 4) after5 = static_cast<long>(st.device_raw_allocs);
  }
#if STRATA_HAVE_CUDA
  cudaFree(grads);
#endif
  return {after1, after5};
}

}  // namespace

int main() {
  if (!gpu::Available()) {
    std::fprintf(stderr, "skipped: no GPU\n");
    return 77;
  }
  const auto [p1, p5] = Run(true);
  Expect(p1 > 0 && p5 == p1, "with the pool no device allocation after step 1 (" + std::to_string(p1) + " then " +
                                 std::to_string(p5) + ")");
  const auto [n1, n5] = Run(false);
  Expect(n1 > 0 && n5 > n1, "without the pool the fetches allocate every step (" + std::to_string(n1) + " then " +
                                std::to_string(n5) + ")");
  std::printf("pool gpu: %d failures\n", failures);
  return failures ? 1 : 0;
}
