// Grads: a group's gradients into G (here, or through the reduction with
// several ranks), with the sums of squares the step's norm needs.
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

Status Engine::Impl::Grads(int group, const void* grads, DType dtype) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group, "grads"));
  if (!grads) return InvalidError("grads: null gradient pointer for group " + std::to_string(group));
  if (lay_.frozen(group))
    return InvalidError("grads: group " + std::to_string(group) +
                        " is frozen (freeze_group): it keeps its parameters alone and takes no gradients");
  GroupStep& gs = steps_[static_cast<size_t>(group)];
  // The overlapped step updates this group once its gradients are complete:
  // one more would land in a G the update already read (or is reading).
  if (OverlapHasTaken(group)) STRATA_RETURN_IF_ERROR(UndoOverlap(group, "grads"));
  if (lay_.reduces) {
    STRATA_RETURN_IF_ERROR(DrainComm(/*wait=*/false));  // an earlier background failure: now
    STRATA_RETURN_IF_ERROR(reducer_->Grads(group, grads, dtype));  // OnGradsComplete: from the accumulation
    ++gs.handed;
    last_grads_s_ = stats_->Now();
    return Status::Ok();
  }
  const GroupLayout& L = lay_.part.group(group);
  const uint64_t lo = static_cast<uint64_t>(lay_.srank) * L.shard_numel;  // one shard here: lay_.srank is 0
  const uint64_t real = L.RealInShard(lay_.srank);
  const char* src = static_cast<const char*>(grads) + lo * DTypeSize(dtype);
  void* src_buf = nullptr;
  if (device_->separate()) {  // bring the gradients to the host first
    src_buf = staging_.grad.Acquire();
    auto t = device_->CopyOut(src_buf, src, real * DTypeSize(dtype));
    Status st = t.ok() ? (*t)->Wait() : t.status();
    if (!st.ok()) { staging_.grad.Release(src_buf); return st.WithContext("grads: group " + std::to_string(group)); }
    stats_->AddMoved(TierKind::kDevice, TierKind::kHost, real * DTypeSize(dtype));
    src = static_cast<const char*>(src_buf);
  }
  Status st = AccumulateG(group, src, dtype, real);
  if (src_buf) staging_.grad.Release(src_buf);
  if (!st.ok()) return st.WithContext("grads: group " + std::to_string(group));
  ++gs.handed;
  OnGradsComplete(group);
  last_grads_s_ = stats_->Now();
  return Status::Ok();
}

// Adds `count` elements of `src` (host memory, `dtype`) to this rank's shard
// of the group's G — the step's first call overwrites, the padding stays
// zero — and records the shard's sum of squares for the global norm.
Status Engine::Impl::AccumulateG(int group, const void* src, DType dtype, uint64_t count) {
  GroupStep& gs = steps_[static_cast<size_t>(group)];
  const uint64_t n = lay_.part.group(group).shard_numel, gsize = DTypeSize(lay_.gdtype);
  const StateBlock& gb = blocks_[static_cast<size_t>(group)][int(StateKind::kG)];
  const bool direct = io_->Direct(gb);
  void* G = direct ? io_->DirectPtr(gb) : staging_.grad.Acquire();
  Status st;
  if (gs.grad_calls > 0 && !direct) st = io_->Load(gb, G);
  if (gs.grad_calls == 0 && dtype == lay_.gdtype) {  // stored as handed in
    std::memcpy(G, src, count * gsize);
  } else if (gs.grad_calls == 0 && lay_.gdtype == DType::kF32) {
    st = kernels::Cast(dtype, src, DType::kF32, G, count);
  } else if (st.ok()) {  // a tile at a time: widen, add in fp32, store in G's dtype (nearest even)
    constexpr uint64_t kTile = 4096;
    float wide[kTile], sum[kTile];
    for (uint64_t at = 0; st.ok() && at < count; at += kTile) {
      const uint64_t k = std::min(kTile, count - at);
      const float* x = wide;
      if (dtype == DType::kF32) x = static_cast<const float*>(src) + at;
      else st = kernels::Cast(dtype, static_cast<const char*>(src) + at * DTypeSize(dtype), DType::kF32, wide, k);
      char* g = static_cast<char*>(G) + at * gsize;
      if (!st.ok()) break;
      if (lay_.gdtype == DType::kF32) {
        float* gf = reinterpret_cast<float*>(g);
        if (gs.grad_calls == 0) std::memcpy(gf, x, k * 4);
        else for (uint64_t i = 0; i < k; ++i) gf[i] += x[i];
        continue;
      }
      if (gs.grad_calls == 0) {
        st = kernels::Cast(DType::kF32, x, lay_.gdtype, g, k);
        continue;
      }
      st = kernels::Cast(lay_.gdtype, g, DType::kF32, sum, k);
      for (uint64_t i = 0; st.ok() && i < k; ++i) sum[i] += x[i];
      if (st.ok()) st = kernels::Cast(DType::kF32, sum, lay_.gdtype, g, k);
    }
  }
  if (st.ok() && gs.grad_calls == 0) std::memset(static_cast<char*>(G) + count * gsize, 0, (n - count) * gsize);
  kernels::SquaresSum sq;
  if (st.ok()) st = kernels::SumSquares(lay_.gdtype, G, n, &sq);
  // The step's last gradients of g: its early update may use them from here.
  if (st.ok() && !direct && gs.grad_calls + 1 == options_.grad_accumulation_steps && worker_ && step_.prepared &&
      step_.early && !step_.doomed)
    KeepGCopy(group, G, n * gsize);
  if (st.ok() && !direct) st = io_->Store(gb, G);
  if (!direct) staging_.grad.Release(G);
  if (!st.ok()) return st;
  gs.sum_squares = sq.sum_squares;
  gs.finite = sq.all_finite;
  ++gs.grad_calls;
  return Status::Ok();
}

}  // namespace strata
