// The memory the engine's "auto" budgets come from: RAM, at most a cgroup's
// memory limit (read from a tree laid out as /sys/fs/cgroup is), shared
// among the ranks on the host; budgets in bytes are each rank's, and all
// of them must fit.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "base/align.h"
#include "engine/config/config.h"
#include "engine/engine.h"
#include "tests/util/on_ranks.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::OnRanks;
using testing::TempDir;
using testing::WriteLine;

TEST(CgroupMemoryLimit, V1TakesTheTightestLimitOnThePathUp) {
  TempDir root;
  const fs::path mem = fs::path(root.path()) / "memory";
  WriteLine(mem / "memory.limit_in_bytes", "9223372036854771712");  // unlimited
  WriteLine(mem / "jobs" / "memory.limit_in_bytes", "8589934592");
  WriteLine(mem / "jobs" / "rank0" / "memory.limit_in_bytes", "17179869184");  // looser than its parent
  const std::string proc = "12:pids:/jobs/rank0\n4:memory:/jobs/rank0\n0::/\n";
  const CgroupLimit l = CgroupMemoryLimit(proc, root.path());
  EXPECT_EQ(l.bytes, 8 * kGiB);
  EXPECT_EQ(l.dir, (mem / "jobs").string());
}

TEST(CgroupMemoryLimit, V1UnlimitedIsNoLimit) {
  TempDir root;
  const fs::path mem = fs::path(root.path()) / "memory";
  WriteLine(mem / "memory.limit_in_bytes", "9223372036854771712");
  WriteLine(mem / "a" / "memory.limit_in_bytes", "9223372036854771712");
  const CgroupLimit l = CgroupMemoryLimit("4:memory:/a\n", root.path());
  EXPECT_EQ(l.bytes, 0u);
  EXPECT_EQ(l.dir, "");
}

// Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names
// the host's path, but the container's own cgroup is mounted at the root.
TEST(CgroupMemoryLimit, AContainerSeesItsCgroupAtTheMountRoot) {
  TempDir root;
  const fs::path mem = fs::path(root.path()) / "memory";
  WriteLine(mem / "memory.limit_in_bytes", "4294967296");
  const CgroupLimit l = CgroupMemoryLimit("9:cpu,memory:/docker/0123abcd\n", root.path());
  EXPECT_EQ(l.bytes, 4 * kGiB);
  EXPECT_EQ(l.dir, mem.string());
}

TEST(CgroupMemoryLimit, V2AloneAndHybrid) {
  TempDir alone;
  const fs::path a = alone.path();
  WriteLine(a / "cgroup.controllers", "cpu memory");
  WriteLine(a / "user.slice" / "memory.max", "max");
  WriteLine(a / "user.slice" / "job.scope" / "memory.max", "3221225472");
  CgroupLimit l = CgroupMemoryLimit("0::/user.slice/job.scope\n", alone.path());
  EXPECT_EQ(l.bytes, 3 * kGiB);
  EXPECT_EQ(l.dir, (a / "user.slice" / "job.scope").string());
  l = CgroupMemoryLimit("0::/user.slice\n", alone.path());
  EXPECT_EQ(l.bytes, 0u) << "\"max\" is no limit";

  TempDir hybrid;  // v2 at unified/, memory on v1: the tighter of both
  const fs::path h = hybrid.path();
  WriteLine(h / "unified" / "job" / "memory.max", "2147483648");
  WriteLine(h / "memory" / "job" / "memory.limit_in_bytes", "1073741824");
  l = CgroupMemoryLimit("4:memory:/job\n0::/job\n", hybrid.path());
  EXPECT_EQ(l.bytes, 1 * kGiB);
  EXPECT_EQ(l.dir, (h / "memory" / "job").string());
  l = CgroupMemoryLimit("0::/job\n", hybrid.path());
  EXPECT_EQ(l.bytes, 2 * kGiB);
}

TEST(CgroupMemoryLimit, MalformedLinesAndValuesAreSkipped) {
  TempDir root;
  const fs::path mem = fs::path(root.path()) / "memory";
  WriteLine(mem / "x" / "memory.limit_in_bytes", "lots");
  EXPECT_EQ(CgroupMemoryLimit("garbage\n4:memory:relative\n4:memory:/x\n", root.path()).bytes, 0u);
  EXPECT_EQ(CgroupMemoryLimit("", root.path()).bytes, 0u);
}

ConfigFacts Facts(uint32_t ranks) {
  ConfigFacts f;
  f.largest_group_numel = 1000;
  f.host_ram_bytes = 16 * kGiB;
  f.ranks_on_host = ranks;
  return f;
}

std::string Refusal(const Status& st) { return st.ok() ? "ok" : st.message(); }

