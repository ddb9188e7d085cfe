// The optimizer step as a pipeline over shards, each shard's W, M, V, G in a
// staging slot while it is read, updated and written back. strata.step_io
// picks the disk's schedule (config.h):
//   alternate:  in batches of half the slots (b): update batch k beside the
//               writes of batch k-1 (compact: beside the reads of batch
//               k+1); read batch k+1; write batch k; ... the disk never
//               reads and writes at once;
//   concurrent: while shard i is updated, shard i+1 is read and shard i-1
//               written (three slots or more; reads run up to K-2 ahead).
// States the CPU addresses in place (host-homed, or the device tier's host
// arena) are not moved at all; nor are W, M, V (and P) homed on a GPU when
// the GPU updates them in place (gpu_update.cpp): only G comes to the device.
//
// Nothing half-happens: a group's new W, M, V are written to fresh extents
// (NvmeTier copies on write) and published together once all three writes
// are done, or all discarded; the group is then committed for this step. A
// failed step leaves every group wholly old or wholly new, and the next Step
// finishes the uncommitted ones from their old state and the gradients still
// in G. P follows W: when only P's store fails, P is recomputed from W.
#include "engine/step/pipeline.h"

#include "base/text.h"

#include <algorithm>
#include <cfloat>
#include <array>
#include <cstring>
#include <deque>
#include <tuple>
#include <utility>

#include "base/align.h"
#include "base/log.h"

#include "engine/layout/staging_plan.h"
#include "kernels/cpu/adagrad.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/compact.h"
#include "kernels/cpu/lion.h"
#include "kernels/cpu/parallel.h"

