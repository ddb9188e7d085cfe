// Engine::Impl: the composition. It creates the components (layout/,
// residency/, reduce/, step/, checkpoint/), wires them, and routes the API's
// calls to them; docs/architecture.md draws it.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "engine/layout/block_io.h"
#include "engine/engine.h"
#include "engine/checkpoint/checkpointer.h"
#include "engine/layout/layout.h"
#include "engine/reduce/agree.h"
#include "engine/reduce/reducer.h"
#include "engine/residency/p_home.h"
#include "engine/residency/residency.h"
#include "engine/step/group_step.h"
#include "engine/step/gpu_updater.h"
#include "engine/step/pipeline.h"
#include "engine/step/shard_store.h"
#include "engine/step/speculation.h"
#include "engine/step/step_state.h"
#include "engine/activations/activation_store.h"
#include "engine/step/update_worker.h"
#include "engine/format/manifest.h"
#include "engine/layout/partition.h"
#include "engine/layout/staging.h"
#include "engine/stats/stats.h"
#include "io/net/comm.h"
#include "io/net/store.h"
#include "io/file_storage.h"
#include "kernels/cpu/compact.h"

namespace strata {


class Engine::Impl {
 public:
  Impl(const Config& config, const EngineOptions& options);
  ~Impl();
  Status Init();
  Status InitRanks();
  // The ranks of this job that share this process's memory (ConfigFacts::
  // ranks_on_host): one collective on every rank, at create.
  Result<uint32_t> CountRanksOnHost(const std::string& memory_key);
  // The processes of this job on this host whose kernels run on the CPUs
  // this one's will (after the NUMA binding to come, where there is one),
  // and under the same cgroup CPU limit: ranks that are threads of one
  // process share its kernels' arena, and count once. One collective on
  // every rank, at create (before anything that cannot be undone).
  Status CountCpuSharers();
  std::string RankTracePath(const std::string& path) const;
  Status Build();
  Status BuildOnce();
  Status BuildState();  // build.cpp: its rank-local part
  void UndoBuild();
  // INVALID unless the engine is built and `group` is one of its groups.
  Status CheckGroup(int group, const char* call) const;
  Status Grads(int group, const void* grads, DType dtype);
  // One grads call in parts (grads.cpp): GradsPart writes elements
  // [first, first + count) straight into G, GradsEnd completes the call.
  // Taken where PartsRefused says nothing: one rank, G in host memory and in
  // the parts' dtype; or several ranks, the reduction on host buffers with its
  // thread (the parts packed there, GradReducer::PartsBegin); the group's
  // first gradients of the step.
  // `lend`: the whole tiles of the part stay at `src` (GroupStep::lent)
  // where the step's update can read them there (LendsParts), else copied.
  Status GradsPart(int group, uint64_t first, uint64_t count, const void* src, DType dtype, bool lend = false);
  Status GradsEnd(int group);
  // Whether a part of `group`'s gradients handed now may stay lent: one
  // rank, the update on the CPU, fp32 state format, W, M, V not on NVMe, and
  // no update of the group before the step (the overlapped step's early
  // updates copy).
  bool LendsParts(int group) const;
  // Copies the group's (all groups') lent parts into G: before anything but
  // the step's update reads G, and before step returns without having used them.
  void SettleLent(int group);
  void SettleAllLent();
  // Whether parts lent to `group` this step may still be read (its
  // GroupStep::lent, or the reducer's ReadsLent).
  bool LentInUse(int group);
  // G of `group` for reading, after this step's gradients of it (where
  // PartsRefused has no reason but the dtype); its lent parts copied in.
  Result<const void*> GradsView(int group);
  // G of `group` where it is host memory (PartsRefused says nothing but the dtype).
  char* GOf(int group) const;
  // Why `group` cannot take gradients of `dtype` in parts ("" when it can).
  std::string PartsRefused(int group, DType dtype) const;
  // INVALID, naming the group, while a grads call in parts is open: `call`
  // would see half a gradient.
  Status CheckNoOpenParts(const char* call) const;
  Result<StepResult> Step(const StepOptions& options);
  // Drops this step's gradients: Step's collectives and settling, updating
  // nothing (a speculation discarded), the loss scale and counts unchanged.
  Status DiscardGrads();
  std::string AgainOrRestart() const;  // step.cpp: a failed step's way on
  bool discarding_ = false;  // within DiscardGrads' Step
  Status ReadMaster(int group, float* out) { return ReadState(group, StateKind::kW, out); }
  Status ReadState(int group, StateKind kind, float* out);
  Status WriteState(int group, StateKind kind, const float* in);
  // P of group g from its master W. `gather` (stages 1-2, several ranks: a
  // collective): the other ranks' slices too; without, this rank's slice only.
  Status RecomputePGroup(int g, void* buf, uint64_t buf_bytes, bool gather = true);
  EngineStats Stats() const;

