// The step simulator: the 1T-on-512-GPUs figures (its speed, under 5 s, is
// bench/plan/simulate_speed.cpp), the bytes it moves and which resource
// bounds a step, the prefetch cache's behaviour and determinism, and the
// speculative overlapped step: what speculates and the memory it holds. The
// simulated times, against the closed forms of the engine's schedules, are
// a benchmark: bench/plan/schedule_model.cpp.
#include "tools/plan/simulator.h"

#include <gtest/gtest.h>

#include <cmath>

#include "base/align.h"
#include "tools/plan/fixtures.h"
#include "tools/plan/placement.h"

namespace strata::plan {
namespace {

Config Cfg(int stage, const char* param, const char* opt, const std::string& extra = "") {
  auto c = FixtureConfig(stage, param, opt, extra);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : Config{};
}

// The issue's figures for 1T parameters on 512 GPUs. How long the simulation
// and --auto take (the issue asks for under 5 s) is a benchmark:
// bench/plan/simulate_speed.cpp.
TEST(Simulator, OneTrillionOn512Gpus) {
  const ModelSpec m = PresetModel("1t").value();
  ClusterSpec c = PresetCluster("dgx2").value();
  c.nodes = 32;
  ASSERT_EQ(c.world_size(), 512u);
  Result<SimResult> r = Simulate(m, c, Cfg(3, "nvme", "nvme"), {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->fetches, 2 * m.groups.size());
  // Every rank gathers the whole model twice and reduce-scatters its gradients once.
  const double psi2 = 2.0 * static_cast<double>(m.total_numel()) * 511 / 512;
  EXPECT_NEAR(static_cast<double>(r->network_bytes), 3 * psi2, 0.01 * psi2);
  Result<AutoPlan> a = PlanAuto(m, c, Cfg(3, "none", "none"), "/nvme");
  ASSERT_TRUE(a.ok());
}

// The optimizer alone with W, M, V, G on NVMe and no GPU (the calibration
// scenario): reads 16 B and writes 12 B per parameter (P is in place), and
// with a fast CPU the disk bounds it; with a slow one the CPU.
TEST(Simulator, OptimizerOnNvmeIsDiskBound) {
  const ModelSpec m = FlatModel(16, 2u << 20);
  ClusterSpec c = OneRankCluster(2e9, 1e9);
  auto r = Simulate(m, c, Cfg(3, "none", "nvme"), {.optimizer_only = true});
  ASSERT_TRUE(r.ok());
  const double n = 32.0 * (1 << 20);
  EXPECT_EQ(r->disk_read_bytes, static_cast<uint64_t>(16 * n));
  EXPECT_EQ(r->disk_write_bytes, static_cast<uint64_t>(12 * n));
  EXPECT_EQ(r->bound, SimResource::kDisk);
  // A slow CPU becomes the bound instead, and the disk overlaps it.
  c.cpu_adam_eps = n / 10;  // 10 s of updates
  auto slow = Simulate(m, c, Cfg(3, "none", "nvme"), {.optimizer_only = true});
  EXPECT_EQ(slow->bound, SimResource::kCpu);
}

// strata.state_format "compact" on the same NVMe-bound step: the step moves
// W 1 (int8 corrections; the bf16 half is P, here in place), M 1.125, V
// 1.125 (and G 4) bytes a parameter instead of 4 each.
TEST(Simulator, CompactNvmeStepMovesItsBytes) {
  const ModelSpec m = FlatModel(16, 2u << 20);
  const ClusterSpec c = OneRankCluster(2e9, 1e9);
  const std::string compact = R"("strata": {"state_format": "compact"}, )";
  auto f = Simulate(m, c, Cfg(3, "none", "nvme"), {.optimizer_only = true});
  auto r = Simulate(m, c, Cfg(3, "none", "nvme", compact), {.optimizer_only = true});
  ASSERT_TRUE(f.ok() && r.ok());
  const double n = 32.0 * (1 << 20);
  EXPECT_EQ(r->disk_read_bytes, static_cast<uint64_t>(7.25 * n));  // W 1 + M 1.125 + V 1.125 + G 4
  EXPECT_EQ(r->disk_write_bytes, static_cast<uint64_t>(3.25 * n));
  EXPECT_EQ(r->bound, SimResource::kDisk);
}

// The compact step runs the compact kernel: with its rate slower than the
// disk, the CPU bounds the step (its figures: bench/plan/schedule_model.cpp).
TEST(Simulator, CompactUpdateAtItsOwnRate) {
  const ModelSpec m = FlatModel(16, 2u << 20);
  ClusterSpec c = OneRankCluster(1e12, 1e12);
  const double n = 32.0 * (1 << 20);
  c.cpu_compact_adam_eps = n / 20;  // 20 s of compact updates
  auto slower = Simulate(m, c, Cfg(3, "none", "nvme", R"("strata": {"state_format": "compact"}, )"),
                         {.optimizer_only = true});
  ASSERT_TRUE(slower.ok());
  EXPECT_EQ(slower->bound, SimResource::kCpu);
}

// strata.step_io "alternate" (the default) and "concurrent" order the same
// I/O differently: the same bytes (their times: bench/plan/schedule_model.cpp).
TEST(Simulator, AlternateAndConcurrentMoveTheSameBytes) {
  const ModelSpec m = FlatModel(16, 2u << 20);
  const ClusterSpec c = OneRankCluster(2e9, 1e9);
  const std::string compact = R"("strata": {"state_format": "compact"}, )";
  const std::string concurrent = R"("strata": {"state_format": "compact", "step_io": "concurrent"}, )";
  auto alt = Simulate(m, c, Cfg(3, "none", "nvme", compact), {.optimizer_only = true});
  auto con = Simulate(m, c, Cfg(3, "none", "nvme", concurrent), {.optimizer_only = true});
  ASSERT_TRUE(alt.ok() && con.ok());
  EXPECT_EQ(alt->disk_read_bytes, con->disk_read_bytes);
  EXPECT_EQ(alt->disk_write_bytes, con->disk_write_bytes);
}

// P on NVMe beside W: fp32 writes P (2 B, a copy of W) besides W, M, V (12 B)
// and reads W, M, V, G (16 B); in compact P is the master's bf16 half, read
// and written with W, M, V: 5.25 B each way, plus G's 4 read.
TEST(Simulator, CompactReadsAndWritesPWithTheMaster) {
  const ModelSpec m = FlatModel(16, 2u << 20);
  ClusterSpec c = PresetCluster("local").value();
  c.gpus_per_node = 1;
  const double n = 32.0 * (1 << 20);
  auto f = Simulate(m, c, Cfg(3, "nvme", "nvme"), {.optimizer_only = true});
  auto r = Simulate(m, c, Cfg(3, "nvme", "nvme", R"("strata": {"state_format": "compact"}, )"),
                    {.optimizer_only = true});
  ASSERT_TRUE(f.ok() && r.ok());
  EXPECT_EQ(f->disk_write_bytes, static_cast<uint64_t>(14 * n));
  EXPECT_EQ(f->disk_read_bytes, static_cast<uint64_t>(16 * n));
  EXPECT_EQ(r->disk_write_bytes, static_cast<uint64_t>(5.25 * n));
  EXPECT_EQ(r->disk_read_bytes, static_cast<uint64_t>(9.25 * n));
}

// The 1T plan on one DGX-2 (disk-bound): compact moves fewer bytes.
TEST(Simulator, CompactOneTrillionOnDgx2) {
  const ModelSpec m = PresetModel("1t").value();
  const ClusterSpec c = PresetCluster("dgx2").value();
  auto f = Simulate(m, c, Cfg(3, "nvme", "nvme"), {});
  auto r = Simulate(m, c, Cfg(3, "nvme", "nvme", R"("strata": {"state_format": "compact"}, )"), {});
  ASSERT_TRUE(f.ok() && r.ok());
  EXPECT_EQ(f->bound, SimResource::kDisk);
  // Per parameter of a rank's shard: fp32 reads P in forward and backward
  // (about 4: a group used at the turn is not read again), G once in the
  // step (4) and W, M, V (12), compact P, W, M, V (5.25) instead of the 12;
  // it writes G (4), then P + W, M, V: 14 against 5.25.
  const double shard = static_cast<double>(MakeLayout(m, 16).value().shard_numel);
  const auto per = [&](uint64_t bytes) { return static_cast<double>(bytes) / shard; };
  EXPECT_NEAR(per(f->disk_read_bytes), 20, 0.02);
  EXPECT_NEAR(per(f->disk_read_bytes) - per(r->disk_read_bytes), 12 - 5.25, 1e-6);
  EXPECT_NEAR(per(f->disk_write_bytes), 18, 1e-6);
  EXPECT_NEAR(per(r->disk_write_bytes), 9.25, 1e-6);
}

// P on the host: with room on the device for every group, backward finds the
// forward's copies (no evictions, one load per group); without, it evicts.
TEST(Simulator, PrefetchCacheFollowsTheDeviceRoom) {
  ModelSpec m = PresetModel("gpt2").value();
  ClusterSpec c = PresetCluster("dgx-a100").value();
  c.gpus_per_node = 1;
  auto roomy = Simulate(m, c, Cfg(3, "cpu", "cpu"), {});
  ASSERT_TRUE(roomy.ok());
  EXPECT_EQ(roomy->evictions, 0u);
  const Layout l = MakeLayout(m, 1).value();
  EXPECT_EQ(roomy->pcie_bytes, 2 * 2 * l.shard_numel) << "P (bf16) crosses once, and the bf16 gradients once";
  c.device_bytes = 128ull << 20;  // room for about half of gpt2's P beside the activations
  m.seq = 128;
  auto tight = Simulate(m, c, Cfg(3, "cpu", "cpu"), {});
  ASSERT_TRUE(tight.ok());
  EXPECT_GT(tight->evictions, 0u);
  EXPECT_GT(tight->pcie_bytes, roomy->pcie_bytes);
  EXPECT_EQ(tight->prefetch_hits, tight->fetches);  // the trace foresees every fetch
}

TEST(Simulator, Deterministic) {
  const ModelSpec m = PresetModel("13b").value();
  ClusterSpec c = PresetCluster("dgx-h100").value();
  c.nodes = 4;
  const Config cfg = Cfg(3, "cpu", "nvme");
  auto a = Simulate(m, c, cfg, {.overlap_step = true});
  auto b = Simulate(m, c, cfg, {.overlap_step = true});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->evictions, b->evictions);
  EXPECT_EQ(a->disk_read_bytes, b->disk_read_bytes);
  EXPECT_EQ(a->pcie_bytes, b->pcie_bytes);
  EXPECT_EQ(a->network_bytes, b->network_bytes);
  EXPECT_EQ(a->speculated_groups, b->speculated_groups);
}

// Write-behind (strata.write_behind "auto": one rank, W, M, V on NVMe in
// units, G and P in host memory): the plan writes behind where the step
// slots, grown or not, hold every unit's W, M, V, and not where they must
// grow and cannot; the bytes are those of writing before the step returns
// ("never"); "auto" speculation does not speculate there (the engine's
// StartOverlap), where without write-behind it does. What it does to the
// step's time: bench/plan/schedule_model.cpp.
TEST(Simulator, WriteBehindMovesTheSameBytesAndDoesNotSpeculate) {
  const WriteBehindScenario x;
  auto cfg = [](const char* wb, const std::string& more = "") {
    auto k = WriteBehindScenario::Cfg(wb, more);
    EXPECT_TRUE(k.ok()) << k.status().ToString();
    return k.ok() ? *k : Config{};
  };
  // Where the slots must grow and cannot, it does not write behind: a host
  // budget without room for them, or speculation "always" with the
  // overlapped step (its room comes first).
  auto tight = ComputeCapacity(x.m, x.c, cfg("auto", R"(, "host_budget": "1GiB")"));
  ASSERT_TRUE(tight.ok());
  EXPECT_FALSE(tight->writes_behind);
  EXPECT_EQ(tight->write_behind_slots, 0);
  Result<Layout> lay = MakeLayout(x.m, 1);
  ASSERT_TRUE(lay.ok());
  const Capacity always =
      ComputeCapacity(x.m, *lay, x.c, cfg("auto", R"(, "speculation": "always")"), /*overlap_step=*/true);
  EXPECT_FALSE(always.writes_behind);
  auto behind = Simulate(x.m, x.c, cfg("auto"), {});
  auto before = Simulate(x.m, x.c, cfg("never"), {});
  ASSERT_TRUE(behind.ok() && before.ok());
  auto cap = ComputeCapacity(x.m, x.c, cfg("auto"));
  ASSERT_TRUE(cap.ok());
  EXPECT_TRUE(cap->writes_behind);
  EXPECT_FALSE(ComputeCapacity(x.m, x.c, cfg("never"))->writes_behind);
  EXPECT_EQ(behind->disk_write_bytes, before->disk_write_bytes);
  EXPECT_EQ(behind->disk_read_bytes, before->disk_read_bytes);
  auto behind_over = Simulate(x.m, x.c, cfg("auto"), {.overlap_step = true});
  auto before_over = Simulate(x.m, x.c, cfg("never"), {.overlap_step = true});
  ASSERT_TRUE(behind_over.ok() && before_over.ok());
  EXPECT_EQ(behind_over->speculated_rate, 0.0) << "\"auto\" speculates where the step writes behind";
  EXPECT_GT(before_over->speculated_rate, 0.0);
  EXPECT_EQ(behind_over->disk_read_bytes, behind->disk_read_bytes);
}

// Several ranks with P on NVMe (stage 3, fp32, W, M, V on NVMe in units of
// 1M elements, pieces of every group's shard at two ranks; G
// in host memory, no GPU): "auto" writes behind where every group's
// gathered copy fits the device budget at once (the engine keeps them, and
// the forward loads no P from NVMe), and not where the budget is short of
// them (the forward reads P through the gate); "never" never does.
TEST(Simulator, WriteBehindWithPOnNvmeAtTwoRanksNeedsKeptCopies) {
  ModelSpec m = PresetModel("gpt2").value();
  ClusterSpec c = PresetCluster("local").value();
  c.host_bytes = uint64_t{16} << 30;
  c.device_bytes = c.host_bytes / 4;
  c.gpus_per_node = 2;  // (two ranks on this host)
  auto cfg = [](const char* wb, const char* budget) {
    auto k = ParseConfig(std::string(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1000000,
        "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}},
      "strata": {"grad_home": "host", "write_behind": ")") + wb + R"(", "device_budget": ")" + budget + R"("}})");
    EXPECT_TRUE(k.ok()) << k.status().ToString();
    return k.ok() ? *k : Config{};
  };
  uint64_t p_bytes = 0;  // every group's fp32 P, as the copies hold it
  for (const auto& g : m.groups) p_bytes += g.numel * 4;
  ASSERT_LT(p_bytes, uint64_t{1} << 30);
  auto kept = ComputeCapacity(m, c, cfg("auto", "2GiB"));
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  EXPECT_TRUE(kept->writes_behind) << "every copy fits 2 GiB: the copies stay, and the step writes behind";
  auto short_of = ComputeCapacity(m, c, cfg("auto", "200MiB"));
  ASSERT_TRUE(short_of.ok()) << short_of.status().ToString();
  EXPECT_GT(p_bytes, uint64_t{200} << 20);
  EXPECT_FALSE(short_of->writes_behind) << "200 MiB does not hold every copy: the forward reads P from NVMe";
  auto always = ComputeCapacity(m, c, cfg("always", "200MiB"));
  auto never = ComputeCapacity(m, c, cfg("never", "2GiB"));
  ASSERT_TRUE(always.ok() && never.ok());
  EXPECT_TRUE(always->writes_behind);
  EXPECT_FALSE(never->writes_behind);
}

using Xl = XlOnOneA100;

// The overlapped step is speculative: it overlaps backward with gradient
// clipping, with fp16's dynamic loss scaling and on several ranks (it used
// to be turned off there), every group speculating; --auto simulates it
// beside the plain step (what it hides: bench/plan/schedule_model.cpp).
TEST(Simulator, OverlapSpeculatesWithClippingFp16AndRanks) {
  Xl x;
  const std::string clip = R"("gradient_clipping": 1.0, )";
  const std::string fp16 = R"("fp16": {"enabled": true, "loss_scale": 0}, )";
  for (const std::string& extra : {std::string(), clip, fp16, clip + fp16}) {
    const Config cfg = Cfg(2, "none", "cpu", extra);
    auto plain = Simulate(x.m, x.c, cfg, {});
    auto over = Simulate(x.m, x.c, cfg, {.overlap_step = true});
    ASSERT_TRUE(plain.ok() && over.ok()) << extra;
    EXPECT_FALSE(plain->overlapped);
    ASSERT_TRUE(over->overlapped) << extra;
    EXPECT_EQ(over->speculated_groups, over->groups) << extra;
  }
  // Eight ranks (ZeRO-2 over a DGX A100): each rank speculates its shards.
  ClusterSpec node = PresetCluster("dgx-a100").value();
  const Config cfg = Cfg(2, "none", "cpu", clip);
  auto over = Simulate(x.m, node, cfg, {.overlap_step = true});
  ASSERT_TRUE(over.ok());
  EXPECT_EQ(over->speculated_groups, over->groups);
  // --auto weighs the overlapped step under clipping too.
  Result<AutoPlan> a = PlanAuto(x.m, x.c, Cfg(3, "none", "none", clip), "/nvme");
  ASSERT_TRUE(a.ok() && a->best >= 0);
  const Candidate *with = nullptr, *without = nullptr;
  for (const Candidate& k : a->candidates) {
    if (k.Label() == "stage 2, P none, W/M/V cpu, overlap") with = &k;
    if (k.Label() == "stage 2, P none, W/M/V cpu") without = &k;
  }
  ASSERT_TRUE(with && without && with->simulated && without->simulated);
  EXPECT_TRUE(with->sim.overlapped);
}

// With strata.speculation "always" every overlapped step speculates at the
// replay rate asked; host-homed state holds backups, NVMe-homed state a
// second extent instead (the weights of committed and replayed steps:
// bench/plan/schedule_model.cpp).
TEST(Simulator, ReplayRateAndWhatAReplayHolds) {
  Xl x;
  const Config cfg = Cfg(2, "none", "cpu", R"("gradient_clipping": 1.0, "strata": {"speculation": "always"}, )");
  for (double rate : {0.0, 0.05, 0.5, 1.0}) {
    auto r = Simulate(x.m, x.c, cfg, {.overlap_step = true, .replay_rate = rate});
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->replay_rate, rate);
    EXPECT_GT(r->spec_host_bytes, 0u) << rate;
  }
  const Config nvme = Cfg(2, "none", "nvme", R"("gradient_clipping": 1.0, "strata": {"speculation": "always"}, )");
  auto rn = Simulate(x.m, x.c, nvme, {.overlap_step = true, .replay_rate = 1.0});
  ASSERT_TRUE(rn.ok());
  EXPECT_EQ(rn->spec_host_bytes, 0u);
  EXPECT_GT(rn->spec_disk_bytes, 0u);
}

