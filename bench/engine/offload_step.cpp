// One optimizer step over N parameters with W, M, V (and G) homed on NVMe in
// DIR and a small host budget, gradients ready; prints the median step time
// and the bytes the step read and wrote. bench/offload_step.sh compares it
// with fio on the same directory.
// Usage: strata-offload-step DIR [params=256M] [groups=16] [steps=3] [host_budget=1GiB]
// Env: RINGS (strata.io_rings, default 1), STEP_IO (strata.step_io, default
// alternate), TRACE (strata.trace_path), PACED=1 (wait for a stdin line before each step; see below),
// FORMATS (below), PARAM_NVME=1 (P homed on NVMe too), GRAD_ACCUM (data_types.grad_accum_dtype).
// Parameters start at zero beyond 2^30 of them (nothing held in memory for them).
#include <algorithm>
#include <memory>
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
  // FORMATS: the strata.state_format of each engine, comma-separated; with
  // two, both engines live side by side (their swap files in DIR/<format>)
  // and each round steps both, in alternating order.
  std::vector<std::string> formats;
  {
    std::string f = std::getenv("FORMATS") ? std::getenv("FORMATS") : "fp32";
    for (size_t at = 0; at <= f.size();) {
      const size_t comma = std::min(f.find(',', at), f.size());
      formats.push_back(f.substr(at, comma - at));
      at = comma + 1;
    }
  }
  struct Run {
    std::string format;
    std::unique_ptr<Engine> eng;
    std::vector<double> times;
    EngineStats before{}, after{};
  };
  std::vector<Run> runs;
  for (const std::string& format : formats) {
    const std::string where = formats.size() > 1 ? dir + "/" + format : dir;
    if (formats.size() > 1 && std::system(("mkdir -p '" + where + "'").c_str()) != 0) return Fail(IoError("mkdir " + where));
    const bool param_nvme = std::getenv("PARAM_NVME") && std::string(std::getenv("PARAM_NVME")) == "1";
    const std::string accum = std::getenv("GRAD_ACCUM") ? std::getenv("GRAD_ACCUM") : "fp32";
    const std::string json = R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "data_types": {"grad_accum_dtype": ")" + accum + R"("},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + where + R"("},
      "offload_param": {"device": ")" + (param_nvme ? "nvme" : "none") + R"(", "nvme_path": ")" + where +
                             R"(", "buffer_size": )" + std::to_string(per_group) + R"(}},
    "aio": {"block_size": 1048576, "queue_depth": 32},
    "strata": {"host_budget": ")" + host_budget + R"(", "device_budget": "4GiB", "io_rings": )" + (std::getenv("RINGS") ? std::string(std::getenv("RINGS")) : std::string("1")) +
    R"(, "step_io": ")" + (std::getenv("STEP_IO") ? std::string(std::getenv("STEP_IO")) : std::string("alternate")) + "\"" +
    R"(, "state_format": ")" + format + "\"" +
    (std::getenv("TRACE") ? R"(, "trace_path": ")" + std::string(std::getenv("TRACE")) + "\"" : std::string()) + "}}";
    auto cfg = ParseConfig(json);
    if (!cfg.ok()) return Fail(cfg.status());
    auto e = Engine::Create(*cfg, {});
    if (!e.ok()) return Fail(e.status());
    Engine& eng = **e;
    // Up to 2^30 parameters start at 0.01; more start at zero, which the
    // engine holds no memory for until Build (8 billion would need 32 GB).
    const bool valued = *params <= (uint64_t{1} << 30);
    std::vector<float> init(valued ? per_group : 0, 0.01f);
    for (int g = 0; g < groups; ++g) {
      auto r = eng.AddParam(g, "g" + std::to_string(g), per_group, valued ? init.data() : nullptr);
      if (!r.ok()) return Fail(r.status());
    }
    init = {};
    if (Status st = eng.Build(); !st.ok()) return Fail(st);
    runs.push_back({format, std::move(*e), {}, {}, {}});
  }
  std::vector<uint16_t> grads(per_group, 0x3c00);  // bf16 gradients (as a bf16 model hands them)
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<uint16_t>(0x3a00 + (i % 256));
  // PACED=1: before each round print "ready" and wait for a line on stdin (EOF
  // ends the run), so that bench/offload_step.sh can measure fio right before
  // each round and pair them.
  const bool paced = std::getenv("PACED") && std::string(std::getenv("PACED")) == "1";
  for (int s = 0; s < steps; ++s) {
    if (paced) {
      std::printf("ready\n");
      std::fflush(stdout);
      char line[64];
      if (!std::fgets(line, sizeof line, stdin)) break;
    }
    for (size_t k = 0; k < runs.size(); ++k) {
      Run& run = runs[s % 2 == 0 ? k : runs.size() - 1 - k];
      Engine& eng = *run.eng;
      for (int g = 0; g < groups; ++g)
        if (Status st = eng.Grads(g, grads.data(), DType::kBF16); !st.ok()) return Fail(st);
      run.before = eng.stats();
      const auto t0 = std::chrono::steady_clock::now();
      auto r = eng.Step({});
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!r.ok()) return Fail(r.status());
      run.after = eng.stats();
      run.times.push_back(secs);
      const uint64_t rb = run.after.nvme_to_host - run.before.nvme_to_host;
      const uint64_t wb = run.after.host_to_nvme - run.before.host_to_nvme;
      std::printf("step %d %s: %.3f s, read %s, wrote %s, cpu optimizer %.3f s, disk busy %.3f s\n", s,
                  run.format.c_str(), secs, FormatBytes(rb).c_str(), FormatBytes(wb).c_str(),
                  run.after.cpu_optimizer_s, run.after.disk_busy_s);
    }
    // The round's lines, in FORMATS order (bench/offload_step.sh reads them).
    for (Run& run : runs)
      std::printf("offload_step_round format=%s step_s=%.4f read_bytes=%llu write_bytes=%llu\n", run.format.c_str(),
                  run.times.back(), static_cast<unsigned long long>(run.after.nvme_to_host - run.before.nvme_to_host),
                  static_cast<unsigned long long>(run.after.host_to_nvme - run.before.host_to_nvme));
    std::fflush(stdout);
  }
  for (Run& run : runs) {
    if (run.times.empty()) return 0;
    std::sort(run.times.begin(), run.times.end());
    std::printf("host peak %s of %s budget (%s)\n", FormatBytes(run.after.host.peak).c_str(),
                FormatBytes(run.after.host.budget).c_str(), run.format.c_str());
    std::printf("offload_step format=%s params=%llu step_s=%.4f read_bytes=%llu write_bytes=%llu step_io=%s\n",
                run.format.c_str(), static_cast<unsigned long long>(per_group * static_cast<uint64_t>(groups)),
                run.times[run.times.size() / 2],
                static_cast<unsigned long long>(run.after.nvme_to_host - run.before.nvme_to_host),
                static_cast<unsigned long long>(run.after.host_to_nvme - run.before.host_to_nvme),
                run.eng->config().strata.step_io.c_str());
    // strata.write_behind: how many steps returned before their writes
    // landed, and how long the engine then waited for them (the next step's
    // reads). A time, so the benchmark's to report, not a test's to compare.
    std::printf("offload_step_behind format=%s write_behind_steps=%llu behind_wait_s=%.4f\n", run.format.c_str(),
                static_cast<unsigned long long>(run.after.write_behind_steps), run.after.behind_wait_s);
  }
  return 0;
}
