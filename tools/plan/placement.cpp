// The --auto search.
#include "tools/plan/placement.h"

namespace strata::plan {

std::string Candidate::Label() const {
  const auto& z = config.zero;
  return "stage " + std::to_string(z.stage) + ", P " + OffloadDeviceName(z.offload_param.device) +
         ", W/M/V " + OffloadDeviceName(z.offload_optimizer.device) + (overlap_step ? ", overlap" : "") +
         (activations.empty() ? "" : ", activations " + activations);
}

Config WithActivationOffload(const Config& base, const ModelSpec& model, const std::string& where,
                             const std::string& nvme_path) {
  Config c = base;
  if (where.empty()) return c;
  uint64_t layer = 0;
  const uint64_t all = StashableActivationBytes(model, &layer);
  if (where == "host") {
    c.strata.activation_host_bytes = all;
    return c;
  }
  c.strata.activation_host_bytes = 2 * layer;
  c.strata.activation_prefetch_bytes = layer;
  c.strata.activation_nvme_bytes = all;
  // The store's swap goes where the state's does, else to strata.nvme_paths.
  const auto& z = c.zero;
  const bool state_folder = (z.offload_param.device == OffloadDevice::kNvme && !z.offload_param.nvme_path.empty()) ||
                            (z.offload_optimizer.device == OffloadDevice::kNvme && !z.offload_optimizer.nvme_path.empty());
  if (!state_folder && c.strata.nvme_paths.empty() && !nvme_path.empty()) c.strata.nvme_paths = {nvme_path};
  return c;
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
  // Activation offload (the trainer's saved activations in the engine's
  // store, sized as strata-train's --offload-activations sizes it) is a
  // choice too where the activations are the device's (a GPU, a model with
  // a shape) and the base config has no store of its own.
  std::vector<std::string> activations = {""};
  if (cluster.has_gpu && model.hidden > 0 && base.strata.activation_host_bytes == 0)
    activations = {"", "host", "nvme"};
  AutoPlan plan;
  double best_s = 0;
  for (int stage = 0; stage <= 3; ++stage)
    for (OffloadDevice param : kDevices) {
      if (param != OffloadDevice::kNone && stage < 3) continue;  // parameter offload is a stage-3 feature
      for (OffloadDevice opt : kDevices) {
        // Activation offload is tried where the placement does not fit
        // without it: where it fits, offload only adds copies (and takes
        // host memory that speculation and prefetch would use).
        bool fits_without[2] = {false, false};
        for (const std::string& acts : activations)
        for (int overlap = 0; overlap <= 1; ++overlap) {
          if (!acts.empty() && fits_without[overlap]) continue;
          Candidate c;
          c.overlap_step = overlap == 1;
          c.activations = acts;
          c.config = WithActivationOffload(WithPlacement(base, stage, param, opt, nvme_path, layout, nullptr), model,
                                           acts, nvme_path);
          c.capacity = ComputeCapacity(model, layout, cluster, c.config, c.overlap_step);
          c.config = WithActivationOffload(WithPlacement(base, stage, param, opt, nvme_path, layout, &c.capacity),
                                           model, acts, nvme_path);
          if (c.overlap_step && FitSpeculationDisk(model, layout, cluster, &c.config))
            c.capacity = ComputeCapacity(model, layout, cluster, c.config, true);
          if (acts.empty()) fits_without[overlap] = c.capacity.Fits();
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
    }
  return plan;
}

}  // namespace strata::plan
