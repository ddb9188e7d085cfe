// Step: the norm, clipping and loss scale over the ranks, then the update
// (StepPipeline), its agreement and P's gather; a failed step stays pending
// (StepState) until it is finished or a checkpoint is loaded.
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

bool Engine::Impl::WritesBehind(const std::vector<int>& groups) const {
  return behind_allowed_ && pipeline_ && pipeline_->CanRunBehind(groups);
}

// The two slots PlanStaging gives the pieces hold the step of a model whose
// largest group is half of it (an embedding); a model of many equal layers
// needs more. They come out of the host budget's rest, after everything
// else is built, so that no plan that fits the budget stops fitting: the
// check (CheckHostPlan) stays the two slots'. Speculation "always" keeps the
// rest for its own room (StartOverlap, after this).
Status Engine::Impl::GrowStagingBehind() {
  if (!behind_allowed_ || !pipeline_) return Status::Ok();
  if (options_.overlap_step && config_.strata.speculation == "always") return Status::Ok();
  StagingPool& pool = staging_.opt;
  const std::vector<uint64_t> pieces = pipeline_->BehindPieces(StepOrder());
  if (pool.count() == 0 || pieces.empty()) return Status::Ok();
  uint64_t need = 0;
  for (uint64_t p : pieces) need += p;
  // Cut in the step's order, from slots none of which is lent (Step and
  // PrepareStep settle the last step's writes before a read-ahead or a run
  // cuts any): the slots that sequence fills, exactly. ApplyStep checks
  // the pool itself again before each run (BehindFitsNow).
  const int64_t slots = BuffersForPieces(pieces, pool.bytes());
  if (slots < 0) return InternalError("write_behind: a unit's W, M, V are larger than a step staging slot");
  const int64_t extra = slots - pool.count();
  if (extra <= 0) return Status::Ok();
  const uint64_t cost = static_cast<uint64_t>(extra) * AlignUp(pool.bytes(), 4096);  // (the host tier charges whole pages)
  const uint64_t left = host_->budget() > host_->used() ? host_->budget() - host_->used() : 0;
  if (cost > left) {
    STRATA_LOG_INFO("write_behind: the step's W, M, V ({}) need {} more step staging slots of {} ({}), but "
                    "strata.host_budget ({}) has {} left: the step writes before it returns",
                    FormatBytes(need), extra, FormatBytes(pool.bytes()), FormatBytes(cost),
                    FormatBytes(host_->budget()), FormatBytes(left));
    return Status::Ok();
  }
  STRATA_RETURN_IF_ERROR(pool.Grow(static_cast<int>(extra)).WithContext("build: write_behind's step staging"));
  STRATA_LOG_INFO("write_behind: {} more step staging slots of {} ({}; {} in all) hold the step's W, M, V ({}) at once",
                  extra, FormatBytes(pool.bytes()), FormatBytes(cost), pool.count(), FormatBytes(need));
  return Status::Ok();
}

void Engine::Impl::SettleBehind(bool recovers) {
  if (!pipeline_) return;
  Status st = pipeline_->WaitBehind();
  if (st.ok()) return;
  if (step_.broken.empty() && behind_loss_.empty()) {  // (else said already, or broken before)
    std::string lost = "step " + std::to_string(behind_step_) +
                       " left its W, M, V writes to finish after its update (strata.write_behind), and a write "
                       "failed (" + st.ToString() + "): its new state is lost";
    if (behind_agreed_) {
      // The other ranks learn it at the next step or save (AgreeBehind);
      // until then this rank's forward and backward go on with theirs
      // (they read nothing the write held: P and G are off NVMe, or P's
      // copies all hold the step's new P, else the step waited for its
      // writes and the ranks agreed before it returned). A load
      // (`recovers`) clears it when it succeeds (AbandonStep); one that
      // changed nothing leaves it for the next agreement.
      STRATA_LOG_ERROR("rank {}: {}; every rank's next step (or checkpoint save) fails with it", options_.rank, lost);
      behind_loss_ = std::move(lost);
    } else {
      step_.broken = std::move(lost);
      behind_lost_ = true;
    }
  }
  // A load rewrites every block: its writes go ahead, and the engine stays
  // broken unless it succeeds (AbandonStep).
  if (recovers) pipeline_->ClearBehind();
}

