// read_state and write_state: one state of one group, whole, through the
// shard store (either format) and, with several ranks, an all-gather.
#include "engine/engine_impl.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "io/net/launch_env.h"

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"
#include "engine/layout/staging_plan.h"
#include "engine/step/step_checks.h"
#include "kernels/cpu/cast.h"
#include "kernels/cpu/norm.h"
#include "tiers/gpu.h"

namespace strata {

// The refusal of an optimizer state that a frozen group does not keep.
static Status FrozenKeepsNo(const char* call, int group, StateKind kind) {
  return InvalidError(std::string(call) + ": group " + std::to_string(group) + " is frozen (freeze_group): it keeps " +
                      "its parameters alone (read as the master weights), no optimizer state " +
                      (kind == StateKind::kM ? "exp_avg" : kind == StateKind::kV ? "exp_avg_sq" : StateName(kind)));
}

Status Engine::Impl::ReadState(int group, StateKind kind, float* out) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group, "read_state"));
  if (!out) return InvalidError("read_state: null output for group " + std::to_string(group));
  if (OverlapHasTaken(group)) STRATA_RETURN_IF_ERROR(UndoOverlap(group, "read_state"));  // never a speculative value
  if (lay_.frozen(group)) {
    if (kind != StateKind::kW) return FrozenKeepsNo("read_state", group, kind);
    return ReadFrozen(group, out).WithContext("read_state: frozen group " + std::to_string(group));
  }
  const StateBlock& w = blocks_[static_cast<size_t>(group)][static_cast<size_t>(kind)];
  if (!w.alloc.charged)
    return InvalidError(std::string("read_state: the ") + config_.optimizer.type + " optimizer keeps no state " +
                        StateName(kind));
  const GroupLayout& L = lay_.part.group(group);
  const uint64_t n = L.numel;
  // This rank's shard, into `all` at its place (or straight out, with one shard).
  std::vector<float> all;
  float* mine = out;
  if (lay_.sworld > 1) {
    all.resize(L.padded);
    mine = all.data() + static_cast<uint64_t>(lay_.srank) * L.shard_numel;
  }
  const uint64_t take = lay_.sworld > 1 ? L.shard_numel : n;
  Status st;
  if (lay_.compact) {  // the three unpacked together (M's codes depend on V's)
    std::vector<float> f(3 * L.shard_numel);
    float* wmv[3] = {f.data(), f.data() + L.shard_numel, f.data() + 2 * L.shard_numel};
    const bool has_v = blocks_[static_cast<size_t>(group)][int(StateKind::kV)].alloc.charged != 0;
    st = shards_->ReadShardF32(group, wmv[0], wmv[1], has_v ? wmv[2] : nullptr);
    if (st.ok()) std::memcpy(mine, wmv[static_cast<int>(kind) - 1], take * 4);
  } else if (io_->Direct(w)) {
    std::memcpy(mine, io_->DirectPtr(w), take * 4);
  } else {
    void* buf = staging_.opt.Acquire();
    st = io_->Load(w, buf);
    if (st.ok()) std::memcpy(mine, buf, take * 4);
    staging_.opt.Release(buf);
  }
  if (lay_.sworld > 1) {
    // The ranks agree first: a rank whose own read failed would leave the
    // others in the gather until the timeout (each now names it at once).
    const std::string what = std::string("read ") + StateName(kind) + " of g" + std::to_string(group);
    st = Agree(st, what);
    if (st.ok()) {
      comm_->SetLabel(what);
      st = comm_->AllGather(mine, all.data(), L.shard_numel * 4);
    }
    if (st.ok()) std::memcpy(out, all.data(), n * 4);
  }
  return st.WithContext("read_state: group " + std::to_string(group));
}

