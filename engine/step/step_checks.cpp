// The step's refusals before it changes anything: the kernels' path at
// create, finite step options, and the strata.nonfinite policy (step_checks.h).
#include "engine/step/step_checks.h"

#include <cmath>
#include <string>

#include "base/log.h"
#include "kernels/cpu/isa.h"

namespace strata {
namespace {

std::string GroupText(int group) {
  return group >= 0 ? "group " + std::to_string(group) : "a group of another rank";
}

}  // namespace

Status CheckCpuIsaVariable() {
  Result<kernels::CpuIsa> isa = kernels::ActiveCpuIsa();  // "STRATA_CPU_ISA: CPU ISA 'x' is not one of ..."
  if (isa.ok()) return Status::Ok();
  if (isa.status().code() == Code::kInvalid) return ConfigError(isa.status().message());
  return isa.status();
}

// A NaN option used to slip through `v >= 0 ? v : config` as "from the
// config"; an infinite one would write infinities into every weight.
Status CheckStepOptions(const StepOptions& so, const char* call) {
  const struct {
    const char* name;
    double value;
  } options[] = {{"lr", so.lr}, {"beta1", so.beta1}, {"beta2", so.beta2}, {"eps", so.eps},
                 {"weight_decay", so.weight_decay}, {"max_grad_norm", so.max_grad_norm}};
  for (const auto& o : options) {
    if (std::isfinite(o.value)) continue;
    return InvalidError(std::string(call) + ": step option " + o.name + " is " + (std::isnan(o.value) ? "NaN" : "infinite") +
                        "; allowed: a finite number (negative: the config's value)");
  }
  return Status::Ok();
}

// The first group whose gradients of this step are not finite, or -1 (none
// here: with several ranks the non-finite shard may be another rank's).
static int FirstNonfiniteGroup(const std::vector<GroupStep>& groups) {
  for (size_t g = 0; g < groups.size(); ++g)
    if (groups[g].grad_calls > 0 && !groups[g].finite) return static_cast<int>(g);
  return -1;
}

bool OverlapMayUpdate(const Config& config, const GroupStep& gs) {
  return gs.finite || config.strata.nonfinite == "apply";
}

// One non-finite gradient would make every later update of the master
// weights and moments NaN for good; the default holds the step back instead.
bool HoldBackNonfinite(const Config& config, const std::vector<GroupStep>& groups, bool finite, Status* error) {
  if (finite) return false;
  const std::string& policy = config.strata.nonfinite;
  if (!config.fp16.enabled && policy == "apply") return false;
  if (config.fp16.enabled) return true;  // an overflow; the scaler lowers the scale
  std::string what = "gradients of " + GroupText(FirstNonfiniteGroup(groups)) + " are not finite (NaN or infinite)";
  const std::string done = "nothing was updated";
  if (policy == "error") {
    *error = InvalidError("step: " + what + "; " + done + " (strata.nonfinite is \"error\") and this step's gradients "
                          "were dropped: hand new ones before the next step (a step now updates with none)");
    return true;
  }
  STRATA_LOG_WARN("step: {}; skipped: {} (strata.nonfinite is \"skip\")", what, done);
  return true;
}

}  // namespace strata