namespace strata {

namespace {

// Moves in flight for one job: at most one per state, no allocation.
struct Moves {
  std::array<BlockMove, kNumStates> m;
  std::array<int, kNumStates> state{};  // the state each move carries
  int n = 0;
  BlockMove* begin() { return m.data(); }
  BlockMove* end() { return m.data() + n; }
  void Add(int s, BlockMove x) {
    state[static_cast<size_t>(n)] = s;
    m[static_cast<size_t>(n++)] = std::move(x);
  }
};

struct Job {
  int group = -1;
  // Its unit of the group (Layout::units): elements [first, first + len)
  // of the shard; a group stepped whole is one job of unit 0.
  int unit = 0;
  uint64_t first = 0, len = 0;
  bool last_of_group = true;  // the run's last job of its group (g_done)
  void* slot = nullptr;
  float* ptr[kNumStates] = {};  // where each state is during the update
  Moves loads, stores;
  bool summed = false;               // sum holds the stored blocks' checksums (alternate)
  uint64_t sum[kNumStates] = {};
  bool updated = false;  // the update (CPU or GPU) ran and succeeded
  bool settled = false;  // finish_stores ran
  bool p_shadow = false;  // compact: a host-homed P updated in the slot, copied back at commit
  bool gpu = false;  // W, M, V (and a device-homed P) are updated in place on the GPU
  bool p_copy_failed = false;  // (gpu) updated, but the copy of P to its host home failed
  StepKernelOptions ko;  // the group's options (its own update count)
  bool g_copy = false;   // G is the feed's copy (Feed::g_copy): handed back by g_done
  bool behind = false;   // RunBehind: committed at Updated, its writes after the run returned
};

// The update of elements [first, first + len): the kernel once over G, or,
// where parts of G are lent (GroupStep::lent, in element order), once per
// piece, reading G where each piece is (`g`: G's element `first`; `p`: the
// copy-out's, of `psize` bytes an element, or null). An element gets the
// same operations wherever a call cuts the range (the kernels' tails run
// their vector body on padded copies), so the result is bitwise one call's.
Status StepInPieces(const StepKernelOptions& ko, uint64_t first, uint64_t len, float* w, float* m, float* v,
                      const char* g, uint64_t gsize, const std::vector<LentPart>& lent, char* p, uint64_t psize) {
  const uint64_t end = first + len;
  auto run = [&](uint64_t a, uint64_t b, const void* gp) {
    const uint64_t o = a - first;
    return StepKernelCpu(ko, b - a, w + o, m ? m + o : nullptr, v ? v + o : nullptr, gp, p ? p + o * psize : nullptr);
  };
  uint64_t at = first;
  for (const LentPart& part : lent) {
    const uint64_t a = std::max(part.first, first), b = std::min(part.first + part.count, end);
    if (a >= b) continue;
    if (at < a) STRATA_RETURN_IF_ERROR(run(at, a, g + (at - first) * gsize));
    STRATA_RETURN_IF_ERROR(run(a, b, static_cast<const char*>(part.src) + (a - part.first) * gsize));
    at = b;
  }
  if (at < end) STRATA_RETURN_IF_ERROR(run(at, end, g + (at - first) * gsize));
  return Status::Ok();
}

}  // namespace

StepKernelOptions StepPipeline::KernelOptions(const StepOptions& so, double grad_scale, int64_t step) const {
  const OptimizerConfig& oc = layout_.config->optimizer;
  auto pick = [](double v, double dflt) { return v >= 0 ? v : dflt; };
  const double lr = pick(so.lr, oc.lr), b1 = pick(so.beta1, oc.beta1), b2 = pick(so.beta2, oc.beta2);
  const double eps = pick(so.eps, oc.eps), wd = pick(so.weight_decay, oc.weight_decay);
  const bool copy_f32 = layout_.dtype == DType::kF32;  // fp32 compute: P is a copy of W, no kernel copy-out
  StepKernelOptions o = MakeStepKernelOptions(oc.type, oc.type == "adamw" || oc.adam_w_mode,
                                              StepHyper{lr, b1, b2, eps, wd, grad_scale, step}, layout_.gdtype,
                                              copy_f32 ? DType::kBF16 : layout_.dtype);
  o.adam.moment_update = MomentUpdateOf(oc.moment_update);  // the CPU and GPU updates alike
  return o;
}

Status StepPipeline::Check(const StepOptions& so) const {
  const StepKernelOptions o = KernelOptions(so, 1.0, 1);
  const OptimizerConfig& oc = layout_.config->optimizer;
  const double eps = so.eps >= 0 ? so.eps : oc.eps;  // (the C API passes a 0 asked for as the least positive double)
  if (CompactEpsMakesNaN(*layout_.config, eps))
    return InvalidError("step option eps " + ShortDouble(eps <= DBL_TRUE_MIN ? 0.0 : eps) + " (0 as a float) with strata.state_format \"compact\": an element whose moments round to 0 "
                        "in their block would update by 0/0 (NaN); give eps > 0");
  return ValidateStepKernelOptions(o);
}

Status StepPipeline::Run(const std::vector<int>& order, double grad_scale, const StepOptions& so, int64_t step,
                         std::string* broken) {
  size_t next = 0;
  Feed feed;
  feed.next = [&](bool) { return next < order.size() ? order[next++] : -1; };
  feed.step_of = [step](int) { return step; };
  return RunFeed(feed, grad_scale, so, broken);
}

Status StepPipeline::RunFeed(const Feed& feed, double grad_scale, const StepOptions& so, std::string* broken) {
  const Config& config = *layout_.config;
  const bool copy_f32 = layout_.dtype == DType::kF32;  // fp32 compute: P is a copy of W, no kernel copy-out
  Speculation* const spec = feed.spec;
  // The run's jobs as the feed hands out their groups, (group, unit): a
  // group stepped in units gives a job for each unit not yet committed in
  // this step; jobs (a deque: stable) beside.
  std::vector<std::pair<int, int>> order;
  std::deque<Job> jobs;
  // Whether job i exists: known already, or the feed has it (wait: blocks
  // until it does or the run is over; else only looks).
  auto avail = [&](int i, bool wait) {
    while (static_cast<int>(order.size()) <= i) {
      const int g = feed.next(wait);
      if (g < 0) return false;
      const int n = layout_.Units(g);
      GroupStep& gs = steps_[static_cast<size_t>(g)];
      if (n > 1 && gs.unit_done.size() != static_cast<size_t>(n)) gs.unit_done.assign(static_cast<size_t>(n), 0);
      for (int u = 0; u < n; ++u) {
        if (n > 1 && gs.unit_done[static_cast<size_t>(u)]) continue;
        order.emplace_back(g, u);
        jobs.emplace_back();
      }
    }
    return true;
  };
  Status first_error;
  auto keep = [&](Status s) { if (first_error.ok() && !s.ok()) first_error = std::move(s); };

  // Compact: P's slice is the master's bf16 half, a state like W, M, V (its
  // store is part of the commit, never recomputed); fp32: a copy of W.
  auto is_copy = [&](int s) { return s == int(StateKind::kP) && !layout_.compact; };
  // Whether j's update leaves block b in its home: the CPU addresses it in
  // place, or the GPU updated it there.
  auto at_home = [&](const Job& j, const StateBlock& b) {
    return io_.Direct(b) || (j.gpu && b.home == TierKind::kDevice);
  };
  // f(s, block) for each state of j that goes back home after the update.
  auto for_each_stored = [&](Job& j, auto&& f) {
    for (int s : {int(StateKind::kP), int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)}) {
      const StateBlock& b = blocks_[static_cast<size_t>(j.group)][static_cast<size_t>(s)].Part(j.unit);
      if (b.alloc.charged != 0 && !at_home(j, b)) f(s, b);  // (P that is W's bytes has no block: W's store is P's)
    }
  };
  // Job j's update is in for this step: its unit (in units), or its group,
  // whose P is stale when it did not reach home (in units never: P is W's
  // bytes or updated in place).
  auto mark_committed = [&](const Job& j, bool p_stale) {
    GroupStep& gs = steps_[static_cast<size_t>(j.group)];
    if (layout_.Units(j.group) > 1) {
      gs.unit_done[static_cast<size_t>(j.unit)] = 1;
      gs.committed = std::all_of(gs.unit_done.begin(), gs.unit_done.end(), [](uint8_t d) { return d != 0; });
    } else {
      gs.p_stale = p_stale;
      gs.committed = true;
    }
  };
  // Waits for j's stores, then publishes W, M, V (and P) together when all
  // of them landed, else discards them; marks the group committed or not.
  auto finish_stores = [&](Job& j) {
    if (j.group < 0 || j.settled) return;
    j.settled = true;
    if (j.g_copy) {  // read by the update (or never, when it did not run); units: by the group's last
      j.g_copy = false;
      if (j.last_of_group) feed.g_done(j.group);
    }
    if (j.behind) {  // committed at Updated: W, M, V land and are published together, or none is
      Status st;
      int want = 0;
      for_each_stored(j, [&](int, const StateBlock&) { ++want; });
      for (int k = 0; k < j.stores.n; ++k) {
        Status s = io_.WaitStore(j.stores.m[static_cast<size_t>(k)]);
        if (st.ok() && !s.ok()) st = std::move(s);
      }
      const bool landed = st.ok() && j.stores.n == want;
      for (int k = 0; k < j.stores.n; ++k) io_.SettleStore(j.stores.m[static_cast<size_t>(k)], landed);
      j.stores.n = 0;
      if (!st.ok())
        keep(st.WithContext("group " + std::to_string(j.group) + " unit " + std::to_string(j.unit) +
                            ": its new W, M, V were discarded"));
      if (j.slot) { ReleaseSlot(j.slot); j.slot = nullptr; }
      return;
    }
    const bool in_units = layout_.Units(j.group) > 1;
    GroupStep& gs = steps_[static_cast<size_t>(j.group)];
    Status state_st, p_st;
    int state_stores = 0, state_homes = 0;  // W, M, V moves started; of those that go home
    bool p_stored = false;
    for (int k = 0; k < j.stores.n; ++k) {
      const bool is_p = is_copy(j.stores.state[static_cast<size_t>(k)]);
      if (is_p) p_stored = true;
      else ++state_stores;
      Status s = io_.WaitStore(j.stores.m[static_cast<size_t>(k)]);
      Status& into = is_p ? p_st : state_st;
      if (into.ok() && !s.ok()) into = std::move(s);
    }
    for_each_stored(j, [&](int s, const StateBlock&) { state_homes += !is_copy(s); });
    // Committed: updated, and every W, M, V store started and landed (or,
    // host homes and the GPU's, updated in place already).
    const bool commit = (in_units ? gs.unit_done[static_cast<size_t>(j.unit)] != 0 : gs.committed) ||
                        (j.updated && state_stores == state_homes && state_st.ok());
    // Device copies land in place: once one has started and any failed, the
    // group's state is neither old nor new (NVMe writes are copy on write).
    // (A device tier without a GPU is a host arena, used in place: no copies.)
    auto copied_to_device = [&](StateKind k) {
      const StateBlock& b = blocks_[static_cast<size_t>(j.group)][int(k)];
      return b.home == TierKind::kDevice && !io_.Direct(b);
    };
    const bool on_device = blocks_[static_cast<size_t>(j.group)][int(StateKind::kW)].home == TierKind::kDevice ||
                           (layout_.compact && copied_to_device(StateKind::kP));
    const StateBlock& pb = blocks_[static_cast<size_t>(j.group)][int(StateKind::kP)];
    // P follows W: a committed group whose P did not reach home gets it
    // recomputed from W (fp32 format); one whose P landed is fresh again.
    const bool p_is_w = layout_.PIsW(j.group);
    // (A GPU update whose copy of P home failed: P is at home, and stale.)
    const bool p_stale =
        j.p_copy_failed || (!layout_.compact && !p_is_w && !at_home(j, pb) && (!p_stored || !p_st.ok()));
    // Speculation (speculation.h) undoes a half-written group from its
    // backups: nothing is broken there.
    if (!spec && !commit && state_stores > 0 && on_device && broken->empty())
      *broken = "the optimizer state of group " + std::to_string(j.group) + " on the device is partly written (" +
                state_st.message() + ")";
    // Compact with W, M, V updated in place and P's bf16 half staged: a
    // failed store of that half leaves a master that is neither old nor new.
    if (!spec && !commit && layout_.compact && j.updated && io_.Direct(blocks_[static_cast<size_t>(j.group)][int(StateKind::kW)]) && broken->empty())
      *broken = "the master weights of group " + std::to_string(j.group) + " are partly written (their bf16 half " +
                "did not land: " + state_st.message() + ")";
    if (commit && j.p_shadow) {  // (speculation: its home slice was backed up at the load)
      const uint64_t off = layout_.PSliceOffset(j.group), bytes = layout_.part.group(j.group).shard_numel * 2;
      std::memcpy(static_cast<char*>(io_.DirectPtr(pb)) + off, reinterpret_cast<char*>(j.ptr[int(StateKind::kP)]) + off,
                  bytes);
    }
    // Published, or (speculation) held for the step to commit or discard.
    for (int k = 0; k < j.stores.n; ++k) {
      BlockMove& m = j.stores.m[static_cast<size_t>(k)];
      const bool keep_it = commit && (!is_copy(j.stores.state[static_cast<size_t>(k)]) || p_st.ok());
      if (spec && keep_it) spec->Hold(j.group, std::move(m));
      else io_.SettleStore(m, keep_it);
    }
    j.stores.n = 0;
    if (spec) {
      if (commit) spec->Ready(j.group, p_stale);
      else spec->Fail(j.group);
    } else if (commit) {
      mark_committed(j, p_stale);
    }
    // Speculated (held) only at one rank: with several, whether a copy is
    // gathered must not depend on which groups this rank had speculated when
    // a discard forgets them.
    if (commit && (!spec || layout_.sworld == 1) && ((p_stored && p_st.ok()) || p_is_w) && on_p_stored_ &&
        !layout_.compact && !layout_.p_gathered_after_step() && (p_is_w || !at_home(j, pb)))
      on_p_stored_(j.group, p_is_w ? j.ptr[int(StateKind::kW)] : j.ptr[int(StateKind::kP)], spec != nullptr,
                   in_units ? j.first * DTypeSize(layout_.dtype) : 0, in_units ? j.len * DTypeSize(layout_.dtype) : 0);
    keep(std::move(state_st));
    keep(std::move(p_st));
    if (j.slot) { ReleaseSlot(j.slot); j.slot = nullptr; }
  };
  auto start_loads = [&](int i) {
    Job& j = jobs[static_cast<size_t>(i)];
    std::tie(j.group, j.unit) = order[static_cast<size_t>(i)];
    j.first = layout_.UnitFirst(j.group, j.unit);
    j.len = layout_.UnitNumel(j.group, j.unit);
    j.last_of_group = static_cast<size_t>(i) + 1 == order.size() || order[static_cast<size_t>(i) + 1].first != j.group;
    GroupStep& gs = steps_[static_cast<size_t>(j.group)];
    Ahead ahead;  // W, M, V read ahead into a slot (ReadAhead): the job takes the slot and the reads
    if (TakeAhead(j.group, j.unit, &ahead)) j.slot = ahead.slot;
    const bool has_grads = gs.grad_calls > 0;
    j.gpu = gpu_.UpdatesOnGpu(j.group);
    j.ko = KernelOptions(so, grad_scale, feed.step_of(j.group));
    // A unit's place in a block the CPU addresses in place (units: fp32 W,
    // M, V; G and P in their dtypes; a staged unit sits at its slot region's start).
    auto unit_at = [&](int s) {
      return j.first * (s == int(StateKind::kG) ? DTypeSize(layout_.gdtype) : s == int(StateKind::kP) ? DTypeSize(layout_.dtype) : 4);
    };
    for (int s = 0; s < kNumStates; ++s) {
      const StateBlock& whole = blocks_[static_cast<size_t>(j.group)][static_cast<size_t>(s)];
      if (whole.alloc.charged == 0) continue;  // state unused by this optimizer
      const StateBlock& b = whole.Part(j.unit);
      if (j.gpu && b.home == TierKind::kDevice) {  // a device pointer: the GPU updates it in place
        j.ptr[s] = static_cast<float*>(io_.DirectPtr(b));
        continue;
      }
      const bool shadow = layout_.compact && s == int(StateKind::kP) && io_.Direct(b) &&
                          !io_.Direct(blocks_[static_cast<size_t>(j.group)][int(StateKind::kW)]);
      // Speculation: the old contents of what the update changes in place
      // (compact: this rank's slice of P, also when staged as a shadow).
      if (spec && io_.Direct(b) && s != int(StateKind::kG) && !is_copy(s)) {
        const bool p = s == int(StateKind::kP);
        spec->Backup(j.group, static_cast<const char*>(io_.DirectPtr(b)) + (p ? layout_.PSliceOffset(j.group) : 0),
                     p ? layout_.part.group(j.group).shard_numel * 2 : layout_.StateBytes(s, j.group));
      }
      if (io_.Direct(b) && !shadow) {
        j.ptr[s] = reinterpret_cast<float*>(static_cast<char*>(io_.DirectPtr(b)) + unit_at(s));
        continue;
      }
      if (!j.slot) j.slot = Slot(j.group, j.unit, /*wait=*/true);  // blocks until a slot's writes are done
      j.ptr[s] = reinterpret_cast<float*>(static_cast<char*>(j.slot) + SlotOffset(j.group, j.unit, s));
      if (shadow) {  // this rank's slice, updated here and copied back when the group commits
        const uint64_t off = layout_.PSliceOffset(j.group);
        std::memcpy(reinterpret_cast<char*>(j.ptr[s]) + off, static_cast<const char*>(io_.DirectPtr(b)) + off,
                    layout_.part.group(j.group).shard_numel * 2);
        j.p_shadow = true;
        continue;
      }
      if (is_copy(s) || (s == int(StateKind::kG) && !has_grads)) continue;  // written, not read
      if (s == int(StateKind::kG) && feed.g_copy) {  // the feed holds G already: no read
        if (const void* g = feed.g_copy(j.group)) {
          j.ptr[s] = reinterpret_cast<float*>(static_cast<char*>(const_cast<void*>(g)) + unit_at(s));
          j.g_copy = true;
          continue;
        }
      }
      if (ahead.has[static_cast<size_t>(s)]) {
        ahead.has[static_cast<size_t>(s)] = false;
        BlockMove& r = ahead.m[static_cast<size_t>(s)];
        if (io_.Version(b) == r.nvme.version) {  // not written since the read started: its contents
          j.loads.Add(s, std::move(r));
          stats_.OnReadAheadUsed(b.bytes);
          continue;
        }
        io_.Finish(r).IgnoreError();  // written since: read again, below
      }
      auto m = io_.StartLoad(b, j.ptr[s]);
      if (m.ok()) j.loads.Add(s, std::move(m).value());
      else keep(m.status());
    }
    for (int s = 0; s < kNumStates; ++s)  // (none left, unless a state was not loaded after all)
      if (ahead.has[static_cast<size_t>(s)]) io_.Finish(ahead.m[static_cast<size_t>(s)]).IgnoreError();
  };

