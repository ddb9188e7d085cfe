// StepState: where the engine's step stands between calls — the updates
// applied, the loss scale, a step that failed part-way (pending) or cannot
// be finished (broken), and overlap_step's prepared options. Owned by the
// composition's step (engine/step.cpp); checkpoints save and restore the
// counts and the scale. No lock: the API's calls are made from one thread
// at a time. The overlap thread (UpdateWorker) only reads: prepared_opts
// while `prepared` holds (set before the first grads call of a step), and
// the counts, which only Step changes, after that thread is idle; it reports
// a step that cannot be finished through UpdateWorker::WaitIdle, never here.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "engine/config/engine_options.h"
#include "engine/step/loss_scaler.h"
#include "engine/step/speculation_policy.h"

namespace strata {

struct StepState {
  int64_t applied = 0;  // optimizer updates applied (steps_applied)
  // skip_groups_without_grads: each group's own updates (bias correction),
  // sized at build. Without it every group follows `applied`.
  std::vector<int64_t> group_steps;
  LossScaler scaler;
  // Set when a step cannot be finished (its gradients are lost, or a device
  // copy failed in place) or a load failed while writing the state: only a
  // checkpoint load brings the engine back.
  std::string broken;
  // The options of a step that failed part-way; the next Step (with these)
  // finishes it. Its norm and scale need no keeping: G and the loss scale
  // stay as they were until it is done.
  std::optional<StepOptions> pending;
  bool overlap = false;   // overlap_step applies (decided at build)
  bool prepared = false;  // prepare_step was called for the step in progress
  StepOptions prepared_opts;
  // overlap_step, this step: the early updates are speculative (held until
  // the step knows the norm: clipping, fp16 or a nonfinite policy that holds
  // back could still change them), else committed as they land; and the
  // factor on G they use (no clipping: 1 / (loss scale x mean divisor)).
  bool speculative = false;
  double spec_scale = 1.0;
  // Whether this step's groups update early at all: always when the early
  // updates are certain (not speculative); when they would be speculative,
  // as the policy decides (strata.speculation; it learns from every step).
  bool early = true;
  SpeculationPolicy policy;
  // This step's gradients include non-finite ones that the policy holds
  // back (fp16: an overflow): nothing more is worth updating early. Written
  // by the thread that completes gradients (OnGradsComplete), reset by prepare_step.
  bool doomed = false;
  int queued = 0;  // groups queued for an early update this step (same thread as doomed)
};

}  // namespace strata
