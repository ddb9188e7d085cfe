// Layout: where the engine's state is, decided at create (ranks) and build
// (partition, homes, frozen groups, step slots) and constant after build.
// Every component reads it; none changes it after build.
//
// Invariants (after build):
// - `part` is finalized for `sworld` shards; every group g has
//   part.group(g).shard_numel elements per shard and `padded` in all.
// - A group's P home holds the whole group (stages 0-2) or this rank's shard
//   (stage 3 with several ranks: p_sharded); W, M, V, G hold this rank's shard.
// - A frozen group keeps P alone (no G, W, M, V anywhere).
// No lock: written only before build returns (the composition's thread).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "base/dtype.h"
#include "engine/config/config.h"
#include "engine/layout/block_io.h"
#include "engine/layout/partition.h"

namespace strata {

struct Layout {
  const Config* config = nullptr;  // the engine's, outlives the layout
  Partition part;
  DType dtype = DType::kF32;    // of P: the compute dtype
  DType gdtype = DType::kF32;   // of G: data_types.grad_accum_dtype
  bool compact = false;         // strata.state_format "compact"
  // Ranks. State is cut into `sworld` shards and this rank owns `srank`:
  // stage 0 keeps everything everywhere (1, 0); stages 1-3 shard (world, rank).
  int srank = 0, sworld = 1;
  bool p_sharded = false;     // stage 3 with several ranks
  bool multi = false;         // a communicator with several ranks
  bool reduces = false;       // gradients go through the reduction (several ranks, or device buffers)
  bool device_buffers = false;  // the communicator moves device memory (NCCL)
  bool device_on_gpu = false;   // the device tier is separate(): a GPU, or the strict host arena
  TierKind home[kNumStates] = {};
  std::vector<uint8_t> frozen_groups;          // per group: freeze_group marked it (sized at build)
  uint64_t opt_slot_offsets[kNumStates + 1] = {};  // of each state in a step slot; [kNumStates]: slot bytes
  uint64_t opt_piece_bytes = 0;  // the largest piece of the step's slots (StagingSizes::piece_bytes); 0: whole slots
  // Step units (set at build, SetStepUnits): the step updates a group's shard
  // in units of at most `unit_numel` elements, each with its own NVMe blocks
  // of W, M, V, written (copy on write) and committed on its own, so that the
  // swap's copy-on-write room is a few units' blocks, not the largest
  // groups'. `units[g]` is 1 (the whole shard) unless the group is split.
  uint64_t unit_numel = 0;
  std::vector<uint32_t> units;

