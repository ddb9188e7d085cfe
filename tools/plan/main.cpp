// strata-plan: what fits where, and how fast. Sizes every state in every tier
// for a model on a cluster under a Strata/DeepSpeed config, simulates the
// engine's step against the cluster's rates, searches placements (--auto) and
// measures this machine's rates (--calibrate).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>

#include "base/sizes.h"
#include "tools/plan/calibrate.h"
#include "tools/plan/report.h"

namespace strata::plan {
namespace {

struct Args {
  std::string model = "gpt2", cluster = "local", config, nvme_path = "/local_nvme";
  uint32_t nodes = 0, gpus_per_node = 0;
  uint64_t seq = 0, micro_batch = 0, grad_accum = 0;
  double replay_rate = kDefaultReplayRate;
  bool no_checkpointing = false, overlap_step = false, simulate = false, autoplace = false, json = false;
  std::string offload_activations;  // --offload-activations: "", host, nvme
  std::string svg, write_config, calibrate_dir, calibrate_size = "512MiB";
};

constexpr const char* kDefaultConfig = R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3}})";

int Fail(const Status& s) {
  std::fprintf(stderr, "strata-plan: %s\n", s.ToString().c_str());
  return 1;
}

Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  return f.good() ? Status::Ok() : IoError("cannot write " + path);
}

int RunCalibrate(const Args& a) {
  CalibrateOptions o;
  o.dir = a.calibrate_dir;
  auto size = ParseByteSize(a.calibrate_size);
  if (!size.ok()) return Fail(size.status());
  o.file_bytes = *size;
  auto c = Calibrate(o);
  if (!c.ok()) return Fail(c.status());
  std::printf("disk under %s: read %.0f MB/s, write %.0f MB/s\n", o.dir.c_str(), c->nvme_read_Bps / 1e6,
              c->nvme_write_Bps / 1e6);
  std::printf(
      "CPU Adam: %.0f M elements/s (compact state: %.0f M/s); host memory: %.1f GB/s; XXH3: %.1f GB/s\n",
      c->cpu_adam_eps / 1e6, c->cpu_compact_adam_eps / 1e6, c->host_mem_Bps / 1e9, c->checksum_Bps / 1e9);
  for (const CpuLayerRate& r : c->cpu_layer_rates)
    std::printf(
        "CPU layers at C = %llu: blocks %.1f GFLOP/s, LM head %.1f GFLOP/s (%.1f of %ld cores free)\n",
        static_cast<unsigned long long>(r.hidden), r.block_flops / 1e9, r.head_flops / 1e9, r.free_cores,
        sysconf(_SC_NPROCESSORS_ONLN));
  const std::string path = o.dir + "/strata-plan-calibration.json";
  if (Status st = WriteFile(path, CalibrationJson(*c)); !st.ok()) return Fail(st);
  std::printf("wrote %s (pass it as --cluster)\n", path.c_str());
  return 0;
}

Result<Report> MakeReport(const Args& a) {
  Report r;
  STRATA_ASSIGN_OR_RETURN(r.model, ResolveModel(a.model));
  if (a.seq) r.model.seq = a.seq;
  if (a.micro_batch) r.model.micro_batch = a.micro_batch;
  if (a.grad_accum) r.model.grad_accum = a.grad_accum;
  if (a.no_checkpointing) r.model.checkpointing = false;
  STRATA_ASSIGN_OR_RETURN(r.cluster, ResolveCluster(a.cluster));
  if (a.nodes) r.cluster.nodes = a.nodes;
  if (a.gpus_per_node) r.cluster.gpus_per_node = a.gpus_per_node;
  STRATA_RETURN_IF_ERROR(CheckWorld(r.cluster));
  STRATA_ASSIGN_OR_RETURN(r.config,
                          a.config.empty() ? ParseConfig(kDefaultConfig) : LoadConfigFile(a.config));
  // The store sized to the model, as strata-train sizes it.
  r.config = WithActivationOffload(r.config, r.model, a.offload_activations, a.nvme_path);
  STRATA_ASSIGN_OR_RETURN(r.layout, MakeLayout(r.model, static_cast<int>(r.cluster.world_size())));
  r.overlap_step = a.overlap_step;
  r.replay_rate = a.replay_rate;
  const Config base = r.config;
  if (a.autoplace) {
    STRATA_ASSIGN_OR_RETURN(r.autoplan, PlanAuto(r.model, r.cluster, r.config, a.nvme_path, a.replay_rate));
    if (r.autoplan->best >= 0) {
      const Candidate& best = r.autoplan->candidates[static_cast<size_t>(r.autoplan->best)];
      r.config = best.config;
      r.overlap_step = best.overlap_step;
    }
  }
  r.capacity = ComputeCapacity(r.model, r.layout, r.cluster, r.config, r.overlap_step);
  if (a.simulate || (r.autoplan && r.autoplan->best >= 0))
    r.sim = Simulate(r.model, r.layout, r.capacity, r.cluster, r.config,
                     {.overlap_step = r.overlap_step, .replay_rate = r.replay_rate});
  CompareStateFormats(r, a.autoplace ? &base : nullptr, a.nvme_path);
  return r;
}

