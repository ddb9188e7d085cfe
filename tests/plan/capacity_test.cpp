// strata-plan's capacity figures against the published accounting:
// the ZeRO paper (Rajbhandari et al. 2020, mixed-precision Adam: 2 + 2 + 12
// bytes per parameter, divided by N as each stage partitions), ZeRO-Offload
// (Ren et al. 2021: fp16 P on the GPU, fp32 W, M, V and gradients = 16 bytes
// on the CPU, partitioned) and ZeRO-Infinity (Rajbhandari et al. 2021: P and
// optimizer state on NVMe; a 1T model on one DGX-2 only that way).
#include "tools/plan/capacity.h"

#include <gtest/gtest.h>

#include "tools/plan/placement.h"

namespace strata::plan {
namespace {

constexpr uint32_t kNodes = 8, kGpus = 8, kN = kNodes * kGpus;
constexpr uint64_t kGroups = 24;
constexpr uint64_t kGroupNumel = kN * 2048 * 100;  // shards exactly: no padding
constexpr uint64_t kPsi = kGroups * kGroupNumel;

ModelSpec Model() {
  ModelSpec m;
  m.name = "zero-check";
  for (uint64_t g = 0; g < kGroups; ++g) m.groups.push_back({"g" + std::to_string(g), kGroupNumel, false});
  return m;  // no shape: no activation estimate
}

ClusterSpec Cluster() {
  ClusterSpec c = PresetCluster("dgx-a100").value();
  c.nodes = kNodes;
  c.gpus_per_node = kGpus;
  return c;
}

Capacity Cap(int stage, const char* param, const char* optimizer, const char* format = "fp32",
             const char* opt_type = "AdamW") {
  const std::string json = std::string(R"({"bf16": {"enabled": true}, "optimizer": {"type": ")") + opt_type +
                           R"("}, "strata": {"state_format": ")" + format + R"("},
    "zero_optimization": {"stage": )" +
                           std::to_string(stage) + R"(, "offload_param": {"device": ")" + param +
                           R"(", "nvme_path": "/nvme"}, "offload_optimizer": {"device": ")" + optimizer +
                           R"(", "nvme_path": "/nvme"}}})";
  auto cfg = ParseConfig(json);
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  // The papers' placement: G beside W, M, V on NVMe (GradHome tests "auto").
  if (cfg.ok()) cfg->strata.grad_home = "nvme";
  auto cap = ComputeCapacity(Model(), Cluster(), *cfg);
  EXPECT_TRUE(cap.ok()) << cap.status().ToString();
  return *cap;
}

uint64_t Dev(const Capacity& c) { return c.ModelStates(TierKind::kDevice); }
uint64_t Host(const Capacity& c) { return c.ModelStates(TierKind::kHost); }
uint64_t Nvme(const Capacity& c) { return c.ModelStates(TierKind::kNvme); }

// A model file's counts are whole numbers within what the sizes can hold,
// refused by name where not: 2048.7 was 2048, a hidden of 2^32 wrapped its
// groups' sizes to 6.4e10 parameters, 1e9 layers ran out of memory.
TEST(ModelFile, CountsAreWholeAndBounded) {
  for (const char* bad : {R"({"layers": 1, "hidden": 4294967296, "vocab": 1, "context": 1})",
                          R"({"layers": 2, "hidden": 64, "seq": 2048.7})",
                          R"({"groups": [{"name": "a", "numel": 2.5}]})",
                          R"({"groups": [{"name": "a", "numel": 1e13}]})",
                          R"({"layers": 1e9, "hidden": 64})",
                          R"({"layers": 2, "hidden": 64, "micro_batch": -1})",
                          R"({"layers": 2, "hidden": 64, "vocab": 1e30})"}) {
    auto m = ParseModelJson(bad);
    EXPECT_FALSE(m.ok()) << bad;
    if (!m.ok()) {
      EXPECT_NE(m.status().message().find("model."), std::string::npos) << m.status().message();
    }
  }
  auto ok = ParseModelJson(R"({"layers": 2, "hidden": 64, "seq": 2048.0, "groups": [{"numel": 1e6}]})");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->seq, 2048u);
  EXPECT_EQ(ok->groups[0].numel, 1000000u);
}

