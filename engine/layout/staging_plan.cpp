// The host staging pools' sizes, and the refusal of a host budget that
// cannot hold them with the host-homed blocks (staging_plan.h).
#include "engine/layout/staging_plan.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"
#include "engine/format/manifest.h"
#include "kernels/cpu/compact.h"

namespace strata {
int StepSlots(const Config& c) {
  return static_cast<int>(std::clamp<uint64_t>(c.zero.offload_optimizer.buffer_count, 3, 16));
}

int StepGroupsWriting(int slots, bool concurrent) {
  return concurrent ? std::max(slots, 3) - 1 : std::max(slots / 2, 1);
}

uint64_t StepPieceBytes(const Layout& m, const std::function<uint64_t(uint64_t)>& padded, int g, int u, bool largest) {
  uint64_t at = 0;
  for (int s : {int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)})
    if (m.StagedInSlot(s)) at += AlignUp(padded(largest ? m.unit_numel * 4 : m.PartBytes(s, g, u)), 4096);
  return at;
}

bool BehindLossAgreeable(const Layout& m, bool p_copies_kept) {
  return m.multi && (m.home[int(StateKind::kP)] != TierKind::kNvme || p_copies_kept) &&
         m.home[int(StateKind::kG)] != TierKind::kNvme;
}

bool WriteBehindAllowed(const Config& c, const Layout& m, bool p_copies_kept) {
  return c.strata.write_behind == "always" ||
         (c.strata.write_behind == "auto" && (!m.multi || BehindLossAgreeable(m, p_copies_kept)));
}

std::vector<uint64_t> BehindPieces(const Layout& m, const std::function<uint64_t(uint64_t)>& padded,
                                   const std::vector<int>& groups) {
  std::vector<uint64_t> pieces;
  if (!m.opt_piece_bytes || m.compact) return pieces;
  for (int g : groups)
    for (int u = 0; u < m.Units(g); ++u)
      pieces.push_back(AlignUp(StepPieceBytes(m, padded, g, u, /*largest=*/false), 4096));
  return pieces;
}

StagingSizes PlanStaging(const Layout& m, const std::function<uint64_t(uint64_t)>& padded) {
  StagingSizes z;
  const bool gpu = m.device_on_gpu;
  const int ngroups = m.part.num_groups();
  // The step's slots: every state that the CPU cannot address in place, of
  // the groups the step updates (frozen groups never pass through them).
  uint64_t off = 0;
  for (int s = 0; s < kNumStates; ++s) {
    z.opt_offsets[s] = off;
    if (!m.StagedInSlot(s)) continue;
    uint64_t largest = 0;  // bytes of this state on this rank, largest group that trains
    for (int g = 0; g < ngroups; ++g)  // (P that is W's bytes has no block: nothing of it is staged)
      if (!m.frozen(g) && m.StateUsedBy(s, g)) largest = std::max(largest, m.StateBytes(s, g));
    if (largest > 0) off += AlignUp(padded(largest), 64 * kKiB);
  }
  z.opt_offsets[kNumStates] = off;
  if (off > 0) z.opt_slots = StepSlots(*m.config);
  // Pieces: every group that trains steps in units, whose staged states are
  // fp32 W, M, V (G and P are addressed in place, or P is W's bytes).
  bool pieces = off > 0 && m.unit_numel > 0 && !m.compact && m.any_trainable();
  for (int g = 0; pieces && g < ngroups; ++g) pieces = m.frozen(g) || m.SplitsIntoUnits(g);
  if (pieces) {
    const uint64_t at = StepPieceBytes(m, padded, 0, 0, /*largest=*/true);
    const uint64_t per = at ? off / at : 0;
    if (per >= 2) {
      z.piece_bytes = at;
      const int want = StepSlots(*m.config);
      z.opt_slots = std::max(2, static_cast<int>((static_cast<uint64_t>(want) + per - 1) / per));
    }
  }
  // P loaded into a device copy through host memory (PHome::Load): from
  // NVMe, or at stage 3 over ranks from its shard homed on a separate
  // device (a GPU, or the strict arena), copied out and into the gathered copy.
  const bool p_through_host = m.home[0] == TierKind::kNvme || (m.home[0] == TierKind::kDevice && m.p_sharded);
  if (p_through_host && gpu) {  // P: home -> host -> device
    z.param_slots = static_cast<int>(std::clamp<uint64_t>(m.config->zero.offload_param.buffer_count, 1, 4));
    // P's block, loaded whole into a slot (PHome::Load): this rank's shard
    // at stage 3 over ranks, else the whole group.
    uint64_t largest = 0;
    for (int g = 0; g < ngroups; ++g) largest = std::max(largest, m.StateBytes(int(StateKind::kP), g));
    z.param_bytes = padded(largest);
  }
  // Gradients: only groups that train get them.
  uint64_t trained_shard = 0, trained_numel = 0, largest_padded = 0;
  for (int g = 0; g < ngroups; ++g) {
    if (m.frozen(g)) continue;
    trained_shard = std::max(trained_shard, m.part.group(g).shard_numel);
    trained_numel = std::max(trained_numel, m.part.group(g).numel);
    largest_padded = std::max(largest_padded, m.part.group(g).padded);
  }
  if (m.home[int(StateKind::kG)] == TierKind::kNvme && trained_shard)
    z.grad_bytes = padded(trained_shard * DTypeSize(m.gdtype));
  if (gpu) z.grad_bytes = std::max(z.grad_bytes, trained_numel * 4);
  if (m.reduces) z.grad_bytes = std::max(z.grad_bytes, AlignUp(largest_padded * 4, 4096));  // a whole group's fp32 grads
  if (z.grad_bytes) z.grad_slots = gpu || (m.multi && m.home[int(StateKind::kG)] == TierKind::kNvme) ? 2 : 1;
  if (z.grad_bytes && m.reduces && !m.device_buffers) {
    // Host buffers: the group being packed, the one being reduced on the
    // communication thread (overlap_comm), and G's staging when G is not
    // addressable in place — each in a slot of its own, or the thread and
    // the caller could wait on each other.
    const bool g_staged = !BlockIo::DirectAt(m.home[int(StateKind::kG)], gpu);
    z.grad_slots = 1 + (m.config->zero.overlap_comm ? 1 : 0) + (g_staged ? 1 : 0);
  }
  if (!BlockIo::DirectAt(m.home[int(StateKind::kP)], gpu))
    for (int g = 0; g < ngroups; ++g)
      if (m.frozen(g)) z.frozen_bytes = std::max(z.frozen_bytes, padded(m.StateBytes(int(StateKind::kP), g)));
  if (z.frozen_bytes) z.frozen_slots = 1;
  return z;
}