Status Engine::Impl::AgreeWriteBehind() {
  // Allowed, and a step could write behind at all (W, M, V stepped in
  // pieces: on NVMe, not compact, no GPU update).
  const bool could = pipeline_ && !pipeline_->BehindPieces(StepOrder()).empty();
  const bool kept = residency_ && residency_->KeepsCopies();
  const bool allowed = could && WriteBehindAllowed(config_, lay_, kept);
  if (!lay_.multi) {
    behind_allowed_ = allowed;
    return Status::Ok();
  }
  float votes[2] = {allowed ? 1.0f : 0.0f, BehindLossAgreeable(lay_, kept) ? 1.0f : 0.0f};
  comm_->SetLabel("build: write behind");
  STRATA_RETURN_IF_ERROR(comm_->AllReduce(votes, 2).WithContext("build: agreeing whether the step writes behind"));
  const float w = static_cast<float>(comm_->world_size());
  behind_allowed_ = votes[0] == w;
  behind_agreed_ = behind_allowed_ && votes[1] == w;
  if (config_.strata.write_behind == "auto" && could && !behind_allowed_)
    STRATA_LOG_INFO("write_behind \"auto\": the step writes before it returns: with several ranks it writes behind "
                    "only where G is off NVMe on every rank, and P is too or its gathered copies stay in memory "
                    "from step to step (stage 3, no GPU, every copy within strata.device_budget) on every rank "
                    "(a lost write is then agreed at the next step, before anything reads it)");
  return Status::Ok();
}

bool Engine::Impl::CopyStays(int g) const {
  const PCopy f = p_refreshed_[static_cast<size_t>(g)];
  return lay_.frozen(g) || f == PCopy::kCommitted || f == PCopy::kHeld;  // not a discarded speculation's
}

bool Engine::Impl::PCopiesCurrent() const {
  for (int g = 0; g < lay_.part.num_groups(); ++g)
    if (!CopyStays(g) || !residency_->resident(g)) return false;
  return true;
}

// Every rank calls it at the same point (the step, a checkpoint save), so
// it is one more collective in their common order: a 4-byte all-gather.
Status Engine::Impl::AgreeBehind(const char* call, bool step_end) {
  if (!behind_agreed_) return Status::Ok();
  // The last step's writes have landed, or one was lost (behind_loss_). At
  // a step's end its own are in flight, or waited for (ApplyStep).
  if (!step_end) SettleBehind();
  // The label's step is the same on every rank (a rank whose failed step
  // broke its engine has none pending); the step whose writes these are,
  // as the message names it: this one at its end, a failed step's while it
  // is pending (its writes are the last left behind: the call that failed
  // agreed on those before it), else the last applied.
  const int64_t label_step = step_.applied + (step_end ? 1 : 0);
  const int64_t step = step_.applied + (step_end || step_.pending ? 1 : 0);
  std::vector<int> lost;
  const Status agreed = Agree(behind_loss_.empty() ? Status::Ok() : StateError(behind_loss_),
                              "writes behind s" + std::to_string(label_step), &lost);
  if (agreed.ok()) return agreed;
  if (lost.empty())  // the all-gather itself failed
    return agreed.WithContext(std::string(call) + ": agreeing on the writes behind step " + std::to_string(step));
  std::string ranks;
  for (int k : lost) ranks += (ranks.empty() ? "" : ", ") + std::to_string(k);
  if (step_.broken.empty())
    step_.broken = !behind_loss_.empty()
                       ? behind_loss_
                       : "rank " + ranks + " lost a write behind step " + std::to_string(step) +
                             " (strata.write_behind; its log names it): the ranks' states are no longer one step's";
  behind_loss_.clear();
  return CheckUsable(call);
}

void Engine::Impl::AnnounceBehindLoss() {
  if (!behind_lost_ || !lay_.multi) return;
  behind_lost_ = false;
  (void)DrainComm(/*wait=*/true);  // (this step's reductions, which the others ran too)
  comm_->SetLabel("lost write after step " + std::to_string(step_.applied));
  (void)comm_->Barrier();  // fails on every rank: the others are at another collective
}

