// SpeculatedRate and MixSteps (speculation_mix.h).
#include "tools/plan/speculation_mix.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

namespace strata::plan {

// Which steps speculate: strata.speculation, with R the fraction of steps
// that clip or skip, each step independently. "always": every step, so R
// of them replay. "never": none (they run as without overlap). "auto"
// (engine/step/speculation_policy.h): a step speculates when the last one
// was kept and at most one of the three before it was not, with
// probability S = (1 - R) ((1 - R)^3 + 3 R (1 - R)^2); of those, R replay.
// Without a GPU, with W, M, V in host memory, "auto" never speculates (the
// engine's StartOverlap: its backups would cost what the update does), nor
// where the step writes behind.
double SpeculatedRate(const Config& config, const ClusterSpec& cluster, const Capacity& cap, double replay_rate) {
  const double rr = replay_rate;
  const std::string& policy = config.strata.speculation;
  if (policy == "never") return 0.0;
  if (policy != "auto") return 1.0;
  if (!cluster.has_gpu && HomesOf(config, cluster, cap.g_on_host).opt != TierKind::kNvme) return 0.0;
  if (cap.writes_behind) return 0.0;  // (StartOverlap: where the step writes behind, its writes are hidden without speculation)
  return (1 - rr) * (std::pow(1 - rr, 3) + 3 * rr * std::pow(1 - rr, 2));
}

SimResult MixSteps(const SimResult& commit, const SimResult& replay, const SimResult& plain, double spec,
                   double replay_rate) {
  const double rr = replay_rate;
  const double w_commit = spec * (1 - rr), w_replay = spec * rr, w_plain = 1 - spec;
  const auto mix3 = [&](double a, double b, double c) { return w_commit * a + w_replay * b + w_plain * c; };
  const auto mix_bytes = [&](uint64_t a, uint64_t b, uint64_t c) {
    return static_cast<uint64_t>(mix3(static_cast<double>(a), static_cast<double>(b), static_cast<double>(c)) + 0.5);
  };
  SimResult r = spec > 0 ? commit : plain;
  r.step_s = mix3(commit.step_s, replay.step_s, plain.step_s);
  r.forward_backward_s = mix3(commit.forward_backward_s, replay.forward_backward_s, plain.forward_backward_s);
  r.optimizer_s = mix3(commit.optimizer_s, replay.optimizer_s, plain.optimizer_s);
  for (size_t i = 0; i < r.busy_s.size(); ++i) r.busy_s[i] = mix3(commit.busy_s[i], replay.busy_s[i], plain.busy_s[i]);
  r.bound = SimResource(std::max_element(r.busy_s.begin(), r.busy_s.end()) - r.busy_s.begin());
  r.disk_read_bytes = mix_bytes(commit.disk_read_bytes, replay.disk_read_bytes, plain.disk_read_bytes);
  r.disk_write_bytes = mix_bytes(commit.disk_write_bytes, replay.disk_write_bytes, plain.disk_write_bytes);
  r.pcie_bytes = mix_bytes(commit.pcie_bytes, replay.pcie_bytes, plain.pcie_bytes);
  r.network_bytes = mix_bytes(commit.network_bytes, replay.network_bytes, plain.network_bytes);
  r.plain = plain.plain;
  r.overlapped = true;
  r.replay_rate = rr;
  r.speculated_rate = spec;
  r.committed = TimesOf(commit);
  r.replayed = TimesOf(replay);
  return r;
}

}  // namespace strata::plan
