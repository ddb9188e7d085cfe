// The step simulator: runs the engine's own schedule for one training step —
// the recorded fetch trace replayed through PrefetchSchedule (prefetch
// window, farthest-next-use eviction from the device's room for P), stage-3
// gathers, the blocking Grads path, the optimizer pipeline over shards with
// buffer_count slots (reads K-2 shards ahead, update on the CPU, writes
// behind; W, M, V in strata.state_format's bytes, StateBytes) or the
// overlapped per-group step — against a cost model of one
// rank's share of the cluster. No data moves. Ranks are symmetric under
// ZeRO, so one rank is simulated and collectives are costed as rings over N.
#pragma once

#include <array>
#include <cstdint>

#include "engine/config/config.h"
#include "tools/plan/capacity.h"
#include "tools/plan/cluster.h"
#include "tools/plan/model.h"

namespace strata::plan {

enum class SimResource : int { kGpu, kPcie, kNetwork, kDisk, kCpu };
inline constexpr int kNumSimResources = 5;
const char* SimResourceName(SimResource r);  // "gpu", "pcie", "network", "disk", "cpu"

struct SimOptions {
  bool overlap_step = false;    // EngineOptions.overlap_step (needs no clipping and no fp16)
  bool optimizer_only = false;  // the Step call alone, gradients in place (as bench/engine/offload_step)
};

struct SimResult {
  double step_s = 0;              // one steady-state step, trace recorded
  double forward_backward_s = 0;  // until the last Grads returns
  double optimizer_s = 0;         // the rest: the step's exposed time
  std::array<double, kNumSimResources> busy_s{};
  SimResource bound = SimResource::kGpu;  // the busiest resource
  uint64_t fetches = 0, prefetch_hits = 0, stalls = 0, evictions = 0;
  double stall_s = 0;
  uint64_t disk_read_bytes = 0, disk_write_bytes = 0, pcie_bytes = 0, network_bytes = 0;
  double Busy(SimResource r) const { return busy_s[static_cast<size_t>(r)]; }
};

// `capacity` gives the device's room for cached copies of P (what is left
// when everything else resident is counted).
SimResult Simulate(const ModelSpec& model, const Layout& layout, const Capacity& capacity,
                   const ClusterSpec& cluster, const Config& config, const SimOptions& options);
Result<SimResult> Simulate(const ModelSpec& model, const ClusterSpec& cluster, const Config& config,
                           const SimOptions& options);

}  // namespace strata::plan