Status Engine::Impl::WriteState(int group, StateKind kind, const float* in) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group, "write_state"));
  if (!in) return InvalidError("write_state: null input for group " + std::to_string(group));
  if (lay_.frozen(group) && kind != StateKind::kW) return FrozenKeepsNo("write_state", group, kind);
  // Writing W at stages 1-2 gathers P over the ranks (RecomputePGroup): every
  // rank writes it, and agrees first.
  if (lay_.multi && kind == StateKind::kW && !lay_.frozen(group) && lay_.p_gathered_after_step())
    STRATA_RETURN_IF_ERROR(AgreeBehind("write_state"));
  // Several ranks (every one calls it): a refusal of one rank's own (a group
  // still fetched, gradients pending, a write left behind that was lost)
  // is every rank's, before the collectives below.
  Status between = CheckBetweenSteps("write_state");
  if (lay_.multi && !lay_.frozen(group)) between = Agree(between, "write_state: between steps on every rank");
  STRATA_RETURN_IF_ERROR(between);
  if (lay_.frozen(group)) return WriteFrozen(group, in).WithContext("write_state: frozen group " + std::to_string(group));
  const StateBlock& b = blocks_[static_cast<size_t>(group)][static_cast<size_t>(kind)];
  if (!b.alloc.charged)
    return InvalidError(std::string("write_state: the ") + config_.optimizer.type + " optimizer keeps no state " +
                        StateName(kind));
  const GroupLayout& L = lay_.part.group(group);
  const uint64_t lo = static_cast<uint64_t>(lay_.srank) * L.shard_numel, real = L.RealInShard(lay_.srank);
  // Several ranks: a state left part new, part old on any rank breaks every
  // rank's engine at once (a lone broken rank would refuse the next call
  // while the others wait for it in a collective). Every rank calls
  // write_state alike, so this agreement is a collective like its others.
  auto break_together = [&](bool part_way_here, Status st) {
    if (!lay_.multi) return st;
    Status all = Agree(part_way_here ? StateError("a store left part new, part old") : Status::Ok(),
                       "write_state of g" + std::to_string(group) + " whole");
    if (!all.ok() && step_.broken.empty())
      step_.broken = "write_state of group " + std::to_string(group) + " failed part-way on another rank (" +
                     all.message() + ")";
    return st.ok() ? all : st;
  };
  if (lay_.compact) {  // unpack all three, replace one, pack all three (M's codes depend on V's)
    std::vector<float> f(3 * L.shard_numel);
    float* wmv[3] = {f.data(), f.data() + L.shard_numel, f.data() + 2 * L.shard_numel};
    const bool has_v = blocks_[static_cast<size_t>(group)][int(StateKind::kV)].alloc.charged != 0;
    float* v = has_v ? wmv[2] : nullptr;
    Status st = shards_->ReadShardF32(group, wmv[0], wmv[1], v);
    if (st.ok()) {
      float* dst = wmv[static_cast<int>(kind) - 1];
      std::memset(dst, 0, L.shard_numel * 4);
      std::memcpy(dst, in + lo, real * 4);
      st = shards_->WriteShardF32(group, wmv[0], wmv[1], v);
      // P, W, M, V are stored one after another: a failure part-way can
      // leave the new bf16 half of the master beside the old corrections.
      if (!st.ok() && step_.broken.empty())
        step_.broken = "write_state of group " + std::to_string(group) + " failed part-way (" + st.ToString() +
                       "): its compact state (P, W, M, V, stored one after another) may be mixed";
    }
    st = break_together(!st.ok() && !step_.broken.empty(), st);
    if (kind == StateKind::kW && lay_.multi && lay_.p_gathered_after_step())
      st = Agree(st, "write_state of g" + std::to_string(group));
    if (st.ok() && kind == StateKind::kW && lay_.p_gathered_after_step()) {
      st = RecomputePGroup(group, nullptr, 0);
      steps_[static_cast<size_t>(group)].p_stale = !st.ok();
    }
    DropDeviceCopies();
    return st.WithContext("write_state: group " + std::to_string(group));
  }
  void* slot = staging_.opt.Acquire();
  float* dst = io_->Direct(b) ? static_cast<float*>(io_->DirectPtr(b)) : static_cast<float*>(slot);
  Status st = dst ? Status::Ok() : InternalError("write_state: no staging slot for a staged block");
  if (st.ok()) {
    std::memset(dst, 0, L.shard_numel * 4);
    std::memcpy(dst, in + lo, real * 4);
    size_t stored = 0;
    if (!io_->Direct(b)) st = io_->Store(b, dst, &stored);
    // Stored in units, each published as written: a failure after the first
    // leaves this state part new, part old. No later call may read it as
    // one state (the compact path's rule above).
    if (!st.ok() && stored > 0 && step_.broken.empty())
      step_.broken = "write_state of group " + std::to_string(group) + "'s " + StateName(kind) + " failed after " +
                     std::to_string(stored) + " of its " + std::to_string(b.parts.size()) + " units were written (" +
                     st.ToString() + "): it is part new, part old";
  }
  st = break_together(!st.ok() && !step_.broken.empty(), st);
  // Stages 1-2, several ranks: P's recompute gathers; the ranks agree on
  // the store first (one that failed would leave the others waiting).
  if (kind == StateKind::kW && lay_.multi && lay_.p_gathered_after_step()) st = Agree(st, "write_state of g" + std::to_string(group));
  if (st.ok() && kind == StateKind::kW) {
    st = RecomputePGroup(group, slot, slot ? staging_.opt.bytes() : 0);
    // W is the new master now: a P that did not follow it is marked, so that
    // no fetch reads the old P beside it (STATE) and the next step (or a
    // write_state again) rewrites it.
    steps_[static_cast<size_t>(group)].p_stale = !st.ok();
  }
  staging_.opt.Release(slot);
  DropDeviceCopies();
  return st.WithContext("write_state: group " + std::to_string(group));
}

