// The step simulator: runs the engine's own schedule for one training step —
// the recorded fetch trace replayed through PrefetchSchedule (prefetch
// window, farthest-next-use eviction from the device's room for P), stage-3
// gathers, the blocking Grads path, the optimizer pipeline over shards with
// buffer_count slots (reads K-2 shards ahead, update on the CPU, writes
// behind; W, M, V in strata.state_format's bytes, StateBytes) or the
// speculative overlapped step — against a cost model of one rank's share of
// the cluster. No data moves. Ranks are symmetric under ZeRO, so one rank is
// simulated and collectives are costed as rings over N.
//
// The overlapped step (EngineOptions.overlap_step) is speculative: each
// group granted room (Capacity::speculation) backs up its host-homed W, M, V
// and updates as soon as its gradients are complete in backward, with or
// without clipping, fp16 loss scaling or several ranks; the other groups
// update after backward. The worker's work yields to backward's own (it
// takes the gaps backward leaves on each resource) and streams the groups
// queued when it is free through the step's pipeline. After backward the step commits (nothing more to
// do) or, at the replay rate (clipping applied, or a non-finite value
// discards the step), waits for the speculation in flight, restores the
// backups and runs the whole update again. Its figures are the expectation
// (1 - R) x committed + R x replayed.
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

// The replay rate a plan assumes unless told: the fraction of steps whose
// speculation is discarded (clipping applies, or the step is skipped for a
// non-finite value). DeepSpeed's SuperOffload report found clipping rare
// after warm-up (BLOOM-176B); 5% leaves a margin for warm-up and loss spikes.
inline constexpr double kDefaultReplayRate = 0.05;

struct SimOptions {
  bool overlap_step = false;                // EngineOptions.overlap_step: the speculative overlapped step
  double replay_rate = kDefaultReplayRate;  // 0..1, with overlap_step
  bool optimizer_only = false;  // the Step call alone, gradients in place (as bench/engine/offload_step)
};

// One way a step can go: its iteration time (from the step's first forward
// to the return of step) and its exposed time (from the end of backward to
// the return of step).
struct StepTimes {
  double iteration_s = 0, forward_backward_s = 0, exposed_s = 0;
};

struct SimResult {
  // Under the options; with overlap_step the expectation over the steps:
  // S (1 - R) x committed + S R x replayed + (1 - S) x without overlap
  // (busy times and bytes too), S the fraction that speculates under
  // strata.speculation (speculated_rate).
  double step_s = 0;              // one steady-state step, trace recorded
  double forward_backward_s = 0;  // until the last Grads returns
  double optimizer_s = 0;         // the rest: the step's exposed time
  StepTimes plain;                // without overlap (always simulated)
  bool overlapped = false;        // overlap_step (and not optimizer_only)
  double replay_rate = 0;         // the R used: the fraction of steps that clip or skip
  // strata.speculation, and the fraction of steps that speculate under it
  // (of those, R replay; the others run as without overlap).
  std::string speculation;
  double speculated_rate = 0;
  StepTimes committed, replayed;  // the overlapped step committed, and replayed
  int speculated_groups = 0, groups = 0;  // speculating / all
  int spec_groups_eligible = 0;           // that could speculate (W, M, V not updated on a GPU)
  double speculated_fraction = 0;         // of the bytes speculation needs, the share granted
  // Capacity::speculation: reserved (host arena, swap room) and needed by every group.
  uint64_t spec_host_bytes = 0, spec_host_needed = 0;
  uint64_t spec_disk_bytes = 0, spec_disk_needed = 0;
  std::array<double, kNumSimResources> busy_s{};
  SimResource bound = SimResource::kGpu;  // the busiest resource
  uint64_t fetches = 0, prefetch_hits = 0, stalls = 0, evictions = 0;
  double stall_s = 0;
  uint64_t disk_read_bytes = 0, disk_write_bytes = 0, pcie_bytes = 0, network_bytes = 0;
  // The activation store (strata.activation_*): bytes stashed a step, of
  // those spilled to NVMe, and the redeems that waited for their bytes.
  uint64_t act_bytes = 0, act_nvme_bytes = 0, act_stalls = 0;
  double act_stall_s = 0;
  double Busy(SimResource r) const { return busy_s[static_cast<size_t>(r)]; }
};

// `capacity` gives the device's room for cached copies of P (what is left
// when everything else resident is counted) and, with overlap_step, the
// groups that speculate (ComputeCapacity(..., overlap_step = true); one sized
// without speculation is sized again with it). options.replay_rate outside
// 0..1 is clamped (the CLI refuses it).
SimResult Simulate(const ModelSpec& model, const Layout& layout, const Capacity& capacity,
                   const ClusterSpec& cluster, const Config& config, const SimOptions& options);
Result<SimResult> Simulate(const ModelSpec& model, const ClusterSpec& cluster, const Config& config,
                           const SimOptions& options);

}  // namespace strata::plan
