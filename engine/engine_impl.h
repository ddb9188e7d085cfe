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
#include "engine/layout/layout.h"
#include "engine/reduce/reducer.h"
#include "engine/residency/p_home.h"
#include "engine/residency/residency.h"
#include "engine/step/group_step.h"
#include "engine/step/gpu_update.h"
#include "engine/step/loss_scaler.h"
#include "engine/format/manifest.h"
#include "engine/layout/partition.h"
#include "engine/layout/staging.h"
#include "engine/stats/stats.h"
#include "io/net/comm.h"
#include "io/net/store.h"
#include "io/uring_storage.h"
#include "kernels/cpu/compact.h"

namespace strata {

// How far a group's update on the GPU got (UpdateOnGpu).
enum class GpuUpdateOutcome : uint8_t {
  kUntouched,  // failed before the kernel: W, M, V are as they were
  kPartial,    // failed from the kernel's launch on: W, M, V may be neither old nor new
  kUpdated,    // W, M, V are new (P may still have failed to reach its home)
};

// A shard's P (compact), W, M, V blocks where the CPU addresses them: in
// place, or in one staging slot held until destruction.
struct ShardBlocks {
  void* at[kNumStates] = {};
  void* slot = nullptr;
  StagingPool* pool = nullptr;
  ShardBlocks() = default;
  ShardBlocks(const ShardBlocks&) = delete;
  ShardBlocks& operator=(const ShardBlocks&) = delete;
  ~ShardBlocks();
};

// A shard's W, M, V in one format, for conversions: fp32 (f: W, M, V; V
// null for Lion) or compact (cs).
struct FormatView {
  bool compact = false;
  float* f[3] = {};
  kernels::CompactState cs{};
  // Array k of saved state s (0 W, 1 M, 2 V; manifest::SavedArrays' order)
  // at element `at` (a multiple of kCompactBlock for the scales); null for
  // a state not kept.
  char* Array(int s, int k, uint64_t at) const;
  FormatView Shift(uint64_t at) const;  // every array from element `at` on
};
// n elements of `from` into `to`: packs fp32 into compact, or unpacks.
Status ConvertView(const FormatView& from, const FormatView& to, uint64_t n);

class Engine::Impl {
 public:
  Impl(const Config& config, const EngineOptions& options);
  ~Impl();
  Status Init();
  Status InitRanks();
  std::string RankTracePath(const std::string& path) const;
  Status Build();
  Status BuildOnce();
  void UndoBuild();
  Status Grads(int group, const void* grads, DType dtype);
  Result<StepResult> Step(const StepOptions& options);
  Status ReadMaster(int group, float* out) { return ReadState(group, StateKind::kW, out); }
  Status ReadState(int group, StateKind kind, float* out);
  Status WriteState(int group, StateKind kind, const float* in);
  Status RecomputePGroup(int g, void* buf, uint64_t buf_bytes);
  EngineStats Stats() const;

  // state_format.cpp. strata.state_format "compact" (bf16 compute only): W's
  // block holds the master's int8 corrections, M's and V's their codes then
  // their scales, and P's block (this rank's slice of it, at PSliceOffset)
  // is the master's bf16 half: P is part of the optimizer state.
  // The compact arrays of group g's shard, from where its P, W, M, V blocks
  // are in memory (v null for Lion).
  kernels::CompactState CompactAt(int g, void* p, void* w, void* m, void* v) const;
  // This rank's shard of group g's W, M, V as fp32, whatever the format (n =
  // shard_numel floats each; v null when the optimizer keeps none).
  // Not the step's path: checkpoints, read_state, write_state, build.
  Status ReadShardF32(int g, float* w, float* m, float* v);
  // The reverse: packs (compact) or copies them into their homes; with
  // compact, P's slice too (with several ranks in stages 1-2 the caller
  // gathers the other slices).
  Status WriteShardF32(int g, const float* w, const float* m, const float* v);
  // Where group g's blocks are for the CPU: in place, or in a slot (read
  // from their homes when `load`; a P holding the whole group always is).
  Status LocateShard(int g, bool load, ShardBlocks* sb);
  // Writes the slot-staged blocks of `sb` back to their homes.
  Status StoreShard(int g, const ShardBlocks& sb);
  // What a checkpoint saves of state s (kW, kM, kV) of group g, as up to two
  // pieces in memory, from where the blocks are (`at`, by StateKind): fp32
  // the block; compact W the bf16 half (P's slice) then the corrections; a
  // frozen group's (s = kP) its slice of P (FrozenSavedBytes).
  struct Piece {
    const void* ptr;
    uint64_t bytes;
  };
  int SavedPieces(int g, int s, void* const at[kNumStates], Piece out[2]) const;
  FormatView ShardView(int g, const ShardBlocks& sb) const;  // the engine's format

