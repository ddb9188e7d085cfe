// strata-plan's prediction of a whole strata-train step against the real
// strata-train on this machine: `--calibrate DIR` measures the disk, memory,
// Adam and layer-kernel rates, `--model small --cluster DIR/...calibration.json
// --config <strata-train's config> --simulate` predicts the step, and
// strata-train (P, W, M, V, G on NVMe under DIR) measures it: step = B·T /
// tokens_per_s. Within 25%. The machine may be shared: each round calibrates
// right before it trains, other processes' CPU time is read from /proc/stat
// during both, and the layer rates are scaled by the cores left free to
// strata-train over those left free to the calibration (a no-op on an idle
// machine) before the prediction is compared; the median of three rounds'
// ratios is asserted. Needs a writable disk folder: STRATA_PLAN_TEST_DIR,
// else /tmp.
// Usage: plan_train_prediction_test STRATA_PLAN STRATA_TRAIN
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tools/plan/calibrate.h"

namespace {

using strata::plan::FreeCores;
using strata::plan::MachineBusySeconds;

std::string g_plan, g_train;  // binaries, from argv

constexpr const char* kPreset = "small";
constexpr int kBatch = 8, kSeq = 128;  // strata-train's defaults for "small"
constexpr int kRounds = 3;

// Runs a command; returns its stdout, or an empty string when it fails.
std::string Run(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  if (pclose(p) != 0) {
    ADD_FAILURE() << "failed: " << cmd << "\n" << out;
    return "";
  }
  return out;
}

// The config strata-train builds without --config or --resident
// (tools/train/main.cpp, MakeConfig), its swap folder `swap`.
std::string TrainConfig(const std::string& swap) {
  nlohmann::json j = {
      {"optimizer",
       {{"type", "AdamW"},
        {"params", {{"lr", 3e-3}, {"betas", {0.9, 0.95}}, {"eps", 1e-8}, {"weight_decay", 0.0}}}}},
      {"gradient_clipping", 1.0},
      {"bf16", {{"enabled", true}}},
      {"zero_optimization",
       {{"stage", 3},
        {"stage3_prefetch_bucket_size", 2e6},
        {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", swap}}},
        {"offload_param", {{"device", "nvme"}, {"nvme_path", swap}}}}},
      {"strata", {{"device_budget", "2MiB"}, {"host_budget", "256MiB"}}}};
  return j.dump(2);
}

double ChildrenCpuSeconds() {  // user + system of the children waited for
  rusage u{};
  getrusage(RUSAGE_CHILDREN, &u);
  auto sec = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec);
  };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool Calibrate(const std::filesystem::path& dir) {
  return !Run(g_plan + " --calibrate " + dir.string() + " --calibrate-size 128MiB").empty();
}

// The simulated step on the cluster file `cluster`.
double Predicted(const std::string& cluster, const std::string& config) {
  const std::string out = Run(g_plan + " --model " + kPreset + " --cluster " + cluster + " --config " +
                              config + " --simulate --json");
  const auto j = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("simulation")) {
    ADD_FAILURE() << "no simulation in strata-plan's JSON:\n" << out;
    return 0;
  }
  return j["simulation"]["step_s"].get<double>();
}

// The calibration with its layer rates as they would have been with
// `free_cores` cores left free (the rates scale with the cores they get).
std::string RescaledCluster(const std::filesystem::path& calibration, double free_cores) {
  std::ifstream in(calibration);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("cpu_layers")) {
    ADD_FAILURE() << calibration << ": no cpu_layers";
    return calibration.string();
  }
  for (auto& e : j["cpu_layers"]) {
    const double f = free_cores / e["free_cores"].get<double>();
    e["block_flops"] = e["block_flops"].get<double>() * f;
    e["head_flops"] = e["head_flops"].get<double>() * f;
    e["free_cores"] = free_cores;
  }
  const std::filesystem::path out = calibration.parent_path() / "rescaled-calibration.json";
  std::ofstream(out) << j.dump(2);
  return out.string();
}

// strata-train's mean step after the first: B·T over its tokens_per_s; and
// the cores other processes left free meanwhile.
double Measured(const std::filesystem::path& swap, double* free_cores) {
  const double busy0 = MachineBusySeconds(), self0 = ChildrenCpuSeconds(), wall0 = Now();
  const std::string out = Run(g_train + " --preset " + kPreset + " --steps 12 --nvme " + swap.string());
  const double busy1 = MachineBusySeconds(), self1 = ChildrenCpuSeconds(), wall1 = Now();
  *free_cores = FreeCores(busy0 < 0 || busy1 < 0 ? -1 : std::max(0.0, (busy1 - busy0) - (self1 - self0)),
                          wall1 - wall0);
  const size_t at = out.rfind("tokens_per_s=");
  if (at == std::string::npos) {
    ADD_FAILURE() << "no tokens_per_s in strata-train's output:\n" << out;
    return 0;
  }
  const double tps = std::atof(out.c_str() + at + 13);
  return tps > 0 ? kBatch * kSeq / tps : 0;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

TEST(TrainPrediction, StrataTrainStepWithin25Percent) {
  const char* base = std::getenv("STRATA_PLAN_TEST_DIR");
  const std::filesystem::path dir =
      std::filesystem::path(base ? base : "/tmp") / ("strata-plan-train-" + std::to_string(::getpid()));
  const std::filesystem::path swap = dir / "swap";
  std::filesystem::create_directories(swap);
  const std::string config = (dir / "train-config.json").string();
  std::ofstream(config) << TrainConfig(swap.string());

  const std::filesystem::path calibration = dir / "strata-plan-calibration.json";
  std::vector<double> predicted, measured, ratio;
  for (int r = 0; r < kRounds; ++r) {
    if (!Calibrate(dir)) break;
    const double raw = Predicted(calibration.string(), config);
    double free_cores = 0;
    const double m = Measured(swap, &free_cores);
    const double p = Predicted(RescaledCluster(calibration, free_cores), config);
    if (raw <= 0 || p <= 0 || m <= 0) break;
    predicted.push_back(p);
    measured.push_back(m);
    ratio.push_back(p / m);
    std::printf(
        "round %d: strata-train --preset %s (%d x %d tokens): predicted %.3f s/step (%.3f s before matching "
        "the %.1f cores left free to strata-train), measured %.3f s/step (%+.1f%%)\n",
        r + 1, kPreset, kBatch, kSeq, p, raw, free_cores, m, 100 * (p / m - 1));
  }
  std::filesystem::remove_all(dir);
  ASSERT_EQ(ratio.size(), static_cast<size_t>(kRounds));
  const double err = Median(ratio) - 1;
  std::printf("median: predicted %.3f s/step, measured %.3f s/step; median of the rounds' errors %+.1f%%\n",
              Median(predicted), Median(measured), 100 * err);
  EXPECT_LE(std::abs(err), 0.25);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s STRATA_PLAN STRATA_TRAIN\n", argv[0]);
    return 2;
  }
  g_plan = argv[1];
  g_train = argv[2];
  return RUN_ALL_TESTS();
}
