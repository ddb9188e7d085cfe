// overlap_step: groups updated while backward goes on (UpdateWorker), and
// their end at the step. Where the step could still change an update —
// clipping, fp16's loss scale, a strata.nonfinite policy that holds a step
// back — the early update is speculative (step/speculation.h): held until
// the step knows the global norm, then committed, discarded with the
// skipped step, or discarded and redone with the clipping coefficient (a
// replay). Either way the result is bitwise the step without overlap: a
// committed speculation used the same factor on G (1 / (loss scale x mean
// divisor), compared exactly) and the same options and update count.
#include <cstring>

#include "base/log.h"
#include "base/sizes.h"
#include "engine/engine_impl.h"
#include "engine/layout/staging_plan.h"
#include "engine/step/step_checks.h"

namespace strata {

Status Engine::Impl::StartOverlap() {
  step_.overlap = true;
  SpeculationPolicy::Mode mode;
  if (!SpeculationPolicy::ParseMode(config_.strata.speculation, &mode))  // the config refused others
    return InternalError("strata.speculation \"" + config_.strata.speculation + "\"");
  step_.policy = SpeculationPolicy(mode);
  // Without a GPU, with W, M, V in host memory, an early update that might
  // be discarded must first back up what it changes in place (W, M, V: the
  // state's size, copied each step, and held), which costs about what the
  // update itself does, and it runs beside a backward that has the same
  // cores: it hides nothing. "auto" then never speculates (nor takes the
  // room); "always" still does. (A strict arena stands in for a GPU's
  // memory, as everywhere.)
  if (mode == SpeculationPolicy::Mode::kAuto && !device_->separate() &&
      lay_.home[int(StateKind::kW)] != TierKind::kNvme)
    step_.policy.Decline("no GPU and W, M, V in host memory: backing up what an early update changes costs about "
                         "what the update does, beside a backward on the same cores");
  // Where the step writes behind (strata.write_behind), its NVMe writes are
  // hidden already (in the next forward), without speculation's swap room
  // or its replays: "auto" does not speculate there either. (Measured on the
  // 51M GPT-2 of bench/vs_deepspeed.sh at one rank: steps that speculated
  // took 2.03-2.14 s against 1.71-2.00 s writing behind, and the room grew
  // the swap from 1.17x the state to 1.5x.)
  if (mode == SpeculationPolicy::Mode::kAuto && WritesBehind(StepOrder()))
    step_.policy.Decline("the step writes behind (strata.write_behind): its writes are hidden without speculation");
  auto padded = [this](uint64_t bytes) { return io_->NvmePadded(bytes); };
  auto gpu_updates = [this](int g) { return gpu_->UpdatesOnGpu(g); };
  const Speculation::Needs total = Speculation::TotalNeeds(lay_, gpu_updates, padded);
  const uint64_t want_host = config_.strata.speculation_host_bytes;
  uint64_t host_bytes = want_host;
  if (want_host == StrataConfig::kSpeculationAuto) {
    const uint64_t left = host_->budget() > host_->used() ? host_->budget() - host_->used() : 0;
    host_bytes = std::min(total.host, left);
  }
  // As the swap room (build.cpp): none for "never"; under "auto" an "auto"
  // arena is taken when the policy first speculates.
  if (config_.strata.speculation == "never") host_bytes = 0;
  if (config_.strata.speculation == "auto" && want_host == StrataConfig::kSpeculationAuto)
    spec_host_later_ = std::exchange(host_bytes, 0);
  // The swap room was reserved at build (build.cpp: the NVMe tier's spare).
  const uint64_t disk_bytes = spec_disk_room_;
  spec_ = std::make_unique<Speculation>(lay_, blocks_, *io_, *host_, steps_, gpu_updates, padded);
  STRATA_RETURN_IF_ERROR(spec_->Init(host_bytes, nvme_ ? disk_bytes : 0));
  const bool host_short = total.host > host_bytes + spec_host_later_,
             disk_short = nvme_ && total.disk > disk_bytes + spec_disk_later_;
  if (config_.strata.speculation != "never" && (host_short || disk_short)) {
    const std::string what =
        "overlap_step: speculation has room for " + FormatBytes(host_bytes + spec_host_later_) + " of the " +
        FormatBytes(total.host) + " host bytes and " + FormatBytes(disk_bytes + spec_disk_later_) + " of the " +
        FormatBytes(total.disk) + " swap bytes its groups need (strata.speculation_host_bytes, "
        "strata.speculation_disk_bytes); where clipping, fp16 or strata.nonfinite could change an update, the "
        "groups that do not fit update after backward";
    // A room the config gave short is a warning; "auto" sizing it (the swap
    // within 1.5x the state, the host budget's rest) is the policy, said once.
    const bool given_short = (host_short && want_host != StrataConfig::kSpeculationAuto) ||
                             (disk_short && config_.strata.speculation_disk_bytes != StrataConfig::kSpeculationAuto);
    if (given_short) WarnOnce("speculation-room", what);
    else STRATA_LOG_INFO("{}", what);
  }
  g_copy_.assign(static_cast<size_t>(lay_.num_groups()), nullptr);
  if (!BlockIo::DirectAt(lay_.home[int(StateKind::kG)], lay_.device_on_gpu)) {
    uint64_t largest = 0;
    for (int g = 0; g < lay_.num_groups(); ++g)
      if (!lay_.frozen(g)) largest = std::max(largest, lay_.part.group(g).shard_numel * DTypeSize(lay_.gdtype));
    if (Status st = g_copies_.Init(host_.get(), StepSlots(config_), largest); !st.ok()) {
      g_copies_.Clear();
      STRATA_LOG_INFO("overlap_step: no room for copies of G ({}); early updates read G from the disk", st.ToString());
    }
  }
  worker_ = std::make_unique<UpdateWorker>(
      [this](const UpdateWorker::Next& next, std::string* broken) { return RunOverlap(next, broken); },
      [this] { UseDeviceOnThisThread(); });
  worker_->Start();
  return Status::Ok();
}

void Engine::Impl::ReserveSpeculationRoom() {
  if (!spec_) return;
  if (spec_host_later_ > 0) {  // "auto": what the groups need, at most what the host budget has left now
    const uint64_t left = host_->budget() > host_->used() ? host_->budget() - host_->used() : 0;
    const uint64_t bytes = std::min(std::exchange(spec_host_later_, 0), left);
    if (Status st = bytes ? spec_->AddHostRoom(bytes) : Status::Ok(); !st.ok())
      WarnOnce("speculation-host-late", "overlap_step: cannot take " + FormatBytes(bytes) +
                                            " of host memory for speculation (" + st.ToString() +
                                            "); host-homed groups update after backward");
    else if (bytes)
      STRATA_LOG_INFO("overlap_step: {} of host memory taken for speculation, now that it speculates "
                      "(strata.speculation \"auto\")", FormatBytes(bytes));
  }
  if (spec_disk_later_ == 0 || !nvme_) return;
  const uint64_t bytes = std::exchange(spec_disk_later_, 0);
  if (Status st = nvme_->GrowSpare(bytes); !st.ok()) {
    WarnOnce("speculation-disk-late",
             "overlap_step: cannot reserve " + FormatBytes(bytes) + " of swap for speculation (" + st.ToString() +
                 "); NVMe-homed groups update after backward");
    return;
  }
  spec_disk_room_ += bytes;
  spec_->AddDiskRoom(bytes);
  STRATA_LOG_INFO("overlap_step: {} of swap reserved for speculation, now that it speculates (strata.speculation "
                  "\"auto\")", FormatBytes(bytes));
}

void Engine::Impl::KeepGCopy(int g, const void* G, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(copies_mu_);
  void*& slot = g_copy_[static_cast<size_t>(g)];
  if (!slot) slot = g_copies_.TryAcquire();
  if (slot) std::memcpy(slot, G, bytes);
}

void Engine::Impl::DropGCopies() {
  std::lock_guard<std::mutex> lock(copies_mu_);
  for (void*& p : g_copy_) {
    g_copies_.Release(p);
    p = nullptr;
  }
}

void Engine::Impl::OnGradsComplete(int g) {
  const GroupStep& gs = steps_[static_cast<size_t>(g)];
  if (!worker_ || !step_.prepared || !step_.early || step_.doomed ||
      gs.grad_calls != options_.grad_accumulation_steps)
    return;
  // Non-finite gradients that the policy holds back: the step will not
  // update anything (with fp16, an overflow): none of it is worth speculating.
  if (!OverlapMayUpdate(config_, gs)) {
    step_.doomed = true;
    return;
  }
  ++step_.queued;
  worker_->Enqueue(g);
}

// On the overlap thread: one streamed run over the groups queued, each
// reserved in the speculation's room first (one that does not fit is left
// to the step).
Status Engine::Impl::RunOverlap(const UpdateWorker::Next& next, std::string* broken) {
  Speculation* spec = step_.speculative ? spec_.get() : nullptr;
  StepPipeline::Feed feed;
  feed.spec = spec;
  feed.step_of = [this](int g) { return StepsOf(g) + 1; };
  feed.next = [&](bool wait) {
    for (;;) {
      const int g = next(wait);
      if (g < 0 || !spec || spec->Reserve(g)) return g;
    }
  };
  feed.g_copy = [this](int g) -> const void* {
    std::lock_guard<std::mutex> lock(copies_mu_);
    return g_copy_[static_cast<size_t>(g)];
  };
  feed.g_done = [this](int g) {
    std::lock_guard<std::mutex> lock(copies_mu_);
    g_copies_.Release(g_copy_[static_cast<size_t>(g)]);
    g_copy_[static_cast<size_t>(g)] = nullptr;
  };
  return pipeline_->RunFeed(feed, step_.spec_scale, step_.prepared_opts, broken);
}

// The thread idle. A speculative run's failure is not the step's: what it
// held is undone (the pipeline failed those groups) and the step updates
// them after backward, where a lasting fault shows as the step's own error.
Status Engine::Impl::FinishOverlap() {
  if (!worker_) return Status::Ok();
  Status st = worker_->WaitIdle(&step_.broken);
  DropGCopies();  // of groups the thread did not take (no room, abandoned)
  if (st.ok() || !step_.speculative) return st;
  STRATA_LOG_WARN("overlap_step: a speculative update failed ({}); its groups are updated by the step", st.ToString());
  return Status::Ok();
}

Status Engine::Impl::UndoOverlap(int g, const char* call) {
  if (!step_.speculative)
    return StateError(std::string(call) + ": group " + std::to_string(g) + " already had its " +
                      std::to_string(options_.grad_accumulation_steps) +
                      " grads call(s) of this step and was updated early by the overlapped step (final: with no "
                      "clipping, no fp16 and strata.nonfinite \"apply\" nothing could change it); call step first");
  STRATA_RETURN_IF_ERROR(DrainComm().WithContext(call));  // the reduction queues no more
  worker_->Abandon();
  (void)FinishOverlap();
  const int early = static_cast<int>(spec_->ready().size());
  DiscardSpeculation();
  step_.prepared = false;  // the rest of this step is not overlapped
  stats_->OnOverlap(StatsRecorder::Speculated::kReplayed, early);
  WarnOnce("overlap-undone", std::string("overlap_step: ") + call + " of group " + std::to_string(g) +
                                 " after its gradients were complete; this step's early updates were undone and "
                                 "it updates after backward (exact, not overlapped)");
  return RepairStaleP().WithContext(call);  // P of the undone groups, from their restored W
}

void Engine::Impl::DiscardSpeculation(bool replay) {
  for (int g : spec_->ready()) {
    PCopy& f = p_refreshed_[static_cast<size_t>(g)];
    if (f != PCopy::kHeld) continue;
    f = replay ? PCopy::kDiscarded : PCopy::kOld;
    if (!replay && !residency_->Invalidate(g) && step_.broken.empty())
      step_.broken = "the device copy of group " + std::to_string(g) +
                     " holds a discarded speculative update and is still fetched";
  }
  spec_->Discard();
}

bool Engine::Impl::KeepsSpeculation(const StepOptions& so, const StepResult& r, double grad_scale) const {
  // max_grad_norm needs no match: the factor on G (equal, or clipping applied) says what it did.
  return !r.skipped && grad_scale == step_.spec_scale && SameStepOptions(so, step_.prepared_opts, /*with_clip=*/false);
}

void Engine::Impl::SettleOverlap(const StepOptions& so, const StepResult& r, double grad_scale) {
  if (!spec_) return;
  const int early = static_cast<int>(spec_->ready().size());
  if (!step_.prepared || !step_.speculative || step_.queued == 0) {
    int committed = 0;  // not speculative: committed as they landed (a resumed step: none of them early)
    for (const auto& gs : steps_) committed += gs.committed && step_.prepared && !step_.pending ? 1 : 0;
    spec_->Commit();    // nothing held; undoes reservations that never ran
    stats_->OnOverlap(StatsRecorder::Speculated::kNone, committed);
    return;
  }
  const double t0 = stats_->Now();
  StatsRecorder::Speculated outcome;
  if (r.skipped) {
    DiscardSpeculation();
    outcome = StatsRecorder::Speculated::kDiscarded;
  } else if (KeepsSpeculation(so, r, grad_scale)) {
    spec_->Commit();
    for (PCopy& f : p_refreshed_) f = f == PCopy::kHeld ? PCopy::kCommitted : f;  // the copies hold committed P now
    outcome = StatsRecorder::Speculated::kCommitted;
  } else {
    if (!SameStepOptions(so, step_.prepared_opts, /*with_clip=*/false))
      WarnOnce("overlap-options", "overlap_step: step got other options than prepare_step; the early updates "
                                  "were discarded and redone after backward (exact, but not overlapped)");
    DiscardSpeculation(/*replay=*/true);
    outcome = StatsRecorder::Speculated::kReplayed;
  }
  stats_->Span(Resource::kCpuOptimizer, outcome == StatsRecorder::Speculated::kCommitted ? "commit" : "discard", t0,
               stats_->Now(), 0);
  stats_->OnOverlap(outcome, early);
}

}  // namespace strata
