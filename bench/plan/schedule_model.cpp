// Benchmark of strata-plan's time model: the step times the simulator
// predicts for the schedules the engine runs, each against its closed form
// (the disk bound of an NVMe step, the alternate schedule's batches, the
// compact kernel's rate, the overlapped step's replay and policy weights)
// or against the other schedule it must beat. These are model outputs, not
// measurements: no clock is read, so the figures are the same on any
// machine. The bytes, counts and memory the same scenarios give are
// tests/plan/simulator_test.cpp's. One line per figure (model, expected,
// ratio; seconds, or a ratio of them) or relation (held or not); last line:
// `schedule_model figures=F relations=R failed=X worst_ratio=W`, W the
// figure whose model-over-expected ratio is farthest from 1. Exit 1 when a
// relation fails or a figure is off by more than its tolerance.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <string>

#include "engine/config/config.h"
#include "tools/plan/fixtures.h"
#include "tools/plan/placement.h"
#include "tools/plan/simulator.h"

namespace strata::plan {
namespace {

struct Report {
  int figures = 0, relations = 0, failed = 0;
  double worst = 1.0;

  void Near(const std::string& what, double model, double expected, double tolerance) {
    ++figures;
    const bool ok = std::fabs(model - expected) <= tolerance;
    const double ratio = expected != 0 ? model / expected : (model == 0 ? 1.0 : INFINITY);
    if (std::fabs(ratio - 1) > std::fabs(worst - 1)) worst = ratio;
    if (!ok) ++failed;
    std::printf("%-64s model %.6g  expected %.6g  ratio %.6f%s\n", what.c_str(), model, expected, ratio,
                ok ? "" : "  OFF");
  }
  void Holds(const std::string& what, bool ok, double a, double b) {
    ++relations;
    if (!ok) ++failed;
    std::printf("%-64s %.6g against %.6g: %s\n", what.c_str(), a, b, ok ? "holds" : "FAILS");
  }
};

Config Cfg(int stage, const char* param, const char* opt, const std::string& extra = "") {
  auto c = FixtureConfig(stage, param, opt, extra);
  if (!c.ok()) {
    std::fprintf(stderr, "config: %s\n", c.status().ToString().c_str());
    std::exit(1);
  }
  return *c;
}

SimResult Sim(const ModelSpec& m, const ClusterSpec& c, const Config& cfg, const SimOptions& o) {
  auto r = Simulate(m, c, cfg, o);
  if (!r.ok()) {
    std::fprintf(stderr, "simulate: %s\n", r.status().ToString().c_str());
    std::exit(1);
  }
  return *r;
}

// W, M, V, G on NVMe, no GPU, a fast CPU: the sum of the read and write
// times; a slow CPU bounds it instead, the disk beside it.
void NvmeStep(Report& rep) {
  const ModelSpec m = FlatModel(16, 2u << 20);
  ClusterSpec c = OneRankCluster(2e9, 1e9);
  const double n = 32.0 * (1 << 20), bound = 16 * n / 2e9 + 12 * n / 1e9;
  const SimResult r = Sim(m, c, Cfg(3, "none", "nvme"), {.optimizer_only = true});
  rep.Near("nvme optimizer step: the disk bound", r.step_s, bound, 0.01 * bound);
  c.cpu_adam_eps = n / 10;
  const SimResult slow = Sim(m, c, Cfg(3, "none", "nvme"), {.optimizer_only = true});
  rep.Holds("slow CPU: the step outlasts its 10 s of updates", slow.step_s > 10, slow.step_s, 10);
  rep.Holds("slow CPU: the disk runs beside the updates", slow.step_s < 10 + bound, slow.step_s, 10 + bound);
  // compact moves 7.25 B read and 3.25 B written a parameter instead of 16 and 12
  const std::string compact = R"("strata": {"state_format": "compact"}, )";
  c.cpu_adam_eps = 1e15;
  const SimResult k = Sim(m, c, Cfg(3, "none", "nvme", compact), {.optimizer_only = true});
  const double kbound = 7.25 * n / 2e9 + 3.25 * n / 1e9, ratio = (7.25 / 2 + 3.25) / (16.0 / 2 + 12);
  rep.Near("compact nvme step: its disk bound", k.step_s, kbound, 0.01 * kbound);
  rep.Near("compact over fp32 step: their byte ratio (0.344)", k.step_s / r.step_s, ratio, 0.01 * ratio);
  // the compact kernel's own rate
  c = OneRankCluster(1e12, 1e12);
  c.cpu_adam_eps = n / 10;
  const Config cc = Cfg(3, "none", "nvme", compact);
  const SimResult same = Sim(m, c, cc, {.optimizer_only = true});
  c.cpu_compact_adam_eps = n / 20;
  const SimResult slower = Sim(m, c, cc, {.optimizer_only = true});
  const SimResult fp32 = Sim(m, c, Cfg(3, "none", "nvme"), {.optimizer_only = true});
  rep.Near("compact updates at the fp32 rate (none given)", same.Busy(SimResource::kCpu), 10, 1e-6);
  rep.Near("compact updates at their own rate", slower.Busy(SimResource::kCpu), 20, 1e-6);
  rep.Near("fp32 updates at theirs", fp32.Busy(SimResource::kCpu), 10, 1e-6);
}

// strata.step_io "alternate": batches of buffer_count/2 shards, as the engine
// runs them (tests/plan/simulator_test.cpp had these as
// AlternateScheduleSerializesAsTheEngine).
void Alternate(Report& rep) {
  const uint64_t per = 2u << 20;
  const ModelSpec m = FlatModel(16, per);
  ClusterSpec c = OneRankCluster(2e9, 1e9);
  c.nvme_mixed_factor = 1.0;
  const double r = 7.25 * per / 2e9, w = 3.25 * per / 1e9, u = r + w;
  c.cpu_adam_eps = c.cpu_compact_adam_eps = per / u;
  const std::string compact = R"("strata": {"state_format": "compact"}, )";
  const std::string concurrent = R"("strata": {"state_format": "compact", "step_io": "concurrent"}, )";
  const SimResult alt = Sim(m, c, Cfg(3, "none", "nvme", compact), {.optimizer_only = true});
  const SimResult con = Sim(m, c, Cfg(3, "none", "nvme", concurrent), {.optimizer_only = true});
  const double expected = 2 * r + 16 * u + 16 * w;
  rep.Near("alternate compact step: 2r + 16u + 16w", alt.step_s, expected, 0.01 * expected);
  rep.Holds("concurrent overlaps the writes too (< 0.8 x alternate)", con.step_s < 0.8 * alt.step_s, con.step_s,
            0.8 * alt.step_s);
  c.host_mem_Bps = 4.0 * per / (0.1 * u);
  const SimResult copies = Sim(m, c, Cfg(3, "none", "nvme", compact), {.optimizer_only = true});
  rep.Near("P's slice copies on the CPU: 16 x 2 x 0.1u more",
           copies.Busy(SimResource::kCpu) - alt.Busy(SimResource::kCpu), 16 * 2 * 0.1 * u, 1e-9);
  rep.Holds("and on the step's path", copies.step_s > alt.step_s + 16 * 0.1 * u, copies.step_s,
            alt.step_s + 16 * 0.1 * u);
  c.host_mem_Bps = 1e18;
  const double r32 = 16.0 * per / 2e9, w32 = 12.0 * per / 1e9;
  c.cpu_adam_eps = per / w32;
  const SimResult f = Sim(m, c, Cfg(3, "none", "nvme"), {.optimizer_only = true});
  const double expected32 = 16 * r32 + 16 * w32 + 2 * w32;
  rep.Near("alternate fp32 step: 16r + 16w + 2w", f.step_s, expected32, 0.01 * expected32);
}

// The 1T plan on one DGX-2: compact is faster and keeps the disk less busy;
// 1T on 512 GPUs simulates a step at all.
void OneTrillion(Report& rep) {
  const ModelSpec m = PresetModel("1t").value();
  const ClusterSpec c = PresetCluster("dgx2").value();
  const SimResult f = Sim(m, c, Cfg(3, "nvme", "nvme"), {});
  const SimResult r = Sim(m, c, Cfg(3, "nvme", "nvme", R"("strata": {"state_format": "compact"}, )"), {});
  rep.Holds("1T on a DGX-2: compact < 0.75 x fp32", r.step_s < 0.75 * f.step_s, r.step_s, 0.75 * f.step_s);
  rep.Holds("1T on a DGX-2: compact's disk busy < 0.6 x fp32's",
            r.Busy(SimResource::kDisk) < 0.6 * f.Busy(SimResource::kDisk), r.Busy(SimResource::kDisk),
            0.6 * f.Busy(SimResource::kDisk));
  ClusterSpec big = c;
  big.nodes = 32;
  const SimResult b = Sim(m, big, Cfg(3, "nvme", "nvme"), {});
  rep.Holds("1T on 512 GPUs: a step of positive length", b.step_s > 0, b.step_s, 0);
  const SimResult again = Sim(m, big, Cfg(3, "nvme", "nvme"), {});
  rep.Holds("1T on 512 GPUs: the same step again (deterministic)", again.step_s == b.step_s, again.step_s, b.step_s);
}

using Xl = XlOnOneA100;

// The overlapped step: what it hides, with clipping, fp16 and ranks; the
// replay rate's and the "auto" policy's weights; GPU-updated groups.
void Overlap(Report& rep) {
  Xl x;
  const std::string clip = R"("gradient_clipping": 1.0, )";
  const std::string fp16 = R"("fp16": {"enabled": true, "loss_scale": 0}, )";
  for (const std::string& extra : {std::string(), clip, fp16, clip + fp16}) {
    const std::string tag = "overlap [" + extra + "]";
    const Config cfg = Cfg(2, "none", "cpu", extra);
    const SimResult plain = Sim(x.m, x.c, cfg, {});
    const SimResult over = Sim(x.m, x.c, cfg, {.overlap_step = true});
    rep.Holds(tag + ": plain step's optimizer > 0.2 s", plain.optimizer_s > 0.2, plain.optimizer_s, 0.2);
    rep.Holds(tag + ": exposed < 0.25 x plain", over.optimizer_s < 0.25 * plain.optimizer_s, over.optimizer_s,
              0.25 * plain.optimizer_s);
    rep.Holds(tag + ": committed exposed < 0.1 x plain", over.committed.exposed_s < 0.1 * plain.optimizer_s,
              over.committed.exposed_s, 0.1 * plain.optimizer_s);
    rep.Holds(tag + ": step < plain step", over.step_s < plain.step_s, over.step_s, plain.step_s);
    rep.Near(tag + ": the plain step beside it is the plain run's", over.plain.iteration_s, plain.step_s, 0);
    rep.Near(tag + ": its optimizer too", over.plain.exposed_s, plain.optimizer_s, 0);
  }
  const ClusterSpec node = PresetCluster("dgx-a100").value();
  const SimResult p8 = Sim(x.m, node, Cfg(2, "none", "cpu", clip), {});
  const SimResult o8 = Sim(x.m, node, Cfg(2, "none", "cpu", clip), {.overlap_step = true});
  rep.Holds("8 ranks: exposed < 0.5 x plain", o8.optimizer_s < 0.5 * p8.optimizer_s, o8.optimizer_s,
            0.5 * p8.optimizer_s);
  Result<AutoPlan> a = PlanAuto(x.m, x.c, Cfg(3, "none", "none", clip), "/nvme");
  const Candidate *with = nullptr, *without = nullptr;
  for (const Candidate& k : a.ok() ? a->candidates : std::vector<Candidate>{}) {
    if (k.Label() == "stage 2, P none, W/M/V cpu, overlap") with = &k;
    if (k.Label() == "stage 2, P none, W/M/V cpu") without = &k;
  }
  const bool both = with && without && with->simulated && without->simulated;
  rep.Holds("--auto: the overlapped candidate is faster", both && with->sim.step_s < without->sim.step_s,
            both ? with->sim.step_s : NAN, both ? without->sim.step_s : NAN);

  // "always": (1 - R) committed + R replayed; a replay restores and redoes.
  const Config always = Cfg(2, "none", "cpu", R"("gradient_clipping": 1.0, "strata": {"speculation": "always"}, )");
  const SimResult plain = Sim(x.m, x.c, always, {});
  double last = 0;
  for (double rate : {0.0, 0.05, 0.5, 1.0}) {
    const std::string tag = "always, replay rate " + std::to_string(rate);
    const SimResult r = Sim(x.m, x.c, always, {.overlap_step = true, .replay_rate = rate});
    rep.Near(tag + ": exposed weighted", r.optimizer_s,
             (1 - rate) * r.committed.exposed_s + rate * r.replayed.exposed_s, 1e-12);
    rep.Near(tag + ": step weighted", r.step_s, (1 - rate) * r.committed.iteration_s + rate * r.replayed.iteration_s,
             1e-12);
    rep.Holds(tag + ": more replays, more exposed", r.optimizer_s > last, r.optimizer_s, last);
    last = r.optimizer_s;
    const double restore = 2.0 * static_cast<double>(r.spec_host_bytes) / x.c.RankHostMem();
    rep.Near(tag + ": replayed = committed + restore + plain", r.replayed.exposed_s,
             r.committed.exposed_s + restore + plain.optimizer_s, 1e-9);
  }
  const SimResult all = Sim(x.m, x.c, always, {.overlap_step = true, .replay_rate = 1.0});
  rep.Holds("always, every step replayed: exposed >= plain", all.optimizer_s >= plain.optimizer_s, all.optimizer_s,
            plain.optimizer_s);
  rep.Holds("always, every step replayed: step >= plain", all.step_s >= plain.step_s, all.step_s, plain.step_s);
  const Config nvme = Cfg(2, "none", "nvme", R"("gradient_clipping": 1.0, "strata": {"speculation": "always"}, )");
  const SimResult pn = Sim(x.m, x.c, nvme, {});
  const SimResult rn = Sim(x.m, x.c, nvme, {.overlap_step = true, .replay_rate = 1.0});
  rep.Near("nvme, always replayed: committed + plain", rn.optimizer_s, rn.committed.exposed_s + pn.optimizer_s,
           1e-9 * pn.optimizer_s);

  // "auto": a fraction S speculates; clipped every step it is the plain step.
  const Config aut = Cfg(2, "none", "cpu", R"("gradient_clipping": 1.0, )");
  const SimResult ap = Sim(x.m, x.c, aut, {});
  for (double rate : {0.0, 0.05, 0.3, 1.0}) {
    const SimResult r = Sim(x.m, x.c, aut, {.overlap_step = true, .replay_rate = rate});
    const double s = (1 - rate) * (std::pow(1 - rate, 3) + 3 * rate * std::pow(1 - rate, 2));
    rep.Near("auto, replay rate " + std::to_string(rate) + ": weighted step", r.step_s,
             s * (1 - rate) * r.committed.iteration_s + s * rate * r.replayed.iteration_s + (1 - s) * ap.step_s,
             1e-9 * ap.step_s);
  }
  const SimResult none = Sim(x.m, x.c, aut, {.overlap_step = true, .replay_rate = 0.0});
  rep.Near("auto, never clipped: the committed step", none.step_s, none.committed.iteration_s, 1e-12 * ap.step_s);
  const Config never = Cfg(2, "none", "cpu", R"("gradient_clipping": 1.0, "strata": {"speculation": "never"}, )");
  const SimResult nv = Sim(x.m, x.c, never, {.overlap_step = true, .replay_rate = 0.05});
  rep.Near("never: the plain step", nv.step_s, ap.step_s, 1e-12 * ap.step_s);

  const SimResult gp = Sim(x.m, x.c, Cfg(2, "none", "none"), {});
  const SimResult go = Sim(x.m, x.c, Cfg(2, "none", "none"), {.overlap_step = true});
  rep.Near("W, M, V on the GPU: the overlapped step is the plain one", go.committed.iteration_s, gp.step_s, 1e-12);
  Config zero = Cfg(2, "none", "nvme");
  zero.strata.speculation_disk_bytes = 0;
  const ModelSpec flat = FlatModel(16, 2u << 20);
  const ClusterSpec one = OneRankCluster(2e9, 1e9);
  const SimResult rz = Sim(flat, one, zero, {.overlap_step = true});
  const SimResult pz = Sim(flat, one, zero, {});
  rep.Near("no swap room for speculation: the plain step", rz.committed.exposed_s, pz.optimizer_s, 1e-12);
}

// Write-behind (tests/plan/simulator_test.cpp has its bytes and policy):
// the step's writes leave its part after backward for the next forward, and
// with overlap_step (a step that does not speculate) its reads go ahead
// during backward; "without overlap" is the step without either read-ahead.
void WriteBehind(Report& rep) {
  const WriteBehindScenario x;
  auto cfg = [](const char* wb) {
    auto k = WriteBehindScenario::Cfg(wb);
    if (!k.ok()) {
      std::fprintf(stderr, "config: %s\n", k.status().ToString().c_str());
      std::exit(1);
    }
    return *k;
  };
  const SimResult behind = Sim(x.m, x.c, cfg("auto"), {}), before = Sim(x.m, x.c, cfg("never"), {});
  rep.Holds("write-behind: the step after backward < writing before it returns",
            behind.optimizer_s < before.optimizer_s, behind.optimizer_s, before.optimizer_s);
  rep.Holds("write-behind: the step < writing before it returns", behind.step_s < before.step_s, behind.step_s,
            before.step_s);
  const SimResult over = Sim(x.m, x.c, cfg("auto"), {.overlap_step = true});
  rep.Holds("write-behind, overlap_step: read ahead, less after backward", over.optimizer_s < behind.optimizer_s,
            over.optimizer_s, behind.optimizer_s);
  rep.Near("write-behind, overlap_step: 'without overlap' is the plain step", over.plain.iteration_s, behind.step_s,
           1e-12);
  rep.Near("write-behind, overlap_step: and its part after backward", over.plain.exposed_s, behind.optimizer_s, 1e-12);
}

// Activation offload runs beside the layers; a disk too slow for it stalls.
void Activations(Report& rep) {
  const ModelSpec m = PresetModel("gpt2-medium").value();
  ClusterSpec c = PresetCluster("dgx-h100").value();
  c.nodes = c.gpus_per_node = 1;
  const Config base = Cfg(3, "none", "cpu");
  const SimResult none = Sim(m, c, base, {});
  const SimResult host = Sim(m, c, WithActivationOffload(base, m, "host", "/nvme"), {});
  const SimResult nvme = Sim(m, c, WithActivationOffload(base, m, "nvme", "/nvme"), {});
  rep.Holds("activations to the host: < 1.05 x the step without", host.step_s < 1.05 * none.step_s, host.step_s,
            1.05 * none.step_s);
  rep.Holds("activations to NVMe: < 1.05 x the step without", nvme.step_s < 1.05 * none.step_s, nvme.step_s,
            1.05 * none.step_s);
  ClusterSpec slow = c;
  slow.nvme_read_Bps = slow.nvme_write_Bps = 50e6;
  const SimResult crawl = Sim(m, slow, WithActivationOffload(base, m, "nvme", "/nvme"), {});
  rep.Holds("a slow disk stalls backward (> 0.1 s)", crawl.act_stall_s > 0.1, crawl.act_stall_s, 0.1);
  rep.Holds("and the step shows it", crawl.step_s > nvme.step_s + crawl.act_stall_s / 2, crawl.step_s,
            nvme.step_s + crawl.act_stall_s / 2);
}

}  // namespace
}  // namespace strata::plan

int main() {
  using namespace strata::plan;
  Report rep;
  NvmeStep(rep);
  Alternate(rep);
  OneTrillion(rep);
  Overlap(rep);
  WriteBehind(rep);
  Activations(rep);
  std::printf("schedule_model figures=%d relations=%d failed=%d worst_ratio=%.6f\n", rep.figures, rep.relations,
              rep.failed, rep.worst);
  return rep.failed ? 1 : 0;
}
