// The simulator's prediction from calibrated rates, as behaviour: finite and
// positive, and moving the right way when a calibrated rate moves. Whether it
// matches a measured step on this machine is a benchmark
// (bench/plan/calibrated_prediction.cpp): under load it cannot be a test.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/config/config.h"
#include "tools/plan/calibrate.h"
#include "tools/plan/simulator.h"

namespace strata::plan {
namespace {

constexpr int kGroups = 16;
constexpr uint64_t kPerGroup = 4u << 20;  // 16 x 4M = 64M parameters, as the benchmark

Config OffloadConfig() {
  auto c = ParseConfig(R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}},
    "aio": {"block_size": 1048576, "queue_depth": 32},
    "strata": {"host_budget": "1GiB", "device_budget": "1GiB"}})");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : Config{};
}

// Rates of the order this project's machines measure.
Calibration Rates() {
  Calibration cal;
  cal.nvme_read_Bps = 2e9;
  cal.nvme_write_Bps = 1.5e9;
  cal.nvme_mixed_factor = 1.2;
  cal.cpu_adam_eps = 5e8;
  cal.host_mem_Bps = 1e10;
  cal.checksum_Bps = 5e9;
  cal.dir_free_bytes = 100ull << 30;
  return cal;
}

SimResult Predict(const Calibration& cal) {
  ModelSpec m;
  m.name = "calibration";
  for (int g = 0; g < kGroups; ++g) m.groups.push_back({"g" + std::to_string(g), kPerGroup, false});
  ClusterSpec c = CalibratedCluster(cal);
  c.has_gpu = false;
  auto sim = Simulate(m, c, OffloadConfig(), {.optimizer_only = true});
  EXPECT_TRUE(sim.ok()) << sim.status().ToString();
  return sim.ok() ? *sim : SimResult{};
}

TEST(CalibratedPrediction, IsFiniteAndPositive) {
  const SimResult sim = Predict(Rates());
  EXPECT_TRUE(std::isfinite(sim.step_s));
  EXPECT_GT(sim.step_s, 0);
  EXPECT_GT(sim.Busy(SimResource::kDisk), 0);
  EXPECT_GT(sim.Busy(SimResource::kCpu), 0);
}

TEST(CalibratedPrediction, FollowsTheDiskRates) {
  const SimResult base = Predict(Rates());
  ASSERT_EQ(base.bound, SimResource::kDisk) << SimResourceName(base.bound);  // W, M, V, G stream from NVMe
  Calibration slower = Rates();
  slower.nvme_read_Bps /= 2;
  slower.nvme_write_Bps /= 2;
  EXPECT_GT(Predict(slower).step_s, base.step_s * 1.5);
  Calibration faster_reads = Rates();
  faster_reads.nvme_read_Bps *= 2;
  EXPECT_LT(Predict(faster_reads).step_s, base.step_s);
}

TEST(CalibratedPrediction, FollowsTheCpuRate) {
  const SimResult base = Predict(Rates());
  Calibration slow_adam = Rates();
  slow_adam.cpu_adam_eps /= 100;  // 5 M/s: the CPU bounds the step now
  const SimResult slow = Predict(slow_adam);
  EXPECT_EQ(slow.bound, SimResource::kCpu) << SimResourceName(slow.bound);
  EXPECT_GT(slow.step_s, base.step_s * 2);
}

}  // namespace
}  // namespace strata::plan
