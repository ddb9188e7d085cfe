// The step pipeline's staging and threads (pipeline.h): its slots (whole,
// or pieces of a job's size), the read-ahead of a step that updates after
// backward, and write-behind: a run whose writes go on, on the pipeline's own
// thread, after it returns, with the gate every other NVMe move waits at.
#include <algorithm>
#include <utility>

#include "base/align.h"
#include "base/log.h"
#include "engine/layout/staging_plan.h"
#include "engine/step/pipeline.h"

namespace strata {

// A job's slot: a whole one, or (every group that trains stepped in units)
// a piece of one, which holds a unit's W, M, V (staging_plan.h).
void* StepPipeline::Slot(int g, int u, bool wait) {
  if (pieces()) return wait ? opt_staging_.AcquirePiece(PieceBytes(g, u)) : opt_staging_.TryAcquirePiece(PieceBytes(g, u));
  return wait ? opt_staging_.Acquire() : opt_staging_.TryAcquire();
}

uint64_t StepPipeline::PieceBytes(int g, int u) const {
  return StepPieceBytes(layout_, [this](uint64_t b) { return io_.NvmeBuffer(b); }, g, u, /*largest=*/false);
}

void StepPipeline::ReleaseSlot(void* slot) {
  if (pieces()) opt_staging_.ReleasePiece(slot);
  else opt_staging_.Release(slot);
}

uint64_t StepPipeline::SlotOffset(int g, int u, int s) const {
  if (!pieces()) return layout_.opt_slot_offsets[s];
  uint64_t at = 0;  // W, M, V back to back (StepPieceBytes)
  for (int k : {int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)}) {
    if (k == s) return at;
    if (layout_.StagedInSlot(k)) at += AlignUp(io_.NvmeBuffer(layout_.PartBytes(k, g, u)), 4096);
  }
  return at;  // (no other state is staged in a piece)
}

void StepPipeline::ReadAhead(const std::vector<int>& groups) {
  if (layout_.compact) return;  // (compact's W, M, V are read through the shard store)
  for (int g : groups) {
    if (gpu_.UpdatesOnGpu(g)) continue;
    for (int u = 0; u < layout_.Units(g); ++u) {  // a group in units: a slot a unit, in the step's order
      Ahead a;
      a.group = g;
      a.unit = u;
      for (int s : {int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)}) {
        const StateBlock& b = blocks_[static_cast<size_t>(g)][static_cast<size_t>(s)].Part(u);
        if (b.alloc.charged == 0 || b.home != TierKind::kNvme) continue;
        if (!a.slot && !(a.slot = Slot(g, u, /*wait=*/false))) break;
        auto m = io_.StartLoad(b, static_cast<char*>(a.slot) + SlotOffset(g, u, s));
        if (!m.ok()) continue;  // the run reads it itself, and reports what fails
        a.m[static_cast<size_t>(s)] = std::move(m).value();
        a.has[static_cast<size_t>(s)] = true;
      }
      if (!a.slot) return;  // no slot free: nothing more to read ahead
      bool any = false;
      for (bool h : a.has) any = any || h;
      if (!any) {
        ReleaseSlot(a.slot);
        continue;
      }
      std::lock_guard<std::mutex> lock(ahead_mu_);
      ahead_.push_back(std::move(a));
    }
  }
}

void StepPipeline::DropReadAhead() {
  std::deque<Ahead> drop;
  {
    std::lock_guard<std::mutex> lock(ahead_mu_);
    drop.swap(ahead_);
  }
  for (Ahead& a : drop) {
    for (int s = 0; s < kNumStates; ++s)
      if (a.has[static_cast<size_t>(s)]) io_.Finish(a.m[static_cast<size_t>(s)]).IgnoreError();  // the disk is done with the slot
    ReleaseSlot(a.slot);
  }
}

bool StepPipeline::TakeAhead(int g, int u, Ahead* out) {
  std::lock_guard<std::mutex> lock(ahead_mu_);
  for (auto it = ahead_.begin(); it != ahead_.end(); ++it)
    if (it->group == g && it->unit == u) {
      *out = std::move(*it);
      ahead_.erase(it);
      return true;
    }
  return false;
}

StepPipeline::~StepPipeline() {
  Status st = WaitBehind();
  if (behind_thread_.joinable()) behind_thread_.join();
  if (!st.ok()) STRATA_LOG_WARN("step: the engine closes with a step's writes failed: {}", st.ToString());
}

std::vector<uint64_t> StepPipeline::BehindPieces(const std::vector<int>& order) const {
  for (int g : order)
    if (gpu_.UpdatesOnGpu(g)) return {};
  return strata::BehindPieces(layout_, [this](uint64_t b) { return io_.NvmeBuffer(b); }, order);
}