  // A G that cannot be read back (corrupt, or never written) is a step
  // that cannot be finished: the engine is broken, not resumable.
  auto finish_loads = [&](Job& j) {
    // Read from NVMe, each load's checksum is verified as it finishes: the
    // job's (W, M, V) on both cores at once, once the disk is done with all.
    std::array<Status, kNumStates> got;
    bool nvme = j.loads.n > 1;
    for (int k = 0; nvme && k < j.loads.n; ++k) nvme = j.loads.m[static_cast<size_t>(k)].kind == BlockMove::kNvme;
    if (nvme) {
      for (int k = 0; k < j.loads.n; ++k) io_.WaitIo(j.loads.m[static_cast<size_t>(k)]);  // (its disk span: here)
      kernels::ParallelForEach(static_cast<size_t>(j.loads.n),
                               [&](size_t k) { got[k] = io_.Finish(j.loads.m[k]); });  // distinct moves: no shared state
    }
    for (int k = 0; k < j.loads.n; ++k) {
      Status s = nvme ? std::move(got[static_cast<size_t>(k)]) : io_.Finish(j.loads.m[static_cast<size_t>(k)]);
      if (!s.ok() && j.loads.state[static_cast<size_t>(k)] == int(StateKind::kG) &&
          (s.code() == Code::kCorrupt || s.code() == Code::kState) && broken->empty())
        *broken = "the gradients of group " + std::to_string(j.group) + " are lost (" + s.message() + ")";
      keep(std::move(s));
    }
    j.loads.n = 0;
  };
  // The checksums of what j stores, each block's on a core of its own.
  auto checksum_stores = [&](Job& j) {
    std::array<std::pair<int, const StateBlock*>, kNumStates> todo;
    size_t n = 0;
    for_each_stored(j, [&](int s, const StateBlock& b) { todo[n++] = {s, &b}; });
    kernels::ParallelForEach(n, [&](size_t i) {
      j.sum[todo[i].first] = io_.StoreChecksum(*todo[i].second, j.ptr[todo[i].first]);
    });
    j.summed = true;
  };
  auto start_stores = [&](Job& j) {
    for_each_stored(j, [&](int s, const StateBlock& b) {
      auto m = io_.StartStore(b, j.ptr[s], j.summed ? &j.sum[s] : nullptr);
      if (m.ok()) j.stores.Add(s, std::move(m).value());
      else keep(m.status());
    });
  };
  // The GPU update of one job (gpu_update.cpp): W, M, V are new in place
  // (committed now, as host homes are), untouched, or partly written, which
  // breaks the engine as a failed device copy does. P follows W: when only
  // P failed to reach home it is recomputed from W.
  auto update_on_gpu = [&](Job& j) {
    GroupStep& gs = steps_[static_cast<size_t>(j.group)];
    const double t0 = stats_.Now();
    GpuUpdateOutcome outcome = GpuUpdateOutcome::kUntouched;
    Status st = gpu_.Update(j.group, j.ptr, j.ko, &outcome);
    stats_.Span(Resource::kCpuOptimizer, "gpu update", t0, stats_.Now(), layout_.part.group(j.group).shard_numel);
    if (outcome == GpuUpdateOutcome::kPartial && broken->empty())
      *broken = "the optimizer state of group " + std::to_string(j.group) + " on the device is partly written (" +
                st.message() + ")";
    if (outcome == GpuUpdateOutcome::kUpdated) {
      j.updated = true;
      gs.committed = true;
      j.p_copy_failed = !st.ok();
      if (j.p_copy_failed) gs.p_stale = true;
    }
    keep(std::move(st));
    return first_error.ok();
  };
  // The update of one job whose states are in place (the CPU's, or the
  // GPU's); false on error.
  auto update = [&](Job& j) {
    GroupStep& gs = steps_[static_cast<size_t>(j.group)];
    const uint64_t len = j.len;
    if (gs.grad_calls == 0) std::memset(j.ptr[int(StateKind::kG)], 0, len * DTypeSize(layout_.gdtype));  // host memory
    if (j.gpu) return update_on_gpu(j);
    float* W = j.ptr[int(StateKind::kW)];
    void* P = static_cast<char*>(static_cast<void*>(j.ptr[int(StateKind::kP)])) + layout_.PSliceOffset(j.group);
    stats_.Begin(Resource::kCpuOptimizer);
    const double t0 = stats_.Now();
    Status st;
    if (layout_.compact) {  // P's slice is the bf16 half: nothing more to write
      const kernels::CompactState cs = shards_.CompactAt(j.group, j.ptr[int(StateKind::kP)], j.ptr[int(StateKind::kW)],
                                                 j.ptr[int(StateKind::kM)], j.ptr[int(StateKind::kV)]);
      st = CompactStepKernelCpu(j.ko, len, cs, j.ptr[int(StateKind::kG)]);
    } else {
      st = StepInPieces(j.ko, j.first, len, W, j.ptr[int(StateKind::kM)], j.ptr[int(StateKind::kV)],
                        reinterpret_cast<const char*>(j.ptr[int(StateKind::kG)]), DTypeSize(layout_.gdtype), gs.lent,
                        copy_f32 ? nullptr : static_cast<char*>(P), DTypeSize(layout_.dtype));
    }
    if (copy_f32 && !layout_.compact && !layout_.PIsW(j.group)) std::memcpy(P, W, len * 4);
    stats_.End(Resource::kCpuOptimizer);
    stats_.Span(Resource::kCpuOptimizer, spec ? "update (speculative)" : "update", t0, stats_.Now(), len);
    if (st.ok()) {
      j.updated = true;
      // W, M, V updated in place (host homes): committed now; P follows
      // through its store (or, when that fails, a recompute from W).
      if (!spec && io_.Direct(blocks_[static_cast<size_t>(j.group)][int(StateKind::kW)]) &&
          (!layout_.compact || io_.Direct(blocks_[static_cast<size_t>(j.group)][int(StateKind::kP)])) && !j.p_shadow)
        gs.committed = true;
    }
    keep(st);
    return first_error.ok();
  };

