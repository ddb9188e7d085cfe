// Engine: Strata's core. It owns the tiers and the storage, lays parameter
// groups out as sharded state blocks (P, W, M, V, G), keeps each block in its
// home tier, caches P on the device, prefetches from a recorded trace, and
// runs the optimizer over every shard as a pipeline over the tiers.
//
// The per-step protocol (what the C API wraps):
//   auto e = Engine::Create(config, {});            // config: engine/config.h
//   e->AddParam(group, "blk0.w", n, init);           // ... for every tensor
//   e->Build();
//   for each step:
//     for each group g in forward/backward order:
//       void* p = e->Fetch(g);                       // full group, compute dtype
//       ... compute ...; e->Release(g);
//       e->Grads(g, grads, DType::kF32);             // accumulated into G
//     StepResult r = e->Step(opts);                  // optimizer over all shards
//
// Thread safety: one caller thread drives an Engine; internally it uses the
// storage's I/O threads, the device tier's copy threads and a prefetch thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "engine/config/config.h"
#include "engine/config/engine_options.h"
#include "engine/layout/placement.h"
#include "engine/stats/engine_stats.h"

namespace strata {

class Engine {
 public:
  // Resolves budgets, creates the storage and the device and host tiers.
  // Errors: kConfig for contradictions, kUnsupported for features not built.
  static Result<std::unique_ptr<Engine>> Create(const Config& config, const EngineOptions& options);
  ~Engine();

  // Registers `numel` parameters named `name` in `group` (groups are numbered
  // from 0, in any order, without gaps at Build). `init` (may be null = zeros)
  // holds numel fp32 values and is copied. Returns the offset, in elements,
  // of the tensor inside its group. REQUIRES: before Build.
  Result<uint64_t> AddParam(int group, const std::string& name, uint64_t numel, const float* init);
  // AddParam with a shape (dims, outermost first; empty for a scalar), kept
  // with the tensor and recorded in checkpoints, so that strata-export writes
  // the tensor in that shape. Every dim is at least 1; the product is the
  // tensor's numel and `init`'s length. Errors (INVALID) name the tensor.
  Result<uint64_t> AddShapedParam(int group, const std::string& name, const std::vector<uint64_t>& shape,
                                  const float* init);
  // Names tensor `of` of `group` also `alias` (a tied weight used by two
  // modules): checkpoints record it, and strata-export writes the values
  // under both names. REQUIRES: before Build. Errors (INVALID) name both.
  Status AddAlias(int group, const std::string& alias, const std::string& of);
  // Marks `group` frozen (a fine-tune's base weights): it keeps P alone, in
  // the compute dtype, homed where offload_param says, and no G, W, M or V
  // anywhere; Fetch and Release work on it as on any group, Grads refuses
  // it, and Step leaves it bitwise unchanged. ReadMaster gives its P as
  // fp32, WriteState(kMaster) sets it, checkpoints save and load it. A group
  // may be frozen before its tensors are added. Idempotent.
  // REQUIRES: before Build. Errors: INVALID (group outside 0..1000000), STATE.
  Status FreezeGroup(int group);
  // Whether FreezeGroup marked `group` (false for a group never marked).
  bool group_frozen(int group) const;
  // Lays out and shards the groups, allocates every block in its home tier,
  // reserves swap space and writes the initial state. Budget contradictions
  // (a group larger than a budget) are refused here.
  Status Build();

  // Device pointer to the group's full parameters in the compute dtype,
  // valid until Release. Waits only for this group's move. The stream
  // contract is strata.h's ("Streams and lifetimes"); these C++ calls take
  // no stream: the C API waits for the caller's stream before Release and
  // Grads, and a C++ caller finishes its own device work first.
  Result<void*> Fetch(int group);
  Status Release(int group);
  // Adds the group's full gradients (`dtype` elements, on the device, and
  // complete: no copy or kernel still writing them) to its G accumulator.
  // The first call of a step overwrites. `grads` may be reused on return.
  Status Grads(int group, const void* grads, DType dtype);
  // One Grads call in parts (strata.h, strata_engine_grads_part): each part
  // written straight into G, the call complete at GradsEnd. TakesGradParts
  // says whether the group takes parts of `dtype` ("" when it does, else why
  // not: a GPU, G not in host memory, another dtype; several ranks without
  // overlap_comm or on device buffers). With several ranks the parts are of
  // the whole group, packed for the reduction, one group at a time.
  // `lend`: the engine may keep reading `grads` (strata.h,
  // strata_engine_grads_part_lend): the caller keeps it alive and unchanged
  // until the next Step or LoadCheckpoint returns, whatever its result, or
  // the engine's end.
  Status GradsPart(int group, uint64_t first, uint64_t count, const void* grads, DType dtype, bool lend = false);
  Status GradsEnd(int group);
  // Whether the engine may still read parts lent to `group` in this step
  // (strata_engine_grads_lent): false once they were copied or reduced.
  Result<bool> LentInUse(int group);
  // The loans end (strata_engine_grads_part_lend): the reductions that read
  // lent parts are waited for (a failure stays for the next step to report)
  // and what is still lent is copied in. Step and LoadCheckpoint do this as
  // they return; the C API calls it where they return before reaching them.
  void EndLoans();
  std::string WhyNoGradParts(int group, DType dtype) const;
  // This step's gradients of the group as accumulated (G: its elements in
  // G's dtype, host memory), for reading, where G is host memory and the
  // group has had a grads call this step (strata_engine_grads_view).
  Result<const void*> GradsView(int group);
  // Activations (activations/activation_store.h): Stash copies `bytes` at
  // `src` (device memory with a GPU, else host memory; complete) into the
  // store and returns a handle; Redeem copies it back into `dst` and frees
  // it; DropStash frees it unread. REQUIRES: after Build.
  Result<uint64_t> Stash(const void* src, uint64_t bytes);
  Status Redeem(uint64_t handle, void* dst, uint64_t bytes);
  Status DropStash(uint64_t handle);
  // With overlap_step: the options of the coming Step, before its first
  // Grads; Step must then be called with the same options.
  Status PrepareStep(const StepOptions& options);
  // Runs the optimizer over every shard: global norm, clipping, fp16 loss
  // scaling (skip on overflow), update of W, M, V, new P to its home.
  Result<StepResult> Step(const StepOptions& options);
  // Drops every gradient given since the last Step (a backward that failed
  // part-way, a batch to skip), as torch's zero_grad does: nothing is
  // updated (a speculative early update is discarded), the step count and
  // the loss scale stay. Several ranks: a collective, called where each
  // would call Step. STATE when an early update of this step is committed
  // already (overlap_step without speculation), or a failed step is pending.
  Status DiscardGrads();
  // The global L2 norm of this step's gradients so far, as Step will see it
  // (after strata.grad_reduce, without the fp16 loss scale); infinite when a
  // gradient is not finite. With several ranks every rank calls it, in the
  // same place of its step (a collective). Changes nothing.
  Result<double> GradNorm();

