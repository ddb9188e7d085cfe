// Benchmark: the simulator's prediction against a measured step on this
// machine. The rates come from --calibrate's measurements (taken here, in the
// same folder), the step is the real Engine's optimizer step over 64M
// parameters with W, M, V, G on NVMe (as bench/engine/offload_step), in paired
// rounds. Last line: `calibrated_prediction ratio=R`, the median over rounds of
// predicted / measured step time (1 is exact; it was within 25% on an idle
// machine, and misses under load, which is why it is a benchmark, not a test).
// Usage: strata-calibrated-prediction [DIR] [fp32|compact]   (a writable disk
// folder, default STRATA_PLAN_TEST_DIR, else /tmp; the state format, default
// fp32: compact checks the planner's compact step, its bytes and its CPU rate).
// Exit 1 when a step fails, 2 on bad arguments.
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

std::string ConfigJson(const std::string& dir, const std::string& format) {
  return R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
         dir + R"("}},
    "aio": {"block_size": 1048576, "queue_depth": 32},
    "strata": {"host_budget": "1GiB", "device_budget": "1GiB", "state_format": ")" +
         format + R"("}})";
}

int Fail(const Status& st) {
  std::fprintf(stderr, "calibrated_prediction: %s\n", st.ToString().c_str());
  return 1;
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
    uint64_t read = 0, written = 0;  // by the steps (the grads calls write G too)
    for (int s = 0; s < steps; ++s) {
      for (int g = 0; g < kGroups; ++g) STRATA_RETURN_IF_ERROR(e_->Grads(g, grads_.data(), DType::kBF16));
      const EngineStats before = e_->stats();
      const auto t0 = std::chrono::steady_clock::now();
      STRATA_RETURN_IF_ERROR(e_->Step({}).status());
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      const EngineStats after = e_->stats();
      read += after.nvme_to_host - before.nvme_to_host;
      written += after.host_to_nvme - before.host_to_nvme;
    }
    std::sort(times.begin(), times.end());
    const EngineStats st = e_->stats();
    std::printf("engine, last step: wall %.3f s, disk busy %.3f s, cpu optimizer %.3f s; a step reads %.0f MB, "
                "writes %.0f MB (%.0f MB/s over the disk's busy time)\n",
                st.step_wall_s, st.disk_busy_s, st.cpu_optimizer_s, double(read) / steps / 1e6,
                double(written) / steps / 1e6, double(read + written) / steps / st.disk_busy_s / 1e6);
    return times[times.size() / 2];
  }

 private:
  std::unique_ptr<Engine> e_;
  std::vector<uint16_t> grads_;
};

// This disk's rates drift by tens of percent from minute to minute, so the
// rounds pair them: each calibrates, then times steps right away.
Result<double> Round(int round, const std::string& dir, const ModelSpec& m, const Config& cfg, Scenario& scenario) {
  CalibrateOptions co;
  co.dir = dir;
  co.file_bytes = 512ull << 20;
  co.repeats = 3;
  co.queue_depth = 32;
  STRATA_ASSIGN_OR_RETURN(Calibration cal, Calibrate(co));
  STRATA_ASSIGN_OR_RETURN(double measured, scenario.Steps(kSteps));
  ClusterSpec c = CalibratedCluster(cal);
  c.has_gpu = false;
  STRATA_ASSIGN_OR_RETURN(SimResult sim, Simulate(m, c, cfg, {.optimizer_only = true}));
  std::printf("round %d: calibration: disk read %.0f MB/s, write %.0f MB/s, mixed x%.2f; Adam %.0f M/s, compact "
              "Adam %.0f M/s; XXH3 %.1f GB/s\n",
              round, cal.nvme_read_Bps / 1e6, cal.nvme_write_Bps / 1e6, cal.nvme_mixed_factor, cal.cpu_adam_eps / 1e6,
              cal.cpu_compact_adam_eps / 1e6, cal.checksum_Bps / 1e9);
  std::printf("round %d: simulated: disk busy %.3f s, cpu busy %.3f s; reads %.0f MB, writes %.0f MB\n", round,
              sim.Busy(SimResource::kDisk), sim.Busy(SimResource::kCpu), double(sim.disk_read_bytes) / 1e6,
              double(sim.disk_write_bytes) / 1e6);
  std::printf("round %d: optimizer step over %llu parameters on NVMe: predicted %.3f s, measured %.3f s (%+.1f%%), "
              "bound by %s\n",
              round, static_cast<unsigned long long>(m.total_numel()), sim.step_s, measured,
              100 * (sim.step_s - measured) / measured, SimResourceName(sim.bound));
  return sim.step_s / measured;
}

int Run(const std::filesystem::path& dir, const std::string& format) {
  auto cfg = ParseConfig(ConfigJson(dir.string(), format));
  if (!cfg.ok()) return Fail(cfg.status());
  Scenario scenario;
  if (Status st = scenario.Build(*cfg); !st.ok()) return Fail(st);
  if (auto warm = scenario.Steps(1); !warm.ok()) return Fail(warm.status());
  ModelSpec m;
  m.name = "calibration";
  for (int g = 0; g < kGroups; ++g) m.groups.push_back({"g" + std::to_string(g), kPerGroup, false});
  std::vector<double> ratios;
  for (int round = 0; round < kRounds; ++round) {
    auto ratio = Round(round, dir.string(), m, *cfg, scenario);
    if (!ratio.ok()) return Fail(ratio.status());
    ratios.push_back(*ratio);
  }
  std::sort(ratios.begin(), ratios.end());
  std::printf("calibrated_prediction format=%s ratio=%.3f\n", format.c_str(), ratios[ratios.size() / 2]);
  return 0;
}

}  // namespace
}  // namespace strata::plan

int main(int argc, char** argv) {
  const char* base = argc > 1 ? argv[1] : std::getenv("STRATA_PLAN_TEST_DIR");
  const std::string format = argc > 2 ? argv[2] : "fp32";
  if (argc > 3 || (format != "fp32" && format != "compact")) {
    std::fprintf(stderr, "usage: strata-calibrated-prediction [DIR] [fp32|compact] (got format '%s')\n",
                 format.c_str());
    return 2;
  }
  const std::filesystem::path dir =
      std::filesystem::path(base ? base : "/tmp") / ("strata-plan-calib-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const int rc = strata::plan::Run(dir, format);
  std::filesystem::remove_all(dir);
  return rc;
}