  if (feed.behind) {
    // Write-behind (RunBehind): every job's loads, each into a piece of its
    // own, then every update. Once all are updated their groups are
    // committed and P handed on, and the caller goes on (Updated); the
    // writes follow in the batches a run writes in (the swap's room for
    // writes in flight is theirs). A failure before that writes nothing:
    // the groups stay uncommitted, old on NVMe, for the next run.
    for (int i = 0; avail(i, /*wait=*/true); ++i) start_loads(i);
    bool all = true;
    for (auto& j : jobs) {
      finish_loads(j);
      if (!first_error.ok() || !update(j)) {
        all = false;
        break;
      }
    }
    if (all && first_error.ok()) {
      const size_t dt = DTypeSize(layout_.dtype);
      for (auto& j : jobs) {
        const bool in_units = layout_.Units(j.group) > 1;
        mark_committed(j, /*p_stale=*/false);  // (P is W's bytes, or updated in place: pieces need either)
        if (on_p_stored_ && layout_.PIsW(j.group) && !layout_.p_gathered_after_step())
          on_p_stored_(j.group, j.ptr[int(StateKind::kW)], false, in_units ? j.first * dt : 0, in_units ? j.len * dt : 0);
        j.behind = true;
      }
      Updated();
      const size_t batch = static_cast<size_t>(
          std::max(StepGroupsWriting(StepSlots(config), config.strata.step_io == "concurrent"), 1));
      for (size_t b = 0; b < jobs.size() && first_error.ok(); b += batch) {
        const size_t e = std::min(jobs.size(), b + batch);
        for (size_t i = b; i < e; ++i) start_stores(jobs[i]);
        for (size_t i = b; i < e; ++i) finish_stores(jobs[i]);
      }
    }
  } else if (config.strata.step_io == "concurrent") {
    for (int i = 0; first_error.ok() && avail(i, /*wait=*/true); ++i) {
      // Slot reuse: with K slots, job i+1 takes the slot of job i+1-K, once its
      // writes finish; reads run up to K-2 shards ahead of the update (of the
      // groups the feed has: a streamed run does not wait for those ahead).
      const int k = std::max(StepSlots(config), 3);
      if (i + 2 - k >= 0) finish_stores(jobs[static_cast<size_t>(i + 2 - k)]);
      for (int a = i; a <= i + k - 2 && avail(a, /*wait=*/false); ++a)
        if (jobs[static_cast<size_t>(a)].group < 0) start_loads(a);
      Job& j = jobs[static_cast<size_t>(i)];
      finish_loads(j);
      if (!first_error.ok() || !update(j)) break;
      start_stores(j);
    }
  } else {
    // Alternate, in batches of half the slots; the disk never reads and
    // writes at once. fp32: the CPU updates batch k beside batch k-1's
    // writes, then the disk reads batch k+1 (into batch k-1's slots) while
    // the CPU checksums batch k's blocks and verifies each of batch k+1's as
    // it lands, then writes batch k beside the verification of batch k+1's
    // last block (the disk never waits for a hash). A batch costs about
    // max(update, write) + read. Compact: the update (about 4x the CPU per
    // byte moved of fp32's, and a third of the bytes) is longer than a
    // batch's writes, so it runs beside the reads instead: batch k-1's
    // writes finish, batch k+1's reads start, then batch k is updated, its
    // writes start once the reads have landed, and batch k+1's loads are
    // checked beside them; a batch costs about max(read, update) + write.
    const bool update_beside_reads = layout_.compact;
    const int batch = StepGroupsWriting(StepSlots(config), /*concurrent=*/false);
    // Starts the loads of the groups the feed has, up to a batch (wait: for
    // the first at least, unless the run is over); returns the end.
    auto load_batch = [&](int first, bool wait) {
      int a = first;
      for (; a < first + batch && avail(a, wait && a == first); ++a) start_loads(a);
      return a;
    };
    int prev = 0, cur = 0, cur_end = load_batch(0, /*wait=*/true);
    for (int a = cur; a < cur_end; ++a) finish_loads(jobs[static_cast<size_t>(a)]);
    while (cur < cur_end && first_error.ok()) {
      auto update_batch = [&] {
        for (int i = cur; i < cur_end && first_error.ok(); ++i) update(jobs[static_cast<size_t>(i)]);
      };
      if (!update_beside_reads) update_batch();
      if (!first_error.ok()) break;
      for (int a = prev; a < cur; ++a) finish_stores(jobs[static_cast<size_t>(a)]);  // frees the slots batch k+1 reads into
      const int next = cur_end, next_end = load_batch(next, /*wait=*/false);
      if (update_beside_reads) update_batch();
      if (!first_error.ok()) break;
      for (int i = cur; i < cur_end; ++i) checksum_stores(jobs[static_cast<size_t>(i)]);
      // fp32: the CPU was idle while batch k+1 read, so it checks each load
      // as it lands and only the last beside the writes. Compact: the CPU
      // spent the reads on batch k's update, so they have landed unchecked;
      // the writes start once all have landed, and every check runs beside them.
      BlockMove* last = nullptr;
      for (int a = next; a < next_end; ++a)
        for (auto& m : jobs[static_cast<size_t>(a)].loads) {
          if (last && update_beside_reads) io_.WaitIo(*last);
          else if (last) keep(io_.Finish(*last));
          last = &m;
        }
      if (last) io_.WaitIo(*last);
      for (int i = cur; i < cur_end; ++i) start_stores(jobs[static_cast<size_t>(i)]);
      for (int a = next; a < next_end; ++a) finish_loads(jobs[static_cast<size_t>(a)]);
      prev = cur;
      cur = next;
      cur_end = next_end;
      if (cur == cur_end && first_error.ok()) {  // none more yet (a streamed run), or the end
        for (int a = prev; a < cur; ++a) finish_stores(jobs[static_cast<size_t>(a)]);
        prev = cur;
        cur_end = load_batch(cur, /*wait=*/true);
        for (int a = cur; a < cur_end; ++a) finish_loads(jobs[static_cast<size_t>(a)]);
      }
    }
  }
  // Drain: every load and store in flight finishes before the slots return.
  for (auto& j : jobs) {
    finish_loads(j);
    finish_stores(j);
  }
  return first_error.WithContext("step");
}

}  // namespace strata