  int num_groups() const { return part.num_groups(); }
  const GroupLayout& group(int g) const { return part.group(g); }
  bool frozen(int g) const {
    return static_cast<size_t>(g) < frozen_groups.size() && frozen_groups[static_cast<size_t>(g)] != 0;
  }
  bool any_trainable() const;  // a group that is not frozen exists
  // The largest shard (kShard), padded group (kPadded) or group (kNumel)
  // among the groups that train; 0 when every group is frozen. Sizes what
  // only they use (G, W, M, V, their staging, the GPU update's scratch,
  // reduce buffers, the host memory's lower bound).
  enum class Size { kShard, kPadded, kNumel };
  uint64_t LargestTrainable(Size size) const;
  // The device copy holds the whole group; P's home holds the whole group
  // (stages 0-2: every rank keeps all parameters) or this rank's shard (stage 3).
  uint64_t PBytes(int g) const { return part.group(g).padded * DTypeSize(dtype); }
  uint64_t PHomeNumel(int g) const { return p_sharded ? part.group(g).shard_numel : part.group(g).padded; }
  // P's home is the device and holds whole groups: fetches hand it out as is.
  bool p_whole_on_device() const { return home[0] == TierKind::kDevice && !p_sharded; }
  // Stages 1-2 with several ranks: P's home holds the whole group on every
  // rank, each rank updates its slice (at this byte offset) and gathers the rest.
  bool p_gathered_after_step() const { return sworld > 1 && !p_sharded; }
  uint64_t PSliceOffset(int g) const {
    return p_gathered_after_step() ? static_cast<uint64_t>(srank) * part.group(g).shard_numel * DTypeSize(dtype) : 0;
  }
  // P that is W's bytes (fp32 compute, not compact, a trainable group, P's
  // home block the size of W's, P on NVMe with W on NVMe or in host memory,
  // or both in host memory): the step does not store P (it would write W
  // again), a device copy is read from W's block (residency's PHome), and P
  // has no block of its own (StateUsedBy). In host memory, W updated in
  // place is P updated in place, as a P of its own would be (speculation.h).
  bool PIsW(int g) const {
    const TierKind p = home[int(StateKind::kP)], w = home[int(StateKind::kW)];
    return dtype == DType::kF32 && !compact &&
           ((p == TierKind::kNvme && (w == TierKind::kNvme || w == TierKind::kHost)) ||
            (p == TierKind::kHost && w == TierKind::kHost)) &&
           !frozen(g) && StateBytes(int(StateKind::kP), g) == StateBytes(int(StateKind::kW), g);
  }
  // The block P is read from: W's where P is W's bytes, else P's own.
  StateKind PSource(int g) const { return PIsW(g) ? StateKind::kW : StateKind::kP; }
  // A checkpoint's "P" block of frozen group g: this rank's slice of P.
  uint64_t FrozenSavedBytes(int g) const { return part.group(g).shard_numel * DTypeSize(dtype); }
  // Which states the optimizer keeps (V: Adam only).
  bool StateUsed(int s) const;
  // Whether group g has a block of state s: a frozen group keeps P alone.
  // (P that is W's bytes has none: Layout::PIsW.)
  bool StateUsedBy(int s, int g) const { return StateUsed(s) && (s == 0 ? !PIsW(g) : !frozen(g)); }
  // The bytes of state s of group g on this rank (P: whole group or this
  // rank's shard; else a shard; compact: the packed arrays).
  uint64_t StateBytes(int s, int g) const;
  // Whether state s has a region in the step's staging slots.
  bool StagedInSlot(int s) const;

  // The step's unit: zero_optimization.sub_group_size (Strata's default 4
  // Mi elements), in whole kShardAlign chunks.
  uint64_t StepUnitNumel() const;
  // Whether group g's shard may be stepped in units: fp32 state (not
  // compact), W (so M, V) homed on NVMe, a G and a P the CPU addresses in
  // place (P that is W's bytes, or a P home in host memory), no GPU. Other
  // groups step whole, as before.
  bool SplitsIntoUnits(int g) const;
  // Sets unit_numel and units (after the homes and the frozen groups).
  void SetStepUnits();
  // Sets multi, srank, sworld, p_sharded, device_buffers and reduces for
  // rank `rank` of `world` (config's stage), with a communicator or none
  // (`comm`), one that moves device memory or not (`comm_device_buffers`):
  // the engine's at create, and strata-plan's for rank 0 of its cluster.
  void SetRanks(bool comm, int rank, int world, bool comm_device_buffers);
  int Units(int g) const { return static_cast<size_t>(g) < units.size() ? static_cast<int>(units[static_cast<size_t>(g)]) : 1; }
  // Unit u of group g: its first element in the shard, and its elements.
  uint64_t UnitFirst(int g, int u) const { return Units(g) == 1 ? 0 : static_cast<uint64_t>(u) * unit_numel; }
  uint64_t UnitNumel(int g, int u) const {
    const uint64_t n = part.group(g).shard_numel;
    return Units(g) == 1 ? n : std::min(unit_numel, n - UnitFirst(g, u));
  }
  // The bytes of state s's block of group g in unit u (a group in units
  // splits only fp32 W, M, V; one unit: the whole block, StateBytes).
  uint64_t PartBytes(int s, int g, int u) const { return Units(g) == 1 ? StateBytes(s, g) : UnitNumel(g, u) * 4; }
};

// strata.grad_home (config.h): G's home for `setting` when W, M, V are homed
// at `opt_home`. "auto" is the host when `host_holds_g` (the host plan holds
// G beside the staging), else NVMe.
TierKind GradHome(const std::string& setting, TierKind opt_home, bool host_holds_g);

}  // namespace strata