// Save, load and write_state run between steps: nothing fetched, no
// gradients pending, nothing loading.
Status Engine::Impl::CheckBetweenSteps(const char* call, bool recovers) {
  if (!built_) return StateError(std::string(call) + ": the engine is not built");
  SettleBehind(recovers);
  if (!recovers) STRATA_RETURN_IF_ERROR(CheckUsable(call, false));
  // A group's grads_part without its grads_end is pending too; a load
  // abandons it (AbandonStep), as it does a failed step: the way out of a
  // broken engine mid-backward.
  if (!recovers) STRATA_RETURN_IF_ERROR(CheckNoOpenParts(call));
  residency_->DropAheadPins();
  for (int g = 0; g < lay_.part.num_groups(); ++g) {
    const GroupStep& gs = steps_[static_cast<size_t>(g)];
    if (residency_->pins(g) > 0) return StateError(std::string(call) + ": group " + std::to_string(g) + " is fetched");
    if (gs.grad_calls > 0 && !(recovers && (step_.pending || !step_.broken.empty())))  // a load abandons a failed step
      return StateError(std::string(call) + ": gradients of group " + std::to_string(g) +
                        " are pending; save or load between steps");
  }
  residency_->WaitIdle();
  // A stash dropped or redeemed while its write was in flight still writes
  // to the swap (the activation store's thread): a save's snapshot of the
  // swap file, or a load's writes, come after it.
  if (acts_) acts_->WaitIdle();
  return Status::Ok();
}

Status Engine::Impl::SaveCheckpoint(const std::string& dir, const std::string& tag, const void* blob,
                                    uint64_t blob_bytes) {
  STRATA_RETURN_IF_ERROR(AgreeBehind("checkpoint save"));  // several ranks: a write one lost fails every one's save
  // A refusal of one rank's own is every rank's (the save's collectives follow).
  STRATA_RETURN_IF_ERROR(Agree(CheckBetweenSteps("checkpoint save"), "checkpoint save: between steps on every rank"));
  return checkpointer_->Save(dir, tag, blob, blob_bytes);
}