// The default policy ("auto", engine/step/speculation_policy.h): a step
// speculates when the last one was kept and at most one of the three before
// it was not, so with R the chance a step clips, a fraction
// S = (1 - R) ((1 - R)^3 + 3 R (1 - R)^2) speculates; "never" none (the
// steps that weighs: bench/plan/schedule_model.cpp).
TEST(Simulator, AutoPolicySpeculatesItsFraction) {
  Xl x;
  const Config cfg = Cfg(2, "none", "cpu", R"("gradient_clipping": 1.0, )");
  ASSERT_EQ(cfg.strata.speculation, "auto");
  for (double rate : {0.0, 0.05, 0.3, 1.0}) {
    auto r = Simulate(x.m, x.c, cfg, {.overlap_step = true, .replay_rate = rate});
    ASSERT_TRUE(r.ok());
    const double s = (1 - rate) * (std::pow(1 - rate, 3) + 3 * rate * std::pow(1 - rate, 2));
    EXPECT_NEAR(r->speculated_rate, s, 1e-15) << rate;
    EXPECT_EQ(r->speculation, "auto");
  }
  const Config never = Cfg(2, "none", "cpu", R"("gradient_clipping": 1.0, "strata": {"speculation": "never"}, )");
  auto nv = Simulate(x.m, x.c, never, {.overlap_step = true, .replay_rate = 0.05});
  ASSERT_TRUE(nv.ok());
  EXPECT_EQ(nv->speculated_rate, 0.0);
  // No GPU, W, M, V in host memory: "auto" never speculates there (as the
  // engine declines it); with them on NVMe it does.
  ClusterSpec cpu = x.c;
  cpu.has_gpu = false;
  auto host = Simulate(x.m, cpu, cfg, {.overlap_step = true, .replay_rate = 0.05});
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->speculated_rate, 0.0);
  auto on_nvme = Simulate(x.m, cpu, Cfg(2, "none", "nvme", R"("gradient_clipping": 1.0, )"),
                          {.overlap_step = true, .replay_rate = 0.05});
  ASSERT_TRUE(on_nvme.ok());
  EXPECT_GT(on_nvme->speculated_rate, 0.0);
}

