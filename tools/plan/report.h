// Output: a table for the terminal, JSON for scripts and an SVG chart of
// bytes per tier per state against each tier's capacity. Everything printed
// is a function of the inputs only, so runs give identical output.
#pragma once

#include <optional>
#include <string>

#include "engine/config/config.h"
#include "tools/plan/capacity.h"
#include "tools/plan/placement.h"
#include "tools/plan/simulator.h"

namespace strata::plan {

// The plan under the other strata.state_format, for what compact saves
// against fp32: the same placement sized and simulated, and with --auto the
// other format's own search. --auto never changes the format (compact is
// a numerical choice, within kernels/cpu/compact.h's bounds of fp32): it
// reports both, and the config it writes keeps the user's.
struct FormatComparison {
  std::string format;                // the other format: "compact" or "fp32"
  bool available = true;             // false: the config refuses it (Adagrad has no compact kernel)
  Capacity capacity;                 // the same placement in that format
  std::optional<SimResult> sim;      // when the report simulates and that capacity fits
  std::optional<AutoPlan> autoplan;  // with --auto
};

struct Report {
  ModelSpec model;
  ClusterSpec cluster;
  Layout layout;
  Config config;  // the plan's config (the --auto winner, when there is one)
  bool overlap_step = false;
  double replay_rate = kDefaultReplayRate;  // --replay-rate: of the overlapped step's speculations
  Capacity capacity;
  std::optional<SimResult> sim;
  std::optional<AutoPlan> autoplan;
  std::optional<FormatComparison> other_format;
};

// Fills r.other_format from r.config (and r.sim, r.overlap_step). `auto_base`:
// the user's config before --auto placed it (null without --auto), searched
// again under the other format with `nvme_path`.
void CompareStateFormats(Report& r, const Config* auto_base, const std::string& nvme_path);

std::string FormatTable(const Report& r);
std::string FormatJson(const Report& r);  // one JSON document
std::string FormatSvg(const Report& r);   // a standalone SVG image
// The config JSON of the plan, ready for strata-train --config.
std::string PlanConfigJson(const Report& r);

}  // namespace strata::plan