  // Checkpoints (engine/checkpoint.cpp). Save writes this rank's W, M, V,
  // the step count, the loss scaler and `blob` (the trainer's own state) to
  // DIR/TAG, a new folder (an existing TAG is refused), then points
  // DIR/latest at it; every file is fsynced and renamed into place, so a
  // crash leaves the previous or the new checkpoint whole, never a mix.
  // Load (TAG "" = latest) verifies the manifest and every checksum before
  // changing anything: a corrupt, truncated or incomplete checkpoint is a
  // CORRUPT error naming the file, and the engine is as it was.
  // REQUIRES: between steps (no fetched group, no gradients pending).
  Status SaveCheckpoint(const std::string& dir, const std::string& tag, const void* blob, uint64_t blob_bytes);
  Status LoadCheckpoint(const std::string& dir, const std::string& tag, std::vector<uint8_t>* blob);

  // The optimizer's state of a group, without padding: the fp32 master
  // weights, the first moments (exp_avg; Lion's momentum, Adagrad's sum) or
  // the second (exp_avg_sq; Adam only). Read gathers the shards when state is
  // partitioned (every rank calls it, in the same order). Write takes the
  // whole group's values (every rank passes the same), keeps this rank's
  // shard, and for the master weights refreshes P; it works between steps.
  // For trainers' own state_dict/load_state_dict.
  enum class OptimizerState { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2 };
  Status ReadState(int group, OptimizerState which, float* out);
  Status WriteState(int group, OptimizerState which, const float* in);
  // Optimizer updates applied so far (bias correction counts from it); with
  // skip_groups_without_grads every group's own count becomes `steps` too.
  Status SetStepsApplied(int64_t steps);
  // The updates applied to `group`, which its bias correction counts from:
  // steps_applied() unless skip_groups_without_grads (then only the steps in
  // which it got gradients); 0 for a frozen group. SetGroupSteps sets it
  // (between steps; INVALID without skip_groups_without_grads, where every
  // group follows steps_applied(), and for a frozen group).
  Result<int64_t> GroupSteps(int group) const;
  Status SetGroupSteps(int group, int64_t steps);

  // The fp32 master weights of a group, without padding (tests, export).
  // With several ranks and partitioned state this gathers the shards: every
  // rank must call it, in the same order.
  Status ReadMaster(int group, float* out);
  EngineStats stats() const;
  // Where this process landed (GPU, NUMA binding), decided at Create (the
  // host tier's node as of now: a binding that failed since says so);
  // DescribePlacement(placement()) says it in one line.
  Placement placement() const;
  // The trainer's own spans in the trace (strata.trace_path), beside the
  // engine's: BeginSpan returns a token for EndSpan; spans begun on one
  // thread nest (engine/stats.h says what is refused). WriteTrace writes the
  // trace file now; without a trace path it is kConfig. Thread-safe, also
  // while another thread drives the engine.
  Result<uint64_t> BeginSpan(const char* name);
  Status EndSpan(uint64_t token);
  Status WriteTrace();
  // The scale the trainer multiplies the next loss by (fp16), else 1.
  double loss_scale() const;
  int64_t steps_applied() const;  // optimizer updates so far (skipped steps excluded)
  int num_groups() const;
  uint64_t group_numel(int group) const;  // without padding
  DType compute_dtype() const;
  const Config& config() const;

  // Ranks (engine/ranks.cpp): this engine's rank and world size, and
  // values[n] := their sum over the ranks, in fp64, added in rank order so
  // that every rank gets the same bits (a trainer's loss, averaged for its
  // log). Every rank calls SumOverRanks with the same n, in the same order
  // relative to the engine's other collectives. REQUIRES: no gradients
  // pending (before a step's first Grads, or after its Step).
  int rank() const;
  int world_size() const;
  Status SumOverRanks(double* values, size_t n);

  class Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
