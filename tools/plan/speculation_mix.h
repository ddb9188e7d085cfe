// The overlapped step over many steps: which fraction of them speculate
// under strata.speculation (the engine's policy, engine/step/
// speculation_policy.h), and the expected step from the simulator's three
// runs of one (committed, replayed, and without speculation).
#pragma once

#include "engine/config/config.h"
#include "tools/plan/capacity.h"
#include "tools/plan/cluster.h"
#include "tools/plan/simulator.h"

namespace strata::plan {

inline StepTimes TimesOf(const SimResult& s) { return StepTimes{s.step_s, s.forward_backward_s, s.optimizer_s}; }

// The fraction of steps that speculate, with `replay_rate` (R, 0..1) the
// fraction that clip or skip, each step independently.
double SpeculatedRate(const Config& config, const ClusterSpec& cluster, const Capacity& cap, double replay_rate);

// Weights `commit` by spec (1 - R), `replay` by spec R and `plain` by
// 1 - spec: the times, the resources' busy seconds and the bytes; fetches,
// stalls and the rest are commit's (backward is the same either way), or
// plain's where none speculates (a step that writes behind does so in
// plain only). Sets the overlapped fields, not the speculation room's.
SimResult MixSteps(const SimResult& commit, const SimResult& replay, const SimResult& plain, double spec,
                   double replay_rate);

}  // namespace strata::plan