  // frozen.cpp: groups marked by FreezeGroup keep P alone (block kP; no G,
  // W, M, V), never updated. Whether group g is one:
  // A frozen group's P where the CPU addresses it: in place, or in the slot
  // of frozen_staging_ (read from its home when `load`). sb->at[kP] holds
  // lay_.PHomeNumel(g) elements of the compute dtype; StoreShard writes it back.
  Status LocateFrozenP(int g, bool load, ShardBlocks* sb);
  // read_master of a frozen group: its P widened to fp32 (stage 3 with
  // several ranks: the shards gathered; every rank calls it).
  Status ReadFrozen(int g, float* out);
  // write_state(kMaster) of a frozen group: P := `in` in the compute dtype
  // (this rank's shard at stage 3, else the whole group).
  Status WriteFrozen(int g, const float* in);
  // Build, several ranks: INVALID naming the first group that some rank
  // froze and rank 0 did not (or the reverse); every rank returns an error.
  Status AgreeOnFrozen();

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

  // checkpoint.cpp (save), checkpoint_load.cpp (load)
  Status SaveCheckpoint(const std::string& dir, const std::string& tag, const void* blob, uint64_t blob_bytes);
  Status LoadCheckpoint(const std::string& dir, const std::string& tag, std::vector<uint8_t>* blob);
  // `recovers`: a checkpoint load, which may abandon a pending failed step.
  Status CheckBetweenSteps(const char* call, bool recovers = false);
  // Refuses every call but a checkpoint load on a broken engine, and the
  // calls that would mix a pending failed step with new work.
  Status CheckUsable(const char* call, bool pending_ok = true) const;
  // Ends the step (one that finished, or any after a successful load):
  // nothing pending or broken, every group's gradients and flags reset.
  void AbandonStep();
  Status Agree(const Status& local, const std::string& what);
  Result<std::string> WriteShardFile(const std::string& data_path, const std::string& name);
  Result<std::string> SnapshotShardFile(const std::string& link_path, const std::string& name);
  Status WriteManifest(const std::string& dir, const std::string& tag, const std::string& part, const void* blob,
                       uint64_t blob_bytes);
  Status ResaveExisting(const std::string& dir, const std::string& tag, const void* blob, uint64_t blob_bytes);
  Status SameStateAs(const manifest::Manifest& m, const std::string& folder);
  Status FindCheckpoint(const std::string& dir, const std::string& tag, std::string* folder, manifest::Manifest* m);
  Status CheckManifestLayout(const manifest::Manifest& m, const std::string& mpath);
  static std::string StatesOf(uint32_t bits);
  Status VerifyFile(const manifest::File& file, const std::string& folder);
  Status ApplyResharded(const manifest::Manifest& m, const std::string& folder);
  Status RecomputeP(void* buf, uint64_t buf_bytes);

  // optimizer_driver.cpp
  Status RunOptimizer(const std::vector<int>& groups, double grad_scale, const StepOptions& so, int64_t step);
  // The overlapped step's thread: updates groups whose gradients are complete.
  void StartOverlap();
  void StopOverlap();
  void EnqueueUpdate(int group);
  Status WaitOverlapIdle();
  Status PrepareStep(const StepOptions& so);

  // gpu_update.cpp: the optimizer on the GPU for W, M, V homed there.
  // Decides at build (strata.gpu_optimizer, a GPU, a CUDA twin, the budget)
  // and reserves the scratch; logs once when the CPU updates device state.
  void SetUpGpuUpdate();
  void TearDownGpuUpdate();
  bool UpdatesOnGpu(int g) const;  // this group's W, M, V are updated on the GPU, in place
  // One group's update on the GPU: `at` holds W, M, V (and P when homed on
  // the device) as device pointers, G and any other P as host memory. Returns
  // after the stream's synchronization, with *outcome saying what changed.
  Status UpdateOnGpu(int g, float* const at[kNumStates], const StepKernelOptions& ko, GpuUpdateOutcome* outcome);
  Status UpdateCompactOnGpu(int g, float* const at[kNumStates], const StepKernelOptions& ko,
                            GpuUpdateOutcome* outcome);  // UpdateOnGpu's compact case

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

