// The cluster a plan is made for: nodes of GPUs with device memory, host
// memory, NVMe drives, and the rates of every link and processor the step
// uses. From a preset ("dgx2", "dgx-a100", "dgx-h100", "local") or from a
// JSON file of the same keys (what --calibrate writes is such a file).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace strata::plan {

// The CPU layer kernels' measured speed at one width (--calibrate), in FLOP/s
// of the model's count (model.h: BlockStepFlops, HeadStepFlops): a block's
// forward, recompute and backward, and the tied LM head's forward and backward.
struct CpuLayerRate {
  uint64_t hidden = 0;  // C
  double block_flops = 0;
  double head_flops = 0;
  // Cores that other processes left free meanwhile (/proc/stat): below the
  // machine's count, these are a busy machine's rates. Informational.
  double free_cores = 0;
};

struct ClusterSpec {
  std::string name;
  uint32_t nodes = 1;
  uint32_t gpus_per_node = 1;  // ranks per node
  bool has_gpu = true;         // false: the device tier is a host arena (a machine without a GPU)
  uint64_t device_bytes = 0;   // per GPU
  uint64_t host_bytes = 0;     // per node
  uint32_t nvme_drives = 0;    // per node
  uint64_t nvme_drive_bytes = 0;
  double nvme_read_Bps = 0;   // per drive
  double nvme_write_Bps = 0;  // per drive
  // Reads and writes in flight together take this times the sum of their
  // alone-times (1: they simply share the drive; --calibrate measures it).
  double nvme_mixed_factor = 1;
  double pcie_Bps = 0;          // per GPU, each direction
  double intra_node_Bps = 0;    // per GPU, collectives within a node (NVLink / NVSwitch)
  double network_Bps = 0;       // per node, collectives between nodes
  double gpu_flops = 0;         // per GPU, peak 16-bit
  double gpu_efficiency = 0.4;  // fraction of peak a layer's matmuls reach
  double device_mem_Bps = 0;    // per GPU (HBM), for an optimizer step on the device
  double cpu_adam_eps = 0;      // per node, elements per second of the CPU Adam (all cores)
  // The same for compact state (kernels/cpu/compact.h: unpack, update, pack);
  // 0: unknown, taken as cpu_adam_eps (the presets; --calibrate measures it).
  double cpu_compact_adam_eps = 0;
  double host_mem_Bps = 0;      // per node, memcpy-like streams (gradient accumulation)
  double checksum_Bps = 0;      // per node, XXH3 over swap blocks (all cores)
  // Without a GPU the layers run on the CPU kernels at these rates, by width
  // (ascending); empty: at gpu_flops x gpu_efficiency like a GPU's.
  std::vector<CpuLayerRate> cpu_layer_rates;

  uint32_t world_size() const { return nodes * gpus_per_node; }
  uint64_t nvme_bytes() const { return nvme_drive_bytes * nvme_drives; }
  // Per-rank shares of what a node's ranks share.
  double RankNvmeRead() const { return nvme_read_Bps * nvme_drives / gpus_per_node; }
  double RankNvmeWrite() const { return nvme_write_Bps * nvme_drives / gpus_per_node; }
  double RankAdamEps() const { return cpu_adam_eps / gpus_per_node; }
  double RankCompactAdamEps() const {
    return (cpu_compact_adam_eps > 0 ? cpu_compact_adam_eps : cpu_adam_eps) / gpus_per_node;
  }
  double RankHostMem() const { return host_mem_Bps / gpus_per_node; }
  double RankChecksum() const { return checksum_Bps / gpus_per_node; }
  // Bandwidth of one rank in a ring collective: NVLink inside a node, the
  // node's network share across nodes.
  double RankCollectiveBps() const;
  // FLOP/s of the layers at width `hidden`: the calibrated CPU rates
  // interpolated in log(hidden) (clamped to the widths measured), else the GPU's.
  double LayerFlops(uint64_t hidden, bool head) const;
};

Result<ClusterSpec> PresetCluster(const std::string& name);
// JSON keys: preset, name, nodes, gpus_per_node, has_gpu, device_memory,
// host_memory, nvme_drives, nvme_drive_capacity (sizes as numbers of bytes or
// "32GB"-style strings), nvme_read, nvme_write, pcie, intra_node, network,
// device_mem_bw, host_mem_bw, checksum_rate (bytes per second, numbers or
// "12GB"), gpu_tflops, gpu_efficiency, cpu_adam_rate and cpu_compact_adam_rate
// (elements per second),
// cpu_layers ([{"hidden": C, "block_flops": F, "head_flops": F,
// "free_cores": N}, ...]).
Result<ClusterSpec> ParseClusterJson(const std::string& text);
// The world a plan is for, nodes x gpus_per_node, is 1..2^20 ranks (as a
// checkpoint's; world_size() is 32-bit). ParseClusterJson checks it; so must
// whoever overrides nodes or gpus_per_node afterwards.
Status CheckWorld(const ClusterSpec& c);
// A preset name, or a path to a JSON file.
Result<ClusterSpec> ResolveCluster(const std::string& name_or_path);

}  // namespace strata::plan