Status Engine::Impl::PrepareStep(const StepOptions& so) {
  STRATA_RETURN_IF_ERROR(CheckStepOptions(so, "prepare_step"));
  if (!built_) return StateError("prepare_step: the engine is not built");
  SettleBehind();  // the last step's writes are done before this one reads
  AnnounceBehindLoss();
  if (!step_.broken.empty()) return CheckUsable("prepare_step", /*pending_ok=*/true);
  // A write lost here and not yet agreed: this step is not prepared (it
  // reads and updates nothing early); the step fails on every rank at once.
  if (!behind_loss_.empty()) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckNoOpenParts("prepare_step"));
  STRATA_RETURN_IF_ERROR(pipeline_->Check(so).WithContext("prepare_step: the step's options (nothing was changed)"));
  for (const auto& gs : steps_)
    if (gs.grad_calls > 0 || gs.parts.open)
      return StateError("prepare_step: gradients of this step have already arrived");
  step_.prepared = true;
  step_.prepared_opts = so;
  step_.doomed = false;
  step_.queued = 0;
  // The early updates are certain only where nothing after backward can
  // change them: no clipping, no loss scale, non-finite gradients applied.
  const double clip = so.max_grad_norm >= 0 ? so.max_grad_norm : config_.gradient_clipping;
  step_.speculative = clip > 0 || config_.fp16.enabled || config_.strata.nonfinite != "apply";
  step_.spec_scale = 1.0 / (step_.scaler.scale() * GradMeanDivisor());  // ScaleGradients' factor without clipping
  // Speculation that would likely be thrown away is not worth its cost (a
  // replay updates twice): the policy decides, and the step then updates
  // after backward, exactly as without overlap.
  std::string why;
  step_.early = !step_.speculative || step_.policy.Decide(&why);
  if (step_.early && step_.speculative) ReserveSpeculationRoom();
  if (!step_.early) {
    const double now = stats_->Now();
    stats_->CallSpan("no speculation", -1, now, now);
    stats_->OnSpeculationDeclined();
    STRATA_LOG_DEBUG("overlap_step: step {} does not speculate: {}", step_.applied + 1, why);
    // It updates after backward: its first groups' W, M, V on NVMe come
    // into the idle step slots while backward runs. In index order, the
    // order GrowStagingBehind counted the pieces in: a cohort that lags
    // (first in StepOrder) would cut them in another, which the slots may
    // not hold at once, and the step could not write behind.
    std::vector<int> order = StepOrder();
    std::sort(order.begin(), order.end());
    pipeline_->ReadAhead(order);
  }
  return Status::Ok();
}

// The groups ApplyStep will update, in its order (before the gradients are
// in, groups without gradients under skip_groups_without_grads included).
std::vector<int> Engine::Impl::StepOrder() const {
  std::map<int64_t, std::vector<int>> cohorts;
  for (int g = 0; g < lay_.part.num_groups(); ++g)
    if (!lay_.frozen(g) && !steps_[static_cast<size_t>(g)].committed) cohorts[StepsOf(g)].push_back(g);
  std::vector<int> order;
  for (const auto& [steps, groups] : cohorts) order.insert(order.end(), groups.begin(), groups.end());
  return order;
}

Status Engine::Impl::CheckUsable(const char* call, bool pending_ok, bool in_pass) const {
  if (!step_.broken.empty())
    return StateError(std::string(call) + ": the engine is broken: " + step_.broken +
                      "; load the last checkpoint to go on");
  if (!behind_loss_.empty() && !in_pass)
    return StateError(std::string(call) + ": the engine is broken: " + behind_loss_ +
                      "; load the last checkpoint (on every rank) to go on");
  if (step_.pending && !pending_ok)
    return StateError(std::string(call) + ": a failed step is pending; call step again with the same options to "
                      "finish it, or load a checkpoint");
  return Status::Ok();
}

void Engine::Impl::StopStep() {
  if (pipeline_) pipeline_->DropReadAhead();
  if (worker_) {
    worker_->Abandon();  // (queued updates: none is wanted now)
    (void)worker_->WaitIdle();  // (a load: its failures do not matter now)
    DropGCopies();
    DiscardSpeculation();  // (made with the worker)
  }
}