// An activation estimate past 2^64 bytes (a 1T model at a 1 Mi-token context,
// 256 sequences, no checkpointing: 2.9e19) saturates: the plan does not fit.
// It converted to 0 and the plan fit.
TEST(Activations, AnEstimatePast64BitsDoesNotFit) {
  ModelSpec m = PresetModel("1t").value();
  m.seq = 1 << 20;
  m.micro_batch = 256;
  m.checkpointing = false;
  EXPECT_EQ(ActivationBytes(m), UINT64_MAX);
  const ClusterSpec c = PresetCluster("dgx-h100").value();
  const Config base = ParseConfig(R"({"bf16": {"enabled": true}})").value();
  const Layout l = MakeLayout(m, c.world_size()).value();
  const Config cfg = WithPlacement(base, 3, OffloadDevice::kNvme, OffloadDevice::kNvme, "/nvme", l, nullptr);
  const Capacity cap = ComputeCapacity(m, l, c, cfg);
  EXPECT_FALSE(cap.Fits());
  EXPECT_EQ(cap.Used(TierKind::kDevice), UINT64_MAX);
}

// ZeRO paper, Figure 1 / section 5: per-device model states, K = 12.
TEST(ZeroPaper, StagesWithoutOffload) {
  EXPECT_EQ(Dev(Cap(0, "none", "none")), (2 + 2 + 12) * kPsi);
  EXPECT_EQ(Dev(Cap(1, "none", "none")), 4 * kPsi + 12 * kPsi / kN);
  EXPECT_EQ(Dev(Cap(2, "none", "none")), 2 * kPsi + 14 * kPsi / kN);
  EXPECT_EQ(Dev(Cap(3, "none", "none")), 16 * kPsi / kN);
  for (int s = 0; s <= 3; ++s) {
    EXPECT_EQ(Host(Cap(s, "none", "none")), 0u) << "stage " << s;
    EXPECT_EQ(Nvme(Cap(s, "none", "none")), 0u) << "stage " << s;
  }
}

TEST(ZeroPaper, PerStateDivision) {
  const Capacity c = Cap(2, "none", "none");
  const auto dev = static_cast<size_t>(TierKind::kDevice);
  EXPECT_EQ(c.bytes[size_t(PlanState::kP)][dev], 2 * kPsi);       // replicated
  EXPECT_EQ(c.bytes[size_t(PlanState::kG)][dev], 2 * kPsi / kN);  // reduce-scattered
  EXPECT_EQ(c.bytes[size_t(PlanState::kW)][dev], 4 * kPsi / kN);  // partitioned
  EXPECT_EQ(c.bytes[size_t(PlanState::kM)][dev], 4 * kPsi / kN);
  EXPECT_EQ(c.bytes[size_t(PlanState::kV)][dev], 4 * kPsi / kN);
}

// ZeRO-Offload: the GPU keeps the 16-bit parameters (2 Psi, or 2 Psi / N in
// stage 3); the CPU the fp32 master weights, moments and gradients, 16 Psi,
// partitioned over the N ranks (DeepSpeed's estimate_zero2/zero3 "cpu_offload"
// formulas without their 1.5 buffer factor: gpu 2 Psi, cpu 16 Psi per node / nodes).
TEST(ZeroOffload, OptimizerOnCpu) {
  for (int s = 1; s <= 2; ++s) {
    const Capacity c = Cap(s, "none", "cpu");
    EXPECT_EQ(Dev(c), 2 * kPsi) << "stage " << s;
    EXPECT_EQ(Host(c), 16 * kPsi / kN) << "stage " << s;
    EXPECT_EQ(Host(c) * kGpus, 16 * kPsi / kNodes) << "per node, stage " << s;
  }
  const Capacity c3 = Cap(3, "none", "cpu");
  EXPECT_EQ(Dev(c3), 2 * kPsi / kN);
  EXPECT_EQ(Host(c3), 16 * kPsi / kN);
  // DeepSpeed's estimate_zero3 with offload_param too: 18 Psi per node / nodes on the CPU.
  const Capacity both = Cap(3, "cpu", "cpu");
  EXPECT_EQ(Dev(both), 0u);
  EXPECT_EQ(Host(both) * kGpus, 18 * kPsi / kNodes);
}

