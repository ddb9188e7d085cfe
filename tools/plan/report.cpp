// The table and the JSON document.
#include "tools/plan/report.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "base/sizes.h"

namespace strata::plan {

namespace {

std::string Fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string Count(double n) {
  if (n >= 1e12) return Fmt("%.3f T", n / 1e12);
  if (n >= 1e9) return Fmt("%.2f G", n / 1e9);
  if (n >= 1e6) return Fmt("%.2f M", n / 1e6);
  return Fmt("%.0f", n);
}

std::string Cell(uint64_t bytes) { return bytes ? FormatBytes(bytes) : "-"; }

std::string Pad(const std::string& s, size_t w) {
  return s.size() >= w ? s + " " : s + std::string(w - s.size(), ' ');
}

const char* Where(OffloadDevice d) {
  return d == OffloadDevice::kNone ? "device" : d == OffloadDevice::kCpu ? "host" : "nvme";
}

std::string Header(const Report& r) {
  const auto& c = r.cluster;
  std::string s = "model " + r.model.name + ": " + Count(static_cast<double>(r.layout.full_numel)) +
                  " parameters in " + std::to_string(r.layout.group_numel.size()) + " groups (largest " +
                  Count(static_cast<double>(r.layout.largest_group)) + "); seq " +
                  std::to_string(r.model.seq) + ", micro-batch " + std::to_string(r.model.micro_batch) +
                  (r.model.checkpointing ? ", activation checkpointing\n" : ", no checkpointing\n");
  s += "cluster " + c.name + ": " + std::to_string(c.nodes) + " node(s) x " +
       std::to_string(c.gpus_per_node) +
       (c.has_gpu ? " GPUs of " + FormatBytes(c.device_bytes) : " ranks without a GPU") + ", host " +
       FormatBytes(c.host_bytes) + ", NVMe " + std::to_string(c.nvme_drives) + " x " +
       FormatBytes(c.nvme_drive_bytes) + " per node (world " + std::to_string(c.world_size()) + ")\n";
  const auto& z = r.config.zero;
  s += std::string("placement: stage ") + std::to_string(z.stage) + ", P on " +
       Where(z.offload_param.device) + ", W/M/V on " + Where(z.offload_optimizer.device) + " (" +
       r.config.strata.state_format + "), " + DTypeName(r.config.compute_dtype()) + ", " +
       r.config.optimizer.type + (r.overlap_step ? ", overlapped step" : "") + "\n";
  return s;
}

std::string CapacityTable(const Capacity& cap, uint32_t ranks) {
  std::string s =
      "\n" + Pad("bytes per rank", 16) + Pad("device", 14) + Pad("host", 14) + Pad("nvme", 14) + "\n";
  for (int st = 0; st < kNumPlanStates; ++st) {
    const auto& row = cap.bytes[static_cast<size_t>(st)];
    if (PlanState(st) == PlanState::kSpeculation &&
        std::all_of(row.begin(), row.end(), [](uint64_t b) { return b == 0; }))
      continue;  // no overlapped step (or nothing granted): no row
    s += Pad(PlanStateName(PlanState(st)), 16);
    for (int t = 0; t < kNumTiers; ++t)
      s += Pad(Cell(cap.bytes[static_cast<size_t>(st)][static_cast<size_t>(t)]), 14);
    s += std::string("  ") + PlanStateDescription(PlanState(st)) + "\n";
  }
  std::string used = Pad("total", 16), avail = Pad("available", 16), fits = Pad("fits", 16),
              node = Pad("per node", 16);
  for (int t = 0; t < kNumTiers; ++t) {
    used += Pad(FormatBytes(cap.Used(TierKind(t))), 14);
    avail += Pad(FormatBytes(cap.capacity[static_cast<size_t>(t)]), 14);
    fits += Pad(cap.Fits(TierKind(t)) ? "yes" : "NO", 14);
    node += Pad(t == 0 ? "-" : FormatBytes(cap.Used(TierKind(t)) * ranks), 14);
  }
  s += used + "\n" + avail + "\n" + node + "\n" + fits + "\n";
  if (cap.write_behind_slots > 0)
    s += "staging includes " + std::to_string(cap.write_behind_slots) +
         " step slots that strata.write_behind adds from the host budget's rest, so that the step returns "
         "before its W, M, V are written\n";
  else if (cap.writes_behind)
    s += "the step slots hold every unit's W, M, V: the step returns before they are written (strata.write_behind)\n";
  s += cap.Fits() ? "=> fits\n" : "=> does not fit:";
  for (const auto& p : cap.Problems()) s += " " + p + ";";
  if (!cap.Fits()) s += "\n";
  return s;
}

// The compute resource is the GPU, or on a machine without one the CPU
// layers: a plan names only resources that exist.
const char* ResourceName(SimResource r, bool has_gpu) {
  return r == SimResource::kGpu && !has_gpu ? "cpu_layers" : SimResourceName(r);
}

std::string Pct(double f) { return Fmt("%.0f%%", 100 * f); }

// The overlapped step beside the step without it: exposed (end of backward to
// the return of step) and iteration times, the replay rate they assume, and
// the memory speculation takes.
std::string OverlapText(const SimResult& sim) {
  std::string s = "overlapped step (speculative), replay rate " + Fmt("%g", sim.replay_rate) + ", speculation " +
                  sim.speculation + " (speculates " + Pct(sim.speculated_rate) + " of steps): exposed " +
                  Fmt("%.3f s", sim.optimizer_s) + ", iteration " + Fmt("%.3f s", sim.step_s) +
                  " (committed: exposed " + Fmt("%.3f s", sim.committed.exposed_s) + ", iteration " +
                  Fmt("%.3f s", sim.committed.iteration_s) + "; replayed: exposed " +
                  Fmt("%.3f s", sim.replayed.exposed_s) + ", iteration " +
                  Fmt("%.3f s", sim.replayed.iteration_s) + ")\n";
  s += "without overlap: exposed " + Fmt("%.3f s", sim.plain.exposed_s) + ", iteration " +
       Fmt("%.3f s", sim.plain.iteration_s) + "\n";
  s += "speculation: " + std::to_string(sim.speculated_groups) + " of " + std::to_string(sim.groups) +
       " groups update during backward (" + Pct(sim.speculated_fraction) + " of the bytes they need)";
  if (sim.spec_host_needed || sim.spec_host_bytes)
    s += "; host backups " + FormatBytes(sim.spec_host_bytes) + " reserved of " +
         FormatBytes(sim.spec_host_needed) + " needed per rank";
  if (sim.spec_disk_needed || sim.spec_disk_bytes)
    s += "; nvme old extents " + FormatBytes(sim.spec_disk_bytes) + " reserved of " +
         FormatBytes(sim.spec_disk_needed) + " needed per rank";
  if (sim.spec_groups_eligible == 0)
    s += "; the GPU updates W, M, V in place: every group updates after backward";
  return s + "\n";
}

std::string SimText(const SimResult& sim, bool has_gpu) {
  std::string s = "\nsimulated step: " + Fmt("%.3f s", sim.step_s) + " (forward+backward " +
                  Fmt("%.3f s", sim.forward_backward_s) + ", step after backward " +
                  Fmt("%.3f s", sim.optimizer_s) + "); bound by " + ResourceName(sim.bound, has_gpu) + "\n";
  s += "busy per rank:";
  for (int i = 0; i < kNumSimResources; ++i)
    s += std::string(" ") + ResourceName(SimResource(i), has_gpu) + " " +
         Fmt("%.3f s", sim.busy_s[static_cast<size_t>(i)]) +
         Fmt(" (%.0f%%)", sim.step_s > 0 ? 100 * sim.busy_s[static_cast<size_t>(i)] / sim.step_s : 0) +
         (i + 1 < kNumSimResources ? "," : "\n");
  if (sim.overlapped) s += OverlapText(sim);
  s += "moved per rank: disk read " + FormatBytes(sim.disk_read_bytes) + ", disk write " +
       FormatBytes(sim.disk_write_bytes) + ", pcie " + FormatBytes(sim.pcie_bytes) + ", network " +
       FormatBytes(sim.network_bytes) + "\n";
  if (sim.fetches)
    s += "fetches " + std::to_string(sim.fetches) + ", prefetch hits " + std::to_string(sim.prefetch_hits) +
         ", stalls " + std::to_string(sim.stalls) + Fmt(" (%.3f s)", sim.stall_s) + ", evictions " +
         std::to_string(sim.evictions) + "\n";
  if (sim.act_bytes)
    s += "activations: " + FormatBytes(sim.act_bytes) + " stashed a step, " + FormatBytes(sim.act_nvme_bytes) +
         " of them through NVMe; " + std::to_string(sim.act_stalls) + " redeems waited" +
         Fmt(" (%.3f s)", sim.act_stall_s) + "\n";
  return s;
}

double Saved(double fp32, double compact) { return fp32 > 0 ? 100 * (fp32 - compact) / fp32 : 0; }

// What compact saves against fp32 (rows read fp32 -> compact whichever the
// plan's format is): each tier whose bytes differ, the step, and --auto's
// pick under the other format.
std::string FormatText(const Report& r) {
  const FormatComparison& o = *r.other_format;
  const std::string& mine = r.config.strata.state_format;
  if (!o.available)
    return "\nstate format " + mine + " (" + o.format + " is refused with " + r.config.optimizer.type + ")\n";
  const bool compact = mine == "compact";
  std::string s = "\nstate format " + mine + "; " +
                  (compact ? std::string("against fp32")
                           : std::string(R"(compact ("strata": {"state_format": "compact"}))")) +
                  " at this placement, fp32 -> compact:\n";
  const Capacity& f = compact ? o.capacity : r.capacity;
  const Capacity& c = compact ? r.capacity : o.capacity;
  for (int t = 0; t < kNumTiers; ++t) {
    const uint64_t a = f.Used(TierKind(t)), b = c.Used(TierKind(t));
    if (a == b) continue;
    const uint64_t ranks = r.cluster.gpus_per_node;
    s += "  " + Pad(std::string(TierName(TierKind(t))) + " per rank", 16) + FormatBytes(a) + " -> " +
         FormatBytes(b) +
         (t == 0 ? "" : " (per node " + FormatBytes(a * ranks) + " -> " + FormatBytes(b * ranks) + ")") +
         Fmt(", saves %.0f%%", Saved(static_cast<double>(a), static_cast<double>(b)));
    if (!f.Fits(TierKind(t)) || !c.Fits(TierKind(t)))
      s += std::string(" (") + (f.Fits(TierKind(t)) ? "compact" : "fp32") + " does not fit)";
    s += "\n";
  }
  if (r.sim && o.sim) {
    const double a = compact ? o.sim->step_s : r.sim->step_s, b = compact ? r.sim->step_s : o.sim->step_s;
    s += "  " + Pad("step", 16) + Fmt("%.3f s", a) + " -> " + Fmt("%.3f s", b) +
         Fmt(", saves %.0f%%", Saved(a, b)) + "; " + o.format + " bound by " +
         ResourceName(o.sim->bound, r.cluster.has_gpu) + "\n";
  }
  if (o.autoplan) {
    s += "  --auto with " + o.format + ": ";
    if (o.autoplan->best < 0) {
      s += "nothing fits\n";
    } else {
      const Candidate& b = o.autoplan->candidates[static_cast<size_t>(o.autoplan->best)];
      s += b.Label() + Fmt(", %.3f s/step", b.sim.step_s) + "\n";
    }
  }
  return s;
}

nlohmann::ordered_json FormatJsonOf(const Report& r) {
  const FormatComparison& o = *r.other_format;
  nlohmann::ordered_json j = {{"format", r.config.strata.state_format}};
  nlohmann::ordered_json other = {{"format", o.format}, {"available", o.available}};
  if (o.available) {
    for (int t = 0; t < kNumTiers; ++t) other["used"][TierName(TierKind(t))] = o.capacity.Used(TierKind(t));
    other["fits"] = o.capacity.Fits();
    if (o.sim) other["step_s"] = o.sim->step_s;
    if (o.autoplan && o.autoplan->best >= 0) {
      const Candidate& b = o.autoplan->candidates[static_cast<size_t>(o.autoplan->best)];
      other["auto"] = {{"placement", b.Label()}, {"step_s", b.sim.step_s}};
    } else if (o.autoplan) {
      other["auto"] = nullptr;
    }
  }
  j["other"] = other;
  return j;
}

nlohmann::ordered_json CapacityJson(const Capacity& cap) {
  nlohmann::ordered_json j;
  for (int t = 0; t < kNumTiers; ++t) {
    nlohmann::ordered_json tier;
    for (int st = 0; st < kNumPlanStates; ++st)
      tier["bytes"][PlanStateName(PlanState(st))] =
          cap.bytes[static_cast<size_t>(st)][static_cast<size_t>(t)];
    tier["used"] = cap.Used(TierKind(t));
    tier["capacity"] = cap.capacity[static_cast<size_t>(t)];
    tier["fits"] = cap.Fits(TierKind(t));
    j["per_rank"][TierName(TierKind(t))] = tier;
  }
  j["write_behind_slots"] = cap.write_behind_slots;
  j["writes_behind"] = cap.writes_behind;
  j["fits"] = cap.Fits();
  return j;
}

nlohmann::ordered_json SimJson(const SimResult& s, bool has_gpu) {
  nlohmann::ordered_json j;
  j["step_s"] = s.step_s;
  j["forward_backward_s"] = s.forward_backward_s;
  j["step_after_backward_s"] = s.optimizer_s;
  j["exposed_s"] = s.optimizer_s;
  j["without_overlap"] = {{"iteration_s", s.plain.iteration_s},
                          {"forward_backward_s", s.plain.forward_backward_s},
                          {"exposed_s", s.plain.exposed_s}};
  if (s.overlapped) {
    const auto times = [](const StepTimes& t) {
      return nlohmann::ordered_json{{"iteration_s", t.iteration_s},
                                    {"forward_backward_s", t.forward_backward_s},
                                    {"exposed_s", t.exposed_s}};
    };
    j["overlap"] = {{"replay_rate", s.replay_rate},
                    {"speculation", s.speculation},
                    {"speculated_rate", s.speculated_rate},
                    {"iteration_s", s.step_s},
                    {"exposed_s", s.optimizer_s},
                    {"committed", times(s.committed)},
                    {"replayed", times(s.replayed)},
                    {"groups", s.groups},
                    {"speculated_groups", s.speculated_groups},
                    {"eligible_groups", s.spec_groups_eligible},
                    {"speculated_fraction", s.speculated_fraction},
                    {"host_bytes", s.spec_host_bytes},
                    {"host_bytes_needed", s.spec_host_needed},
                    {"disk_bytes", s.spec_disk_bytes},
                    {"disk_bytes_needed", s.spec_disk_needed}};
  }
  j["bound"] = ResourceName(s.bound, has_gpu);
  for (int i = 0; i < kNumSimResources; ++i)
    j["busy_s"][ResourceName(SimResource(i), has_gpu)] = s.busy_s[static_cast<size_t>(i)];
  j["moved_bytes"] = {{"disk_read", s.disk_read_bytes},
                      {"disk_write", s.disk_write_bytes},
                      {"pcie", s.pcie_bytes},
                      {"network", s.network_bytes}};
  j["fetches"] = s.fetches;
  j["prefetch_hits"] = s.prefetch_hits;
  j["stalls"] = s.stalls;
  j["stall_s"] = s.stall_s;
  j["evictions"] = s.evictions;
  j["activations"] = {{"stashed_bytes", s.act_bytes},
                      {"nvme_bytes", s.act_nvme_bytes},
                      {"stalls", s.act_stalls},
                      {"stall_s", s.act_stall_s}};
  return j;
}

}  // namespace

std::string PlanConfigJson(const Report& r) { return ConfigToJson(r.config); }

void CompareStateFormats(Report& r, const Config* auto_base, const std::string& nvme_path) {
  FormatComparison o;
  o.format = r.config.strata.state_format == "compact" ? "fp32" : "compact";
  o.available = !(o.format == "compact" && r.config.optimizer.type == "adagrad");
  if (o.available) {
    Config other = r.config;
    other.strata.state_format = o.format;
    if (auto_base && r.overlap_step) {  // --auto sized the swap room for the plan's format: size it again
      other.strata.speculation_disk_bytes = auto_base->strata.speculation_disk_bytes;
      FitSpeculationDisk(r.model, r.layout, r.cluster, &other);
    }
    o.capacity = ComputeCapacity(r.model, r.layout, r.cluster, other, r.overlap_step);
    if (r.sim && o.capacity.Fits())
      o.sim = Simulate(r.model, r.layout, o.capacity, r.cluster, other,
                       {.overlap_step = r.overlap_step, .replay_rate = r.replay_rate});
    if (auto_base) {
      Config base = *auto_base;
      base.strata.state_format = o.format;
      auto a = PlanAuto(r.model, r.cluster, base, nvme_path, r.replay_rate);
      if (a.ok()) o.autoplan = std::move(*a);
    }
  }
  r.other_format = std::move(o);
}

std::string FormatTable(const Report& r) {
  std::string s = Header(r) + CapacityTable(r.capacity, r.cluster.gpus_per_node);
  if (r.sim) s += SimText(*r.sim, r.cluster.has_gpu);
  if (r.other_format) s += FormatText(r);
  if (r.autoplan) {
    s += "\n--auto: " + std::to_string(r.autoplan->candidates.size()) + " placements tried\n";
    for (size_t i = 0; i < r.autoplan->candidates.size(); ++i) {
      const Candidate& c = r.autoplan->candidates[i];
      s += (static_cast<int>(i) == r.autoplan->best ? "  * " : "    ") + Pad(c.Label(), 40);
      s += c.simulated ? Fmt("%.3f s/step, ", c.sim.step_s) + "bound by " +
                             ResourceName(c.sim.bound, r.cluster.has_gpu) +
                             (c.sim.overlapped && c.sim.speculated_groups < c.sim.groups
                                  ? ", " + std::to_string(c.sim.speculated_groups) + " of " +
                                        std::to_string(c.sim.groups) + " groups speculate"
                                  : "") +
                             "\n"
                       : "does not fit (" + c.capacity.Problems().front() + ")\n";
    }
    if (r.autoplan->best < 0)
      s += "nothing fits\n";
    else
      s += "\nconfig for strata-train" + std::string(r.overlap_step ? " (with the overlapped step)" : "") +
           ":\n" + PlanConfigJson(r) + "\n";
  }
  return s;
}

std::string FormatJson(const Report& r) {
  nlohmann::ordered_json j;
  j["model"] = {{"name", r.model.name},
                {"parameters", r.layout.full_numel},
                {"groups", r.layout.group_numel.size()},
                {"largest_group", r.layout.largest_group},
                {"hidden", r.model.hidden},
                {"layers", r.model.layers},
                {"seq", r.model.seq},
                {"micro_batch", r.model.micro_batch},
                {"checkpointing", r.model.checkpointing}};
  const auto& c = r.cluster;
  j["cluster"] = {{"name", c.name},
                  {"nodes", c.nodes},
                  {"gpus_per_node", c.gpus_per_node},
                  {"world_size", c.world_size()},
                  {"device_memory", c.device_bytes},
                  {"host_memory", c.host_bytes},
                  {"nvme_bytes", c.nvme_bytes()}};
  const auto& z = r.config.zero;
  j["placement"] = {{"stage", z.stage},
                    {"param", Where(z.offload_param.device)},
                    {"optimizer", Where(z.offload_optimizer.device)},
                    {"overlap_step", r.overlap_step},
                    {"replay_rate", r.replay_rate},
                    {"state_format", r.config.strata.state_format}};
  j["capacity"] = CapacityJson(r.capacity);
  if (r.sim) j["simulation"] = SimJson(*r.sim, r.cluster.has_gpu);
  if (r.other_format) j["state_format"] = FormatJsonOf(r);
  if (r.autoplan) {
    nlohmann::ordered_json a = nlohmann::ordered_json::array();
    for (const Candidate& cand : r.autoplan->candidates) {
      nlohmann::ordered_json e = {{"placement", cand.Label()}, {"fits", cand.capacity.Fits()}};
      if (cand.simulated) e["step_s"] = cand.sim.step_s;
      if (cand.simulated && cand.sim.overlapped) {
        e["exposed_s"] = cand.sim.optimizer_s;
        e["speculated_fraction"] = cand.sim.speculated_fraction;
      }
      a.push_back(e);
    }
    j["auto"]["candidates"] = a;
    j["auto"]["best"] = r.autoplan->best;
    if (r.autoplan->best >= 0) j["auto"]["config"] = nlohmann::ordered_json::parse(PlanConfigJson(r));
  }
  return j.dump(2) + "\n";
}

}  // namespace strata::plan
