// The simulator's prediction against a measured step on this machine: the
// rates come from --calibrate's measurements (taken here, in the same
// folder), the step is the real Engine's optimizer step over 64M parameters
// with W, M, V, G on NVMe (as bench/engine/offload_step), in paired rounds.
// Within 25% (median of the rounds). Needs a writable disk folder: STRATA_PLAN_TEST_DIR, else /tmp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <vector>

#include "engine/engine.h"
#include "tools/plan/calibrate.h"
#include "tools/plan/simulator.h"

namespace strata::plan {
namespace {

constexpr int kGroups = 16;
constexpr uint64_t kPerGroup = 4u << 20;  // 16 x 4M = 64M parameters
constexpr int kSteps = 3;                 // median of, per round
constexpr int kRounds = 3;                // calibration + steps, paired

std::string ConfigJson(const std::string& dir) {
  return R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
         dir + R"("}},
    "aio": {"block_size": 1048576, "queue_depth": 32},
    "strata": {"host_budget": "1GiB", "device_budget": "1GiB"}})";
}

// The engine of the scenario, built once; Steps() times `steps` steps.
class Scenario {
 public:
  Status Build(const Config& cfg) {
    EngineOptions eo;
    eo.force_no_gpu = true;  // the scenario the "local" cluster describes
    STRATA_ASSIGN_OR_RETURN(e_, Engine::Create(cfg, eo));
    std::vector<float> init(kPerGroup, 0.01f);
    for (int g = 0; g < kGroups; ++g)
      STRATA_RETURN_IF_ERROR(e_->AddParam(g, "g" + std::to_string(g), kPerGroup, init.data()).status());
    STRATA_RETURN_IF_ERROR(e_->Build());
    grads_.resize(kPerGroup);
    for (size_t i = 0; i < grads_.size(); ++i) grads_[i] = static_cast<uint16_t>(0x3a00 + (i % 256));
    return Status::Ok();
  }
  // Median step time of `steps`.
  Result<double> Steps(int steps) {
    std::vector<double> times;
    for (int s = 0; s < steps; ++s) {
      for (int g = 0; g < kGroups; ++g) STRATA_RETURN_IF_ERROR(e_->Grads(g, grads_.data(), DType::kBF16));
      const auto t0 = std::chrono::steady_clock::now();
      STRATA_RETURN_IF_ERROR(e_->Step({}).status());
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    const EngineStats st = e_->stats();
    std::printf("engine, last step: wall %.3f s, disk busy %.3f s, cpu optimizer %.3f s\n", st.step_wall_s,
                st.disk_busy_s, st.cpu_optimizer_s);
    return times[times.size() / 2];
  }

 private:
  std::unique_ptr<Engine> e_;
  std::vector<uint16_t> grads_;
};

// This disk's rates drift by tens of percent from minute to minute, so the
// test pairs them: each round calibrates, then times steps right away, and
// the median of the rounds' errors must be within 25%.
TEST(CalibratedPrediction, OptimizerStepOnNvmeWithin25Percent) {
  const char* base = std::getenv("STRATA_PLAN_TEST_DIR");
  const std::filesystem::path dir =
      std::filesystem::path(base ? base : "/tmp") / ("strata-plan-calib-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  struct Cleanup {
    std::filesystem::path d;
    ~Cleanup() { std::filesystem::remove_all(d); }
  } cleanup{dir};
  auto cfg = ParseConfig(ConfigJson(dir.string()));
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  Scenario scenario;
  ASSERT_TRUE(scenario.Build(*cfg).ok());
  ASSERT_TRUE(scenario.Steps(1).ok());  // warm-up
  ModelSpec m;
  m.name = "calibration";
  for (int g = 0; g < kGroups; ++g) m.groups.push_back({"g" + std::to_string(g), kPerGroup, false});
  std::vector<double> errors;
  for (int round = 0; round < kRounds; ++round) {
    CalibrateOptions co;
    co.dir = dir.string();
    co.file_bytes = 512ull << 20;
    co.repeats = 3;
    co.queue_depth = 32;
    auto cal = Calibrate(co);
    ASSERT_TRUE(cal.ok()) << cal.status().ToString();
    auto measured = scenario.Steps(kSteps);
    ASSERT_TRUE(measured.ok()) << measured.status().ToString();
    ClusterSpec c = CalibratedCluster(*cal);
    c.has_gpu = false;
    auto sim = Simulate(m, c, *cfg, {.optimizer_only = true});
    ASSERT_TRUE(sim.ok());
    const double err = (sim->step_s - *measured) / *measured;
    errors.push_back(std::abs(err));
    std::printf("round %d: calibration: disk read %.0f MB/s, write %.0f MB/s, mixed x%.2f; Adam %.0f M/s; XXH3 %.1f "
                "GB/s\n",
                round, cal->nvme_read_Bps / 1e6, cal->nvme_write_Bps / 1e6, cal->nvme_mixed_factor,
                cal->cpu_adam_eps / 1e6, cal->checksum_Bps / 1e9);
    std::printf("round %d: simulated: disk busy %.3f s, cpu busy %.3f s\n", round, sim->Busy(SimResource::kDisk),
                sim->Busy(SimResource::kCpu));
    std::printf(
        "round %d: optimizer step over %llu parameters on NVMe: predicted %.3f s, measured %.3f s (%+.1f%%), "
        "bound by %s\n",
        round, static_cast<unsigned long long>(m.total_numel()), sim->step_s, *measured, 100 * err,
        SimResourceName(sim->bound));
  }
  std::sort(errors.begin(), errors.end());
  const double median = errors[errors.size() / 2];
  std::printf("median |error| of %d rounds: %.1f%%\n", kRounds, 100 * median);
  EXPECT_LE(median, 0.25);
}

}  // namespace
}  // namespace strata::plan
