// What the step checks before it changes anything: the CPU kernels' path
// (STRATA_CPU_ISA), step options that are not finite, and gradients that are
// not finite (the strata.nonfinite policy).
#pragma once

#include <vector>

#include "engine/config/config.h"
#include "engine/config/engine_options.h"
#include "engine/step/group_step.h"

namespace strata {

// CONFIG naming STRATA_CPU_ISA and its allowed values when it is set to an
// unknown name; UNSUPPORTED when it names a path this CPU lacks. Every kernel
// would refuse later; the first failure used to be far from the cause.
Status CheckCpuIsaVariable();

// INVALID naming the first option (lr, beta1, beta2, eps, weight_decay,
// max_grad_norm) that is NaN or infinite; `call` ("step", "prepare_step")
// starts the message. Negative finite values keep their meaning: "from the config".
Status CheckStepOptions(const StepOptions& options, const char* call);

// Whether a step whose gradients are `finite` or not goes ahead. False: the
// update runs. True: nothing more is updated (the caller marks the step
// skipped); with fp16 it is a loss-scale overflow, silently, as DeepSpeed
// does; else strata.nonfinite says "skip" (one warning naming the first
// non-finite group) or "error" (*error set, naming it); "apply" updates with
// them. (overlap_step's early updates of a step held back are speculative:
// the step discards them.)
bool HoldBackNonfinite(const Config& config, const std::vector<GroupStep>& groups, bool finite, Status* error);
// overlap_step: whether a group whose gradients are complete may be updated
// before the step: not when they are non-finite and the policy holds back.
bool OverlapMayUpdate(const Config& config, const GroupStep& gs);

}  // namespace strata