// ZeRO-Infinity: parameters and optimizer state on NVMe: 18 Psi / N per rank.
TEST(ZeroInfinity, EverythingOnNvme) {
  const Capacity c = Cap(3, "nvme", "nvme");
  EXPECT_EQ(Dev(c), 0u);
  EXPECT_EQ(Host(c), 0u);
  EXPECT_EQ(Nvme(c), 18 * kPsi / kN);
  EXPECT_GT(c.bytes[size_t(PlanState::kStaging)][size_t(TierKind::kHost)],
            0u);  // the swap buffers are pinned
}

// A 1T model (ZeRO-Infinity's 128 layers x 25600) for fine-tuning on one
// DGX-2 (16 x 32 GB, 1.5 TB, NVMe): fits only with P and W/M/V on NVMe.
TEST(ZeroInfinity, OneTrillionOnOneDgx2) {
  const ModelSpec m = PresetModel("1t").value();
  EXPECT_NEAR(static_cast<double>(m.total_numel()), 1.0e12, 0.02e12);
  const ClusterSpec dgx2 = PresetCluster("dgx2").value();
  ASSERT_EQ(dgx2.world_size(), 16u);
  const Config base = ParseConfig(R"({"bf16": {"enabled": true}})").value();
  const Layout l = MakeLayout(m, 16).value();
  const OffloadDevice kAll[] = {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme};
  for (int stage = 0; stage <= 3; ++stage)
    for (OffloadDevice p : kAll)
      for (OffloadDevice o : kAll) {
        const Config cfg = WithPlacement(base, stage, p, o, "/nvme", l, nullptr);
        const Capacity c = ComputeCapacity(m, l, dgx2, cfg);
        const bool want = stage == 3 && p == OffloadDevice::kNvme && o == OffloadDevice::kNvme;
        EXPECT_EQ(c.Fits(), want) << "stage " << stage << " P " << OffloadDeviceName(p) << " W/M/V "
                                  << OffloadDeviceName(o) << ": "
                                  << (c.Problems().empty() ? "" : c.Problems()[0]);
      }
  // CPU offload alone: the host cannot hold 16 bytes (or even the 2 bytes of P) per parameter.
  const Capacity cpu = ComputeCapacity(
      m, l, dgx2, WithPlacement(base, 3, OffloadDevice::kCpu, OffloadDevice::kCpu, "", l, nullptr));
  EXPECT_FALSE(cpu.Fits(TierKind::kHost));
  EXPECT_GT(cpu.Used(TierKind::kHost) * 16, 16 * m.total_numel());
  // The fit: about 18 TB on the node's NVMe, the host holding only staging buffers.
  const Capacity inf = ComputeCapacity(
      m, l, dgx2, WithPlacement(base, 3, OffloadDevice::kNvme, OffloadDevice::kNvme, "/nvme", l, nullptr));
  EXPECT_NEAR(static_cast<double>(inf.ModelStates(TierKind::kNvme) * 16), 18.0 * 1.007e12, 0.2e12);
  auto best = PlanAuto(m, dgx2, base, "/nvme");
  ASSERT_TRUE(best.ok());
  ASSERT_GE(best->best, 0);
  const Config& chosen = best->candidates[static_cast<size_t>(best->best)].config;
  EXPECT_EQ(chosen.zero.stage, 3);
  EXPECT_EQ(chosen.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(chosen.zero.offload_optimizer.device, OffloadDevice::kNvme);
}

// strata.state_format "compact" (kernels/cpu/compact.h, stored as
// engine/layout/staging_plan.cpp sizes it): the master is P's bf16 half (2 B, in P's
// home) plus W's int8 corrections (1 B), M and V 1 B + a 4-byte scale per 32
// elements = 1.125 B each, G fp32 (4 B). kPsi / kN and every shard are
// multiples of 32: the figures are exact.
constexpr uint64_t kRank = kPsi / kN;
size_t S(PlanState s) { return static_cast<size_t>(s); }

// strata.grad_home "auto" as the engine's build decides it: G in host memory
// when the host tier holds it there, else beside W, M, V on NVMe.
TEST(GradHome, AutoKeepsGInHostMemoryWhenItFits) {
  auto capacity = [](const std::string& strata) {
    auto cfg = ParseConfig(R"({"bf16": {"enabled": true}, "strata": {)" + strata + R"(},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}})");
    EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
    auto cap = ComputeCapacity(Model(), Cluster(), *cfg);
    EXPECT_TRUE(cap.ok()) << cap.status().ToString();
    return *cap;
  };
  const size_t g = static_cast<size_t>(PlanState::kG);
  const Capacity nvme = capacity(R"("grad_home": "nvme")"), automatic = capacity("");
  EXPECT_FALSE(nvme.g_on_host);
  EXPECT_EQ(nvme.bytes[g][static_cast<size_t>(TierKind::kNvme)], 4 * kPsi / kN);
  EXPECT_TRUE(automatic.g_on_host);
  EXPECT_EQ(automatic.bytes[g][static_cast<size_t>(TierKind::kHost)], 4 * kPsi / kN);
  EXPECT_EQ(automatic.bytes[g][static_cast<size_t>(TierKind::kNvme)], 0u);
  EXPECT_EQ(Nvme(automatic) + 4 * kPsi / kN, Nvme(nvme));
  // A host budget below G: "auto" puts it on NVMe, as "nvme" does.
  const Capacity tight = capacity(R"("host_budget": )" + std::to_string(4 * kPsi / kN / 2));
  EXPECT_FALSE(tight.g_on_host);
  EXPECT_EQ(tight.bytes[g][static_cast<size_t>(TierKind::kNvme)], 4 * kPsi / kN);
}
size_t T(TierKind t) { return static_cast<size_t>(t); }

TEST(CompactFormat, EverythingOnNvmeBytesPerParameter) {
  const Capacity f = Cap(3, "nvme", "nvme", "fp32"), c = Cap(3, "nvme", "nvme", "compact");
  const size_t nvme = T(TierKind::kNvme);
  EXPECT_EQ(f.bytes[S(PlanState::kP)][nvme], 2 * kRank);
  EXPECT_EQ(f.bytes[S(PlanState::kW)][nvme], 4 * kRank);
  EXPECT_EQ(f.bytes[S(PlanState::kM)][nvme], 4 * kRank);
  EXPECT_EQ(f.bytes[S(PlanState::kV)][nvme], 4 * kRank);
  EXPECT_EQ(Nvme(f), 18 * kRank);
  EXPECT_EQ(c.bytes[S(PlanState::kP)][nvme], 2 * kRank);  // the master's bf16 half
  EXPECT_EQ(c.bytes[S(PlanState::kG)][nvme], 4 * kRank);  // G stays fp32
  EXPECT_EQ(c.bytes[S(PlanState::kW)][nvme], kRank);      // int8 corrections
  EXPECT_EQ(c.bytes[S(PlanState::kM)][nvme], kRank + kRank / 8);
  EXPECT_EQ(c.bytes[S(PlanState::kV)][nvme], kRank + kRank / 8);
  EXPECT_EQ(Nvme(c) * 4, 37 * kRank);  // 9.25 B a parameter against 18
  // P, W, M, V together are kernels/cpu/compact.h's CompactBytes.
  EXPECT_EQ(c.bytes[S(PlanState::kP)][nvme] + c.bytes[S(PlanState::kW)][nvme] +
                c.bytes[S(PlanState::kM)][nvme] + c.bytes[S(PlanState::kV)][nvme],
            5 * kRank + 8 * (kRank / 32));
  // The step's pinned slots shrink with the state they carry.
  EXPECT_LT(c.bytes[S(PlanState::kStaging)][T(TierKind::kHost)],
            f.bytes[S(PlanState::kStaging)][T(TierKind::kHost)]);
}

// P and W in different tiers: the bf16 half stays on the device with P.
TEST(CompactFormat, OptimizerOnCpu) {
  const Capacity c = Cap(3, "none", "cpu", "compact");
  EXPECT_EQ(Dev(c), 2 * kRank);
  EXPECT_EQ(Host(c) * 4, 29 * kRank);  // G 4 + W 1 + M 1.125 + V 1.125, against 16
  EXPECT_EQ(Host(Cap(3, "none", "cpu", "fp32")), 16 * kRank);
}

// On the device, per stage: stage 0 keeps everything whole, stage 2 a whole
// P (whose slice of this rank is the master's half) beside shards.
TEST(CompactFormat, OnTheDevicePerStage) {
  EXPECT_EQ(Dev(Cap(0, "none", "none", "compact")) * 4, 29 * kPsi);  // P 2 + G 2 + W 1 + M, V 2.25
  const Capacity s2 = Cap(2, "none", "none", "compact");
  const size_t dev = T(TierKind::kDevice);
  EXPECT_EQ(s2.bytes[S(PlanState::kP)][dev], 2 * kPsi);
  EXPECT_EQ(s2.bytes[S(PlanState::kG)][dev], 2 * kRank);
  EXPECT_EQ(s2.bytes[S(PlanState::kW)][dev], kRank);
  EXPECT_EQ(s2.bytes[S(PlanState::kM)][dev] * 8, 9 * kRank);
}

// Lion has no V: P + W + M = 4.125 B a parameter (fp32: 2 + 8).
TEST(CompactFormat, Lion) {
  const Capacity lion = Cap(3, "nvme", "nvme", "compact", "Lion");
  const size_t nvme = T(TierKind::kNvme);
  EXPECT_EQ(lion.bytes[S(PlanState::kV)][nvme], 0u);
  EXPECT_EQ((lion.bytes[S(PlanState::kP)][nvme] + lion.bytes[S(PlanState::kW)][nvme] +
             lion.bytes[S(PlanState::kM)][nvme]) *
                8,
            33 * kRank);
  EXPECT_EQ(Nvme(lion) * 8, (33 + 32) * kRank);  // + G 4
  EXPECT_EQ(Nvme(Cap(3, "nvme", "nvme", "fp32", "Lion")), 14 * kRank);
}

// Compact's block scales round up per group (stage 0: whole, unpadded groups).
TEST(CompactFormat, ScalesRoundUpPerGroup) {
  ModelSpec m;
  m.name = "odd";
  m.groups = {{"a", 33, false}, {"b", 33, false}};
  const ClusterSpec local = PresetCluster("local").value();
  auto cfg = ParseConfig(
      R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW"}, "strata": {"state_format": "compact"},
    "zero_optimization": {"stage": 0}})");
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  const Layout l = MakeLayout(m, 1).value();
  const Capacity c = ComputeCapacity(m, l, local, *cfg);
  const size_t dev = T(TierKind::kDevice);
  EXPECT_EQ(c.bytes[S(PlanState::kM)][dev], 2 * (33 + 4 * 2u));
  EXPECT_EQ(c.bytes[S(PlanState::kV)][dev], 2 * (33 + 4 * 2u));
  EXPECT_EQ(c.bytes[S(PlanState::kW)][dev], 66u);
  EXPECT_EQ(c.bytes[S(PlanState::kP)][dev], 2 * 66u);
}

