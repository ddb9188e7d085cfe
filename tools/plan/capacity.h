// Capacity: bytes per rank in each tier for each state, under the engine's
// homes (P per offload_param; W, M, V per offload_optimizer; G in compute
// dtype on the device when the optimizer is, else the fp32 accumulator beside
// W), the ZeRO stage's division (1: W, M, V; 2: + G; 3: + P) and
// strata.state_format (W, M, V in fp32 or compact), plus the activations, the
// device's working buffers, the pinned staging buffers and, with the
// speculative overlapped step, the memory speculation holds until commit.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "tiers/tier.h"
#include "tools/plan/cluster.h"
#include "tools/plan/model.h"

namespace strata::plan {

enum class PlanState : int { kP, kG, kW, kM, kV, kActivations, kWork, kStaging, kSpeculation };
inline constexpr int kNumPlanStates = 9;
inline constexpr int kNumTiers = 3;             // TierKind: device, host, nvme
// "P", "G", "W", "M", "V", "act", "work", "staging", "spec"
const char* PlanStateName(PlanState s);
const char* PlanStateDescription(PlanState s);  // one line for tables and legends

// The sizes a schedule needs, from the engine's own Partition (groups padded
// to world_size x 2048 elements and cut into world_size shards).
struct Layout {
  int world_size = 1;
  uint64_t full_numel = 0;                         // sum of the groups, unpadded (what a replica holds)
  uint64_t shard_numel = 0;                        // sum of one rank's shards
  uint64_t largest_group = 0;                      // elements
  uint64_t largest_shard = 0;                      // elements
  std::vector<uint64_t> group_numel, group_shard;  // per group
};
Result<Layout> MakeLayout(const ModelSpec& model, int world_size);

// The memory of the speculative overlapped step (EngineOptions.overlap_step,
// issue #26), per rank, as the engine sizes it (engine/step/speculation.h).
// Each group's update runs as soon as its gradients are complete in
// backward, before the step knows whether clipping applies or every value is
// finite; a discard must find the old state again:
//   host-homed W, M, V: a backup in host memory (fp32 Adam 12 B a parameter
//     of the rank's shard; compact its W, M, V bytes plus 2 B of P's slice,
//     the master's bf16 half), from strata.speculation_host_bytes ("auto":
//     what every group needs, at most what the host budget has left);
//   NVMe-homed W, M, V (and P): the old extents stay until commit, so the
//     swap holds a second copy of them (each padded as the NVMe tier pads),
//     strata.speculation_disk_bytes ("auto": what every group needs).
// Groups are granted in the order their gradients complete (the last first)
// while their needs fit in what is left of those two; the rest update after
// backward, as without overlap. Groups whose W, M, V (or compact's P) the
// GPU updates in place never speculate.
struct Speculation {
  std::vector<uint64_t> host, disk;             // per group: what its speculation needs in each tier
  std::vector<uint8_t> eligible;                // per group: 1 when it may speculate at all
  std::vector<uint8_t> granted;                 // per group: 1 when it speculates
  uint64_t host_needed = 0, disk_needed = 0;    // every eligible group's
  uint64_t host_bytes = 0, disk_bytes = 0;      // reserved (the kSpeculation row), "auto" resolved
  uint64_t host_granted = 0, disk_granted = 0;  // the granted groups' needs
  int Groups() const;                           // granted groups
  // Of the bytes every group needs, the share granted (0 when none can speculate).
  double Fraction() const;
};

struct Capacity {
  std::array<std::array<uint64_t, kNumTiers>, kNumPlanStates> bytes{};  // [state][tier], per rank
  std::array<uint64_t, kNumTiers> capacity{};  // per rank: usable device, host / ranks, NVMe / ranks
  uint64_t Used(TierKind t) const;
  // P + G + W + M + V in a tier: the ZeRO paper's "model states".
  uint64_t ModelStates(TierKind t) const;
  bool Fits(TierKind t) const { return Used(t) <= capacity[static_cast<int>(t)]; }
  bool Fits() const { return Fits(TierKind::kDevice) && Fits(TierKind::kHost) && Fits(TierKind::kNvme); }
  std::vector<std::string> Problems() const;  // "host: 16.0 TiB needed per rank, 86 GiB available"
  Speculation speculation;                    // empty without the overlapped step
  bool g_on_host = true;                      // G is in host memory (HomesOf's g_on_host for "auto")
  int write_behind_slots = 0;                 // step slots write-behind adds (in kStaging)
  // The step writes behind (strata.write_behind): the step slots, with those
  // added, hold every unit's W, M, V piece at once (the engine's CanRunBehind).
  bool writes_behind = false;
};

// Where each state lives, from a config.
struct Homes {
  TierKind p, g, opt;  // opt: W, M, V
  bool gpu_optimizer;  // the update runs on the device (optimizer state there, with a GPU)
};
// `g_on_host`: strata.grad_home "auto" with W, M, V on NVMe puts G in host
// memory (ComputeCapacity decides it as the engine's build does: when the
// host tier holds it; Capacity::g_on_host).
Homes HomesOf(const Config& config, const ClusterSpec& cluster, bool g_on_host = true);
// The host tier's capacity per rank: 90% of the node's memory over its
// ranks, at most strata.host_budget.
uint64_t HostBudgetOf(const ClusterSpec& cluster, const Config& config);

// Bytes of W, M, V for n elements of one group's shard under
// strata.state_format, as the engine stores them (engine/layout/layout.cpp):
//   fp32     W 4n, M 4n, V 4n (12 B a parameter; Lion has no V: 8)
//   compact  (bf16 compute only) the master is P's bf16 half plus W's int8
//            corrections: W n; M and V n + 4*ceil(n/32) each (an 8-bit code
//            an element, a float scale a block of 32). With P's 2 bytes that
//            is kernels/cpu/compact.h's CompactBytes(n), 5.25 B a parameter
//            (Lion 4.125); P keeps its bytes in its own home, so where P and
//            W share one the tier holds 5.25 against fp32's 2 + 12.
struct StateBytes {
  bool compact = false;
  bool has_v = true;  // Adam, AdamW (Lion has no V)
  uint64_t g_size = 4;  // bytes an element of G: data_types.grad_accum_dtype (fp32 4, bf16 2)
  uint64_t G(uint64_t n) const { return g_size * n; }
  uint64_t W(uint64_t n) const;
  uint64_t M(uint64_t n) const;
  uint64_t V(uint64_t n) const;  // 0 without V
  uint64_t Optimizer(uint64_t n) const { return W(n) + M(n) + V(n); }
};
StateBytes StateBytesOf(const Config& config);

// `overlap_step`: size the speculation (Capacity::speculation, the
// kSpeculation row) in what each tier has left after everything else.
Result<Capacity> ComputeCapacity(const ModelSpec& model, const ClusterSpec& cluster, const Config& config,
                                 bool overlap_step = false);
Capacity ComputeCapacity(const ModelSpec& model, const Layout& layout, const ClusterSpec& cluster,
                         const Config& config, bool overlap_step = false);

}  // namespace strata::plan