// Groups stepped in units (a shard of W, M, V on NVMe larger than
// zero_optimization.sub_group_size, G in host memory, no GPU) do not
// speculate, as the engine's Speculation::NeedsOf says: 16 groups of 2 Mi
// elements, in units of 1 Mi, none; in units of 4 Mi (whole), all.
TEST(Simulator, GroupsInStepUnitsDoNotSpeculate) {
  const ModelSpec m = FlatModel(16, 2u << 20);
  const ClusterSpec c = OneRankCluster(2e9, 1e9);
  const Layout l = MakeLayout(m, 1).value();
  for (uint64_t unit : {uint64_t{1} << 20, uint64_t{4} << 20}) {
    Config cfg = Cfg(2, "none", "nvme", R"("strata": {"grad_home": "host"}, )");
    cfg.zero.sub_group_size = unit;
    const Capacity cap = ComputeCapacity(m, l, c, cfg, /*overlap_step=*/true);
    EXPECT_EQ(cap.speculation.Groups(), unit < (2u << 20) ? 0 : 16) << "sub_group_size " << unit;
  }
}

// What speculation holds, per rank, to the byte, as the engine's
// Speculation::NeedsOf counts it, on 16 groups of 2 Mi elements on one rank
// (n = 32 Mi). Host-homed: a backup of W, M, V (fp32 12 n; compact 3.25 n
// plus P's 2-byte slice: 5.25 n). NVMe-homed: a second extent of W, M, V and
// of P where P lives on NVMe too (fp32 12 n + 2 n; compact 5.25 n).
TEST(Simulator, SpeculationMemoryIsExact) {
  const ModelSpec m = FlatModel(16, 2u << 20);
  const ClusterSpec c = OneRankCluster(2e9, 1e9);
  const Layout l = MakeLayout(m, 1).value();
  const uint64_t n = 32u << 20;
  const std::string compact = R"("strata": {"state_format": "compact"}, )";
  struct Case {
    int stage;
    const char* p;
    const char* opt;
    std::string extra;
    uint64_t host, disk;
  };
  const Case cases[] = {
      {2, "none", "cpu", "", 12 * n, 0},  {2, "none", "cpu", compact, 5 * n + n / 4, 0},
      {3, "cpu", "cpu", "", 12 * n, 0},   {2, "none", "nvme", "", 0, 12 * n},
      {3, "nvme", "nvme", "", 0, 14 * n}, {3, "nvme", "nvme", compact, 0, 5 * n + n / 4},
  };
  for (const Case& k : cases) {
    const Config cfg = Cfg(k.stage, k.p, k.opt, k.extra);
    const std::string what = std::string(k.p) + "/" + k.opt + " " + k.extra;
    const Capacity without = ComputeCapacity(m, l, c, cfg);
    const Capacity cap = ComputeCapacity(m, l, c, cfg, /*overlap_step=*/true);
    const auto row = [&](const Capacity& x, TierKind t) {
      return x.bytes[static_cast<size_t>(PlanState::kSpeculation)][static_cast<size_t>(t)];
    };
    EXPECT_EQ(row(without, TierKind::kHost) + row(without, TierKind::kNvme), 0u) << what;
    EXPECT_EQ(cap.speculation.host_needed, k.host) << what;
    EXPECT_EQ(cap.speculation.disk_needed, k.disk) << what;
    EXPECT_EQ(row(cap, TierKind::kHost), k.host) << what;  // "auto": all of it, where there is room
    EXPECT_EQ(row(cap, TierKind::kNvme), k.disk) << what;
    EXPECT_EQ(cap.Used(TierKind::kHost), without.Used(TierKind::kHost) + k.host) << what;
    EXPECT_EQ(cap.Used(TierKind::kNvme), without.Used(TierKind::kNvme) + k.disk) << what;
    EXPECT_EQ(cap.speculation.Groups(), 16) << what;
    auto r = Simulate(m, c, cfg, {.overlap_step = true});
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->spec_host_bytes, k.host) << what;
    EXPECT_EQ(r->spec_disk_bytes, k.disk) << what;
    EXPECT_EQ(r->speculated_fraction, 1.0) << what;
  }

  // The host budget leaves room for half the backups: "auto" takes that
  // half, and the last 8 groups (the first whose gradients complete) speculate.
  const Config base = Cfg(2, "none", "cpu");
  const uint64_t used = ComputeCapacity(m, l, c, base).Used(TierKind::kHost);
  Config half = base;
  half.strata.host_budget = used + 6 * n;
  const Capacity h = ComputeCapacity(m, l, c, half, true);
  EXPECT_EQ(h.speculation.host_bytes, 6 * n);
  EXPECT_EQ(h.Used(TierKind::kHost), h.capacity[static_cast<size_t>(TierKind::kHost)]) << "never over";
  ASSERT_EQ(h.speculation.granted.size(), 16u);
  for (int g = 0; g < 16; ++g) EXPECT_EQ(h.speculation.granted[static_cast<size_t>(g)], g >= 8 ? 1 : 0) << g;
  auto rh = Simulate(m, l, h, c, half, {.overlap_step = true});
  EXPECT_EQ(rh.speculated_groups, 8);
  EXPECT_DOUBLE_EQ(rh.speculated_fraction, 0.5);
  // strata.speculation_host_bytes given: that much, whatever is left.
  Config quarter = base;
  quarter.strata.speculation_host_bytes = 3 * n;
  const Capacity q = ComputeCapacity(m, l, c, quarter, true);
  EXPECT_EQ(q.speculation.host_bytes, 3 * n);
  EXPECT_EQ(q.speculation.Groups(), 4);
  // 0 on NVMe: no group speculates.
  Config none = Cfg(2, "none", "nvme");
  none.strata.speculation_disk_bytes = 0;
  auto rz = Simulate(m, c, none, {.overlap_step = true});
  ASSERT_TRUE(rz.ok());
  EXPECT_EQ(rz->speculated_groups, 0);
}