TEST(CompactFormat, AdagradIsRefused) {
  auto cfg = ParseConfig(R"({"optimizer": {"type": "Adagrad"}, "strata": {"state_format": "compact"}})");
  ASSERT_FALSE(cfg.ok());
  EXPECT_NE(cfg.status().ToString().find("state_format"), std::string::npos) << cfg.status().ToString();
}

// The 1T plan on one DGX-2 in compact: still only NVMe fits (CPU offload
// needs 9.25 B a parameter of host memory), with about half the NVMe bytes.
TEST(CompactFormat, OneTrillionOnOneDgx2) {
  const ModelSpec m = PresetModel("1t").value();
  const ClusterSpec dgx2 = PresetCluster("dgx2").value();
  const Config base =
      ParseConfig(R"({"bf16": {"enabled": true}, "strata": {"state_format": "compact"}})").value();
  auto best = PlanAuto(m, dgx2, base, "/nvme");
  ASSERT_TRUE(best.ok());
  ASSERT_GE(best->best, 0);
  const Candidate& c = best->candidates[static_cast<size_t>(best->best)];
  EXPECT_EQ(c.config.strata.state_format, "compact") << "--auto keeps the format";
  EXPECT_EQ(c.config.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.config.zero.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_NEAR(static_cast<double>(c.capacity.ModelStates(TierKind::kNvme) * 16), 9.25 * 1.007e12, 0.1e12);
}

}  // namespace
}  // namespace strata::plan

