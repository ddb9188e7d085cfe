// Capacity: bytes per rank in each tier for each state, under the engine's
// homes (P per offload_param; W, M, V per offload_optimizer; G in compute
// dtype on the device when the optimizer is, else the fp32 accumulator beside
// W), the ZeRO stage's division (1: W, M, V; 2: + G; 3: + P) and
// strata.state_format (W, M, V in fp32 or compact), plus the activations, the
// device's working buffers and the pinned staging buffers.
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

enum class PlanState : int { kP, kG, kW, kM, kV, kActivations, kWork, kStaging };
inline constexpr int kNumPlanStates = 8;
inline constexpr int kNumTiers = 3;             // TierKind: device, host, nvme
const char* PlanStateName(PlanState s);         // "P", "G", "W", "M", "V", "act", "work", "staging"
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

struct Capacity {
  std::array<std::array<uint64_t, kNumTiers>, kNumPlanStates> bytes{};  // [state][tier], per rank
  std::array<uint64_t, kNumTiers> capacity{};  // per rank: usable device, host / ranks, NVMe / ranks
  uint64_t Used(TierKind t) const;
  // P + G + W + M + V in a tier: the ZeRO paper's "model states".
  uint64_t ModelStates(TierKind t) const;
  bool Fits(TierKind t) const { return Used(t) <= capacity[static_cast<int>(t)]; }
  bool Fits() const { return Fits(TierKind::kDevice) && Fits(TierKind::kHost) && Fits(TierKind::kNvme); }
  std::vector<std::string> Problems() const;  // "host: 16.0 TiB needed per rank, 86 GiB available"
};

// Where each state lives, from a config.
struct Homes {
  TierKind p, g, opt;  // opt: W, M, V
  bool gpu_optimizer;  // the update runs on the device (optimizer state there, with a GPU)
};
Homes HomesOf(const Config& config, const ClusterSpec& cluster);

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

Result<Capacity> ComputeCapacity(const ModelSpec& model, const ClusterSpec& cluster, const Config& config);
Capacity ComputeCapacity(const ModelSpec& model, const Layout& layout, const ClusterSpec& cluster,
                         const Config& config);

}  // namespace strata::plan
