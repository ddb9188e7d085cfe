// The engine's refusals before it changes anything: the kernels' path at
// create, the host memory at build, finite step options, and the
// strata.nonfinite policy at step. Kept apart from the bodies of Build and
// Step so that they only ask; the rules live here.
#include "engine/layout/preflight.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"
#include "engine/engine_impl.h"
#include "engine/checkpoint/manifest.h"
#include "kernels/cpu/compact.h"
#include "kernels/cpu/isa.h"

namespace strata {
namespace {

std::string GroupText(int group) {
  return group >= 0 ? "group " + std::to_string(group) : "a group of another rank";
}

}  // namespace

Status CheckCpuIsaVariable() {
  Result<kernels::CpuIsa> isa = kernels::ActiveCpuIsa();  // "STRATA_CPU_ISA: CPU ISA 'x' is not one of ..."
  if (isa.ok()) return Status::Ok();
  if (isa.status().code() == Code::kInvalid) return ConfigError(isa.status().message());
  return isa.status();
}

bool StateUsed(const Engine::Impl& m, int s) {
  const std::string& type = m.config_.optimizer.type;
  return s != int(StateKind::kV) || type == "adam" || type == "adamw";
}

bool StateUsedBy(const Engine::Impl& m, int s, int g) {
  return StateUsed(m, s) && (s == int(StateKind::kP) || !m.frozen(g));
}

uint64_t StateBytes(const Engine::Impl& m, int s, int g) {
  if (s == int(StateKind::kP)) return m.PHomeNumel(g) * DTypeSize(m.dtype_);
  const uint64_t n = m.part_.group(g).shard_numel;
  if (s == int(StateKind::kG)) return n * DTypeSize(m.gdtype_);
  if (!m.compact_) return n * 4;
  // W: the int8 corrections (the bf16 half is P); M, V: codes, then a float
  // scale a block. Zeros to 4 KiB: a checkpoint writes them with O_DIRECT.
  if (s == int(StateKind::kW)) return AlignUp(n, manifest::kCompactBlockAlign);
  return manifest::SavedBlockBytes(true, s - 1, n);
}

bool StagedInSlot(const Engine::Impl& m, int s, bool gpu) {
  if (!StateUsed(m, s)) return false;
  if (!BlockIo::DirectAt(m.home_[s], gpu)) return true;
  // Compact: a host-homed P whose W is staged is updated in a slot too and
  // copied back once W, M, V landed, so that a failed store leaves it old.
  return s == int(StateKind::kP) && m.compact_ && !BlockIo::DirectAt(m.home_[int(StateKind::kW)], gpu);
}

int StepSlots(const Config& c) {
  return static_cast<int>(std::clamp<uint64_t>(c.zero.offload_optimizer.buffer_count, 3, 16));
}

StagingSizes PlanStaging(const Engine::Impl& m, const std::function<uint64_t(uint64_t)>& padded) {
  StagingSizes z;
  const bool gpu = m.device_->on_gpu();
  const int ngroups = m.part_.num_groups();
  // The step's slots: every state that the CPU cannot address in place, of
  // the groups the step updates (frozen groups never pass through them).
  uint64_t off = 0;
  for (int s = 0; s < kNumStates; ++s) {
    z.opt_offsets[s] = off;
    if (!StagedInSlot(m, s, gpu)) continue;
    uint64_t largest = 0;  // bytes of this state on this rank, largest group that trains
    for (int g = 0; g < ngroups; ++g)
      if (!m.frozen(g)) largest = std::max(largest, StateBytes(m, s, g));
    if (largest > 0) off += AlignUp(padded(largest), 64 * kKiB);
  }
  z.opt_offsets[kNumStates] = off;
  if (off > 0) z.opt_slots = StepSlots(m.config_);
  const uint64_t shard = m.part_.largest_shard_numel();
  if (m.home_[0] == TierKind::kNvme && gpu) {  // P: nvme -> host -> device
    z.param_slots = static_cast<int>(std::clamp<uint64_t>(m.config_.zero.offload_param.buffer_count, 1, 4));
    z.param_bytes = padded(shard * DTypeSize(m.dtype_));
  }
  // Gradients: only groups that train get them.
  uint64_t trained_shard = 0, trained_numel = 0, largest_padded = 0;
  for (int g = 0; g < ngroups; ++g) {
    if (m.frozen(g)) continue;
    trained_shard = std::max(trained_shard, m.part_.group(g).shard_numel);
    trained_numel = std::max(trained_numel, m.part_.group(g).numel);
    largest_padded = std::max(largest_padded, m.part_.group(g).padded);
  }
  if (m.home_[int(StateKind::kG)] == TierKind::kNvme && trained_shard)
    z.grad_bytes = padded(trained_shard * DTypeSize(m.gdtype_));
  if (gpu) z.grad_bytes = std::max(z.grad_bytes, trained_numel * 4);
  if (m.reduces()) z.grad_bytes = std::max(z.grad_bytes, AlignUp(largest_padded * 4, 4096));  // a whole group's fp32 grads
  if (z.grad_bytes) z.grad_slots = gpu || (m.multi() && m.home_[int(StateKind::kG)] == TierKind::kNvme) ? 2 : 1;
  if (z.grad_bytes && m.reduces() && !m.comm_->device_buffers()) {
    // Host buffers: the group being packed, the one being reduced on the
    // communication thread (overlap_comm), and G's staging when G is not
    // addressable in place — each in a slot of its own, or the thread and
    // the caller could wait on each other.
    const bool g_staged = !BlockIo::DirectAt(m.home_[int(StateKind::kG)], gpu);
    z.grad_slots = 1 + (m.config_.zero.overlap_comm ? 1 : 0) + (g_staged ? 1 : 0);
  }
  if (!BlockIo::DirectAt(m.home_[int(StateKind::kP)], gpu))
    for (int g = 0; g < ngroups; ++g)
      if (m.frozen(g)) z.frozen_bytes = std::max(z.frozen_bytes, padded(StateBytes(m, int(StateKind::kP), g)));
  if (z.frozen_bytes) z.frozen_slots = 1;
  return z;
}

// The host tier charges whole pages per allocation (HostTier::Allocate).
Status CheckHostPlan(const Engine::Impl& m) {
  uint64_t homed = 0;
  for (int g = 0; g < m.part_.num_groups(); ++g)
    for (int s = 0; s < kNumStates; ++s)
      if (StateUsedBy(m, s, g) && m.home_[s] == TierKind::kHost) homed += AlignUp(StateBytes(m, s, g), 4096);
  // Before the NVMe tier exists its padding is unknown; none is a lower bound.
  const StagingSizes z = PlanStaging(m, [](uint64_t bytes) { return bytes; });
  const uint64_t step = z.opt_slots * AlignUp(z.opt_offsets[kNumStates], 4096);
  const uint64_t param = z.param_slots * AlignUp(z.param_bytes, 4096);
  const uint64_t grad = z.grad_slots * AlignUp(z.grad_bytes, 4096);
  const uint64_t frozen = z.frozen_slots * AlignUp(z.frozen_bytes, 4096);
  const uint64_t need = homed + step + param + grad + frozen, budget = m.host_->budget();
  if (need <= budget) return Status::Ok();
  const std::string setting = m.config_.strata.host_budget ? "" : " (\"auto\": half of RAM)";
  return ConfigError("strata.host_budget: " + FormatBytes(budget) + setting + " is too small for this model; Build needs at least " +
                     FormatBytes(need) + " of host memory: " + FormatBytes(homed) + " of state homed on the host, " +
                     std::to_string(z.opt_slots) + " step staging slots of " + FormatBytes(z.opt_offsets[kNumStates]) +
                     " (each holds the largest shard's states that live off the host; "
                     "zero_optimization.offload_optimizer.buffer_count, at least 3), " +
                     FormatBytes(param) + " of parameter staging" +
                     (frozen ? ", " + FormatBytes(frozen) + " of staging for the frozen groups' parameters" : "") +
                     " and " + FormatBytes(grad) + " of gradient staging");
}

// A NaN option used to slip through `v >= 0 ? v : config` as "from the
// config"; an infinite one would write infinities into every weight.
Status CheckStepOptions(const StepOptions& so, const char* call) {
  const struct {
    const char* name;
    double value;
  } options[] = {{"lr", so.lr}, {"beta1", so.beta1}, {"beta2", so.beta2}, {"eps", so.eps},
                 {"weight_decay", so.weight_decay}, {"max_grad_norm", so.max_grad_norm}};
  for (const auto& o : options) {
    if (std::isfinite(o.value)) continue;
    return InvalidError(std::string(call) + ": step option " + o.name + " is " + (std::isnan(o.value) ? "NaN" : "infinite") +
                        "; allowed: a finite number (negative: the config's value)");
  }
  return Status::Ok();
}

// The first group whose gradients of this step are not finite, or -1 (none
// here: with several ranks the non-finite shard may be another rank's).
static int FirstNonfiniteGroup(const std::vector<GroupState>& groups) {
  for (size_t g = 0; g < groups.size(); ++g)
    if (groups[g].grad_calls > 0 && !groups[g].finite) return static_cast<int>(g);
  return -1;
}

bool OverlapMayUpdate(const Engine::Impl& m, const GroupState& gs) {
  return gs.finite || m.config_.strata.nonfinite == "apply";
}

// One non-finite gradient would make every later update of the master
// weights and moments NaN for good; the default holds the step back instead.
// overlap_step updates groups during backward: those whose gradients came
// before the non-finite ones keep their update (the message counts them).
bool HoldBackNonfinite(Engine::Impl& m, bool finite, Status* error) {
  if (finite) return false;
  const Config& config = m.config_;
  const std::string& policy = config.strata.nonfinite;
  if (!config.fp16.enabled && policy == "apply") return false;
  if (m.overlap_) *error = m.WaitOverlapIdle();  // nothing may run on while the step ends
  if (config.fp16.enabled || !error->ok()) return true;  // fp16: an overflow; the scaler lowers the scale
  int updated = 0;
  for (const GroupState& gs : m.groups_) updated += gs.updated ? 1 : 0;
  std::string what = "gradients of " + GroupText(FirstNonfiniteGroup(m.groups_)) + " are not finite (NaN or infinite)";
  const std::string done = updated ? "nothing more was updated (" + std::to_string(updated) +
                                         " groups updated earlier by overlap_step keep their update)"
                                   : "nothing was updated";
  if (policy == "error") {
    *error = InvalidError("step: " + what + "; " + done + " (strata.nonfinite is \"error\")");
    return true;
  }
  STRATA_LOG_WARN("step: {}; skipped: {} (strata.nonfinite is \"skip\")", what, done);
  return true;
}

}  // namespace strata
