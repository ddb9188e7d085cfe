// Output: a table for the terminal, JSON for scripts and an SVG chart of
// bytes per tier per state against each tier's capacity. Everything printed
// is a function of the inputs only, so runs give identical output.
#pragma once

#include <optional>
#include <string>

#include "engine/config.h"
#include "tools/plan/capacity.h"
#include "tools/plan/placement.h"
#include "tools/plan/simulator.h"

namespace strata::plan {

struct Report {
  ModelSpec model;
  ClusterSpec cluster;
  Layout layout;
  Config config;  // the plan's config (the --auto winner, when there is one)
  bool overlap_step = false;
  Capacity capacity;
  std::optional<SimResult> sim;
  std::optional<AutoPlan> autoplan;
};

std::string FormatTable(const Report& r);
std::string FormatJson(const Report& r);  // one JSON document
std::string FormatSvg(const Report& r);   // a standalone SVG image
// The config JSON of the plan, ready for strata-train --config.
std::string PlanConfigJson(const Report& r);

}  // namespace strata::plan