TEST(HostMemory, BudgetsInBytesAreEachRanksAndMustAllFit) {
  auto c = ParseConfig(R"({"strata": {"host_budget": "6GiB"}})");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(ValidateConfig(*c, Facts(1)).ok());
  EXPECT_TRUE(ValidateConfig(*c, Facts(2)).ok());
  EXPECT_EQ(Refusal(ValidateConfig(*c, Facts(3))),
            "strata.host_budget: 6.00 GiB for each of the 3 ranks on this host (18.00 GiB in all) is above this "
            "machine's RAM (16.00 GiB)");
  ConfigFacts limited = Facts(1);
  limited.host_ram_bytes = 4 * kGiB;
  limited.ram_limit = "/sys/fs/cgroup/memory/job";
  EXPECT_EQ(Refusal(ValidateConfig(*c, limited)),
            "strata.host_budget: 6.00 GiB is above this machine's RAM (4.00 GiB: the memory limit of the cgroup "
            "/sys/fs/cgroup/memory/job)");

  auto both = ParseConfig(R"({"strata": {"host_budget": "3GiB", "device_budget": "2GiB"}})");
  ASSERT_TRUE(both.ok());
  ConfigFacts f = Facts(4);
  f.has_gpu = true;  // the device tier is the GPU's: only the host budgets add up (12 GiB)
  EXPECT_TRUE(ValidateConfig(*both, f).ok());
  f.has_gpu = false;
  EXPECT_EQ(Refusal(ValidateConfig(*both, f)),
            "strata.device_budget + strata.host_budget: 5.00 GiB for each of the 4 ranks on this host (20.00 GiB in "
            "all) is above this machine's RAM (16.00 GiB); without a GPU the device tier lives in host memory: lower "
            "strata.device_budget or strata.host_budget");
  f.ranks_on_host = 3;  // 15 GiB
  EXPECT_TRUE(ValidateConfig(*both, f).ok());
}

// Real Gloo ranks on this host: each counts the others (one all-gather at
// create), and the "auto" budgets are the host's share.
TEST(HostMemory, RanksOnThisHostShareTheAutoBudgets) {
  const ConfigFacts machine = ProbeMachineFacts();
  ASSERT_GT(machine.host_ram_bytes, 0u);
  auto cfg = ParseConfig("{}");
  ASSERT_TRUE(cfg.ok());
  EngineOptions alone;
  alone.force_no_gpu = true;
  auto one = Engine::Create(*cfg, alone);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ((*one)->stats().host.budget, machine.host_ram_bytes / 2);
  EXPECT_EQ((*one)->stats().device.budget, machine.host_ram_bytes / 4);
  one->reset();

  for (const int world : {2, 3}) {
    std::vector<EngineStats> stats(static_cast<size_t>(world));
    std::vector<int> sharers(static_cast<size_t>(world));
    OnRanks(world, [&](int rank, net::Communicator& comm) {
      EngineOptions o;
      o.comm = &comm;
      o.force_no_gpu = true;
      auto e = Engine::Create(*cfg, o);
      ASSERT_TRUE(e.ok()) << e.status().ToString();
      stats[static_cast<size_t>(rank)] = (*e)->stats();
      sharers[static_cast<size_t>(rank)] = (*e)->placement().cpu_sharers;
    });
    // Ranks that are threads of one process share its CPU kernels' arena:
    // one process on these CPUs (tests/python/test_cpu_share.py: several).
    EXPECT_EQ(sharers, std::vector<int>(static_cast<size_t>(world), 1)) << world << " ranks";
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(stats[static_cast<size_t>(r)].host.budget, machine.host_ram_bytes / 2 / world) << world << " ranks";
      EXPECT_EQ(stats[static_cast<size_t>(r)].device.budget, machine.host_ram_bytes / 4 / world) << world << " ranks";
    }
  }
}

// A rank's engine (no GPU) with one group "w" of `numel` elements (`init`,
// or zeros where null), built: Build's status in *built (null: not made).
std::unique_ptr<Engine> BuildOnRank(const Config& cfg, net::Communicator& comm, uint64_t numel, const float* init,
                                    Status* built) {
  EngineOptions o;
  o.comm = &comm;
  o.force_no_gpu = true;
  auto e = Engine::Create(cfg, o);
  *built = e.ok() ? (*e)->AddParam(0, "w", numel, init).status() : e.status();
  if (!built->ok()) return nullptr;
  *built = (*e)->Build();
  return std::move(e).value();
}

// A budget in bytes that one rank's RAM holds, but not two ranks': refused
// at build on every rank, naming the count.
TEST(HostMemory, TwoRanksWhoseBudgetsDoNotFitAreRefusedAtBuild) {
  const ConfigFacts machine = ProbeMachineFacts();
  const uint64_t budget = machine.host_ram_bytes / 5 * 3;  // 60% of RAM each
  auto cfg = ParseConfig(R"({"strata": {"device_budget": "64MiB", "host_budget": )" + std::to_string(budget) + "}}");
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  std::vector<Status> built(2);
  OnRanks(2, [&](int rank, net::Communicator& comm) {
    const std::vector<float> w(4096, 0.5f);
    BuildOnRank(*cfg, comm, w.size(), w.data(), &built[static_cast<size_t>(rank)]);
  });
  for (const Status& st : built) {
    EXPECT_EQ(st.code(), Code::kConfig) << st.ToString();
    EXPECT_NE(st.message().find("for each of the 2 ranks on this host"), std::string::npos) << st.ToString();
  }
}

