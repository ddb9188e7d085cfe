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
#include "kernels/cpu/parallel.h"
#include "tiers/gpu.h"

namespace strata {

namespace {

Status OpenPartsError(const char* call, int group) {
  return InvalidError(std::string(call) + ": group " + std::to_string(group) +
                      " has a grads call in parts open (grads_part); end it with grads_end first");
}

// G[0, count) (G's dtype) += src (`dtype`) a tile at a time: widen, add in
// fp32, store in G's dtype (nearest even); `overwrite`: G = src, converted.
Status AddInto(DType gdtype, void* G, const void* src, DType dtype, uint64_t count, bool overwrite) {
  constexpr uint64_t kTile = 4096;
  float wide[kTile], sum[kTile];
  const uint64_t gsize = DTypeSize(gdtype);
  Status st;
  for (uint64_t at = 0; st.ok() && at < count; at += kTile) {
    const uint64_t k = std::min(kTile, count - at);
    const float* x = wide;
    if (dtype == DType::kF32) x = static_cast<const float*>(src) + at;
    else st = kernels::Cast(dtype, static_cast<const char*>(src) + at * DTypeSize(dtype), DType::kF32, wide, k);
    char* g = static_cast<char*>(G) + at * gsize;
    if (!st.ok()) break;
    if (gdtype == DType::kF32) {
      float* gf = reinterpret_cast<float*>(g);
      if (overwrite) std::memcpy(gf, x, k * 4);
      else for (uint64_t i = 0; i < k; ++i) gf[i] += x[i];
      continue;
    }
    if (overwrite) {
      st = kernels::Cast(DType::kF32, x, gdtype, g, k);
      continue;
    }
    st = kernels::Cast(gdtype, g, DType::kF32, sum, k);
    for (uint64_t i = 0; st.ok() && i < k; ++i) sum[i] += x[i];
    if (st.ok()) st = kernels::Cast(DType::kF32, sum, gdtype, g, k);
  }
  return st;
}

}  // namespace

Status Engine::Impl::Grads(int group, const void* grads, DType dtype) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group, "grads"));
  if (!grads) return InvalidError("grads: null gradient pointer for group " + std::to_string(group));
  if (lay_.frozen(group))
    return InvalidError("grads: group " + std::to_string(group) +
                        " is frozen (freeze_group): it keeps its parameters alone and takes no gradients");
  GroupStep& gs = steps_[static_cast<size_t>(group)];
  if (gs.parts.open) return OpenPartsError("grads", group);
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
  if (gs.grad_calls > 0) SettleLent(group);  // added to below: G whole first
  const uint64_t n = lay_.part.group(group).shard_numel, gsize = DTypeSize(lay_.gdtype);
  const StateBlock& gb = blocks_[static_cast<size_t>(group)][int(StateKind::kG)];
  const bool direct = io_->Direct(gb);
  void* G = direct ? io_->DirectPtr(gb) : staging_.grad.Acquire();
  Status st;
  if (gs.grad_calls > 0 && !direct) st = io_->Load(gb, G);
  if (gs.grad_calls == 0 && dtype == lay_.gdtype) {  // stored as handed in (or there already: SumsInG)
    if (G != src) std::memcpy(G, src, count * gsize);
  } else if (gs.grad_calls == 0 && lay_.gdtype == DType::kF32) {
    st = kernels::Cast(dtype, src, DType::kF32, G, count);
  } else if (st.ok()) {
    st = AddInto(lay_.gdtype, G, src, dtype, count, /*overwrite=*/gs.grad_calls == 0);
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

float* Engine::Impl::SumsInG(int group) const {
  const StateBlock& gb = blocks_[static_cast<size_t>(group)][int(StateKind::kG)];
  if (lay_.gdtype != DType::kF32 || !io_->Direct(gb) || steps_[static_cast<size_t>(group)].grad_calls > 0)
    return nullptr;
  return static_cast<float*>(io_->DirectPtr(gb));
}

// ---- one grads call in parts ----------------------------------------------
//
// Each part goes straight into G: no caller's buffer of the whole group to
// fill first, no copy of it here. The tiles of G that a part covers whole
// are summed (squares, for the norm) while the copy has them in cache; the
// end zeroes what no part gave and sums the other tiles from G. The sum is
// SumSquares's over G, bitwise (kernels/cpu/norm.h: TileSquares, JoinTiles),
// so the norm, the clipping and the step are those of one grads call.

char* Engine::Impl::GOf(int group) const {
  return static_cast<char*>(io_->DirectPtr(blocks_[static_cast<size_t>(group)][int(StateKind::kG)]));
}

std::string Engine::Impl::PartsRefused(int group, DType dtype) const {
  const std::string g = "group " + std::to_string(group);
  if (lay_.frozen(group)) return g + " is frozen (freeze_group): it takes no gradients";
  if (device_->separate()) return "with a GPU the gradients are in device memory: hand whole groups";
  if (lay_.reduces) {  // packed for the reduction as they come, in fp32 whatever their dtype
    const std::string why = reducer_->PartsRefused();
    return why.empty() ? "" : "with several ranks " + why;
  }
  if (!io_->Direct(blocks_[static_cast<size_t>(group)][int(StateKind::kG)]))
    return "the gradient accumulator of " + g + " is not in host memory";
  if (dtype != lay_.gdtype)
    return std::string("parts of ") + DTypeName(dtype) + " go into an accumulator of " + DTypeName(lay_.gdtype) +
           " only through a whole grads call";
  return "";
}

Result<const void*> Engine::Impl::GradsView(int group) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group, "grads_view"));
  if (lay_.reduces)
    return InvalidError("grads_view: with several ranks G holds this rank's shard of the reduced sums, "
                        "not the gradients handed in");
  if (const std::string why = PartsRefused(group, lay_.gdtype); !why.empty())
    return InvalidError("grads_view: " + why);
  const GroupStep& gs = steps_[static_cast<size_t>(group)];
  if (gs.parts.open) return OpenPartsError("grads_view", group);
  if (gs.grad_calls == 0)
    return StateError("grads_view: group " + std::to_string(group) + " has no gradients this step");
  SettleLent(group);
  return static_cast<const void*>(GOf(group));
}

