// StepPipeline: the optimizer step over a list of groups, each shard's W, M,
// V, G in a staging slot while it is read, updated and written back, on the
// disk schedule strata.step_io names (pipeline.cpp says how). States the CPU
// addresses in place are not moved; W, M, V homed on a GPU that the GPU
// updates (GpuUpdater) stay there.
//
// Invariants: nothing half-happens. A group's new W, M, V are written to
// fresh extents and published together once all three writes are done, or
// all discarded; the group is then committed for this step (its GroupStep).
// A failed run leaves every group wholly old or wholly new, and a later run
// finishes the uncommitted ones from their old state and the gradients still
// in G. P follows W: when only P's store fails, the group is marked p_stale.
// What cannot be resumed (lost gradients, device state partly written) is
// reported through `broken`.
//
// Touches: the layout and blocks (read), the blocks' I/O, the step's staging
// slots, the stats, the GPU update, the shard store's compact arrays, and
// the GroupStep of each group it is given (no other). No lock and no thread:
// one run at a time (the overlap thread's, or the step's after it is idle).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/config/engine_options.h"
#include "engine/step/group_step.h"
#include "engine/step/gpu_updater.h"
#include "engine/step/shard_store.h"
#include "engine/step/speculation.h"

namespace strata {

class StepPipeline {
 public:
  StepPipeline(const Layout& layout, const std::vector<GroupBlocks>& blocks, BlockIo& io, StagingPool& opt_staging,
               StatsRecorder& stats, GpuUpdater& gpu, const ShardStore& shards, std::vector<GroupStep>& steps)
      : layout_(layout),
        blocks_(blocks),
        io_(io),
        opt_staging_(opt_staging),
        stats_(stats),
        gpu_(gpu),
        shards_(shards),
        steps_(steps) {}
  ~StepPipeline();  // waits for the writes left behind

  // Updates `order`'s groups with the step's options, G multiplied by
  // `grad_scale`, bias correction for update number `step`. *broken (when
  // empty) says why the step cannot be finished, when it cannot.
  Status Run(const std::vector<int>& order, double grad_scale, const StepOptions& so, int64_t step,
             std::string* broken);
  // A run whose groups arrive one at a time (overlap_step: as backward
  // completes them). `next(wait)`: the next group, or -1 (wait: the run is
  // over; else: none yet). `step_of(g)`: the update number of g's bias
  // correction. `spec`: the updates are held, not committed (speculation.h);
  // each group handed out must have been reserved there, and ends Ready or
  // Failed.
  // `g_copy(g)` (may be null): a host copy of g's G that the feed holds,
  // used instead of loading G from its home; `g_done(g)` is called once
  // the run no longer reads it.
  struct Feed {
    std::function<int(bool wait)> next;
    std::function<int64_t(int g)> step_of;
    Speculation* spec = nullptr;
    std::function<const void*(int g)> g_copy;
    std::function<void(int g)> g_done;
    bool behind = false;  // RunBehind's run (on its thread): no spec, no g_copy
  };
  Status RunFeed(const Feed& feed, double grad_scale, const StepOptions& so, std::string* broken);
  // Called (on the run's thread) when a committed group's new P, held in
  // its slot (not compact; the whole group at one rank, this rank's shard at
  // stage 3; W's bytes where P is W), has landed in its home, before the
  // slot is reused: a cached device copy may take it (Residency::Refresh).
  // Not at stages 1-2 with several ranks, where P's home is gathered after
  // the step. `held`: a speculated update (one rank only), held until the
  // step commits or discards it; a discard must then forget the copy. A
  // group stepped in units calls it a unit at a time: `p` holds `bytes` of
  // P from byte `at` of this rank's P (bytes 0: all of it, at 0).
  using PStored = std::function<void(int g, const void* p, bool held, uint64_t at, uint64_t bytes)>;
  void OnPStored(PStored f) { on_p_stored_ = std::move(f); }
  // A step that updates after backward (overlap_step's policy did not
  // speculate): the W, M, V homed on NVMe of `groups`, in that order, are
  // read into free staging slots now, while backward runs, as many as
  // slots are free (a slot a unit; in pieces, a piece a unit). A later run takes a group's reads over when the group
  // comes (an NVMe block written since is read again: NvmeTier::Version).
  // Whatever no run took comes back at DropReadAhead, or to an Acquire that
  // finds the pool empty (StagingPool::SetReclaim): nobody waits on them.
  void ReadAhead(const std::vector<int>& groups);
  void DropReadAhead();
  // Write-behind: a run whose W, M, V writes go on after it returns. Every
  // job (a unit, or a group stepped whole) of `order` is read (or taken
  // from the read-ahead) into a piece of its own and updated, and its group
  // committed (GroupStep), with its P handed on (OnPStored), before the run
  // returns; the writes then go on, in batches as a run's, on the
  // pipeline's own thread, each job's piece coming back once its W, M, V
  // have landed and been published. Where it applies (CanRunBehind): pieces
  // (staging_plan.h), and enough of them for every job at once.
  // A run that fails before every job is updated writes nothing and returns
  // as Run does (the groups it did not commit are redone by the next run);
  // one that gets past its updates returns Ok (the engine counts the step
  // in the stats' write_behind_steps, unless it waits for the writes).
  // A write that fails after the run returned cannot be undone into the
  // step: its job's new state is discarded (the block keeps its old
  // contents), the rest are not started, and the failure is kept for
  // WaitBehind (the engine is broken: a checkpoint load).
  // CanRunBehind: the staging, idle, holds every job's piece of `order`
  // cut in order (BuffersForPieces), as at build. BehindFitsNow: the pieces
  // the run would still cut, after the read-ahead's, fit what the staging
  // has free now (StagingPool::HoldsInOrder), where CanRunBehind holds (the
  // caller asked); RunBehind requires it, since a run that held every piece
  // and still needed one would wait on itself.
  bool CanRunBehind(const std::vector<int>& order) const;
  bool BehindFitsNow(const std::vector<int>& order);
  // Every job's piece of `order`, in the run's order: what the staging must
  // hold for CanRunBehind (none where it never applies: no pieces, compact
  // state, or a GPU updates a group).
  std::vector<uint64_t> BehindPieces(const std::vector<int>& order) const;
  Status RunBehind(const std::vector<int>& order, double grad_scale, const StepOptions& so, int64_t step,
                   std::string* broken);
  // Waits for the writes left behind; their failure, if any, until
  // ClearBehind. Any thread.
  Status WaitBehind();
  void ClearBehind();
  // BlockIo's gate: on the writes' own thread nothing, else WaitBehind.
  Status Gate();