// W, M, V on the GPU are updated in place there: nothing could undo it, so
// no group speculates (the overlapped step is then the step without it).
TEST(Simulator, GpuUpdatedGroupsDoNotSpeculate) {
  Xl x;
  auto over = Simulate(x.m, x.c, Cfg(2, "none", "none"), {.overlap_step = true});
  ASSERT_TRUE(over.ok());
  EXPECT_EQ(over->spec_groups_eligible, 0);
  EXPECT_EQ(over->speculated_groups, 0);
  EXPECT_EQ(over->spec_host_bytes + over->spec_disk_bytes, 0u);
}

// --auto charges speculation to the tiers: with host memory short, the
// overlapped candidates take what is left (fewer groups speculate, no
// budget is passed), and on the 1T DGX-2 plan, whose disk cannot hold a
// second copy of W, M, V and P, the overlapped candidate reserves the swap
// that is left (strata.speculation_disk_bytes) and speculates what fits.
TEST(Simulator, AutoChargesSpeculationToTheTiers) {
  const ModelSpec m = PresetModel("13b").value();
  ClusterSpec c = PresetCluster("dgx-h100").value();
  c.host_bytes = 400 * kGiB;  // 45 GiB a rank: state fits, most backups do not
  Result<AutoPlan> a = PlanAuto(m, c, Cfg(3, "none", "none", R"("gradient_clipping": 1.0, )"), "/nvme");
  ASSERT_TRUE(a.ok());
  int short_of_room = 0;
  for (const Candidate& k : a->candidates) {
    if (!k.simulated || !k.overlap_step) continue;
    const Speculation& s = k.capacity.speculation;
    EXPECT_TRUE(k.capacity.Fits()) << k.Label();
    EXPECT_LE(s.host_granted, s.host_bytes) << k.Label();
    EXPECT_EQ(
        k.capacity.bytes[static_cast<size_t>(PlanState::kSpeculation)][static_cast<size_t>(TierKind::kHost)],
        s.host_bytes);
    if (s.host_needed > s.host_bytes) {
      ++short_of_room;
      EXPECT_LT(k.sim.speculated_groups, k.sim.groups) << k.Label();
      EXPECT_LT(k.sim.speculated_fraction, 1.0) << k.Label();
    }
  }
  EXPECT_GT(short_of_room, 0);

  const ModelSpec t = PresetModel("1t").value();
  Result<AutoPlan> d = PlanAuto(t, PresetCluster("dgx2").value(), Cfg(3, "none", "none"), "/nvme");
  ASSERT_TRUE(d.ok());
  bool seen = false;
  for (const Candidate& k : d->candidates) {
    if (k.Label() != "stage 3, P nvme, W/M/V nvme, overlap") continue;
    seen = true;
    ASSERT_TRUE(k.simulated);
    const Speculation& s = k.capacity.speculation;
    EXPECT_EQ(k.config.strata.speculation_disk_bytes, s.disk_granted);
    EXPECT_EQ(s.disk_bytes, s.disk_granted);
    EXPECT_LT(s.disk_granted, s.disk_needed);
    EXPECT_GT(k.sim.speculated_groups, 0);
    EXPECT_LT(k.sim.speculated_groups, k.sim.groups);
  }
  EXPECT_TRUE(seen);
}

