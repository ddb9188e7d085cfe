// --auto: every placement the engine supports (stage 0-3; P on the device,
// host or NVMe in stage 3; W, M, V on the device, host or NVMe; the
// speculative overlapped step or not), sized and, where it fits, simulated;
// the fastest predicted step (with overlap: expected at the replay rate)
// wins, ties going to the simpler placement (enumerated first). An
// overlapped candidate's speculation takes its room from what the placement
// leaves in host memory and on NVMe; where that is short, fewer groups
// speculate (Capacity::speculation) and its step is slower.
#pragma once

#include <string>
#include <vector>

#include "engine/config/config.h"
#include "tools/plan/capacity.h"
#include "tools/plan/simulator.h"

namespace strata::plan {

struct Candidate {
  Config config;
  bool overlap_step = false;
  std::string activations;  // "", "host", "nvme": activation offload (WithActivationOffload)
  Capacity capacity;
  bool simulated = false;
  SimResult sim;
  std::string Label() const;  // "stage 3, P nvme, W/M/V nvme, overlap"
};

struct AutoPlan {
  std::vector<Candidate> candidates;
  int best = -1;  // index into candidates; -1 when nothing fits
};

// `nvme_path`: the swap folder written into configs that put state on NVMe
// (kept from the base config when it names one).
Result<AutoPlan> PlanAuto(const ModelSpec& model, const ClusterSpec& cluster, const Config& base,
                          const std::string& nvme_path, double replay_rate = kDefaultReplayRate);

// The overlapped step's swap room: strata.speculation_disk_bytes "auto"
// reserves what every group's speculation needs (Capacity::speculation);
// where the NVMe tier has less left, sets it to what the groups that fit in
// what is left take (fewer groups speculate). Returns whether it changed it.
bool FitSpeculationDisk(const ModelSpec& model, const Layout& layout, const ClusterSpec& cluster,
                        Config* config);

// The config with the trainer's activations offloaded `where` ("": not;
// "host": a store holding every stashable byte; "nvme": an arena of two
// layers' inputs and the rest through swap, read ahead one layer), sized as
// strata-train's --offload-activations sizes it; an NVMe store without a
// state folder gets `nvme_path` in strata.nvme_paths.
Config WithActivationOffload(const Config& base, const ModelSpec& model, const std::string& where,
                             const std::string& nvme_path);

// The config with the placement applied and the facts the engine checks at
// build (param swap buffers of a whole group, the host budget per rank).
Config WithPlacement(const Config& base, int stage, OffloadDevice param, OffloadDevice optimizer,
                     const std::string& nvme_path, const Layout& layout, const Capacity* capacity);

}  // namespace strata::plan