  // frozen.cpp: groups marked by FreezeGroup keep P alone (block kP; no G,
  // W, M, V), never updated.
  // read_master of a frozen group: its P widened to fp32 (stage 3 with
  // several ranks: the shards gathered; every rank calls it).
  Status ReadFrozen(int g, float* out);
  // write_state(kMaster) of a frozen group: P := `in` in the compute dtype
  // (this rank's shard at stage 3, else the whole group).
  Status WriteFrozen(int g, const float* in);
  // Build, several ranks: INVALID naming the first group that some rank
  // froze and rank 0 did not (or the reverse); every rank returns an error.
  Status AgreeOnFrozen();
  Result<bool> AgreeKeepGathered();
  std::vector<int> StepOrder() const;

  // A thread the engine starts calls this first: the CUDA current device is
  // per thread, and this process's GPU is placement_.device.
  void UseDeviceOnThisThread() const;

  // wiring.cpp: the reduction (several ranks) and residency, made and
  // connected at build; their threads start.
  Status StartComponents();
  // Fetch and release: residency's, after the step's own refusal.
  Result<void*> Fetch(int group);
  Status Release(int group);
  // P changed (a step, a write of P): the device copies go; `keep_frozen`:
  // a frozen group's stays (its P never changes). REQUIRES: no pins, no loads.
  void DropDeviceCopies(bool keep_frozen = false);

  // Save and load (checkpoint/'s Checkpointer, after CheckBetweenSteps).
  Status SaveCheckpoint(const std::string& dir, const std::string& tag, const void* blob, uint64_t blob_bytes);
  Status LoadCheckpoint(const std::string& dir, const std::string& tag, std::vector<uint8_t>* blob);
  // `recovers`: a checkpoint load, which may abandon a pending failed step.
  Status CheckBetweenSteps(const char* call, bool recovers = false);
  // Refuses every call but a checkpoint load on a broken engine, and the
  // calls that would mix a pending failed step with new work.
  // `in_pass`: a call of the forward and backward (fetch, grads, prepare_step,
  // grad_norm, sum_over_ranks; set_steps, which reads no state), which a
  // write lost behind the last step and
  // not yet agreed (behind_loss_) does not stop: the ranks fail together at
  // the step (AgreeBehind), their collectives in order until then.
  Status CheckUsable(const char* call, bool pending_ok = true, bool in_pass = false) const;
  // Ends the step (one that finished, or any after a successful load):
  // nothing pending or broken, every group's gradients and flags reset.
  void AbandonStep(bool keep_p_stale = false);
  // The part of AbandonStep that touches the state: the read-ahead dropped,
  // the overlap worker's queued updates dropped and its running one waited
  // for, its G copies dropped, its speculation undone. A load calls it
  // before it writes the state (and AbandonStep again after: a no-op then).
  void StopStep();
  // Waits for the last step's writes left behind (strata.write_behind); a
  // failed one breaks the engine, naming it. `recovers` (a load): the
  // failure is then cleared, the load rewriting every block.
  void SettleBehind(bool recovers = false);
  // Whether a step of `groups` (one cohort) writes behind: strata.write_behind
  // allows it here, and the staging pieces hold every unit at once.
  bool WritesBehind(const std::vector<int>& groups) const;
  // At build, where strata.write_behind allows it: more step staging, so
  // that the step's pieces fit at once (WritesBehind), when the host budget
  // has room for them beside everything built; otherwise nothing changes
  // and the reason is logged.
  Status GrowStagingBehind();
  // Several ranks: this rank's lost write is news to the others, whose next
  // collective would wait for it until the timeout. Once, at the next
  // prepare_step or step: a labeled barrier where they run something else,
  // so that theirs fails now, naming this rank.
  void AnnounceBehindLoss();
  bool behind_lost_ = false;  // SettleBehind broke the engine; not yet announced
  // Several ranks where the ranks can agree on a lost write (build's vote:
  // strata.write_behind allows it on every rank, and on every rank G is off
  // NVMe and so is P, or P's copies are kept: BehindLossAgreeable). Then a
  // lost write does not break the communicator: SettleBehind keeps it in behind_loss_ (refused by the
  // calls that read the state, not by those of the pass), and the next step
  // or checkpoint save agrees on it first thing (AgreeBehind), every rank
  // broken together, each able to load the last checkpoint in place.
  // behind_allowed_: strata.write_behind applies (WritesBehind), the same on
  // every rank.
  Status AgreeWriteBehind();
  // `step_end`: at the end of every step where P is on NVMe with its copies
  // kept (BehindCopies), before it returns: agrees on what this rank
  // knows now (a rank whose copies did not all take the step's new P
  // waited for its writes), without waiting for the writes itself.
  Status AgreeBehind(const char* call, bool step_end = false);
  // behind_agreed_ with P on NVMe (its copies kept: BehindLossAgreeable).
  bool BehindCopies() const { return behind_agreed_ && lay_.home[int(StateKind::kP)] == TierKind::kNvme; }
  // Whether every group's copy holds P as the step left it (resident, and
  // refreshed by the step or frozen): those DropDeviceCopies keeps.
  bool CopyStays(int g) const;
  bool PCopiesCurrent() const;
  int64_t behind_step_ = 0;  // the step whose writes were last left behind (RunBehind)
  // Whether reading state `kind` of group g is a collective (its shards
  // gathered over the ranks; a frozen group's P, read as W, at stage 3):
  // then every rank reads it, and agrees first. A frozen group keeps no M
  // or V: that read is refused at once, gathering nothing.
  bool ReadGathers(int g, StateKind kind = StateKind::kW) const {
    if (!lay_.multi || g < 0 || g >= lay_.part.num_groups()) return false;
    return lay_.frozen(g) ? kind == StateKind::kW && lay_.p_sharded : lay_.sworld > 1;
  }
  bool FrozenGroup(int g) const { return g >= 0 && g < lay_.part.num_groups() && lay_.frozen(g); }
  bool behind_allowed_ = false, behind_agreed_ = false;
  std::string behind_loss_;
  bool behind_short_said_ = false;  // ApplyStep's warning that a step could not write behind, given
  Status Agree(const Status& local, const std::string& what, std::vector<int>* failed = nullptr) {
    return AgreeOverRanks(comm_, local, what, failed);
  }
  Status RecomputeP(void* buf, uint64_t buf_bytes);
  Status GatherPGroup(int g);  // state_access.cpp