  // The kernels' refusal of the step's options (beta1 outside [0, 1), a
  // negative learning rate, ...), asked before anything is touched: a step
  // refused here changes nothing and leaves nothing pending.
  Status Check(const StepOptions& so) const;

 private:
  StepKernelOptions KernelOptions(const StepOptions& so, double grad_scale, int64_t step) const;
  bool pieces() const { return layout_.opt_piece_bytes != 0; }
  // A slot (or piece) for group g's unit u; wait: blocks until one is free, else null when none is.
  void* Slot(int g, int u, bool wait);
  void ReleaseSlot(void* slot);
  uint64_t SlotOffset(int g, int u, int s) const;  // of state s in its slot (or piece)
  uint64_t PieceBytes(int g, int u) const;
  // Whether group g's unit u takes a piece in a run on the CPU: a state it
  // uses that the CPU cannot address in place (start_loads, in RunFeed).
  bool TakesPiece(int g, int u) const;
  PStored on_p_stored_;
  // Write-behind: the thread that runs a RunBehind, and what it reports.
  // behind_mu_ guards behind_phase_, behind_status_, behind_failure_, behind_broken_,
  // behind_waiters_, behind_wait_start_.
  enum class Behind { kIdle, kUpdating, kWriting };
  void Updated();  // (the behind thread) every job updated: the caller goes on
  std::thread behind_thread_;
  std::atomic<std::thread::id> behind_id_{};
  std::mutex behind_mu_;
  std::condition_variable behind_cv_;
  Behind behind_phase_ = Behind::kIdle;
  Status behind_status_;   // the run's result up to Updated (or its end)
  Status behind_failure_;  // the writes' after it
  bool behind_updated_ = false;  // the last RunBehind reached Updated
  std::string behind_broken_;
  // Threads in WaitBehind now (any: a call's, the prefetch's, the
  // reduction's), and when the first of them began: the stats count the
  // time any waited, once (behind_wait_s), not each thread's.
  int behind_waiters_ = 0;
  double behind_wait_start_ = 0;  // (stats_.Now())
  struct Ahead {
    int group = -1, unit = 0;
    void* slot = nullptr;
    std::array<BlockMove, kNumStates> m;
    std::array<bool, kNumStates> has{};
  };
  // The read-ahead entry of unit u of group g, moved out (false: none).
  bool TakeAhead(int g, int u, Ahead* out);
  std::mutex ahead_mu_;  // guards ahead_ (a reclaim may come from another thread's Acquire)
  std::deque<Ahead> ahead_;

  const Layout& layout_;
  const std::vector<GroupBlocks>& blocks_;
  BlockIo& io_;
  StagingPool& opt_staging_;
  StatsRecorder& stats_;
  GpuUpdater& gpu_;
  const ShardStore& shards_;
  std::vector<GroupStep>& steps_;
};

}  // namespace strata