Status Engine::Impl::CheckNoOpenParts(const char* call) const {
  for (size_t g = 0; g < steps_.size(); ++g)
    if (steps_[g].parts.open) return OpenPartsError(call, static_cast<int>(g));
  return Status::Ok();
}

bool Engine::Impl::LendsParts(int group) const {
  // W, M, V on NVMe: copied, so that the caller's gradients need not stay in
  // host memory through the step's I/O (where host memory is what is short).
  return !lay_.reduces && !lay_.compact && lay_.home[int(StateKind::kW)] != TierKind::kNvme && gpu_ &&
         !gpu_->UpdatesOnGpu(group) &&
         !(worker_ && step_.prepared && step_.early && !step_.doomed);
}

void Engine::Impl::SettleLent(int group) {
  GroupStep& gs = steps_[static_cast<size_t>(group)];
  if (gs.lent.empty()) return;
  char* G = GOf(group);
  const uint64_t size = DTypeSize(lay_.gdtype);
  for (const LentPart& p : gs.lent)
    kernels::ParallelForTiles(p.count, kernels::kReduceTile, [&](size_t a, size_t b) {
      std::memcpy(G + (p.first + a) * size, static_cast<const char*>(p.src) + a * size, (b - a) * size);
    });
  gs.lent.clear();
}

bool Engine::Impl::LentInUse(int group) {
  if (!steps_[static_cast<size_t>(group)].lent.empty()) return true;
  return reducer_ && reducer_->ReadsLent(group);
}

void Engine::Impl::SettleAllLent() {
  for (int g = 0; g < static_cast<int>(steps_.size()); ++g) SettleLent(g);
  if (reducer_) reducer_->SettleLent();  // several ranks: a call in parts still open
}

