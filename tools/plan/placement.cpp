// The --auto search.
#include "tools/plan/placement.h"

namespace strata::plan {

std::string Candidate::Label() const {
  const auto& z = config.zero;
  return "stage " + std::to_string(z.stage) + ", P " + OffloadDeviceName(z.offload_param.device) +
         ", W/M/V " + OffloadDeviceName(z.offload_optimizer.device) + (overlap_step ? ", overlap" : "");
}

Config WithPlacement(const Config& base, int stage, OffloadDevice param, OffloadDevice optimizer,
                     const std::string& nvme_path, const Layout& layout, const Capacity* capacity) {
  Config c = base;
  c.zero.stage = stage;
  c.zero.offload_param.device = param;
  c.zero.offload_optimizer.device = optimizer;
  if (param == OffloadDevice::kNvme) {
    if (c.zero.offload_param.nvme_path.empty() && c.strata.nvme_paths.empty())
      c.zero.offload_param.nvme_path = nvme_path;
    c.zero.offload_param.buffer_size = std::max(c.zero.offload_param.buffer_size, layout.largest_group);
  }
  if (optimizer == OffloadDevice::kNvme && c.zero.offload_optimizer.nvme_path.empty() &&
      c.strata.nvme_paths.empty())
    c.zero.offload_optimizer.nvme_path = nvme_path;
  if (capacity && c.strata.host_budget == 0)
    c.strata.host_budget = capacity->capacity[static_cast<size_t>(TierKind::kHost)];
  return c;
}

bool FitSpeculationDisk(const ModelSpec& model, const Layout& layout, const ClusterSpec& cluster,
                        Config* config) {
  if (config->strata.speculation_disk_bytes != StrataConfig::kSpeculationAuto) return false;
  if (ComputeCapacity(model, layout, cluster, *config, true).Fits(TierKind::kNvme)) return false;
  const Capacity plain = ComputeCapacity(model, layout, cluster, *config);
  const uint64_t used = plain.Used(TierKind::kNvme),
                 cap = plain.capacity[static_cast<size_t>(TierKind::kNvme)];
  if (used > cap) return false;  // does not fit without speculation either
  config->strata.speculation_disk_bytes = cap - used;
  // What the groups that fit there take, no more.
  config->strata.speculation_disk_bytes =
      ComputeCapacity(model, layout, cluster, *config, true).speculation.disk_granted;
  return true;
}

Result<AutoPlan> PlanAuto(const ModelSpec& model, const ClusterSpec& cluster, const Config& base,
                          const std::string& nvme_path, double replay_rate) {
  STRATA_ASSIGN_OR_RETURN(Layout layout, MakeLayout(model, static_cast<int>(cluster.world_size())));
  const OffloadDevice kDevices[] = {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme};
  AutoPlan plan;
  double best_s = 0;
  for (int stage = 0; stage <= 3; ++stage)
    for (OffloadDevice param : kDevices) {
      if (param != OffloadDevice::kNone && stage < 3) continue;  // parameter offload is a stage-3 feature
      for (OffloadDevice opt : kDevices)
        for (int overlap = 0; overlap <= 1; ++overlap) {
          Candidate c;
          c.overlap_step = overlap == 1;
          c.config = WithPlacement(base, stage, param, opt, nvme_path, layout, nullptr);
          c.capacity = ComputeCapacity(model, layout, cluster, c.config, c.overlap_step);
          c.config = WithPlacement(base, stage, param, opt, nvme_path, layout, &c.capacity);
          if (c.overlap_step && FitSpeculationDisk(model, layout, cluster, &c.config))
            c.capacity = ComputeCapacity(model, layout, cluster, c.config, true);
          if (c.capacity.Fits()) {
            c.sim = Simulate(model, layout, c.capacity, cluster, c.config,
                             {.overlap_step = c.overlap_step, .replay_rate = replay_rate});
            c.simulated = true;
            if (plan.best < 0 || c.sim.step_s < best_s) {
              plan.best = static_cast<int>(plan.candidates.size());
              best_s = c.sim.step_s;
            }
          }
          plan.candidates.push_back(std::move(c));
        }
    }
  return plan;
}

}  // namespace strata::plan