void Engine::Impl::AbandonStep(bool keep_p_stale) {
  StopStep();
  if (reducer_) reducer_->DropParts();  // a grads call in parts never ended: its packed buffer
  step_.pending.reset();
  step_.broken.clear();
  behind_lost_ = false;
  behind_loss_.clear();
  step_.prepared = false;
  step_.queued = 0;
  for (auto& gs : steps_) {
    gs.grad_calls = gs.handed = 0;
    gs.parts = GradParts{};
    gs.lent.clear();  // (the step used them, or a load drops the step's gradients)
    gs.committed = false;
    gs.unit_done.clear();
    // A step keeps P marked that could not be rewritten (fetch refuses it;
    // the next step rewrites it); a load rewrites every P.
    if (!keep_p_stale) gs.p_stale = false;
  }
}

Status Engine::Impl::RepairStaleP() {
  Status st;
  void* buf = nullptr;
  for (int g = 0; st.ok() && g < lay_.part.num_groups(); ++g) {
    GroupStep& gs = steps_[static_cast<size_t>(g)];
    if (!gs.p_stale) continue;
    if (!buf) buf = staging_.opt.Acquire();
    // This rank's slice only: which groups are stale differs between ranks
    // (a collective here would not match), and the other slices are intact
    // (a step that goes ahead gathers every group after: ApplyStep).
    st = RecomputePGroup(g, buf, buf ? staging_.opt.bytes() : 0, /*gather=*/false);
    if (st.ok()) gs.p_stale = false;
  }
  staging_.opt.Release(buf);
  return st.WithContext("step: rewriting P from the committed master weights");
}

Status Engine::Impl::GlobalSquares(double* sum_out, bool* finite_out) {
  double sum = 0;
  bool finite = true;
  for (const auto& gs : steps_) {
    if (gs.grad_calls == 0) continue;
    sum += gs.sum_squares;
    finite = finite && gs.finite;
  }
  if (lay_.multi && lay_.sworld > 1) {  // each rank holds a shard of G
    std::vector<double> sums(static_cast<size_t>(lay_.sworld));
    sums[static_cast<size_t>(lay_.srank)] = sum;  // the label: the caller's
    STRATA_RETURN_IF_ERROR(comm_->AllGather(&sums[static_cast<size_t>(lay_.srank)], sums.data(), sizeof(double))
                               .WithContext("gradient norm"));
    sum = 0;
    for (double x : sums) sum += x;
    finite = std::isfinite(sum);
  }
  *sum_out = sum;
  *finite_out = finite;
  return Status::Ok();
}

Result<double> Engine::Impl::GradNorm() {
  if (!built_) return StateError("grad_norm: the engine is not built");
  STRATA_RETURN_IF_ERROR(CheckUsable("grad_norm", /*pending_ok=*/true, /*in_pass=*/true));
  STRATA_RETURN_IF_ERROR(CheckNoOpenParts("grad_norm"));
  double sum = 0;
  bool finite = true;
  if (lay_.multi) comm_->SetLabel("grad_norm s" + std::to_string(step_.applied + 1));
  STRATA_RETURN_IF_ERROR(GlobalSquares(&sum, &finite).WithContext("grad_norm"));
  if (!finite) return INFINITY;
  return std::sqrt(sum) / step_.scaler.scale() / GradMeanDivisor();
}