// Activation offload (strata.activation_*; WithActivationOffload sizes it as
// strata-train's --offload-activations): every stashable byte goes to the
// host and back over PCIe, and through NVMe past a two-layer arena; it runs
// beside the layers, and a disk too slow for it makes backward wait.
TEST(Simulator, ActivationOffloadMovesItsBytesBesideTheLayers) {
  const ModelSpec m = PresetModel("gpt2-medium").value();
  ClusterSpec c = PresetCluster("dgx-h100").value();
  c.nodes = c.gpus_per_node = 1;
  const Config base = Cfg(3, "none", "cpu");
  const uint64_t stashable = StashableActivationBytes(m);
  ASSERT_GT(stashable, 0u);
  auto sim = [&](const Config& cfg, const ClusterSpec& cl) {
    auto r = Simulate(m, cl, cfg, {});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return *r;
  };
  const SimResult none = sim(base, c), host = sim(WithActivationOffload(base, m, "host", "/nvme"), c),
                  nvme = sim(WithActivationOffload(base, m, "nvme", "/nvme"), c);
  EXPECT_EQ(none.act_bytes, 0u);
  EXPECT_NEAR(static_cast<double>(host.act_bytes), static_cast<double>(stashable), 1e-6 * stashable);
  EXPECT_EQ(host.act_nvme_bytes, 0u);
  EXPECT_NEAR(static_cast<double>(host.pcie_bytes - none.pcie_bytes), 2.0 * host.act_bytes, 1e-6 * stashable);
  EXPECT_EQ(host.disk_write_bytes, none.disk_write_bytes);
  // Through NVMe: all but the arena's two layers' inputs less the read-ahead room.
  EXPECT_GT(nvme.act_nvme_bytes, stashable / 2);
  EXPECT_LT(nvme.act_nvme_bytes, stashable);
  EXPECT_EQ(nvme.disk_write_bytes - none.disk_write_bytes, nvme.act_nvme_bytes);
  EXPECT_EQ(nvme.disk_read_bytes - none.disk_read_bytes, nvme.act_nvme_bytes);
  EXPECT_LE(nvme.act_stalls, 1u) << "read ahead: at most the first redeem from NVMe waits for the disk";
  ClusterSpec slow = c;
  slow.nvme_read_Bps = slow.nvme_write_Bps = 50e6;
  const SimResult crawl = sim(WithActivationOffload(base, m, "nvme", "/nvme"), slow);
  EXPECT_GT(crawl.act_stalls, 0u);
}

