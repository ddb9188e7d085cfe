// The kernels' oneTBB arena, sized from the affinity mask and the cgroup CPU limit.
#include "kernels/cpu/parallel.h"

#include <sched.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <memory>
#include <mutex>
#include <thread>

#include "base/cgroup.h"
#include "base/check.h"
#include "base/log.h"

namespace strata::kernels {
namespace {

std::mutex g_arena_mu;  // guards g_arena and g_threads while they are replaced
std::unique_ptr<tbb::task_arena> g_arena;
int g_threads = 0;

tbb::task_arena& Arena() {
  std::lock_guard<std::mutex> lock(g_arena_mu);
  if (!g_arena) {
    if (g_threads <= 0) {
      const int mask = AffinityCpuCount();
      std::string dir;
      const double limit = CgroupCpuLimit(ProcSelfCgroup(), "/sys/fs/cgroup", &dir);
      g_threads = CpuKernelThreadsFor(mask, limit);
      if (g_threads < mask)
        STRATA_LOG_INFO("CPU kernels: {} threads, not {}: the cgroup {} allows {:.2f} CPUs", g_threads, mask, dir,
                        limit);
    }
    g_arena = std::make_unique<tbb::task_arena>(g_threads);
  }
  return *g_arena;
}

}  // namespace

int AffinityCpuCount() {
  for (int cpus = 1024; cpus <= (1 << 16); cpus *= 4) {
    cpu_set_t* set = CPU_ALLOC(cpus);
    const size_t bytes = CPU_ALLOC_SIZE(cpus);
    const int rc = sched_getaffinity(0, bytes, set);
    const int count = rc == 0 ? CPU_COUNT_S(bytes, set) : 0;
    CPU_FREE(set);
    if (rc == 0) return count > 0 ? count : 1;
    if (errno != EINVAL) break;  // EINVAL: mask larger than our set; grow it
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

int CpuKernelThreadsFor(int affinity_cpus, double cgroup_cpus) {
  const int mask = affinity_cpus > 0 ? affinity_cpus : 1;
  if (!(cgroup_cpus > 0)) return mask;
  const double up = std::ceil(cgroup_cpus);
  return up < mask ? std::max(1, static_cast<int>(up)) : mask;
}

int CpuKernelThreads() {
  Arena();
  std::lock_guard<std::mutex> lock(g_arena_mu);
  return g_threads;
}

void SetCpuKernelThreads(int threads) {
  std::lock_guard<std::mutex> lock(g_arena_mu);
  g_arena.reset();
  g_threads = threads;
}

void ParallelForTiles(size_t n, size_t tile, const std::function<void(size_t, size_t)>& fn) {
  STRATA_CHECK(tile > 0 && tile % 64 == 0);
  if (n <= tile) {
    if (n > 0) fn(0, n);
    return;
  }
  const size_t tiles = (n + tile - 1) / tile;
  Arena().execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, tiles, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          for (size_t t = r.begin(); t != r.end(); ++t) fn(t * tile, std::min(n, (t + 1) * tile));
        },
        tbb::static_partitioner());
  });
}

void ParallelForEach(size_t n, const std::function<void(size_t)>& fn) {
  if (n <= 1) {
    if (n == 1) fn(0);
    return;
  }
  Arena().execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, n, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          for (size_t i = r.begin(); i != r.end(); ++i) fn(i);
        },
        tbb::simple_partitioner());
  });
}

}  // namespace strata::kernels
