// Frozen groups (Engine::FreezeGroup): a fine-tune's base weights, kept as P
// alone in the compute dtype and never updated. Fetch and release treat them
// as any group (residency/); here: marking them, where their P is for the
// CPU, read_master and write_state on them, and the ranks' agreement at
// build. Their checkpoint blocks ("P") are saved in checkpoint.cpp and
// loaded in checkpoint_load.cpp.
#include <algorithm>
#include <cstring>
#include <vector>

#include "engine/engine_impl.h"
#include "kernels/cpu/cast.h"

namespace strata {

Status Engine::FreezeGroup(int group) {
  const std::string what = "freeze_group " + std::to_string(group);
  if (group < 0 || group > 1'000'000) return InvalidError(what + ": the group is not in 0..1000000");
  if (impl_->built_) return StateError(what + ": the engine is already built (freeze groups before build)");
  std::vector<uint8_t>& f = impl_->lay_.frozen_groups;
  if (static_cast<size_t>(group) >= f.size()) f.resize(static_cast<size_t>(group) + 1, 0);
  f[static_cast<size_t>(group)] = 1;
  return Status::Ok();
}

bool Engine::group_frozen(int group) const { return group >= 0 && impl_->lay_.frozen(group); }

Status Engine::Impl::ReadFrozen(int g, float* out) {
  const GroupLayout& L = lay_.part.group(g);
  ShardBlocks sb;
  Status st = shards_->LocateFrozenP(g, true, &sb);
  // Stages 0-2: every rank holds the whole group; nothing to gather.
  if (!lay_.p_sharded) {
    STRATA_RETURN_IF_ERROR(st);
    return kernels::Cast(lay_.dtype, sb.at[int(StateKind::kP)], DType::kF32, out, L.numel);
  }
  std::vector<float> all(L.padded);
  float* mine = all.data() + static_cast<uint64_t>(lay_.srank) * L.shard_numel;
  if (st.ok()) st = kernels::Cast(lay_.dtype, sb.at[int(StateKind::kP)], DType::kF32, mine, L.shard_numel);
  // Agreed before the gather: a rank that failed here would leave the others waiting in it.
  STRATA_RETURN_IF_ERROR(Agree(st, "read P of frozen g" + std::to_string(g)));
  comm_->SetLabel("read P of frozen g" + std::to_string(g));
  STRATA_RETURN_IF_ERROR(comm_->AllGather(mine, all.data(), L.shard_numel * 4));
  std::memcpy(out, all.data(), L.numel * 4);
  return Status::Ok();
}

Status Engine::Impl::WriteFrozen(int g, const float* in) {
  const GroupLayout& L = lay_.part.group(g);
  const uint64_t lo = static_cast<uint64_t>(lay_.srank) * L.shard_numel;
  ShardBlocks sb;
  STRATA_RETURN_IF_ERROR(shards_->LocateFrozenP(g, false, &sb));
  void* p = sb.at[int(StateKind::kP)];
  std::memset(p, 0, lay_.PHomeNumel(g) * DTypeSize(lay_.dtype));  // the padding stays zero
  // Stage 3 with several ranks: this rank's shard; else the whole group.
  const uint64_t from = lay_.p_sharded ? lo : 0, count = lay_.p_sharded ? L.RealInShard(lay_.srank) : L.numel;
  if (count > 0) STRATA_RETURN_IF_ERROR(kernels::Cast(DType::kF32, in + from, lay_.dtype, p, count));
  STRATA_RETURN_IF_ERROR(shards_->StoreShard(g, sb));
  DropDeviceCopies();  // fetched copies hold the old values
  return Status::Ok();
}

// Rank 0's flags against ours. Every rank learns the outcome (Agree), so
// none goes on to allocate while another has refused.
Status Engine::Impl::AgreeOnFrozen() {
  const size_t n = static_cast<size_t>(lay_.part.num_groups());
  std::vector<uint8_t> mine(n), first(n);
  for (size_t g = 0; g < n; ++g) mine[g] = first[g] = lay_.frozen(static_cast<int>(g)) ? 1 : 0;
  comm_->SetLabel("build: frozen groups");
  STRATA_RETURN_IF_ERROR(comm_->Broadcast(first.data(), n, 0).WithContext("build: rank 0's frozen groups"));
  Status local;
  for (size_t g = 0; g < n && local.ok(); ++g)
    if (mine[g] != first[g])
      local = InvalidError("build: group " + std::to_string(g) + " is " + (mine[g] ? "frozen" : "not frozen") +
                           " on rank " + std::to_string(options_.rank) + " but " +
                           (first[g] ? "frozen" : "not frozen") + " on rank 0; every rank must freeze the same groups");
  return Agree(local, "build: frozen groups");
}

}  // namespace strata