Status Engine::Impl::LoadCheckpoint(const std::string& dir, const std::string& tag, std::vector<uint8_t>* blob) {
  STRATA_RETURN_IF_ERROR(CheckBetweenSteps("checkpoint load", /*recovers=*/true));
  return checkpointer_->Load(dir, tag, blob);
}

// P = W in the compute dtype, as after every step: this rank's shard, then
// (stages 1-2 with several ranks) the other ranks' slices gathered.
Status Engine::Impl::RecomputeP(void* buf, uint64_t buf_bytes) {
  // Every group's own slice first (a frozen P is loaded as saved), then,
  // where P is gathered after the step (stages 1-2, several ranks), the
  // gathers, once the ranks agreed: a rank whose read failed part-way
  // skipped the gathers its peers were in (COMM on every rank, the
  // communicator broken, so no load could ever mend the state).
  Status local;
  for (int g = 0; g < lay_.part.num_groups() && local.ok(); ++g)
    if (!lay_.frozen(g)) local = RecomputePGroup(g, buf, buf_bytes, /*gather=*/false);
  if (!lay_.multi || !lay_.p_gathered_after_step()) return local;
  STRATA_RETURN_IF_ERROR(Agree(local, "P recomputed from the master"));
  for (int g = 0; g < lay_.part.num_groups(); ++g)
    if (!lay_.frozen(g)) STRATA_RETURN_IF_ERROR(GatherPGroup(g));
  return Status::Ok();
}

// The other ranks' slices of group g's P gathered into its block, where P
// is gathered after the step (stages 1-2, several ranks) and is a block of
// its own in host-addressable memory (P stored whole, or read from W's
// block, has no slice to gather).
Status Engine::Impl::GatherPGroup(int g) {
  if (!lay_.p_gathered_after_step() || (!lay_.compact && lay_.PIsW(g))) return Status::Ok();
  const StateBlock& p = blocks_[static_cast<size_t>(g)][int(StateKind::kP)];
  if (!io_->Direct(p))
    return lay_.compact ? InternalError("several ranks in stages 1-2 with P off the host") : Status::Ok();
  return reducer_->Gather(g, io_->DirectPtr(p));
}

Status Engine::Impl::RecomputePGroup(int g, void* buf, uint64_t buf_bytes, bool gather) {
  if (lay_.frozen(g)) return InternalError("P of frozen group " + std::to_string(g) + " recomputed from a master it has not");
  if (lay_.compact)  // this rank's slice of P is the master's bf16 half: only the others' slices to gather
    return gather ? GatherPGroup(g) : Status::Ok();
  if (lay_.PIsW(g)) return Status::Ok();  // P's copies are read from W's block
  const uint64_t n = lay_.part.group(g).shard_numel;
  const StateBlock& wb = blocks_[static_cast<size_t>(g)][int(StateKind::kW)];
  float* w = static_cast<float*>(buf);
  if (io_->Direct(wb)) w = static_cast<float*>(io_->DirectPtr(wb));
  else STRATA_RETURN_IF_ERROR(io_->Load(wb, w));
  const StateBlock& p = blocks_[static_cast<size_t>(g)][int(StateKind::kP)];
  if (io_->Direct(p)) {  // our slice (or all of it), then the other ranks' slices
    STRATA_RETURN_IF_ERROR(kernels::Cast(DType::kF32, w, lay_.dtype, static_cast<char*>(io_->DirectPtr(p)) + lay_.PSliceOffset(g), n));
    return gather ? GatherPGroup(g) : Status::Ok();
  }
  const uint64_t at = w == buf ? AlignUp(n * 4, 4096) : 0;  // after W when W is in the buffer
  if (!buf || at + p.bytes > buf_bytes) return InternalError("the staging slot cannot hold W and P");
  char* pbuf = static_cast<char*>(buf) + at;
  STRATA_RETURN_IF_ERROR(kernels::Cast(DType::kF32, w, lay_.dtype, pbuf, n));
  return io_->Store(p, pbuf);
}

}  // namespace strata
