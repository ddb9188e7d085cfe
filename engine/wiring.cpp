// The composition's wiring: the components (the gradient reduction,
// residency, checkpoints) created at build and connected through the calls
// their headers ask for; the API's fetch and release routed to residency.
#include <algorithm>

#include "base/log.h"
#include "base/sizes.h"
#include "engine/engine_impl.h"
#include "tiers/gpu.h"

namespace strata {

void Engine::Impl::UseDeviceOnThisThread() const {
  if (placement_.device < 0) return;
  // The device tier sets it again before each of its CUDA calls; a failure
  // here shows there too, so a warning is enough.
  const Status st = gpu::SetDevice(placement_.device);
  if (!st.ok()) STRATA_LOG_WARN("engine thread: {}", st.ToString());
}

Status Engine::Impl::StartComponents() {
  auto on_thread = [this] { UseDeviceOnThisThread(); };
  if (lay_.reduces) {
    GradReducer::Hooks h;
    h.accumulate = [this](int g, const float* sums, uint64_t n) {
      Status st = AccumulateG(g, sums, DType::kF32, n);
      if (st.ok()) OnGradsComplete(g);  // this rank's shard of g is reduced: its early update may go
      return st;
    };
    h.sums_target = [this](int g) { return SumsInG(g); };
    h.step = [this] { return step_.applied + 1; };
    h.grad_calls = [this](int g) { return steps_[static_cast<size_t>(g)].grad_calls; };
    h.pin_ahead = [this](int g) { return residency_->PinForAhead(g); };
    h.end_ahead = [this](int g, bool gathered) { residency_->EndAhead(g, gathered); };
    h.on_thread_start = on_thread;
    if (stats_->tracing()) {
      h.now = [this] { return stats_->Now(); };
      h.span = [this](const char* name, int g, double s, double e) { stats_->CommSpan(name, g, s, e); };
    }
    if (comm_->world_size() > 1)  // (one rank: a GPU communicator's copy, no collective)
      h.collective = [this](bool gather, uint64_t bytes, double wall_s, double cpu_s) {
        stats_->OnCollective(gather, bytes, wall_s, cpu_s);
      };
    const bool g_staged = !BlockIo::DirectAt(lay_.home[int(StateKind::kG)], lay_.device_on_gpu);
    reducer_ = std::make_unique<GradReducer>(lay_, *comm_, *device_, staging_.grad, g_staged, std::move(h));
    // Its buffers (NCCL: from this rank's device budget) agreed: a rank that
    // could not make them left its peers in the next collective.
    STRATA_RETURN_IF_ERROR(Agree(reducer_->Init(), "build: the gradient reduction's buffers"));
  }
  // P that is W's bytes (Layout::PIsW) is read from W's block: the step does not store P.
  p_home_ = std::make_unique<PHome>(
      lay_,
      [this](int g) -> const StateBlock& {
        return blocks_[static_cast<size_t>(g)][int(lay_.PSource(g))];
      },
      *io_, *device_, staging_.param, *stats_);
  ResidencyOptions ro;
  ro.groups = lay_.num_groups();
  ro.bytes = [this](int g) { return lay_.PBytes(g); };
  ro.window = config_.zero.prefetch_bucket_size * DTypeSize(lay_.dtype);
  ro.sharded = lay_.p_sharded;
  ro.shards = lay_.sworld;
  ro.shard_rank = lay_.srank;
  ro.evict_at_release = device_->strict();
  if (lay_.p_sharded && !device_->strict() && !lay_.p_whole_on_device()) {
    STRATA_ASSIGN_OR_RETURN(ro.keep_gathered, AgreeKeepGathered());
  }
  // A fetch hands out P's home itself where the compute reads it as it is:
  // the device tier holding whole groups, or, without a GPU, host memory
  // (P's block, or W's where P is W's bytes) of one rank's whole group.
  // There is then no copy to load, to refresh after each step, or to hold
  // beside the home (a whole P's bytes of memory, at no GPU). A device
  // budget given without a GPU (or the strict arena) asks for the arena to
  // stand in for a GPU's memory, copies and eviction as there: kept.
  bool host_home = !device_->separate() && config_.strata.device_budget == 0 && !device_->strict() &&
                   lay_.sworld == 1 && !lay_.p_sharded;
  for (int g = 0; host_home && g < lay_.num_groups(); ++g)
    host_home = BlockIo::DirectAt(lay_.home[int(lay_.PSource(g))], /*device_separate=*/false);
  if (lay_.p_whole_on_device() || host_home)
    ro.home = [this](int g) { return io_->DirectPtr(blocks_[static_cast<size_t>(g)][int(lay_.PSource(g))]); };
  ro.on_thread_start = on_thread;
  Gatherer ga;
  if (lay_.p_sharded) {
    ga.gather = [this](int g, void* copy) { return reducer_->Gather(g, copy); };
    ga.refuse = [this](int g, const Status& why) { return reducer_->RefuseGather(g, why); };
    ga.before_fetch = [this](int g) {
      reducer_->WaitAheadOf(g);
      return DrainComm(/*wait=*/false).WithContext("fetch");
    };
    if (reducer_->threaded()) ga.queue_ahead = [this](int g) { reducer_->QueueGatherAhead(g); };
  }
  residency_ = std::make_unique<Residency>(std::move(ro), *device_, *p_home_, *stats_, std::move(ga));
  residency_->Start();
  Checkpointer::Hooks ch;
  ch.recompute_p = [this](void* buf, uint64_t bytes) { return RecomputeP(buf, bytes); };
  ch.drop_copies = [this] { DropDeviceCopies(); };
  ch.stop_step = [this] { StopStep(); };
  ch.abandon_step = [this] { AbandonStep(); };
  checkpointer_ = std::make_unique<Checkpointer>(
      Checkpointer::Deps{config_, lay_, blocks_, *shards_, *io_, staging_, *storage_, nvme_.get(), comm_,
                         options_.rank, options_.world_size, step_, skips_gradless(), *stats_},
      std::move(ch));
  return Status::Ok();
}

// Whether every rank's device budget, beside what build took from it (the
// GPU update's scratch, the reduction's buffers), holds every group's
// gathered copy at once: then residency keeps forward's gathers for
// backward (ResidencyOptions::keep_gathered). A copy may take a pooled
// block larger than asked (DeviceTier::MostCharged), counted so. The ranks
// agree (a sum of yes votes), since budgets may differ between them.
Result<bool> Engine::Impl::AgreeKeepGathered() {
  uint64_t need = 0;
  for (int g = 0; g < lay_.num_groups(); ++g) need += DeviceTier::MostCharged(lay_.PBytes(g));
  const uint64_t budget = device_->budget(), used = device_->used();
  const bool fits = used <= budget && need <= budget - used;
  float votes = fits ? 1.0f : 0.0f;
  comm_->SetLabel("build: keep gathered copies");
  STRATA_RETURN_IF_ERROR(comm_->AllReduce(&votes, 1).WithContext("build: agreeing whether gathered copies stay"));
  const bool all = votes == static_cast<float>(comm_->world_size());
  STRATA_LOG_DEBUG("build: stage 3: {} (the copies need {}; this rank's device tier has {} of {} free)",
                   all ? "each group is gathered once a step, forward's copy kept for backward"
                       : "each group is gathered in forward and again in backward (some rank's device budget "
                         "does not hold every group's copy)",
                   FormatBytes(need), FormatBytes(used <= budget ? budget - used : 0), FormatBytes(budget));
  return all;
}

Result<void*> Engine::Impl::Fetch(int g) {
  if (OverlapHasTaken(g)) STRATA_RETURN_IF_ERROR(UndoOverlap(g, "fetch"));
  if (steps_[static_cast<size_t>(g)].p_stale)
    return StateError("fetch: P of group " + std::to_string(g) + " does not follow its master weights (rewriting "
                      "it failed after a discarded or failed update); the next step rewrites it, or load a checkpoint");
  return residency_->Fetch(g);
}

Status Engine::Impl::Release(int g) { return residency_->Release(g); }

void Engine::Impl::DropDeviceCopies(bool keep_frozen) {
  if (residency_) {
    // keep_frozen (a step's end): frozen P never changes, and a copy the
    // step refreshed (OnPStored) holds the new P already.
    if (keep_frozen)
      residency_->Drop([this](int g) { return CopyStays(g); });
    else residency_->Drop();
  }
  std::fill(p_refreshed_.begin(), p_refreshed_.end(), PCopy::kOld);
}

Status Engine::Impl::DrainComm(bool wait) {
  if (!reducer_) return Status::Ok();
  Status st = reducer_->Drain(wait);
  if (st.ok()) return st;
  if (step_.broken.empty())
    step_.broken = "gradients reduced in the background (zero_optimization.overlap_comm) were lost: " + st.message();
  return st.WithContext("a background gradient reduction (zero_optimization.overlap_comm) failed");
}

}  // namespace strata