  Status PrepareStep(const StepOptions& so);


  // What G's sum is divided by: world size x grad_accumulation_steps with
  // strata.grad_reduce "mean", else 1.
  double GradMeanDivisor() const {
    if (config_.strata.grad_reduce != "mean") return 1.0;
    const int world = lay_.multi ? comm_->world_size() : 1;
    return static_cast<double>(world) * static_cast<double>(options_.grad_accumulation_steps);
  }
  // Several ranks: the reduction's (GradReducer); drains its thread (wait)
  // or only looks, and a background failure breaks the engine.
  Status DrainComm(bool wait = true);
  Status AccumulateG(int group, const void* src, DType dtype, uint64_t count);
  // G of `group`, where a reduction may leave the step's first sums of it
  // (fp32, host memory) for AccumulateG to find in place; else null.
  float* SumsInG(int group) const;

  Config config_;
  EngineOptions options_;
  std::unique_ptr<net::RendezvousStore> store_;
  std::unique_ptr<net::Communicator> own_comm_;
  net::Communicator* comm_ = nullptr;
  Layout lay_;  // constant after build
  std::vector<std::vector<float>> init_;  // per group, until Build
  bool built_ = false;
  std::vector<GroupBlocks> blocks_;  // per group: its blocks in their homes (set at build)
  std::vector<GroupStep> steps_;  // per group: its part in the step in progress

  Placement placement_;  // set by Init, constant after
  ConfigFacts machine_;  // RAM, its cgroup limit, ranks_on_host: set by Init, constant after
  int cpu_mask_sharers_ = 1, cpu_limit_sharers_ = 1;  // CountCpuSharers's: set by Init, constant after
  std::unique_ptr<StatsRecorder> stats_;
  std::unique_ptr<FileStorage> storage_;
  std::unique_ptr<DeviceTier> device_;
  std::unique_ptr<HostTier> host_;
  std::unique_ptr<NvmeTier> nvme_;
  std::unique_ptr<BlockIo> io_;
  StagingPools staging_;  // the host buffers Build takes (layout/staging.h)
  std::unique_ptr<GpuUpdater> gpu_;  // the optimizer on the GPU (set at build)

  StepState step_;  // the step's standing between calls: counts, scale, pending, broken
  Status RepairStaleP();  // pending step: P of committed groups whose P store failed
  // *clipped: the clipping coefficient is below 1 (the factor on G is not
  // the one a speculation used).
  Status ScaleGradients(const StepOptions& so, StepResult* r, double* grad_scale, Status* held, bool* clipped);
  // This rank's groups' sums of squares summed over the ranks, and whether
  // all are finite.
  Status GlobalSquares(double* sum, bool* finite);
  Result<double> GradNorm();
  // `early`: the early updates' failure (not speculative: committed as they landed).
  Status ApplyStep(const StepOptions& so, double grad_scale, Status early);
  int CountCommitted() const;

