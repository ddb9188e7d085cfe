// strata-train's engine config: the built-in one with --config's JSON merged
// over it, and what the trainer must know of the result — the folders the
// swap files really go to (the banner names these), the ZeRO stage, and
// whether the engine sums or averages the ranks' gradients.
#pragma once

#include <string>
#include <vector>

namespace strata::train {

struct ConfigInputs {
  double lr = 3e-3, weight_decay = 0.0, clip = 1.0;
  // --lr was given: it wins over --config's optimizer.params.lr (said in a
  // note where they differ). Not given: the config's lr is the peak.
  bool lr_given = true;
  bool fp16 = false, resident = false;
  std::string device_budget, host_budget;
  std::string nvme;         // --nvme: the swap folder; "" = a fresh one under /var/tmp when one is needed
  std::string trace;        // --trace
  std::string state_format;  // --state-format: strata.state_format ("" = the config's, else fp32)
  bool lead = true;         // rank 0; other ranks write no trace (whichever config names it)
  std::string config_path;  // --config: a JSON merged over the built-in config (RFC 7386)
  // --offload-activations ("", "host", "nvme"): the store's sizes follow the
  // model: activation_count stashes a step of activation_bytes each.
  std::string offload_activations;
  uint64_t activation_bytes = 0, activation_count = 0;
  // --device-budget, --host-budget given on the command line: they win over
  // --config's (said in a note where they differ), as --nvme, --fp16,
  // --resident, --trace and --state-format do when given.
  bool device_budget_given = false, host_budget_given = false;
  // The batch (global, and this rank's): --config's train_batch_size and
  // train_micro_batch_size_per_gpu must agree with them where set.
  int64_t batch = 0, local_batch = 0;
};

struct TrainConfig {
  std::string json;                       // for strata_engine_create
  std::vector<std::string> swap_folders;  // where the swap files go; empty: no state on NVMe
  std::string own_swap;                   // a folder made here, to remove at the end; "" when none
  int stage = -1;                         // zero_optimization.stage (absent: 0); -1 when not an integer
  bool grad_sum = false;                  // strata.grad_reduce "sum": the ranks' gradients are added
  bool compact = false;                   // strata.state_format "compact" (the banner's state bytes)
  double lr = 0;                          // the peak learning rate: --lr, else the config's (ConfigInputs::lr_given)
  std::vector<std::string> notes;         // what the lead rank says of the merge (a setting overridden)
};

// Builds the config. An offloaded section (device "nvme") without a folder of
// its own and without strata.nvme_paths gets --nvme, or a fresh folder under
// /var/tmp, made only then. The flags given win over --config (each
// difference said in a note), and every built-in value --config changes is
// said in a note too. false with `error` when --config cannot be read or
// parsed, its optimizer.params.lr is no finite number >= 0 (nor "auto")
// while --lr is not given, it asks for what strata-train does not do (a
// scheduler, gradient accumulation, a batch other than --batch's), or the
// folder cannot be made. The engine checks everything else. A section
// "auto" or null in --config is the engine's default section, as the engine
// reads it.
bool MakeTrainConfig(const ConfigInputs& in, TrainConfig* out, std::string* error);

}  // namespace strata::train
