// The simulator's prediction against a measured step on this machine: the
// rates come from --calibrate's measurements (taken here, in the same
// folder), the step is the real Engine's optimizer step over 64M parameters
// with W, M, V, G on NVMe (as bench/engine/offload_step), median of 5.
// Within 25%. Needs a writable disk folder: STRATA_PLAN_TEST_DIR, else /tmp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "engine/engine.h"
#include "tools/plan/calibrate.h"
#include "tools/plan/simulator.h"

namespace strata::plan {
namespace {

constexpr int kGroups = 16;
constexpr uint64_t kPerGroup = 4u << 20;  // 16 x 4M = 64M parameters
constexpr int kSteps = 5;                 // median of

std::string ConfigJson(const std::string& dir) {
  return R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
         dir + R"("}},
    "aio": {"block_size": 1048576, "queue_depth": 32},
    "strata": {"host_budget": "1GiB", "device_budget": "1GiB"}})";
}

Result<double> MeasuredStep(const Config& cfg) {
  EngineOptions eo;
  eo.force_no_gpu = true;  // the scenario the "local" cluster describes
  STRATA_ASSIGN_OR_RETURN(auto e, Engine::Create(cfg, eo));
  std::vector<float> init(kPerGroup, 0.01f);
  for (int g = 0; g < kGroups; ++g)
    STRATA_RETURN_IF_ERROR(e->AddParam(g, "g" + std::to_string(g), kPerGroup, init.data()).status());
  STRATA_RETURN_IF_ERROR(e->Build());
  std::vector<uint16_t> grads(kPerGroup);
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<uint16_t>(0x3a00 + (i % 256));
  std::vector<double> times;
  for (int s = 0; s < kSteps; ++s) {
    for (int g = 0; g < kGroups; ++g) STRATA_RETURN_IF_ERROR(e->Grads(g, grads.data(), DType::kBF16));
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(e->Step({}).status());
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  const EngineStats st = e->stats();
  std::printf("engine, last step: wall %.3f s, disk busy %.3f s, cpu optimizer %.3f s\n", st.step_wall_s,
              st.disk_busy_s, st.cpu_optimizer_s);
  return times[kSteps / 2];
}

TEST(CalibratedPrediction, OptimizerStepOnNvmeWithin25Percent) {
  const char* base = std::getenv("STRATA_PLAN_TEST_DIR");
  const std::filesystem::path dir =
      std::filesystem::path(base ? base : "/tmp") / ("strata-plan-calib-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  CalibrateOptions co;
  co.dir = dir.string();
  co.file_bytes = 512ull << 20;
  co.repeats = 5;
  co.queue_depth = 32;
  auto cal = Calibrate(co);
  ASSERT_TRUE(cal.ok()) << cal.status().ToString();
  auto cfg = ParseConfig(ConfigJson(dir.string()));
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  auto measured = MeasuredStep(*cfg);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(measured.ok()) << measured.status().ToString();

  ModelSpec m;
  m.name = "calibration";
  for (int g = 0; g < kGroups; ++g) m.groups.push_back({"g" + std::to_string(g), kPerGroup, false});
  ClusterSpec c = CalibratedCluster(*cal);
  c.has_gpu = false;
  auto sim = Simulate(m, c, *cfg, {.optimizer_only = true});
  ASSERT_TRUE(sim.ok());
  const double err = (sim->step_s - *measured) / *measured;
  std::printf("calibration: disk read %.0f MB/s, write %.0f MB/s, mixed x%.2f; Adam %.0f M/s; XXH3 %.1f GB/s\n",
              cal->nvme_read_Bps / 1e6, cal->nvme_write_Bps / 1e6, cal->nvme_mixed_factor, cal->cpu_adam_eps / 1e6,
              cal->checksum_Bps / 1e9);
  std::printf("simulated: disk busy %.3f s, cpu busy %.3f s\n", sim->Busy(SimResource::kDisk),
              sim->Busy(SimResource::kCpu));
  std::printf(
      "optimizer step over %llu parameters on NVMe: predicted %.3f s, measured %.3f s (%+.1f%%), bound by "
      "%s\n",
      static_cast<unsigned long long>(m.total_numel()), sim->step_s, *measured, 100 * err,
      SimResourceName(sim->bound));
  EXPECT_LE(std::abs(err), 0.25);
}

}  // namespace
}  // namespace strata::plan