  bool skips_gradless() const { return options_.skip_groups_without_grads; }
  // The update count group g's next update follows (its bias correction: + 1).
  int64_t StepsOf(int g) const { return skips_gradless() ? step_.group_steps[static_cast<size_t>(g)] : step_.applied; }
  std::unique_ptr<ShardStore> shards_;  // set at build
  // The components, set at build (residency, the reducer and the worker
  // have threads of their own).
  std::unique_ptr<PHome> p_home_;  // residency's source of P
  std::unique_ptr<Residency> residency_;
  std::unique_ptr<GradReducer> reducer_;

  std::unique_ptr<StepPipeline> pipeline_;  // set at build
  std::unique_ptr<UpdateWorker> worker_;  // overlap_step's thread (when it applies)
  std::unique_ptr<Speculation> spec_;     // overlap_step's held updates (set with worker_)
  double last_grads_s_ = -1;  // stats clock at the return of the step's last grads call (-1: none)
  uint64_t spec_disk_room_ = 0;  // swap reserved for the speculation
  // strata.speculation "auto": the room reserved when the policy first
  // speculates (ReserveSpeculationRoom), not at build; 0 once reserved or tried.
  uint64_t spec_disk_later_ = 0;
  // Whether a group's cached device copy took the step's new P (OnPStored):
  // committed P, a speculation's held P, or a discarded speculation's P
  // that only the step's replay may refresh again. Kept at the step's
  // DropDeviceCopies where it holds committed P; cleared there.
  // kMissed: a group in units whose copy did not take one unit's P.
  enum class PCopy : uint8_t { kOld, kCommitted, kHeld, kDiscarded, kMissed };
  std::vector<PCopy> p_refreshed_;
  uint64_t spec_host_later_ = 0;  // the same for the host arena (StartOverlap)
  void ReserveSpeculationRoom();
  // overlap_step with G off the CPU's reach (NVMe): a host copy of a group's
  // complete G, kept at its last grads call so that its early update does
  // not read G back from the disk (a few buffers; none free: it reads).
  // copies_mu_ guards g_copy_ (the caller's or the reduction's thread
  // keeps, the overlap thread takes and gives back).
  StagingPool g_copies_;
  std::mutex copies_mu_;
  std::vector<void*> g_copy_;  // per group, or null
  void KeepGCopy(int g, const void* G, uint64_t bytes);
  void DropGCopies();

  // overlap_step (step.cpp). At build: the speculation's room and the
  // thread. Group g's gradients are complete: its early update is queued
  // (any thread: the caller's, or the reduction's). The thread's run over
  // the queued groups. At step: the thread idle, and the early updates
  // committed, discarded (the step is skipped) or redone (replayed).
  Status StartOverlap();
  void OnGradsComplete(int g);
  // Whether g's gradients of this step are all in and its early update
  // taken (the caller's thread: grads and fetch refuse it after that).
  bool OverlapHasTaken(int g) const {
    return worker_ && step_.prepared && step_.early &&
           steps_[static_cast<size_t>(g)].handed >= options_.grad_accumulation_steps;
  }
  // `call` (grads, fetch, read_state) touches group g after OverlapHasTaken:
  // a speculative step's early updates are all undone (exact; the step then
  // updates every group after backward) and the call goes on; early updates
  // already committed (not speculative) cannot be, and the call is STATE.
  Status UndoOverlap(int g, const char* call);
  Status RunOverlap(const UpdateWorker::Next& next, std::string* broken);
  Status FinishOverlap();
  void SettleOverlap(const StepOptions& so, const StepResult& r, double grad_scale);
  // Discards the held speculation, and with it each discarded group's device
  // copy that took its speculative P (PCopy::kHeld): dropped now, so the
  // next fetch reads the restored W; or, when the step's replay follows
  // before anything can fetch (`replay`), marked kDiscarded: the replay's P
  // refreshes it again, and the step's end drops what it did not. A copy still
  // pinned breaks the engine (it cannot happen: a fetch of a taken group
  // undoes the speculation before it pins).
  void DiscardSpeculation(bool replay = false);
  // Whether the step commits what was speculated: not skipped, the same
  // factor on G (no clipping), the same options.
  bool KeepsSpeculation(const StepOptions& so, const StepResult& r, double grad_scale) const;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<ActivationStore> acts_;  // set at build
};

}  // namespace strata
