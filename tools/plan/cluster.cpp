// Cluster presets and their JSON form. Preset figures are vendor datasheet
// numbers, discounted to what a transfer of large blocks reaches.
#include "tools/plan/cluster.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/align.h"
#include "base/sizes.h"

namespace strata::plan {

namespace {

constexpr double kG = 1e9;

ClusterSpec Dgx2() {  // 16x V100 32 GB, NVSwitch, 1.5 TB, 8x 3.84 TB NVMe (ZeRO-Infinity's test node)
  ClusterSpec c;
  c.name = "dgx2";
  c.gpus_per_node = 16;
  c.device_bytes = 32 * kGiB;
  c.host_bytes = 1536 * kGiB;
  c.nvme_drives = 8;
  c.nvme_drive_bytes = 3'840'000'000'000ull;
  c.nvme_read_Bps = 3.2 * kG;
  c.nvme_write_Bps = 2.2 * kG;
  c.pcie_Bps = 12 * kG;
  c.intra_node_Bps = 120 * kG;
  c.network_Bps = 100 * kG;  // 8x 100 Gb/s InfiniBand
  c.gpu_flops = 125e12;
  c.device_mem_Bps = 900 * kG;
  c.cpu_adam_eps = 2.0e9;  // 2x 24-core Xeon 8168
  c.host_mem_Bps = 150 * kG;
  c.checksum_Bps = 200 * kG;
  return c;
}

ClusterSpec DgxA100() {  // 8x A100 80 GB, 2 TB, 8x 3.84 TB NVMe gen4, 8x 200 Gb/s
  ClusterSpec c = Dgx2();
  c.name = "dgx-a100";
  c.gpus_per_node = 8;
  c.device_bytes = 80 * kGiB;
  c.host_bytes = 2048 * kGiB;
  c.nvme_read_Bps = 6.0 * kG;
  c.nvme_write_Bps = 3.5 * kG;
  c.pcie_Bps = 24 * kG;
  c.intra_node_Bps = 240 * kG;
  c.network_Bps = 200 * kG;
  c.gpu_flops = 312e12;
  c.device_mem_Bps = 2000 * kG;
  c.cpu_adam_eps = 4.0e9;  // 2x 64-core EPYC 7742
  c.host_mem_Bps = 300 * kG;
  c.checksum_Bps = 400 * kG;
  return c;
}

ClusterSpec DgxH100() {  // 8x H100 80 GB, 2 TB, 8x 3.84 TB NVMe gen4, 8x 400 Gb/s
  ClusterSpec c = DgxA100();
  c.name = "dgx-h100";
  c.pcie_Bps = 50 * kG;
  c.intra_node_Bps = 400 * kG;
  c.network_Bps = 400 * kG;
  c.gpu_flops = 989e12;
  c.device_mem_Bps = 3350 * kG;
  c.cpu_adam_eps = 5.0e9;  // 2x 56-core Xeon 8480C
  return c;
}

// This machine, with nominal rates; --calibrate measures the real ones.
ClusterSpec Local() {
  ClusterSpec c;
  c.name = "local";
  c.has_gpu = false;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  c.host_bytes =
      pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 16 * kGiB;
  c.device_bytes = c.host_bytes / 4;  // the engine's host-arena default
  c.nvme_drives = 1;
  c.nvme_drive_bytes = 256 * kGiB;
  c.nvme_read_Bps = 1 * kG;
  c.nvme_write_Bps = 1 * kG;
  c.pcie_Bps = 10 * kG;
  c.intra_node_Bps = 10 * kG;
  c.network_Bps = 10 * kG;
  c.gpu_flops = 1e11;
  c.device_mem_Bps = 10 * kG;
  const double cores = static_cast<double>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  c.cpu_adam_eps = 2e8 * cores;
  c.host_mem_Bps = 5 * kG * cores;
  c.checksum_Bps = 8 * kG * cores;
  return c;
}

Result<double> Number(const nlohmann::json& v, const std::string& key) {
  if (v.is_number()) return v.get<double>();
  if (v.is_string()) {
    auto b = ParseByteSize(v.get<std::string>());
    if (!b.ok()) return b.status().WithContext("cluster." + key);
    return static_cast<double>(*b);
  }
  return ConfigError("cluster." + key + ": expected a number or a size such as \"32GB\"");
}

constexpr uint64_t kMaxClusterRanks = 1u << 20;    // as a checkpoint's world (engine/format)
constexpr uint64_t kMaxClusterBytes = 1ull << 60;  // per memory, per drive, and all of a node's drives
constexpr uint32_t kMaxCount = 1u << 20;

// What a cluster key's value may be. A plan divides by every rate and
// multiplies the counts into 32-bit world sizes, so a zero rate (an infinite
// time) or a count that would wrap is refused here, naming the key.
enum class FieldKind { kCount, kPositiveCount, kBytes, kRate, kRateOrUnknown, kFactor };

std::string Shown(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

Status CheckValue(const std::string& k, FieldKind kind, double v) {
  const std::string at = "cluster." + k + ": ";
  if (!std::isfinite(v)) return ConfigError(at + "not a finite number");
  switch (kind) {
    case FieldKind::kCount:
    case FieldKind::kPositiveCount: {
      const double lo = kind == FieldKind::kPositiveCount ? 1 : 0;
      if (v != std::floor(v) || v < lo || v > kMaxCount)
        return ConfigError(at + "expected a whole number in " + Shown(lo) + ".." + std::to_string(kMaxCount) +
                           ", not " + Shown(v));
      return Status::Ok();
    }
    case FieldKind::kBytes:
      if (v < 0 || v > static_cast<double>(kMaxClusterBytes))
        return ConfigError(at + "expected a size in 0.." + std::to_string(kMaxClusterBytes) + " bytes, not " +
                           Shown(v));
      return Status::Ok();
    case FieldKind::kRateOrUnknown:  // 0: unknown, the related rate is taken
      if (v == 0) return Status::Ok();
      [[fallthrough]];
    case FieldKind::kRate:
      if (v <= 0) return ConfigError(at + "a rate must be above 0 (a plan divides by it), not " + Shown(v));
      return Status::Ok();
    case FieldKind::kFactor:
      if (v <= 0) return ConfigError(at + "expected a factor above 0, not " + Shown(v));
      return Status::Ok();
  }
  return InternalError(at + "unknown kind");
}

Status ReadLayerRates(const nlohmann::json& j, ClusterSpec* c) {
  if (!j.is_array())
    return ConfigError("cluster.cpu_layers: expected a list of {hidden, block_flops, head_flops}");
  c->cpu_layer_rates.clear();
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string at = "cluster.cpu_layers[" + std::to_string(i) + "]";
    const auto& e = j[i];
    for (const std::string k : {"hidden", "block_flops", "head_flops"}) {
      const bool hidden = k == "hidden";
      const double v = e.is_object() && e.contains(k) && e[k].is_number() ? e[k].get<double>() : 0;
      if (!(v > 0) || !std::isfinite(v) || (hidden && (v != std::floor(v) || v > kMaxCount)))
        return ConfigError(at + "." + k + ": required, " +
                           (hidden ? "a whole number in 1.." + std::to_string(kMaxCount) : "a positive number"));
    }
    if (e.contains("free_cores") && !e["free_cores"].is_number())
      return ConfigError(at + ".free_cores: expected a number");
    c->cpu_layer_rates.push_back({static_cast<uint64_t>(e["hidden"].get<double>()),
                                  e["block_flops"].get<double>(), e["head_flops"].get<double>(),
                                  e.value("free_cores", 0.0)});
  }
  std::sort(c->cpu_layer_rates.begin(), c->cpu_layer_rates.end(),
            [](const CpuLayerRate& a, const CpuLayerRate& b) { return a.hidden < b.hidden; });
  return Status::Ok();
}

}  // namespace

double ClusterSpec::LayerFlops(uint64_t hidden, bool head) const {
  const auto& r = cpu_layer_rates;
  if (has_gpu || r.empty()) return gpu_flops * gpu_efficiency;
  auto rate = [&](const CpuLayerRate& x) { return head ? x.head_flops : x.block_flops; };
  if (hidden <= r.front().hidden) return rate(r.front());
  if (hidden >= r.back().hidden) return rate(r.back());
  size_t i = 1;
  while (r[i].hidden < hidden) ++i;
  const double f = std::log(static_cast<double>(hidden) / static_cast<double>(r[i - 1].hidden)) /
                   std::log(static_cast<double>(r[i].hidden) / static_cast<double>(r[i - 1].hidden));
  return rate(r[i - 1]) + f * (rate(r[i]) - rate(r[i - 1]));
}

double ClusterSpec::RankCollectiveBps() const {
  if (nodes <= 1) return intra_node_Bps;
  return std::min(intra_node_Bps, network_Bps / gpus_per_node);
}

Result<ClusterSpec> PresetCluster(const std::string& name) {
  if (name == "dgx2") return Dgx2();
  if (name == "dgx-a100") return DgxA100();
  if (name == "dgx-h100") return DgxH100();
  if (name == "local") return Local();
  return InvalidError("cluster '" + name +
                      "': not a preset (dgx2, dgx-a100, dgx-h100, local) nor a JSON file");
}

Result<ClusterSpec> ParseClusterJson(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return ConfigError("cluster: not a JSON object");
  ClusterSpec c;
  if (j.contains("preset") && !j["preset"].is_string())
    return ConfigError("cluster.preset: expected a string");
  STRATA_ASSIGN_OR_RETURN(c, PresetCluster(j.value("preset", std::string("local"))));
  using enum FieldKind;
  struct Field {
    const char* key;
    double scale;
    FieldKind kind;
    std::function<void(ClusterSpec&, double)> set;
  };
  const Field fields[] = {
      {"nodes", 1, kPositiveCount, [](ClusterSpec& s, double v) { s.nodes = static_cast<uint32_t>(v); }},
      {"gpus_per_node", 1, kPositiveCount, [](ClusterSpec& s, double v) { s.gpus_per_node = static_cast<uint32_t>(v); }},
      {"device_memory", 1, kBytes, [](ClusterSpec& s, double v) { s.device_bytes = static_cast<uint64_t>(v); }},
      {"host_memory", 1, kBytes, [](ClusterSpec& s, double v) { s.host_bytes = static_cast<uint64_t>(v); }},
      {"nvme_drives", 1, kCount, [](ClusterSpec& s, double v) { s.nvme_drives = static_cast<uint32_t>(v); }},
      {"nvme_drive_capacity", 1, kBytes,
       [](ClusterSpec& s, double v) { s.nvme_drive_bytes = static_cast<uint64_t>(v); }},
      {"nvme_read", 1, kRate, [](ClusterSpec& s, double v) { s.nvme_read_Bps = v; }},
      {"nvme_write", 1, kRate, [](ClusterSpec& s, double v) { s.nvme_write_Bps = v; }},
      {"nvme_mixed_factor", 1, kFactor, [](ClusterSpec& s, double v) { s.nvme_mixed_factor = v; }},
      {"pcie", 1, kRate, [](ClusterSpec& s, double v) { s.pcie_Bps = v; }},
      {"intra_node", 1, kRate, [](ClusterSpec& s, double v) { s.intra_node_Bps = v; }},
      {"network", 1, kRate, [](ClusterSpec& s, double v) { s.network_Bps = v; }},
      {"gpu_tflops", 1e12, kRate, [](ClusterSpec& s, double v) { s.gpu_flops = v; }},
      {"gpu_efficiency", 1, kFactor, [](ClusterSpec& s, double v) { s.gpu_efficiency = v; }},
      {"device_mem_bw", 1, kRate, [](ClusterSpec& s, double v) { s.device_mem_Bps = v; }},
      {"cpu_adam_rate", 1, kRate, [](ClusterSpec& s, double v) { s.cpu_adam_eps = v; }},
      {"cpu_compact_adam_rate", 1, kRateOrUnknown, [](ClusterSpec& s, double v) { s.cpu_compact_adam_eps = v; }},
      {"host_mem_bw", 1, kRate, [](ClusterSpec& s, double v) { s.host_mem_Bps = v; }},
      {"checksum_rate", 1, kRate, [](ClusterSpec& s, double v) { s.checksum_Bps = v; }},
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (k == "preset" || k == "comment") continue;
    if (k == "cpu_layers") {
      STRATA_RETURN_IF_ERROR(ReadLayerRates(*it, &c));
      continue;
    }
    if (k == "name" || k == "has_gpu") {
      if (k == "name" ? !it->is_string() : !it->is_boolean())
        return ConfigError("cluster." + k +
                           (k == "name" ? ": expected a string" : ": expected true or false"));
      if (k == "name")
        c.name = it->get<std::string>();
      else
        c.has_gpu = it->get<bool>();
      continue;
    }
    auto f = std::find_if(std::begin(fields), std::end(fields), [&](const Field& x) { return k == x.key; });
    if (f == std::end(fields)) return ConfigError("cluster." + k + ": unknown key");
    STRATA_ASSIGN_OR_RETURN(double v, Number(*it, k));
    STRATA_RETURN_IF_ERROR(CheckValue(k, f->kind, v));
    f->set(c, v * f->scale);
  }
  if (c.gpu_efficiency > 1) return ConfigError("cluster.gpu_efficiency: not in (0, 1]");
  STRATA_RETURN_IF_ERROR(CheckWorld(c));
  if (c.nvme_drives > 0 && c.nvme_drive_bytes > kMaxClusterBytes / c.nvme_drives)
    return ConfigError("cluster: nvme_drives x nvme_drive_capacity is over " + std::to_string(kMaxClusterBytes) +
                       " bytes");
  return c;
}

Status CheckWorld(const ClusterSpec& c) {
  const uint64_t ranks = uint64_t{c.nodes} * c.gpus_per_node;
  if (ranks == 0 || ranks > kMaxClusterRanks)
    return ConfigError("cluster: nodes x gpus_per_node is " + std::to_string(c.nodes) + " x " +
                       std::to_string(c.gpus_per_node) + " = " + std::to_string(ranks) + " ranks; 1.." +
                       std::to_string(kMaxClusterRanks) + " are planned");
  return Status::Ok();
}

Result<ClusterSpec> ResolveCluster(const std::string& name_or_path) {
  if (name_or_path.find('/') == std::string::npos && !name_or_path.ends_with(".json"))
    return PresetCluster(name_or_path);
  std::ifstream f(name_or_path);
  if (!f) return IoError("cluster file " + name_or_path + ": cannot be opened");
  std::stringstream ss;
  ss << f.rdbuf();
  auto c = ParseClusterJson(ss.str());
  if (!c.ok()) return c.status().WithContext(name_or_path);
  return c;
}

}  // namespace strata::plan