// --auto offloads activations where they do not fit on the device, and not
// where they do (the copies cost PCIe and, past the arena, disk).
TEST(Simulator, AutoOffloadsActivationsOnlyWhereTheyDoNotFit) {
  ModelSpec m = PresetModel("gpt2-large").value();
  ClusterSpec c = PresetCluster("dgx-h100").value();
  c.nodes = c.gpus_per_node = 1;
  Result<AutoPlan> roomy = PlanAuto(m, c, Cfg(3, "none", "none"), "/nvme");
  ASSERT_TRUE(roomy.ok());
  ASSERT_GE(roomy->best, 0);
  EXPECT_EQ(roomy->candidates[static_cast<size_t>(roomy->best)].activations, "")
      << roomy->candidates[static_cast<size_t>(roomy->best)].Label();
  // gpt2-xl at 256 x 256 tokens: its 48 checkpointed inputs (10 GB) and one
  // layer's working set (6 GB) do not fit a 12 GiB device together.
  m = PresetModel("gpt2-xl").value();
  m.micro_batch = 256;
  c.device_bytes = 12 * kGiB;
  Result<AutoPlan> tight = PlanAuto(m, c, Cfg(3, "none", "none"), "/nvme");
  ASSERT_TRUE(tight.ok());
  ASSERT_GE(tight->best, 0) << "nothing fits";
  const Candidate& best = tight->candidates[static_cast<size_t>(tight->best)];
  EXPECT_NE(best.activations, "") << best.Label();
  EXPECT_TRUE(best.capacity.Fits()) << best.Label();
  for (const Candidate& k : tight->candidates)
    if (k.activations.empty()) {
      EXPECT_FALSE(k.capacity.Fits()) << k.Label() << " fits without offload";
    }
}

}  // namespace
}  // namespace strata::plan
