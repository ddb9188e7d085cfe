// The planner's small scenarios, shared by its tests (tests/plan) and its
// time-model benchmark (bench/plan/schedule_model.cpp), so that both speak
// of the same model, cluster and config: a flat model of equal groups, one
// rank on the "local" preset with given disk rates and every other cost
// free, and a ZeRO config with the homes named.
#pragma once

#include <cstdint>
#include <string>

#include "engine/config/config.h"
#include "tools/plan/cluster.h"
#include "tools/plan/model.h"

namespace strata::plan {

// ZeRO `stage` with P offloaded to `param` and the optimizer state to `opt`
// ("none", "cpu", "nvme"; NVMe at /nvme), bf16 compute unless `extra`
// (config text put first, with its trailing comma) asks for fp16. G sits
// beside W, M, V on NVMe, as ZeRO-Infinity and the calibration place it,
// unless `extra` sets strata.grad_home.
inline Result<Config> FixtureConfig(int stage, const char* param, const char* opt, const std::string& extra = "") {
  const bool fp16 = extra.find(R"("fp16")") != std::string::npos;
  auto c = ParseConfig(std::string(fp16 ? "{" : R"({"bf16": {"enabled": true}, )") + extra +
                       R"("zero_optimization": {"stage": )" + std::to_string(stage) +
                       R"(, "offload_param": {"device": ")" + param +
                       R"(", "nvme_path": "/nvme", "buffer_size": 1e10}, "offload_optimizer": {"device": ")" +
                       opt + R"(", "nvme_path": "/nvme"}}})");
  if (c.ok() && extra.find("grad_home") == std::string::npos) c->strata.grad_home = "nvme";
  return c;
}

// `groups` trainable groups of `numel` elements each.
inline ModelSpec FlatModel(int groups, uint64_t numel) {
  ModelSpec m;
  m.name = "flat";
  for (int g = 0; g < groups; ++g) m.groups.push_back({"g" + std::to_string(g), numel, false});
  return m;
}

// One rank on the local preset with the given disk rates; checksums and host
// copies free (P in place: its copies to the slot and back cost nothing), a
// fast CPU: each scenario sets what it measures.
inline ClusterSpec OneRankCluster(double read_Bps, double write_Bps) {
  ClusterSpec c = PresetCluster("local").value();
  c.gpus_per_node = 1;
  c.nvme_read_Bps = read_Bps;
  c.nvme_write_Bps = write_Bps;
  c.cpu_adam_eps = 1e15;
  c.checksum_Bps = 1e18;
  c.host_mem_Bps = 1e18;
  return c;
}

// gpt2-xl on one A100 (1024 tokens, micro-batch 16): with W, M, V on the
// host, a backward (about 1.5 s) that outlasts the CPU's update (about 0.4 s).
struct XlOnOneA100 {
  ModelSpec m = [] {
    ModelSpec x = PresetModel("gpt2-xl").value();
    x.seq = 1024;
    x.micro_batch = 16;
    return x;
  }();
  ClusterSpec c = [] {
    ClusterSpec x = PresetCluster("dgx-a100").value();
    x.gpus_per_node = 1;
    return x;
  }();
};

// Write-behind's scenario: GPT-2 (86M) on one rank of the "local" preset
// with 16 GiB of RAM (not this machine's), P and G in host memory, W, M, V
// on NVMe stepped in units of 3M elements (three to each 7.09 M-element
// block: pieces), strata.write_behind `wb`; `more` adds keys to "strata"
// (with their leading comma).
struct WriteBehindScenario {
  ModelSpec m = PresetModel("gpt2").value();
  ClusterSpec c = [] {
    ClusterSpec x = PresetCluster("local").value();
    x.host_bytes = uint64_t{16} << 30;
    return x;
  }();
  static Result<Config> Cfg(const char* wb, const std::string& more = "") {
    auto k = FixtureConfig(3, "cpu", "nvme",
                           std::string(R"("strata": {"grad_home": "host", "write_behind": ")") + wb + "\"" + more + "}, ");
    if (k.ok()) k->zero.sub_group_size = 3000000;
    return k;
  }
};

}  // namespace strata::plan
