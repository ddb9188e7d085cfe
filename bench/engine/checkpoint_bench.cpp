// Checkpoint save of N parameters whose W, M, V (12 bytes a parameter) are
// homed on NVMe in DIR with a small host budget: the save reads each block
// from the swap file and writes it to DIR/ckpt. Prints every save's time and
// the median; bench/checkpoint.sh compares it with fio on the same directory.
// Usage: strata-checkpoint-bench DIR [params=178956970 (2 GiB of W+M+V)] [groups=32] [saves=3] [host_budget=1GiB]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "base/sizes.h"
#include "engine/engine.h"

using namespace strata;

static int Fail(const Status& s) {
  std::fprintf(stderr, "checkpoint_bench: %s\n", s.ToString().c_str());
  return 1;
}

static std::string ConfigJson(const std::string& dir, const std::string& host_budget) {
  return R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir + R"("}},
    "aio": {"block_size": 1048576, "queue_depth": 32},
    "strata": {"host_budget": ")" + host_budget + R"(", "device_budget": "1GiB"}})";
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [params] [groups] [saves] [host_budget]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1], ckpt = dir + "/ckpt";
  auto params = ParseByteSize(argc > 2 ? argv[2] : "178956970");
  const int groups = argc > 3 ? std::stoi(argv[3]) : 32;
  const int saves = argc > 4 ? std::stoi(argv[4]) : 3;
  if (!params.ok()) return Fail(params.status());
  const uint64_t per_group = *params / static_cast<uint64_t>(groups);
  auto cfg = ParseConfig(ConfigJson(dir, argc > 5 ? argv[5] : "1GiB"));
  if (!cfg.ok()) return Fail(cfg.status());
  auto e = Engine::Create(*cfg, {});
  if (!e.ok()) return Fail(e.status());
  Engine& eng = **e;
  std::vector<float> init(per_group);
  for (size_t i = 0; i < init.size(); ++i) init[i] = 0.01f * static_cast<float>(i % 977);
  for (int g = 0; g < groups; ++g)
    if (auto r = eng.AddParam(g, "layer" + std::to_string(g) + ".weight", per_group, init.data()); !r.ok()) return Fail(r.status());
  init = {};
  if (Status st = eng.Build(); !st.ok()) return Fail(st);
  std::vector<double> times;
  uint64_t bytes = 0, swap_read = 0;
  std::error_code ec;
  std::vector<uint16_t> grads(per_group);
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<uint16_t>(0x3a00 + (i % 256));  // bf16
  for (int s = 0; s < saves; ++s) {
    std::filesystem::remove_all(ckpt, ec);  // the previous save: disk space, outside the timing
    // A training step between saves, as a trainer saves (outside the timing).
    for (int g = 0; g < groups; ++g)
      if (Status st = eng.Grads(g, grads.data(), DType::kBF16); !st.ok()) return Fail(st);
    if (auto r = eng.Step({}); !r.ok()) return Fail(r.status());
    const EngineStats before = eng.stats();
    const auto t0 = std::chrono::steady_clock::now();
    if (Status st = eng.SaveCheckpoint(ckpt, "s" + std::to_string(s), nullptr, 0); !st.ok()) return Fail(st);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const EngineStats after = eng.stats();
    bytes = per_group * static_cast<uint64_t>(groups) * 12;  // W, M, V: the state the checkpoint holds
    swap_read = after.nvme_to_host - before.nvme_to_host;
    times.push_back(secs);
    std::printf("save %d: %.3f s, %s of state saved (%.0f MB/s), %s read from the swap file (%s)\n", s, secs,
                FormatBytes(bytes).c_str(), static_cast<double>(bytes) / secs / 1e6, FormatBytes(swap_read).c_str(),
                swap_read ? "copied" : "snapshot: the swap file linked, nothing copied");
    std::fflush(stdout);
  }
  if (!std::getenv("KEEP_CHECKPOINT")) std::filesystem::remove_all(ckpt, ec);  // KEEP_CHECKPOINT=1: left for strata-export
  std::sort(times.begin(), times.end());
  std::printf("checkpoint_bench params=%llu save_s=%.4f bytes=%llu swap_read_bytes=%llu\n",
              static_cast<unsigned long long>(per_group * static_cast<uint64_t>(groups)), times[times.size() / 2],
              static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(swap_read));
  return 0;
}