Status Engine::Impl::GradsPart(int group, uint64_t first, uint64_t count, const void* src, DType dtype, bool lend) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group, "grads_part"));
  if (!src && count > 0) return InvalidError("grads_part: null gradient pointer for group " + std::to_string(group));
  if (const std::string why = PartsRefused(group, dtype); !why.empty())
    return InvalidError("grads_part: " + why + " (grads takes the group whole)");
  GroupStep& gs = steps_[static_cast<size_t>(group)];
  GradParts& h = gs.parts;
  // The group's elements: at one rank its shard is the group; with several
  // the parts are of the whole group's gradient, packed for the reduction.
  const uint64_t real = lay_.reduces ? lay_.part.group(group).numel : lay_.part.group(group).RealInShard(lay_.srank);
  if (first > real || count > real - first)
    return InvalidError("grads_part: elements [" + std::to_string(first) + ", " + std::to_string(first + count) +
                        ") are outside group " + std::to_string(group) + "'s " + std::to_string(real));
  if (!h.open && (gs.grad_calls > 0 || gs.handed > 0))
    return InvalidError("grads_part: group " + std::to_string(group) +
                        " already has gradients this step; parts take a step's first gradients of a group only "
                        "(hand later ones whole with grads)");
  // A part given again, as it was, is added to (a parameter that backward
  // reached twice); one that overlaps another otherwise is a caller's error.
  auto next = h.given.lower_bound(first);
  const bool again = next != h.given.end() && next->first == first && next->second == count;
  if (!again && count > 0) {
    const bool over_next = next != h.given.end() && next->first < first + count;
    auto prev = next == h.given.begin() ? h.given.end() : std::prev(next);
    const bool over_prev = prev != h.given.end() && prev->first + prev->second > first;
    if (over_next || over_prev) {
      const auto& o = over_prev ? *prev : *next;
      return InvalidError("grads_part: elements [" + std::to_string(first) + ", " + std::to_string(first + count) +
                          ") of group " + std::to_string(group) + " overlap the part [" + std::to_string(o.first) +
                          ", " + std::to_string(o.first + o.second) + ") given before in this call");
    }
  }
  if (lay_.reduces) {  // into the reduction's packed buffer (reducer.h), not G
    if (!h.open) {
      STRATA_RETURN_IF_ERROR(DrainComm(/*wait=*/false));  // an earlier background failure: now
      STRATA_RETURN_IF_ERROR(reducer_->PartsBegin(group, lend));
      h.open = true;
      h.given.clear();
    }
    if (count == 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(reducer_->Part(group, first, count, src, dtype, again, lend));
    if (!again) h.given.emplace(first, count);
    return Status::Ok();
  }
  const uint64_t n = lay_.part.group(group).shard_numel, size = DTypeSize(dtype);
  constexpr uint64_t T = kernels::kReduceTile;
  if (!h.open) {
    h.open = true;
    h.given.clear();
    h.partial.assign((n + T - 1) / T, 0.0);
    h.done.assign(h.partial.size(), 0);
  }
  if (count == 0) return Status::Ok();
  char* G = GOf(group);
  const char* in = static_cast<const char*>(src);
  const uint64_t end = first + count;
  if (again) {
    SettleLent(group);  // (the part may be one of them)
    for (uint64_t t = first / T; t * T < end; ++t) h.done[t] = 0;  // summed again at the end
    return AddInto(dtype, G + first * size, src, dtype, count, /*overwrite=*/false).WithContext("grads_part");
  }
  h.given.emplace(first, count);
  // Tiles [a, b) lie whole in the part (the last tile of G, short or not,
  // only where the part reaches G's end); the ends around them are copied.
  const uint64_t a = (first + T - 1) / T, b = end == n ? (n + T - 1) / T : end / T;
  if (a >= b) {
    std::memcpy(G + first * size, in, count * size);
    return Status::Ok();
  }
  const uint64_t lo = a * T, hi = std::min(n, b * T);
  std::memcpy(G + first * size, in, (lo - first) * size);
  std::memcpy(G + hi * size, in + (hi - first) * size, (end - hi) * size);
  if (lend && LendsParts(group)) {
    // The whole tiles stay where the caller has them (read once here, for
    // their squares, and once by the update): no copy into G, and none of
    // G's cache lines written in the middle of backward.
    STRATA_RETURN_IF_ERROR(kernels::TileSquares(dtype, in + (lo - first) * size, hi - lo, &h.partial[a]));
    auto& lent = steps_[static_cast<size_t>(group)].lent;
    const LentPart part{lo, hi - lo, in + (lo - first) * size};
    lent.insert(std::upper_bound(lent.begin(), lent.end(), part,
                                 [](const LentPart& x, const LentPart& y) { return x.first < y.first; }),
                part);
  } else {
    STRATA_RETURN_IF_ERROR(
        kernels::CopyTileSquares(dtype, in + (lo - first) * size, G + lo * size, hi - lo, &h.partial[a]));
  }
  std::fill(h.done.begin() + static_cast<std::ptrdiff_t>(a), h.done.begin() + static_cast<std::ptrdiff_t>(b), 1);
  return Status::Ok();
}

Status Engine::Impl::GradsEnd(int group) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group, "grads_end"));
  GroupStep& gs = steps_[static_cast<size_t>(group)];
  GradParts& h = gs.parts;
  if (!h.open)
    return StateError("grads_end: group " + std::to_string(group) + " has no grads call in parts open (grads_part)");
  if (lay_.reduces) {  // the packed gradient to the reduction; G gets the sums (OnGradsComplete: from there)
    Status st = reducer_->PartsEnd(group, h.given);
    h = GradParts{};
    if (!st.ok()) return st;
    ++gs.handed;
    last_grads_s_ = stats_->Now();
    return Status::Ok();
  }
  const uint64_t n = lay_.part.group(group).shard_numel, size = DTypeSize(lay_.gdtype);
  constexpr uint64_t T = kernels::kReduceTile;
  char* G = GOf(group);
  uint64_t at = 0;  // what no part gave is zero (and the padding)
  for (const auto& [first, count] : h.given) {
    if (first > at) std::memset(G + at * size, 0, (first - at) * size);
    at = first + count;
  }
  if (at < n) std::memset(G + at * size, 0, (n - at) * size);
  for (uint64_t t = 0; t < h.done.size();) {  // each run of tiles no part summed, from G
    if (h.done[t]) { ++t; continue; }
    uint64_t u = t;
    while (u < h.done.size() && !h.done[u]) ++u;
    const uint64_t lo = t * T, hi = std::min(n, u * T);
    STRATA_RETURN_IF_ERROR(
        kernels::TileSquares(lay_.gdtype, G + lo * size, hi - lo, &h.partial[t]).WithContext("grads_end"));
    t = u;
  }
  const kernels::SquaresSum sq = kernels::JoinTiles(h.partial.data(), h.partial.size());
  h = GradParts{};
  gs.sum_squares = sq.sum_squares;
  gs.finite = sq.all_finite;
  ++gs.grad_calls;
  ++gs.handed;
  if (!LendsParts(group)) SettleLent(group);  // (prepare_step came after the parts: an early update may read G)
  OnGradsComplete(group);
  last_grads_s_ = stats_->Now();
  return Status::Ok();
}

}  // namespace strata
