// Preflight: what Create, Build, PrepareStep and Step check before they change
// anything — the CPU kernels' path (STRATA_CPU_ISA), the host memory Build
// will take, step options that are not finite, and gradients that are not
// finite (the strata.nonfinite policy). Internal to engine/.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/layout/block_io.h"
#include "engine/engine.h"

namespace strata {

struct GroupState;

// CONFIG naming STRATA_CPU_ISA and its allowed values when it is set to an
// unknown name; UNSUPPORTED when it names a path this CPU lacks. Every kernel
// would refuse later; the first failure used to be far from the cause.
Status CheckCpuIsaVariable();

// The host staging pools Build allocates (engine/staging.h), sized in one
// place so that the check at Build's start and the allocation agree.
struct StagingSizes {
  uint64_t opt_offsets[kNumStates + 1] = {};  // of each state in a step slot; [kNumStates]: slot bytes
  int opt_slots = 0;                          // 0: every state is addressed in place
  int param_slots = 0;
  uint64_t param_bytes = 0;
  int grad_slots = 0;
  uint64_t grad_bytes = 0;
  // A frozen group's P off the CPU's reach (NVMe, a GPU): one buffer of the
  // largest, for build, read_master, write_state and checkpoints.
  int frozen_slots = 0;
  uint64_t frozen_bytes = 0;
};

// Which states the optimizer keeps (V: Adam only), and the bytes of state s
// of group g on this rank (P: whole group or this rank's shard; else a shard).
bool StateUsed(const Engine::Impl& m, int s);
// Whether group g has a block of state s: a frozen group keeps P alone.
bool StateUsedBy(const Engine::Impl& m, int s, int g);
uint64_t StateBytes(const Engine::Impl& m, int s, int g);
// Whether state s has a region in the step's staging slots.
bool StagedInSlot(const Engine::Impl& m, int s, bool gpu);
// Slots of the step's pipeline: offload_optimizer.buffer_count, at least 3
// (read ahead, update, write behind), at most 16.
int StepSlots(const Config& c);

// The pools' sizes; `padded` is the NVMe tier's padding of a block's bytes.
// The step's slots, G's staging and the reduction's buffers are sized by
// the groups that train; frozen groups count only in P's fetch staging and
// their own buffer.
StagingSizes PlanStaging(const Engine::Impl& m, const std::function<uint64_t(uint64_t)>& padded);

// At Build's start, with homes chosen and nothing allocated: CONFIG naming
// strata.host_budget, the least host memory Build needs and what for, when
// the budget cannot hold the host-homed blocks and the staging pools.
Status CheckHostPlan(const Engine::Impl& m);

// INVALID naming the first option (lr, beta1, beta2, eps, weight_decay) that
// is NaN or infinite; `call` ("step", "prepare_step") starts the message.
// Negative finite values keep their meaning: "from the config".
Status CheckStepOptions(const StepOptions& options, const char* call);

// Whether a step whose gradients are `finite` or not goes ahead. False: the
// update runs. True: nothing more is updated (the caller marks the step
// skipped); with fp16 it is a loss-scale overflow, silently, as DeepSpeed
// does; else strata.nonfinite says "skip" (one warning naming the first
// non-finite group) or "error" (*error set, naming it); "apply" updates with
// them. Waits for the overlapped updates (overlap_step) before it holds back.
bool HoldBackNonfinite(Engine::Impl& m, bool finite, Status* error);
// overlap_step: whether a group whose gradients are complete may be updated
// before the step: not when they are non-finite and the policy holds back.
bool OverlapMayUpdate(const Engine::Impl& m, const GroupState& gs);

}  // namespace strata