namespace strata::plan {
namespace {

// The activation store (issue 34): what the trainer stashes leaves the
// device; the store's arena counts in host memory and its swap on NVMe, as
// the engine reserves them. gpt2-xl at 4 x 1024 with checkpointing: every
// layer's 2·B·T·C input (48 x 2 x 4 x 1024 x 1600 bytes) moves.
TEST(Activations, TheStoreMovesTheStashedInputsOffTheDevice) {
  ModelSpec m = PresetModel("gpt2-xl").value();
  m.micro_batch = 4;
  m.seq = 1024;
  ClusterSpec c = PresetCluster("dgx-a100").value();
  c.nodes = 1;
  c.gpus_per_node = 1;
  auto base = ParseConfig(R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}})");
  ASSERT_TRUE(base.ok());
  auto act = [](const Capacity& k, TierKind t) {
    return k.bytes[static_cast<size_t>(PlanState::kActivations)][static_cast<size_t>(t)];
  };
  const Capacity keep = ComputeCapacity(m, c, *base).value();
  uint64_t layer = 0;
  const uint64_t stash = StashableActivationBytes(m, &layer);
  EXPECT_EQ(stash, uint64_t{48} * 2 * 4 * 1024 * 1600);
  EXPECT_EQ(layer, uint64_t{2} * 4 * 1024 * 1600);
  EXPECT_EQ(act(keep, TierKind::kDevice), ActivationBytes(m));
  EXPECT_EQ(act(keep, TierKind::kHost), 0u);
  Config nvme = *base;
  nvme.strata.activation_host_bytes = 2 * layer;
  nvme.strata.activation_nvme_bytes = stash;
  const Capacity off = ComputeCapacity(m, c, nvme).value();
  EXPECT_EQ(act(off, TierKind::kDevice), ActivationBytes(m) - stash);
  EXPECT_EQ(act(off, TierKind::kHost), 2 * layer);
  EXPECT_GE(act(off, TierKind::kNvme), stash);
  // A store smaller than the stashes moves only what it holds.
  Config small = *base;
  small.strata.activation_host_bytes = layer;
  const Capacity part = ComputeCapacity(m, c, small).value();
  EXPECT_EQ(act(part, TierKind::kDevice), ActivationBytes(m) - layer);
}

}  // namespace
}  // namespace strata::plan
