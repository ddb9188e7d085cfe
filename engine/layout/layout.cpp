// Layout's derived facts: which states exist and how large their blocks are.
#include "engine/layout/layout.h"

#include <algorithm>

#include "base/align.h"
#include "engine/format/manifest.h"

namespace strata {

bool Layout::any_trainable() const {
  for (int g = 0; g < part.num_groups(); ++g)
    if (!frozen(g)) return true;
  return false;
}

uint64_t Layout::LargestTrainable(Size size) const {
  uint64_t m = 0;
  for (int g = 0; g < part.num_groups(); ++g) {
    if (frozen(g)) continue;
    const GroupLayout& L = part.group(g);
    m = std::max(m, size == Size::kPadded ? L.padded : size == Size::kNumel ? L.numel : L.shard_numel);
  }
  return m;
}

bool Layout::StateUsed(int s) const {
  const std::string& type = config->optimizer.type;
  return s != int(StateKind::kV) || type == "adam" || type == "adamw";
}

uint64_t Layout::StateBytes(int s, int g) const {
  if (s == int(StateKind::kP)) return PHomeNumel(g) * DTypeSize(dtype);
  const uint64_t n = part.group(g).shard_numel;
  if (s == int(StateKind::kG)) return n * DTypeSize(gdtype);
  if (!compact) return n * 4;
  // W: the int8 corrections (the bf16 half is P); M, V: codes, then a float
  // scale a block. Zeros to 4 KiB: a checkpoint writes them with O_DIRECT.
  if (s == int(StateKind::kW)) return AlignUp(n, manifest::kCompactBlockAlign);
  return manifest::SavedBlockBytes(true, s - 1, n);
}

bool Layout::StagedInSlot(int s) const {
  if (!StateUsed(s)) return false;
  if (!BlockIo::DirectAt(home[s], device_on_gpu)) return true;
  // Compact: a host-homed P whose W is staged is updated in a slot too and
  // copied back once W, M, V landed, so that a failed store leaves it old.
  return s == int(StateKind::kP) && compact && !BlockIo::DirectAt(home[int(StateKind::kW)], device_on_gpu);
}

uint64_t Layout::StepUnitNumel() const {
  const uint64_t a = Partition::kShardAlign;
  return std::max(a, config->zero.sub_group_size / a * a);
}

bool Layout::SplitsIntoUnits(int g) const {
  if (compact || frozen(g) || device_on_gpu || home[int(StateKind::kW)] != TierKind::kNvme) return false;
  if (!BlockIo::DirectAt(home[int(StateKind::kG)], device_on_gpu)) return false;
  return PIsW(g) || BlockIo::DirectAt(home[int(StateKind::kP)], device_on_gpu);
}

void Layout::SetRanks(bool comm, int rank, int world, bool comm_device_buffers) {
  multi = comm && world > 1;
  if (multi) {
    if (config->zero.stage >= 1) {
      srank = rank;
      sworld = world;
    }
    p_sharded = config->zero.stage == 3;
  }
  device_buffers = comm && comm_device_buffers;
  reduces = comm && (multi || device_buffers);
}

void Layout::SetStepUnits() {
  unit_numel = StepUnitNumel();
  units.assign(static_cast<size_t>(num_groups()), 1);
  for (int g = 0; g < num_groups(); ++g)
    if (SplitsIntoUnits(g))
      units[static_cast<size_t>(g)] = static_cast<uint32_t>((part.group(g).shard_numel + unit_numel - 1) / unit_numel);
}

TierKind GradHome(const std::string& setting, TierKind opt_home, bool host_holds_g) {
  if (opt_home != TierKind::kNvme || setting == "host") return TierKind::kHost;
  if (setting == "nvme") return TierKind::kNvme;
  return host_holds_g ? TierKind::kHost : TierKind::kNvme;
}

}  // namespace strata