// The global norm of this step's gradients (the ranks' shards summed in
// rank order) and the factor the update applies to them: clipping over the
// loss scale. r->skipped when the step is held back (fp16 overflow,
// strata.nonfinite), with *held saying why when that is an error. A resumed
// step gets the same figures again: G and the loss scale are as they were.
Status Engine::Impl::ScaleGradients(const StepOptions& so, StepResult* r, double* grad_scale, Status* held,
                                    bool* clipped) {
  *clipped = false;
  double sum = 0;
  bool finite = true;
  // The label: Step's, naming the step and its options.
  STRATA_RETURN_IF_ERROR(GlobalSquares(&sum, &finite).WithContext("step"));
  // strata.grad_reduce "mean": G holds the sum over the ranks and the
  // step's grads calls; the step, its norm and its clipping see the mean.
  const double mean = GradMeanDivisor();
  const double scale = step_.scaler.scale();
  r->grad_norm = std::sqrt(sum) / scale / mean;
  if (discarding_) {  // DiscardGrads: every rank took part in the norm; none updates
    r->skipped = true;
    return Status::Ok();
  }
  if (HoldBackNonfinite(config_, steps_, finite, held)) {
    r->skipped = true;
    r->grad_norm = INFINITY;
    return Status::Ok();
  }
  // torch's clip_grad_norm_ (and DeepSpeed's): scaled by max/(norm + 1e-6)
  // whenever that is below 1.
  const double clip = so.max_grad_norm >= 0 ? so.max_grad_norm : config_.gradient_clipping;
  const double c = clip / (r->grad_norm + 1e-6);
  const double coef = (clip > 0 && c < 1.0) ? c : 1.0;
  *clipped = coef < 1.0;
  *grad_scale = coef / (scale * mean);
  return Status::Ok();
}

// Updates every group not yet committed in this step, rewrites P where only
// its store failed, and (stages 1-2, several ranks) gathers P — after every
// rank has learnt that every rank's update is done. Frozen groups never
// change; with skip_groups_without_grads neither do groups without
// gradients, and the others are updated in cohorts of one update count
// (their bias correction).
Status Engine::Impl::ApplyStep(const StepOptions& so, double grad_scale, Status early) {
  Status st = std::move(early);
  bool wrote_behind = false;
  std::map<int64_t, std::vector<int>> cohorts;  // by update count: one pipeline each
  for (int g = 0; g < lay_.part.num_groups(); ++g) {
    const GroupStep& gs = steps_[static_cast<size_t>(g)];
    if (lay_.frozen(g) || gs.committed || (skips_gradless() && gs.grad_calls == 0)) continue;
    cohorts[StepsOf(g)].push_back(g);
  }
  for (const auto& [steps, groups] : cohorts) {
    if (!st.ok()) break;
    // One cohort whose units all fit the staging pieces: the writes go on
    // after the step returns (strata.write_behind).
    bool behind = cohorts.size() == 1 && WritesBehind(groups);
    if (behind && !pipeline_->BehindFitsNow(groups)) {
      // Where the pieces were cut in another order than the build counted (a
      // read-ahead piece given back because its loads failed is cut again
      // later, by the run), next fit may need a slot more: said, once, not
      // hidden.
      behind = false;
      if (!std::exchange(behind_short_said_, true))
        STRATA_LOG_WARN("write_behind: step {}: the step staging's free pieces do not hold the step's W, M, V at "
                      "once: this step (and any other such) writes before it returns", step_.applied + 1);
    }
    if (behind) {
      behind_step_ = step_.applied + 1;
      st = pipeline_->RunBehind(groups, grad_scale, so, steps + 1, &step_.broken);
      wrote_behind = st.ok();
    } else {
      st = pipeline_->Run(groups, grad_scale, so, steps + 1, &step_.broken);
    }
  }
  if (st.ok()) st = RepairStaleP();
  if (!step_.broken.empty())
    st = StateError("step: cannot be finished: " + step_.broken + "; load the last checkpoint to go on (" +
                    st.message() + ")");
  // P on NVMe with its copies kept (BehindCopies): a copy that did not
  // take this step's new P (a group without gradients, a speculated one, a
  // unit it missed) is dropped, and the next fetch loads P from NVMe. Then
  // this rank waits for its writes here, and the ranks agree on them below,
  // so that no fetch meets a write left behind, nor one lost.
  // Agreed whenever the step's agreement itself completed (it failed on
  // some rank, or on none), so that a loss found here is never left
  // behind a pending step whose forward may load P.
  const bool settle = BehindCopies() && wrote_behind && !PCopiesCurrent();
  if (settle) SettleBehind();
  std::vector<int> failed;
  st = Agree(st, "step", &failed);  // none gathers alone
  if (BehindCopies() && (st.ok() || !failed.empty()))
    if (Status agreed = AgreeBehind("step", /*step_end=*/true); !agreed.ok()) st = agreed;
  for (int g = 0; st.ok() && lay_.p_gathered_after_step() && g < lay_.part.num_groups(); ++g)
    if (!lay_.frozen(g)) st = reducer_->Gather(g, io_->DirectPtr(blocks_[static_cast<size_t>(g)][int(StateKind::kP)]));
  if (st.ok() && wrote_behind && !settle) stats_->OnWriteBehind();  // it returned before its writes land
  return st;
}

