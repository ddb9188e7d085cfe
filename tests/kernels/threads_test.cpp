// The CPU kernels' thread count: the affinity mask, at most the cgroup's CPU
// limit. The limit read from made-up cgroup trees (v1, v2, hybrid), and from
// a real cgroup with a CPU quota that a child process joins.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "base/cgroup.h"
#include "kernels/cpu/parallel.h"
#include "tests/util/temp_dir.h"

namespace strata::kernels {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;
using testing::WriteLine;

TEST(CgroupCpuLimit, V2TakesTheTightestQuotaOnThePathUp) {
  TempDir root;
  const fs::path r(root.path());
  WriteLine(r / "cgroup.controllers", "cpu memory");
  WriteLine(r / "cpu.max", "max 100000");
  WriteLine(r / "kubepods" / "cpu.max", "400000 100000");
  WriteLine(r / "kubepods" / "pod1" / "cpu.max", "150000 100000");
  WriteLine(r / "kubepods" / "pod1" / "c1" / "cpu.max", "max 100000");
  std::string dir;
  EXPECT_DOUBLE_EQ(CgroupCpuLimit("0::/kubepods/pod1/c1\n", root.path(), &dir), 1.5);
  EXPECT_EQ(dir, (r / "kubepods" / "pod1").string());
  EXPECT_DOUBLE_EQ(CgroupCpuLimit("0::/kubepods\n", root.path(), nullptr), 4.0);
  dir.clear();
  EXPECT_EQ(CgroupCpuLimit("0::/\n", root.path(), &dir), 0.0) << "max is no limit";
  EXPECT_EQ(dir, "");
}

TEST(CgroupCpuLimit, V1QuotaOverPeriodMinusOneIsNone) {
  TempDir root;
  const fs::path cpu = fs::path(root.path()) / "cpu";
  WriteLine(cpu / "cpu.cfs_quota_us", "-1");
  WriteLine(cpu / "cpu.cfs_period_us", "100000");
  WriteLine(cpu / "docker" / "abc" / "cpu.cfs_quota_us", "250000");
  WriteLine(cpu / "docker" / "abc" / "cpu.cfs_period_us", "100000");
  // The memory hierarchy's limits are not the CPU's.
  WriteLine(fs::path(root.path()) / "memory" / "docker" / "cpu.cfs_quota_us", "1000");
  const std::string proc = "4:memory:/docker\n1:cpu,cpuacct:/docker/abc\n";
  std::string dir;
  EXPECT_DOUBLE_EQ(CgroupCpuLimit(proc, root.path(), &dir), 2.5);
  EXPECT_EQ(dir, (cpu / "docker" / "abc").string());
  EXPECT_EQ(CgroupCpuLimit("1:cpu:/\n", root.path(), nullptr), 0.0);
  EXPECT_EQ(CgroupCpuLimit("garbage\n1:cpu:relative\n", root.path(), nullptr), 0.0);
}

// Co-mounted v1 controllers without a link by the controller's name.
TEST(CgroupCpuLimit, V1CoMountedUnderTheListsName) {
  TempDir root;
  const fs::path cpu = fs::path(root.path()) / "cpu,cpuacct";
  WriteLine(cpu / "docker" / "abc" / "cpu.cfs_quota_us", "200000");
  WriteLine(cpu / "docker" / "abc" / "cpu.cfs_period_us", "100000");
  std::string dir;
  EXPECT_DOUBLE_EQ(CgroupCpuLimit("3:cpu,cpuacct:/docker/abc\n", root.path(), &dir), 2.0);
  EXPECT_EQ(dir, (cpu / "docker" / "abc").string());
}

TEST(CgroupCpuLimit, HybridReadsTheUnifiedMount) {
  TempDir root;
  const fs::path r(root.path());
  WriteLine(r / "unified" / "job" / "cpu.max", "50000 100000");
  EXPECT_DOUBLE_EQ(CgroupCpuLimit("0::/job\n", root.path(), nullptr), 0.5);
}

TEST(CpuKernelThreads, AtMostTheLimitRoundedUpAtLeastOne) {
  EXPECT_EQ(CpuKernelThreadsFor(64, 0), 64);
  EXPECT_EQ(CpuKernelThreadsFor(64, 4.0), 4);
  EXPECT_EQ(CpuKernelThreadsFor(64, 1.5), 2);
  EXPECT_EQ(CpuKernelThreadsFor(4, 0.1), 1);
  EXPECT_EQ(CpuKernelThreadsFor(2, 8.0), 2);
  EXPECT_EQ(CpuKernelThreadsFor(0, 0), 1);
}

// Processes on the same CPUs (ranks on one host) each take their share of
// the mask, and of the limit among those under it, rounded up.
TEST(CpuKernelThreads, ProcessesOnTheSameCpusShareThem) {
  EXPECT_EQ(CpuKernelThreadsFor(2, 0, 2, 2), 1);
  EXPECT_EQ(CpuKernelThreadsFor(64, 0, 8, 8), 8);
  EXPECT_EQ(CpuKernelThreadsFor(64, 0, 3, 3), 22);
  EXPECT_EQ(CpuKernelThreadsFor(4, 0, 8, 8), 1);
  // Ranks bound to CPUs of their own (the mask is their share already)
  // under one limit: the limit's share.
  EXPECT_EQ(CpuKernelThreadsFor(16, 8.0, 1, 4), 2);
  EXPECT_EQ(CpuKernelThreadsFor(16, 64.0, 1, 4), 16);
  EXPECT_EQ(CpuKernelThreadsFor(64, 6.0, 2, 4), 2);
  EXPECT_EQ(CpuKernelThreadsFor(64, 0, 0, -1), 64);  // (below 1: alone)
}

// ShareCpuKernels resizes the arena: the count follows, and 1 and 1 give
// the whole mask back.
TEST(CpuKernelThreads, ShareCpuKernelsResizesTheArena) {
  const int mask = AffinityCpuCount();
  if (CgroupCpuLimit(ProcSelfCgroup(), "/sys/fs/cgroup", nullptr) > 0) GTEST_SKIP() << "a cgroup CPU limit here";
  ShareCpuKernels(2, 2);
  EXPECT_EQ(CpuKernelThreads(), (mask + 1) / 2);
  ShareCpuKernels(1, 1);
  EXPECT_EQ(CpuKernelThreads(), mask);
  SetCpuKernelThreads(3);
  ShareCpuKernels(mask, mask);
  EXPECT_EQ(CpuKernelThreads(), 3) << "SetCpuKernelThreads's count stands";
  SetCpuKernelThreads(0);
  ShareCpuKernels(1, 1);
  EXPECT_EQ(CpuKernelThreads(), mask);
  SetCpuKernelThreads(0);  // no arena left: a later test's child makes its own
}

// A process with another affinity mask has another key.
TEST(CpuKernelThreads, TheMaskKeyFollowsTheMask) {
  if (AffinityCpuCount() < 2) GTEST_SKIP() << "one CPU in the mask";
  const uint64_t all = AffinityMaskKey();
  EXPECT_NE(all, 0u);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu() >= 0 ? sched_getcpu() : 0, &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0) ::_exit(2);
    ::_exit(AffinityMaskKey() != all && AffinityMaskKey() == AffinityMaskKey() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// A real cgroup (v1's cpu hierarchy, where this machine has one we may
// write; skipped elsewhere, cgroup v2 included) with a quota of one CPU: a
// child that joins it runs its kernels on one thread.
TEST(CpuKernelThreads, FollowARealCgroupQuota) {
  if (AffinityCpuCount() < 2) GTEST_SKIP() << "one CPU in the mask: a quota of one changes nothing";
  std::string own;
  for (std::string line, text = ProcSelfCgroup(); !text.empty();) {
    const size_t nl = text.find('\n');
    line = text.substr(0, nl);
    text = nl == std::string::npos ? "" : text.substr(nl + 1);
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",";
    if (controllers.find(",cpu,") != std::string::npos) own = line.substr(b + 1);
  }
  const std::string base = "/sys/fs/cgroup/cpu" + (own == "/" ? std::string() : own);
  const std::string dir = base + "/strata-test-" + std::to_string(::getpid());
  if (own.empty() || ::mkdir(dir.c_str(), 0755) != 0)
    GTEST_SKIP() << "no v1 cpu cgroup to make here (" << base << "): nothing to test";
  struct Remove {
    std::string dir;
    ~Remove() { ::rmdir(dir.c_str()); }
  } remove{dir};
  {
    std::ofstream(dir + "/cpu.cfs_period_us") << "100000\n";
    std::ofstream q(dir + "/cpu.cfs_quota_us");
    q << "100000\n";
    q.flush();
    ASSERT_TRUE(q.good()) << "could not set the quota of " << dir;
  }
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::ofstream procs(dir + "/cgroup.procs");
    procs << "0\n";
    procs.flush();
    if (!procs.good()) ::_exit(100);
    ::_exit(CpuKernelThreads());
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  ASSERT_NE(WEXITSTATUS(status), 100) << "the child could not join " << dir;
  EXPECT_EQ(WEXITSTATUS(status), 1) << "threads in a cgroup of one CPU";
}


// A child forked while a kernel runs on another thread (an overlapped step,
// a data loader's worker started then): the arena it inherits is busy and
// its workers are the parent's; its kernels run on its own thread, to the
// end, with the same tiles. (Entering the inherited arena waited for good
// in about half of such forks.)
TEST(CpuKernelThreads, AChildForkedDuringAKernelRunsItsOwn) {
  if (AffinityCpuCount() < 2) GTEST_SKIP() << "one CPU: the arena has no worker to be busy";
  for (int attempt = 0; attempt < 4; ++attempt) {
    std::atomic<bool> started{false};
    std::thread busy([&] {
      ParallelForTiles(64 * 400, 64, [&](size_t, size_t) {
        started = true;
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      });
    });
    while (!started) std::this_thread::yield();
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::alarm(20);  // a wait for good ends the child by SIGALRM
      std::vector<int> seen(1000, 0);
      ParallelForTiles(64 * 1000, 64, [&](size_t a, size_t) { ++seen[a / 64]; });
      ParallelForEach(1000, [&](size_t i) { ++seen[i]; });
      const bool all = std::all_of(seen.begin(), seen.end(), [](int v) { return v == 2; });
      ::_exit(all && CpuKernelThreads() == 1 ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    busy.join();
    ASSERT_TRUE(WIFEXITED(status)) << "attempt " << attempt << ": the child ended by signal " << WTERMSIG(status);
    EXPECT_EQ(WEXITSTATUS(status), 0) << "attempt " << attempt;
  }
  // The parent's arena is whole.
  std::atomic<int> tiles{0};
  ParallelForTiles(64 * 100, 64, [&](size_t, size_t) { ++tiles; });
  EXPECT_EQ(tiles.load(), 100);
  EXPECT_GE(CpuKernelThreads(), 1);
}

}  // namespace
}  // namespace strata::kernels