// A field of /proc/self/status in KiB (VmHWM: the peak resident set).
uint64_t StatusKiB(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string key;
  uint64_t kib = 0;
  while (f >> key) {
    if (key == field + ":") {
      f >> kib;
      return kib;
    }
    f.ignore(1 << 20, '\n');
  }
  ADD_FAILURE() << "/proc/self/status has no " << field;
  return 0;
}

// Ranks that register a model without values (one larger than RAM, written
// after build) take no memory for them at build: only the values rank 0 was
// given are broadcast. Before, every rank grew every group to its whole
// fp32 size for the broadcast (here 128 MiB a rank, outside every budget).
// The resident peak over the build stays within what the tiers took.
TEST(HostMemory, RanksRegisteredWithoutValuesTakeNoMemoryForThemAtBuild) {
  constexpr uint64_t kNumel = uint64_t{32} << 20;  // 128 MiB of fp32
  auto cfg = ParseConfig(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
      "offload_param": {"device": "cpu"}}, "strata": {"device_budget": "256MiB", "host_budget": "512MiB"}})");
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  {
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";  // the peak starts again from here (Linux 4.0+)
    if (!reset.flush()) GTEST_SKIP() << "cannot reset the resident peak (/proc/self/clear_refs)";
  }
  const uint64_t before = StatusKiB("VmHWM");
  if (before > StatusKiB("VmRSS") + 16 * 1024)  // (reset: the peak is what is resident now)
    GTEST_SKIP() << "the resident peak was not reset (" << before << " KiB against " << StatusKiB("VmRSS") << " resident)";
  std::vector<uint64_t> tiers(2);
  OnRanks(2, [&](int rank, net::Communicator& comm) {
    Status st;
    auto e = BuildOnRank(*cfg, comm, kNumel, nullptr, &st);
    ASSERT_TRUE(e && st.ok()) << st.ToString();
    const EngineStats s = e->stats();
    tiers[static_cast<size_t>(rank)] = s.host.peak + s.device.peak;
  });
  const uint64_t rise = (StatusKiB("VmHWM") - std::min(before, StatusKiB("VmHWM"))) * 1024;
  // What the build writes: each rank's shard of fp32 W, M, V and G (P is
  // W's bytes here), 16 bytes an element of half the group; and a little
  // (the ranks' threads, Gloo's buffers). The values, grown for the
  // broadcast, were 4 bytes an element of the whole group on each rank.
  const uint64_t state = 2 * 16 * (kNumel / 2), allowed = state + 64 * kMiB;
  EXPECT_LE(rise, allowed) << "the resident peak rose by " << rise / kMiB << " MiB over the build; its state is "
                           << state / kMiB << " MiB (the tiers took at most " << (tiers[0] + tiers[1]) / kMiB << " MiB)";
}

// Pages pinned in this process (/proc/self/status VmPin, KiB): io_uring's
// fixed buffers count there, with CAP_IPC_LOCK or without.
uint64_t PinnedKiB() { return StatusKiB("VmPin"); }

// The host tier's memory is registered with io_uring (pinned) only where the
// config puts state on NVMe: with the optimizer offloaded to the CPU nothing
// but checkpoints goes through the ring, and the host tier stays unpinned.
TEST(HostMemory, PinnedForIoUringOnlyWithStateOnNvme) {
  TempDir swap;
  std::vector<float> w(1 << 20, 0.25f);  // 4 MiB a state
  const std::string offload[] = {"cpu", "nvme"};
  for (const std::string& device : offload) {
    const uint64_t before = PinnedKiB();
    auto cfg = ParseConfig(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": ")" + device +
                           R"(", "nvme_path": ")" + swap.path() + R"("}}, "strata": {"device_budget": "64MiB",
                           "host_budget": "256MiB"}})");
    ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
    EngineOptions o;
    o.force_no_gpu = true;
    auto e = Engine::Create(*cfg, o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    ASSERT_TRUE((*e)->AddParam(0, "w", w.size(), w.data()).ok());
    ASSERT_TRUE((*e)->Build().ok());
    const uint64_t pinned = PinnedKiB() - before;
    if (device == "cpu") {
      EXPECT_EQ(pinned, 0u) << "offload_optimizer cpu: the host tier's W, M, V pinned for io_uring";
    } else {
      // The NVMe run's staging (W, M, V of the group) is registered: at
      // least one state's 4 MiB, where this process may pin it (root, or a
      // large RLIMIT_MEMLOCK; else registering fails, with a warning).
      rlimit lim{};
      const bool may_pin = geteuid() == 0 || (getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur >= (256u << 20));
      if (!may_pin) GTEST_SKIP() << "this process may not pin 256 MiB (ulimit -l): the nvme half is unchecked";
      EXPECT_GE(pinned, 4096u) << "offload_optimizer nvme: the staging registered with io_uring";
    }
  }
}

}  // namespace
}  // namespace strata