Result<StepResult> Engine::Impl::Step(const StepOptions& so) {
  STRATA_RETURN_IF_ERROR(CheckStepOptions(so, "step"));
  if (!built_) return StateError("step: the engine is not built");
  // The kernels' own refusal, before anything is touched: a refused option
  // leaves nothing pending (the next valid step goes ahead).
  STRATA_RETURN_IF_ERROR(pipeline_->Check(so).WithContext("step: the step's options (nothing was changed)"));
  SettleBehind();  // the last step's writes left behind are done (or broke the engine)
  if (Status agreed = AgreeBehind("step"); !agreed.ok()) {  // several ranks: one that lost a write fails every one's
    // This rank's overlap may still be updating early (final updates are
    // committed as they finish): it stops, and waits, now (a load that
    // follows stops it too, before it writes: StopStep).
    if (worker_) worker_->Abandon();
    (void)FinishOverlap();
    return agreed;
  }
  AnnounceBehindLoss();
  STRATA_RETURN_IF_ERROR(CheckUsable("step"));
  STRATA_RETURN_IF_ERROR(CheckNoOpenParts("step"));
  residency_->DropAheadPins();
  for (int g = 0; g < lay_.part.num_groups(); ++g)
    if (residency_->pins(g) > 0)
      return StateError(std::string(discarding_ ? "discard_grads" : "step") + ": group " + std::to_string(g) +
                        " is fetched and not released: release it first");
  if (step_.pending && !SameStepOptions(*step_.pending, so))
    return InvalidError("step: a failed step is pending; finish it with the options it was called with (or load a "
                        "checkpoint); nothing was changed");
  residency_->WaitIdle();
  if (!discarding_ && !step_.pending && step_.overlap && step_.prepared && !step_.speculative &&
      !SameStepOptions(step_.prepared_opts, so))
    return InvalidError("step: options differ from those given to prepare_step, with which the overlapped step "
                        "updates groups as their gradients arrive (committed: with no clipping, no fp16 and "
                        "strata.nonfinite \"apply\" they are not speculative): call step with prepare_step's "
                        "options; nothing more was changed");
  if (lay_.multi) {
    // Ranks agree on the step and its options before anything changes: the
    // label rides on the step's first collective, the norm's all-gather
    // (stages 1-3), or on a barrier where there is none (stage 0).
    char hash[24];
    std::snprintf(hash, sizeof hash, "%08llx",
                  static_cast<unsigned long long>(XXH3_64bits(&so, sizeof so) & 0xffffffffu));
    // (Labels are cut at 31 characters: "step N opts HASH" fits for N below
    // 10^12; a discard, whose options are always the config's, is "discard N".)
    comm_->SetLabel(discarding_ ? "discard " + std::to_string(step_.applied + 1)
                                : "step " + std::to_string(step_.applied + 1) + " opts " + hash);
    if (lay_.sworld == 1) STRATA_RETURN_IF_ERROR(comm_->Barrier().WithContext("step: agreeing with the other ranks"));
  }
  stats_->StepBegin();
  // The norm first: the overlap thread may still be updating (every
  // gradient is in; the reduction is drained). A speculation the step will
  // not keep takes no more groups.
  StepResult r;
  double grad_scale = 1;
  Status held;
  bool clipped = false;
  Status scaled = ScaleGradients(so, &r, &grad_scale, &held, &clipped);
  // What a speculation of this step would have met (whether or not it ran):
  // the policy's evidence for the next.
  if (scaled.ok() && step_.overlap && !step_.pending && !discarding_) step_.policy.Record(!r.skipped && !clipped);
  if (worker_ && step_.speculative && (!scaled.ok() || !KeepsSpeculation(so, r, grad_scale))) worker_->Abandon();
  Status early = FinishOverlap();  // the early updates are done (or held)
  if (Status st = std::move(scaled); !st.ok()) {
    // The norm's collective failed (a lost peer): nothing was updated. The
    // step is pending: the same call again finishes it, or a load abandons
    // it (and the held speculation with it).
    stats_->StepEnd(false);
    if (step_.broken.empty()) step_.pending = so;
    return st.WithContext("step " + std::to_string(step_.applied + 1) + " is not finished (0 of " +
                          std::to_string(lay_.part.num_groups()) + " groups updated); " + AgainOrRestart());
  }
  SettleOverlap(so, r, grad_scale);  // committed, discarded (skipped) or to be redone
  Status st = held;
  if (r.skipped) {
    if (!discarding_) step_.scaler.Update(true);  // an overflow (or a non-finite gradient); not a discard
    // P of discarded speculation, from the restored W (bitwise what it was).
    if (Status p = RepairStaleP(); !p.ok() && st.ok()) st = p;
  } else {
    st = ApplyStep(so, grad_scale, std::move(early));
    if (st.ok()) {
      ++step_.applied;
      for (int g = 0; skips_gradless() && g < lay_.part.num_groups(); ++g)  // the groups this step updated
        if (!lay_.frozen(g) && steps_[static_cast<size_t>(g)].grad_calls > 0) ++step_.group_steps[static_cast<size_t>(g)];
      step_.scaler.Update(false);
    }
  }
  pipeline_->DropReadAhead();  // what the step did not take (a skipped step, groups without gradients)
  r.loss_scale = step_.scaler.scale();
  step_.prepared = false;
  if (st.ok() || r.skipped) {
    AbandonStep(/*keep_p_stale=*/true);  // the step is done (or held back): nothing pending, every group fresh for the next
  } else if (step_.broken.empty()) {
    step_.pending = so;
  }
  DropDeviceCopies(/*keep_frozen=*/true);  // P changed (for the committed groups, at least); frozen P never does
  const std::vector<int> ahead = residency_->OnStep();
  stats_->StepEnd(r.skipped);
  stats_->SetExposed(last_grads_s_ >= 0 ? stats_->Now() - last_grads_s_ : 0);
  last_grads_s_ = -1;
  if (!st.ok()) {
    if (!step_.broken.empty() || r.skipped) return st;
    return st.WithContext("step " + std::to_string(step_.applied + 1) + " is not finished (" +
                          std::to_string(CountCommitted()) + " of " + std::to_string(lay_.part.num_groups()) +
                          " groups updated); " + AgainOrRestart());
  }
  residency_->Prefetch(ahead);
  return r;
}