  Config config_;
  EngineOptions options_;
  std::unique_ptr<net::RendezvousStore> store_;
  std::unique_ptr<net::Communicator> own_comm_;
  net::Communicator* comm_ = nullptr;
  Layout lay_;  // constant after build
  std::vector<std::vector<float>> init_;  // per group, until Build
  bool built_ = false;
  std::vector<std::array<StateBlock, kNumStates>> blocks_;  // per group: its blocks in their homes (set at build)
  std::vector<GroupStep> steps_;  // per group: its part in the step in progress

  Placement placement_;  // set by Init, constant after
  std::unique_ptr<StatsRecorder> stats_;
  std::unique_ptr<UringStorage> storage_;
  std::unique_ptr<DeviceTier> device_;
  std::unique_ptr<HostTier> host_;
  std::unique_ptr<NvmeTier> nvme_;
  std::unique_ptr<BlockIo> io_;
  StagingPool param_staging_;  // P: nvme -> host -> device
  StagingPool opt_staging_;    // W, M, V, G (and P) slots of the step pipeline
  StagingPool grad_staging_;   // G when not addressable in place, grads off the GPU
  StagingPool frozen_staging_; // a frozen group's P off the CPU's reach (build, read, write, checkpoints)
  // The GPU update (gpu_update.cpp), set at build. The scratch is used by one
  // RunOptimizer at a time (the overlap thread's, or Step's after
  // WaitOverlapIdle), one group at a time: each update ends synchronized.
  bool gpu_update_ = false;
  Allocation gpu_scratch_;  // device: one shard's G, then (P homed elsewhere, bf16/fp16) its new P
  GpuScratchPlan gpu_scratch_plan_;
  gpu::Stream gpu_stream_ = nullptr;  // the kernels' stream

  // Set when a step cannot be finished (its gradients are lost, or a device
  // copy failed in place) or a load failed while writing the state: only a
  // checkpoint load brings the engine back.
  std::string broken_;
  // The options of a step that failed part-way; the next Step (with these)
  // finishes it. Its norm and scale need no keeping: G and the loss scale
  // stay as they were until it is done.
  std::optional<StepOptions> pending_;
  Status RepairStaleP();  // pending step: P of committed groups whose P store failed
  Status ScaleGradients(const StepOptions& so, StepResult* r, double* grad_scale, Status* held);
  // This rank's groups' sums of squares summed over the ranks, and whether
  // all are finite.
  Status GlobalSquares(double* sum, bool* finite);
  Result<double> GradNorm();
  Status ApplyStep(const StepOptions& so, double grad_scale);
  int CountCommitted() const;

  LossScaler scaler_;
  int64_t step_count_ = 0;  // optimizer updates applied
  // skip_groups_without_grads: each group's own updates (bias correction),
  // sized at build. Without it every group follows step_count_.
  std::vector<int64_t> group_steps_;
  bool skips_gradless() const { return options_.skip_groups_without_grads; }
  // The update count group g's next update follows (its bias correction: + 1).
  int64_t StepsOf(int g) const { return skips_gradless() ? group_steps_[static_cast<size_t>(g)] : step_count_; }
  // The components with threads of their own (set at build).
  std::unique_ptr<PHome> p_home_;
  std::unique_ptr<Residency> residency_;
  std::unique_ptr<GradReducer> reducer_;

  bool overlap_ = false;
  bool prepared_ = false;
  StepOptions prepared_opts_;
  std::mutex overlap_mu_;  // guards overlap_queue_, overlap_busy_, overlap_error_, overlap_stop_
  std::condition_variable overlap_cv_;
  std::deque<int> overlap_queue_;
  bool overlap_busy_ = false, overlap_stop_ = false;
  Status overlap_error_;
  std::thread overlap_thread_;
};

}  // namespace strata