// The host tier charges whole pages per allocation (HostTier::Allocate).
Status CheckHostPlan(const Layout& m, uint64_t host_budget, uint64_t taken, const std::string& taken_what) {
  uint64_t homed = 0;
  for (int g = 0; g < m.part.num_groups(); ++g)
    for (int s = 0; s < kNumStates; ++s)
      if (m.StateUsedBy(s, g) && m.home[s] == TierKind::kHost) homed += AlignUp(m.StateBytes(s, g), 4096);
  // Before the NVMe tier exists its padding is unknown; none is a lower bound.
  const StagingSizes z = PlanStaging(m, [](uint64_t bytes) { return bytes; });
  const uint64_t step = z.opt_slots * AlignUp(z.opt_offsets[kNumStates], 4096);
  const uint64_t param = z.param_slots * AlignUp(z.param_bytes, 4096);
  const uint64_t grad = z.grad_slots * AlignUp(z.grad_bytes, 4096);
  const uint64_t frozen = z.frozen_slots * AlignUp(z.frozen_bytes, 4096);
  const uint64_t need = homed + step + param + grad + frozen + taken, budget = host_budget;
  if (need <= budget) return Status::Ok();
  const std::string setting = m.config->strata.host_budget ? "" : " (\"auto\": half of RAM)";
  return ConfigError("strata.host_budget: " + FormatBytes(budget) + setting + " is too small for this model; Build needs at least " +
                     FormatBytes(need) + " of host memory: " + FormatBytes(homed) + " of state homed on the host, " +
                     std::to_string(z.opt_slots) + " step staging slots of " + FormatBytes(z.opt_offsets[kNumStates]) +
                     " (each holds the largest shard's states that live off the host; "
                     "zero_optimization.offload_optimizer.buffer_count, at least 3; 2 or more when the step "
                     "stages units in pieces of them), " +
                     FormatBytes(param) + " of parameter staging" +
                     (frozen ? ", " + FormatBytes(frozen) + " of staging for the frozen groups' parameters" : "") +
                     " and " + FormatBytes(grad) + " of gradient staging" +
                     (taken ? ", and " + FormatBytes(taken) + " of " + taken_what : ""));
}

}  // namespace strata