// What a failed step's caller can do: call it again, unless the ranks'
// communicator failed for good (a lost peer, a timeout), where no
// collective can run again: every rank must restart.
std::string Engine::Impl::AgainOrRestart() const {
  if (comm_ && comm_->broken())
    return "the ranks' communicator failed (a lost peer or a timeout: every later collective fails), so no rank can "
           "finish it: restart every rank and load the last checkpoint";
  return "call step again with the same options to finish it";
}

Status Engine::Impl::DiscardGrads() {
  if (!built_) return StateError("discard_grads: the engine is not built");
  STRATA_RETURN_IF_ERROR(CheckNoOpenParts("discard_grads"));
  if (step_.pending)
    return StateError("discard_grads: a failed step is pending: finish it with step, with the options it was "
                      "called with, or load a checkpoint");
  if (worker_ && !step_.speculative)
    for (int g = 0; g < lay_.part.num_groups(); ++g)
      if (OverlapHasTaken(g) || steps_[static_cast<size_t>(g)].committed)
        return StateError("discard_grads: group " + std::to_string(g) +
                          " was updated early by the overlapped step already (final: with no clipping, no fp16 and "
                          "strata.nonfinite \"apply\" nothing could change it); its gradients cannot be taken back: "
                          "call step (it applies them), then load a checkpoint saved before to undo them");
  discarding_ = true;
  Result<StepResult> r = Step(StepOptions{});
  discarding_ = false;
  if (!r.ok()) return r.status().WithContext("discard_grads");
  return Status::Ok();
}

int Engine::Impl::CountCommitted() const {
  int n = 0;
  for (const auto& gs : steps_) n += gs.committed;
  return n;
}

}  // namespace strata