int Run(const Args& a) {
  if (!a.calibrate_dir.empty()) return RunCalibrate(a);
  auto r = MakeReport(a);
  if (!r.ok()) return Fail(r.status());
  std::printf("%s", a.json ? FormatJson(*r).c_str() : FormatTable(*r).c_str());
  if (!a.svg.empty())
    if (Status st = WriteFile(a.svg, FormatSvg(*r)); !st.ok()) return Fail(st);
  // Nothing fits: say so on stderr and in the exit status (3), and never
  // write a config that would not run.
  if (!r->capacity.Fits()) {
    // The other state format may fit: say so (the format is the user's to choose).
    std::string other;
    if (const auto& o = r->other_format; o && o->available) {
      if (o->autoplan && o->autoplan->best >= 0)
        other = "; with strata.state_format \"" + o->format + "\" " +
                o->autoplan->candidates[static_cast<size_t>(o->autoplan->best)].Label() + " fits";
      else if (!a.autoplace && o->capacity.Fits())
        other = "; with strata.state_format \"" + o->format + "\" it fits";
    }
    // The overlapped step's swap room ("auto": every group's) may be what does not fit.
    if (Config c = r->config; r->overlap_step && FitSpeculationDisk(r->model, r->layout, r->cluster, &c))
      other += "; with strata.speculation_disk_bytes " + std::to_string(c.strata.speculation_disk_bytes) +
               " it fits (fewer groups speculate)";
    std::fprintf(stderr, "strata-plan: %s: %s%s%s\n", a.autoplace ? "nothing fits" : "does not fit",
                 r->capacity.Problems().front().c_str(), other.c_str(),
                 a.write_config.empty() ? "" : (" (" + a.write_config + " not written)").c_str());
    return 3;
  }
  if (!a.write_config.empty())
    if (Status st = WriteFile(a.write_config, PlanConfigJson(*r)); !st.ok()) return Fail(st);
  return 0;
}

}  // namespace
}  // namespace strata::plan

int main(int argc, char** argv) {
  strata::plan::Args a;
  CLI::App app{"strata-plan: what fits where (device, host, NVMe), and how fast"};
  app.add_option(
         "--model", a.model,
         "preset (tiny, small, medium, gpt2, ..., 13b as strata-train's; 175b, 1t) or model JSON file")
      ->capture_default_str();
  app.add_option("--cluster", a.cluster, "preset (dgx2, dgx-a100, dgx-h100, local) or cluster JSON file")
      ->capture_default_str();
  app.add_option("--nodes", a.nodes, "override the cluster's node count");
  app.add_option("--gpus-per-node", a.gpus_per_node, "override the cluster's GPUs (ranks) per node");
  app.add_option("--config", a.config, "Strata/DeepSpeed config JSON (default: bf16, stage 3, no offload)");
  app.add_option("--seq", a.seq, "sequence length (default: the model's context)");
  app.add_option("--micro-batch", a.micro_batch, "sequences per rank per forward");
  app.add_option("--grad-accum", a.grad_accum, "micro-batches per optimizer step");
  app.add_flag("--no-checkpointing", a.no_checkpointing, "activations without checkpointing");
  app.add_option("--offload-activations", a.offload_activations,
                 "the trainer's saved activations in the engine's activation store, sized to the model: host "
                 "(all in host memory) or nvme (two layers' in host memory, the rest on NVMe)")
      ->check(CLI::IsMember({"host", "nvme"}));
  app.add_flag("--overlap-step", a.overlap_step,
               "the speculative overlapped step (EngineOptions.overlap_step): each group updates as its "
               "gradients complete in backward, with clipping, fp16 and any number of ranks; reports the "
               "exposed and iteration times with and without it and the memory speculation takes");
  app.add_option("--replay-rate", a.replay_rate,
                 "with --overlap-step (and --auto): the fraction of steps (0..1) whose speculative update is "
                 "discarded and run again after backward (clipping applied, or a non-finite gradient). "
                 "Default 0.05: DeepSpeed's SuperOffload found clipping rare after warm-up; 5% allows for "
                 "warm-up and loss spikes")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_flag("--simulate", a.simulate, "simulate one step and print its time and bounding resource");
  app.add_flag("--auto", a.autoplace, "search placements; print the fastest that fits and its config");
  app.add_option("--nvme-path", a.nvme_path, "swap folder written into --auto configs")
      ->capture_default_str();
  app.add_flag("--json", a.json, "print JSON instead of the table");
  app.add_option("--svg", a.svg, "write a bar chart of bytes per tier per state");
  app.add_option("--write-config", a.write_config, "write the plan's config JSON (for strata-train)");
  app.add_option("--calibrate", a.calibrate_dir,
                 "measure this machine's disk (in DIR), CPU Adam, memory and layer rates")
      ->check(CLI::ExistingDirectory);
  app.add_option("--calibrate-size", a.calibrate_size, "disk test file size")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  return strata::plan::Run(a);
}