bool StepPipeline::CanRunBehind(const std::vector<int>& order) const {
  const std::vector<uint64_t> pieces = BehindPieces(order);
  if (pieces.empty()) return false;
  const int64_t slots = BuffersForPieces(pieces, opt_staging_.bytes());
  return slots >= 0 && slots <= opt_staging_.count();
}

bool StepPipeline::TakesPiece(int g, int u) const {
  for (int s = 0; s < kNumStates; ++s) {
    const StateBlock& whole = blocks_[static_cast<size_t>(g)][static_cast<size_t>(s)];
    if (whole.alloc.charged > 0 && !io_.Direct(whole.Part(u))) return true;
  }
  return false;
}

bool StepPipeline::BehindFitsNow(const std::vector<int>& order) {
  std::vector<uint64_t> cuts;  // the run's, in its order: a unit read ahead has its piece
  {
    std::lock_guard<std::mutex> lock(ahead_mu_);
    for (int g : order)
      for (int u = 0; u < layout_.Units(g); ++u) {
        const bool ahead =
            std::any_of(ahead_.begin(), ahead_.end(), [&](const Ahead& a) { return a.group == g && a.unit == u; });
        if (!ahead && TakesPiece(g, u)) cuts.push_back(PieceBytes(g, u));
      }
  }
  return opt_staging_.HoldsInOrder(cuts);
}

void StepPipeline::Updated() {
  {
    std::lock_guard<std::mutex> lock(behind_mu_);
    behind_updated_ = true;
    behind_phase_ = Behind::kWriting;
  }
  behind_cv_.notify_all();
}

Status StepPipeline::RunBehind(const std::vector<int>& order, double grad_scale, const StepOptions& so, int64_t step,
                               std::string* broken) {
  STRATA_RETURN_IF_ERROR(WaitBehind());
  if (behind_thread_.joinable()) behind_thread_.join();
  {
    std::lock_guard<std::mutex> lock(behind_mu_);
    behind_phase_ = Behind::kUpdating;
    behind_status_ = Status::Ok();
    behind_broken_.clear();
    behind_updated_ = false;
  }
  behind_thread_ = std::thread([this, order, grad_scale, so, step] {
    behind_id_ = std::this_thread::get_id();
    size_t next = 0;
    Feed feed;
    feed.next = [&](bool) { return next < order.size() ? order[next++] : -1; };
    feed.step_of = [step](int) { return step; };
    feed.behind = true;
    std::string why;
    Status st = RunFeed(feed, grad_scale, so, &why);
    behind_id_ = std::thread::id();
    std::string lost;
    {
      std::lock_guard<std::mutex> lock(behind_mu_);
      if (!behind_updated_) {
        behind_status_ = std::move(st);
        behind_broken_ = std::move(why);
      } else if (!st.ok()) {
        lost = st.ToString();
        behind_failure_ = std::move(st);
      }
      behind_phase_ = Behind::kIdle;
    }
    behind_cv_.notify_all();
    // Said now, as it happens: the engine learns it at its next call that
    // waits for the writes (SettleBehind), which may be a forward later.
    if (!lost.empty())
      STRATA_LOG_ERROR("write_behind: step {}'s W, M, V writes failed behind its update ({}): its new state is "
                       "lost; the engine's next call that waits for them fails (with several ranks, on every "
                       "rank)",
                       step, lost);
  });
  std::unique_lock<std::mutex> lock(behind_mu_);
  behind_cv_.wait(lock, [&] { return behind_phase_ != Behind::kUpdating; });
  if (behind_updated_) return Status::Ok();
  if (broken->empty()) *broken = behind_broken_;
  return behind_status_;
}

Status StepPipeline::WaitBehind() {
  std::unique_lock<std::mutex> lock(behind_mu_);
  if (behind_phase_ == Behind::kIdle) return behind_failure_;
  // The stats count the time some thread waited (behind_wait_s): from the
  // first waiter's arrival to the last one's leaving. Every waiter of a
  // phase leaves when it ends, so that is the union of their waits.
  if (behind_waiters_++ == 0) behind_wait_start_ = stats_.Now();
  behind_cv_.wait(lock, [&] { return behind_phase_ == Behind::kIdle; });
  Status st = behind_failure_;
  double waited = -1;
  if (--behind_waiters_ == 0)
    waited = stats_.Now() - behind_wait_start_;
  lock.unlock();
  if (waited >= 0) stats_.OnBehindWait(waited);
  return st;
}

void StepPipeline::ClearBehind() {
  std::lock_guard<std::mutex> lock(behind_mu_);
  behind_failure_ = Status::Ok();
}

Status StepPipeline::Gate() {
  if (behind_id_.load() == std::this_thread::get_id()) return Status::Ok();  // the writes themselves
  return WaitBehind();
}

}  // namespace strata
