// Capacity accounting. Per rank, with Psi = parameters and N = ranks:
//   P  compute dtype (2 B): Psi, or Psi/N in stage 3            -> offload_param's tier
//   G  optimizer on the device: compute dtype, Psi (stages 0-1) or Psi/N (2-3), on the device;
//      optimizer offloaded: the fp32 accumulator of this rank's shard, beside W
//   W, M, V  fp32 (4 B each; V only for Adam): Psi, or Psi/N in stages 1-3 -> offload_optimizer's tier
// With bf16 and Adam on the device this is the ZeRO paper's (2 + 2 + 12) Psi
// divided per stage; offloaded, the ZeRO-Offload / ZeRO-Infinity accounting.
// strata.state_format "compact" keeps the master's bf16 half in P and stores
// W as its int8 corrections (1 B), M and V in 1.125 B each (StateBytes):
// offloaded to NVMe in stage 3 that is (2 + 4 + 5.25 - 2) Psi/N, not 18.
#include "tools/plan/capacity.h"

#include <algorithm>

#include "base/sizes.h"
#include "engine/layout/partition.h"
#include "kernels/cpu/compact.h"

namespace strata::plan {

namespace {

constexpr double kDeviceUsable = 0.9;  // the engine's default device budget: 90% of the GPU
constexpr double kHostUsable = 0.9;    // leave a tenth of host memory to the OS and the trainer

TierKind HomeOf(OffloadDevice d) {
  return d == OffloadDevice::kNone  ? TierKind::kDevice
         : d == OffloadDevice::kCpu ? TierKind::kHost
                                    : TierKind::kNvme;
}

constexpr uint64_t kNvmeBlock = 4096;
uint64_t NvmePadded(uint64_t bytes) { return (bytes + kNvmeBlock - 1) / kNvmeBlock * kNvmeBlock; }

void Add(Capacity& c, PlanState s, TierKind t, uint64_t bytes) {
  c.bytes[static_cast<size_t>(s)][static_cast<size_t>(t)] += bytes;
}

}  // namespace

const char* PlanStateName(PlanState s) {
  static const char* kNames[] = {"P", "G", "W", "M", "V", "act", "work", "staging"};
  return kNames[static_cast<int>(s)];
}

const char* PlanStateDescription(PlanState s) {
  static const char* kText[] = {
      "parameters, compute dtype (compact: the master's bf16 half)",
      "gradients (compute dtype on the device; fp32 accumulator when offloaded)",
      "master weights (fp32; compact: int8 corrections to P's bf16)",
      "first moment (fp32, or compact's 8-bit codes)",
      "second moment (fp32, or compact's 8-bit codes)",
      "activations (one micro-batch)",
      "device working buffers (gathered and prefetched groups, one group's gradient)",
      "pinned host staging buffers (swap and step slots)",
  };
  return kText[static_cast<int>(s)];
}

Result<Layout> MakeLayout(const ModelSpec& model, int world_size) {
  Partition part;
  for (size_t g = 0; g < model.groups.size(); ++g)
    STRATA_RETURN_IF_ERROR(
        part.Add(static_cast<int>(g), model.groups[g].name, model.groups[g].numel).status());
  STRATA_RETURN_IF_ERROR(part.Finalize(world_size));
  Layout l;
  l.world_size = world_size;
  for (int g = 0; g < part.num_groups(); ++g) {
    const GroupLayout& gl = part.group(g);
    l.full_numel += gl.numel;
    l.shard_numel += gl.shard_numel;
    l.group_numel.push_back(gl.numel);
    l.group_shard.push_back(gl.shard_numel);
  }
  l.largest_group = part.largest_group_numel();
  l.largest_shard = part.largest_shard_numel();
  return l;
}

uint64_t Capacity::Used(TierKind t) const {
  uint64_t n = 0;
  for (const auto& row : bytes) n += row[static_cast<size_t>(t)];
  return n;
}

uint64_t Capacity::ModelStates(TierKind t) const {
  uint64_t n = 0;
  for (int s = 0; s <= static_cast<int>(PlanState::kV); ++s)
    n += bytes[static_cast<size_t>(s)][static_cast<size_t>(t)];
  return n;
}

std::vector<std::string> Capacity::Problems() const {
  std::vector<std::string> out;
  for (int t = 0; t < kNumTiers; ++t)
    if (!Fits(TierKind(t)))
      out.push_back(std::string(TierName(TierKind(t))) + ": " + FormatBytes(Used(TierKind(t))) +
                    " needed per rank, " + FormatBytes(capacity[static_cast<size_t>(t)]) + " available");
  return out;
}

Homes HomesOf(const Config& config, const ClusterSpec& cluster) {
  Homes h;
  h.p = HomeOf(config.zero.offload_param.device);
  h.opt = HomeOf(config.zero.offload_optimizer.device);
  h.gpu_optimizer = h.opt == TierKind::kDevice && cluster.has_gpu;
  // The engine keeps the fp32 accumulator beside W when the step runs on the CPU.
  h.g = h.gpu_optimizer ? TierKind::kDevice : h.opt == TierKind::kNvme ? TierKind::kNvme : TierKind::kHost;
  return h;
}

uint64_t StateBytes::W(uint64_t n) const { return compact ? n : 4 * n; }
uint64_t StateBytes::M(uint64_t n) const {
  return compact ? n + sizeof(float) * kernels::CompactScaleCount(n) : 4 * n;
}
uint64_t StateBytes::V(uint64_t n) const { return has_v ? M(n) : 0; }

StateBytes StateBytesOf(const Config& config) {
  const std::string& o = config.optimizer.type;
  return {.compact = config.strata.state_format == "compact", .has_v = o == "adam" || o == "adamw",
          .g_size = DTypeSize(config.grad_dtype())};
}

Capacity ComputeCapacity(const ModelSpec& model, const Layout& l, const ClusterSpec& cluster,
                         const Config& config) {
  Capacity c;
  const int stage = config.zero.stage;
  const uint64_t dp = DTypeSize(config.compute_dtype());
  const StateBytes sb = StateBytesOf(config);
  const Homes h = HomesOf(config, cluster);
  const uint64_t opt_numel = stage >= 1 ? l.shard_numel : l.full_numel;
  const uint64_t opt_shard = stage >= 1 ? l.largest_shard : l.largest_group;
  // W, M, V per group (compact's block scales round up per group's shard).
  const std::vector<uint64_t>& opt_groups = stage >= 1 ? l.group_shard : l.group_numel;
  auto sum = [&](uint64_t (StateBytes::*bytes)(uint64_t) const) {
    uint64_t n = 0;
    for (uint64_t g : opt_groups) n += (sb.*bytes)(g);
    return n;
  };

  Add(c, PlanState::kP, h.p, (stage >= 3 ? l.shard_numel : l.full_numel) * dp);
  if (h.gpu_optimizer)
    Add(c, PlanState::kG, TierKind::kDevice, (stage >= 2 ? l.shard_numel : l.full_numel) * dp);
  else
    Add(c, PlanState::kG, h.g, sb.G(opt_numel));
  Add(c, PlanState::kW, h.opt, sum(&StateBytes::W));
  Add(c, PlanState::kM, h.opt, sum(&StateBytes::M));
  Add(c, PlanState::kV, h.opt, sum(&StateBytes::V));
  // The trainer's own device memory, outside strata.device_budget: its
  // activations and the gradient of one group (on the GPU). Without a GPU
  // the CPU layers keep both in host RAM beside strata.host_budget, where
  // they are not counted here.
  const uint64_t trainer = cluster.has_gpu ? ActivationBytes(model) : 0;
  Add(c, PlanState::kActivations, TierKind::kDevice, trainer);
  if (cluster.has_gpu) Add(c, PlanState::kWork, TierKind::kDevice, l.largest_group * dp);
  const uint64_t activations = cluster.has_gpu ? trainer + l.largest_group * dp : 0;

  // The engine's device working buffers: the group in use plus the prefetch
  // window when P is fetched. Prefetching never passes the budget (it stops
  // when only nearer-used copies could go), so the window counts only where
  // the budget leaves room for it; the group in use always counts.
  const bool fetched = h.p != TierKind::kDevice || (stage >= 3 && l.world_size > 1);
  if (fetched) {
    const uint64_t window =
        std::max(l.largest_group, std::min(config.zero.prefetch_bucket_size, l.full_numel));
    const uint64_t want = (l.largest_group + window) * dp;
    const uint64_t budget = config.strata.device_budget;
    const uint64_t state = c.Used(TierKind::kDevice) - activations;  // the engine's device state so far
    const uint64_t room = budget > state ? budget - state : 0;
    Add(c, PlanState::kWork, TierKind::kDevice,
        budget ? std::max(std::min(want, room), l.largest_group * dp) : want);
  }

  // Pinned staging, as the engine allocates it at build.
  if (h.p == TierKind::kNvme && cluster.has_gpu) {
    const uint64_t n = std::clamp<uint64_t>(config.zero.offload_param.buffer_count, 1, 4);
    Add(c, PlanState::kStaging, TierKind::kHost, n * NvmePadded(l.largest_shard * dp));
  }
  if (!h.gpu_optimizer) {
    auto staged = [&](TierKind home) {
      return home == TierKind::kNvme || (home == TierKind::kDevice && cluster.has_gpu);
    };
    uint64_t slot = 0;
    // Compact: P (the master's bf16 half) is loaded and stored with W, M,
    // V, and a host-homed P beside a staged W is updated in a slot too.
    if (staged(h.p) || (sb.compact && h.p == TierKind::kHost && staged(h.opt)))
      slot += NvmePadded(opt_shard * dp);
    if (staged(h.opt))
      slot += NvmePadded(sb.W(opt_shard)) + NvmePadded(sb.M(opt_shard)) + NvmePadded(sb.V(opt_shard));
    if (staged(h.g)) slot += NvmePadded(sb.G(opt_shard));
    const uint64_t slots = std::clamp<uint64_t>(config.zero.offload_optimizer.buffer_count, 3, 16);
    Add(c, PlanState::kStaging, TierKind::kHost, slots * slot);
    uint64_t grad = h.g == TierKind::kNvme ? NvmePadded(sb.G(opt_shard)) : 0;
    if (cluster.has_gpu) grad = std::max(grad, l.largest_group * 4);
    Add(c, PlanState::kStaging, TierKind::kHost, grad * (cluster.has_gpu ? 2 : 1));
  }

  const uint64_t ranks = cluster.gpus_per_node;
  uint64_t device = cluster.has_gpu
                        ? static_cast<uint64_t>(static_cast<double>(cluster.device_bytes) * kDeviceUsable)
                        : cluster.device_bytes;
  uint64_t host = static_cast<uint64_t>(static_cast<double>(cluster.host_bytes) * kHostUsable) / ranks;
  if (config.strata.device_budget) device = std::min(device, config.strata.device_budget > UINT64_MAX - activations
                                                               ? UINT64_MAX
                                                               : config.strata.device_budget + activations);
  if (config.strata.host_budget) host = std::min(host, config.strata.host_budget);
  c.capacity = {device, host, cluster.nvme_bytes() / ranks};
  return c;
}

Result<Capacity> ComputeCapacity(const ModelSpec& model, const ClusterSpec& cluster, const Config& config) {
  STRATA_ASSIGN_OR_RETURN(Layout l, MakeLayout(model, static_cast<int>(cluster.world_size())));
  return ComputeCapacity(model, l, cluster, config);
}

}  // namespace strata::plan
