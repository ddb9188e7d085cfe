// The engine's options at create (EngineOptions) and at each step
// (StepOptions, StepResult): the values the API passes, below every
// component (engine.h's Engine takes and returns them).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "base/dtype.h"

namespace strata {

namespace net {
class Communicator;
}
class FaultPlan;

struct EngineOptions {
  // Ranks: world_size 1 runs alone; world_size > 1 (or 0: "from the
  // environment", torchrun / OpenMPI / Slurm variables) opens the rendezvous
  // store and a communicator (Gloo on CPUs) unless `comm` is given. Stages
  // 0-3 partition state as ZeRO does (zero_optimization.stage).
  int rank = 0;
  int world_size = 1;
  net::Communicator* comm = nullptr;  // optional, caller-owned, outlives the engine
  int grad_accumulation_steps = 1;  // Grads calls per group per step (for the overlapped step)
  bool force_no_gpu = false;        // tests: the device tier is a host arena even with a GPU
  // Tests without a GPU: the step takes the GPU optimizer's path (gpu_update.h:
  // G to a device scratch, P through it) on the host arena, the CPU kernels
  // standing in for the CUDA ones. No effect with a GPU.
  bool gpu_optimizer_twin = false;
  // The GPU this process drives (one process per GPU): -1, the launcher's
  // local rank (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID; 0
  // without a launcher); else that index. An index past the last GPU is
  // refused at Create naming both numbers; without a GPU it does not matter.
  int device = -1;
  // Update each group as soon as its gradients are complete (after
  // grad_accumulation_steps Grads calls), overlapping the rest of backward.
  // Needs gradient_clipping 0 and no fp16 (else it is off, with a warning),
  // and PrepareStep before the step's first Grads. Bitwise the same result.
  bool overlap_step = false;
  // A group that got no gradients in a step (no Grads call): false (the
  // default, as DeepSpeed's flat optimizer) updates it as with zero
  // gradients (its moments decay, weight decay applies); true leaves it
  // untouched, W, M, V and P bitwise as they were, as torch's optimizers
  // skip a parameter whose .grad is None. Each group then counts its own
  // updates for bias correction (group_steps), saved in checkpoints.
  bool skip_groups_without_grads = false;
  // Tests: faults injected into the storage's completions (io/fault.h).
  std::shared_ptr<FaultPlan> faults;
};

// Options that may change every step. Negative means "from the config"; zero
// is zero; NaN and infinities are refused (INVALID naming the option).
struct StepOptions {
  double lr = -1;
  double beta1 = -1, beta2 = -1;
  double eps = -1;
  double weight_decay = -1;
  // Clip the global gradient norm to this (torch's clip_grad_norm_, after
  // strata.grad_reduce); 0: no clipping; negative: the config's
  // gradient_clipping.
  double max_grad_norm = -1;
};

// Whether two steps get the same options, bit for bit; `with_clip` false
// leaves max_grad_norm out (what the update itself depends on, the factor
// on G aside).
inline bool SameStepOptions(const StepOptions& a, const StepOptions& b, bool with_clip = true) {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
         a.weight_decay == b.weight_decay && (!with_clip || a.max_grad_norm == b.max_grad_norm);
}

struct StepResult {
  double grad_norm = 0;  // global L2 norm of the (unscaled) gradients
  bool skipped = false;  // nothing was updated: fp16 overflow, or non-finite gradients (strata.nonfinite "skip")
  double loss_scale = 1;  // the scale to multiply the next loss by (fp16), else 1
};

}  // namespace strata
