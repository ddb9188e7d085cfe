// One optimizer step over N parameters with W, M, V (and G) homed on NVMe in
// DIR and a small host budget, gradients ready; prints the median step time
// and the bytes the step read and wrote. bench/offload_step.sh compares it
// with fio on the same directory.
// Usage: strata-offload-step DIR [params=256M] [groups=16] [steps=3] [host_budget=1GiB]
// Env: RINGS (strata.io_rings, default 1), STEP_IO (strata.step_io, default
// alternate), TRACE (strata.trace_path), PACED=1 (wait for a stdin line before each step; see below).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <vector>

#include "base/sizes.h"
#include "engine/engine.h"

using namespace strata;

static int Fail(const Status& s) {
  std::fprintf(stderr, "offload_step: %s\n", s.ToString().c_str());
  return 1;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [params] [groups] [steps] [host_budget]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  auto params = ParseByteSize(argc > 2 ? argv[2] : "268435456");
  const int groups = argc > 3 ? std::stoi(argv[3]) : 16;
  const int steps = argc > 4 ? std::stoi(argv[4]) : 3;
  const std::string host_budget = argc > 5 ? argv[5] : "1GiB";
  if (!params.ok()) return Fail(params.status());
  const uint64_t per_group = *params / static_cast<uint64_t>(groups);
  const std::string json = R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir + R"("}},
    "aio": {"block_size": 1048576, "queue_depth": 32},
    "strata": {"host_budget": ")" + host_budget + R"(", "device_budget": "4GiB", "io_rings": )" + (std::getenv("RINGS") ? std::string(std::getenv("RINGS")) : std::string("1")) +
    R"(, "step_io": ")" + (std::getenv("STEP_IO") ? std::string(std::getenv("STEP_IO")) : std::string("alternate")) + "\"" +
    (std::getenv("TRACE") ? R"(, "trace_path": ")" + std::string(std::getenv("TRACE")) + "\"" : std::string()) + "}}";
  auto cfg = ParseConfig(json);
  if (!cfg.ok()) return Fail(cfg.status());
  auto e = Engine::Create(*cfg, {});
  if (!e.ok()) return Fail(e.status());
  Engine& eng = **e;
  std::vector<float> init(per_group, 0.01f);
  for (int g = 0; g < groups; ++g) {
    auto r = eng.AddParam(g, "g" + std::to_string(g), per_group, init.data());
    if (!r.ok()) return Fail(r.status());
  }
  init = {};
  if (Status st = eng.Build(); !st.ok()) return Fail(st);
  std::vector<uint16_t> grads(per_group, 0x3c00);  // bf16 gradients (as a bf16 model hands them)
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<uint16_t>(0x3a00 + (i % 256));
  std::vector<double> times;
  EngineStats before{}, after{};
  // PACED=1: before each step print "ready" and wait for a line on stdin (EOF
  // ends the run), so that bench/offload_step.sh can measure fio right before
  // each step and pair them.
  const bool paced = std::getenv("PACED") && std::string(std::getenv("PACED")) == "1";
  for (int s = 0; s < steps; ++s) {
    if (paced) {
      std::printf("ready\n");
      std::fflush(stdout);
      char line[64];
      if (!std::fgets(line, sizeof line, stdin)) break;
    }
    for (int g = 0; g < groups; ++g)
      if (Status st = eng.Grads(g, grads.data(), DType::kBF16); !st.ok()) return Fail(st);
    before = eng.stats();
    const auto t0 = std::chrono::steady_clock::now();
    auto r = eng.Step({});
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!r.ok()) return Fail(r.status());
    after = eng.stats();
    times.push_back(secs);
    std::printf("step %d: %.3f s, read %s, wrote %s, cpu optimizer %.3f s, disk busy %.3f s\n", s, secs,
                FormatBytes(after.nvme_to_host - before.nvme_to_host).c_str(),
                FormatBytes(after.host_to_nvme - before.host_to_nvme).c_str(), after.cpu_optimizer_s,
                after.disk_busy_s);
    std::printf("offload_step_round step_s=%.4f read_bytes=%llu write_bytes=%llu\n", secs,
                static_cast<unsigned long long>(after.nvme_to_host - before.nvme_to_host),
                static_cast<unsigned long long>(after.host_to_nvme - before.host_to_nvme));
    std::fflush(stdout);
  }
  if (times.empty()) return 0;
  std::sort(times.begin(), times.end());
  std::printf("host peak %s of %s budget\n", FormatBytes(after.host.peak).c_str(), FormatBytes(after.host.budget).c_str());
  std::printf("offload_step params=%llu step_s=%.4f read_bytes=%llu write_bytes=%llu step_io=%s\n",
              static_cast<unsigned long long>(per_group * static_cast<uint64_t>(groups)), times[times.size() / 2],
              static_cast<unsigned long long>(after.nvme_to_host - before.nvme_to_host),
              static_cast<unsigned long long>(after.host_to_nvme - before.host_to_nvme),
              cfg->strata.step_io.c_str());
  return 0;
}
