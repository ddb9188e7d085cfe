// The kernels' oneTBB arena, sized from the affinity mask and the cgroup CPU limit.
#include "kernels/cpu/parallel.h"

#include <pthread.h>
#include <sched.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <string>
#include <memory>
#include <mutex>
#include <new>
#include <thread>

#include "base/cgroup.h"
#include "base/check.h"
#include "base/log.h"

namespace strata::kernels {
namespace {

std::mutex g_arena_mu;  // guards the four below
// Replaced whole (a new size); a kernel holds the arena it runs in.
std::shared_ptr<tbb::task_arena> g_arena;
int g_threads = 0;                             // g_arena's size (0: not made yet)
int g_forced = 0;                              // SetCpuKernelThreads's, 0: none
int g_mask_sharers = 1, g_limit_sharers = 1;  // ShareCpuKernels's

// The arena's size from the mask, the limit and the sharers, said once at
// INFO where it is below the mask's CPUs. Under g_arena_mu.
int ThreadsNow() {
  if (g_forced > 0) return g_forced;
  const int mask = AffinityCpuCount();
  std::string dir;
  const double limit = CgroupCpuLimit(ProcSelfCgroup(), "/sys/fs/cgroup", &dir);
  const int threads = CpuKernelThreadsFor(mask, limit, g_mask_sharers, g_limit_sharers);
  if (threads < mask && threads != g_threads) {
    std::string why;
    if (g_mask_sharers > 1) why = std::to_string(g_mask_sharers) + " processes run on these CPUs";
    if (limit > 0 && std::ceil(limit / std::max(g_limit_sharers, 1)) < mask) {
      if (!why.empty()) why += "; ";
      char cpus[32];
      std::snprintf(cpus, sizeof cpus, "%.2f", limit);
      why += "the cgroup " + dir + " allows " + cpus + " CPUs" +
             (g_limit_sharers > 1 ? " to " + std::to_string(g_limit_sharers) + " processes" : "");
    }
    STRATA_LOG_INFO("CPU kernels: {} threads, not {}: {}", threads, mask, why);
  }
  return threads;
}

// A child of fork whose parent had an arena: oneTBB's workers are the
// parent's (not here), and the arena may have been busy on another thread
// at the fork: a kernel entering it would wait for good. The child's
// kernels run on the calling thread alone (the same tiles: the same bits).
bool g_forked = false;

void BeforeFork() { g_arena_mu.lock(); }
void AfterForkInParent() { g_arena_mu.unlock(); }
void AfterForkInChild() {
  if (g_arena) {
    // Never destroyed here (its destructor would wait for the parent's
    // threads), and no allocator call in a fork handler: moved into static
    // storage that is never destructed.
    alignas(std::shared_ptr<tbb::task_arena>) static unsigned char kept[sizeof(std::shared_ptr<tbb::task_arena>)];
    new (kept) std::shared_ptr<tbb::task_arena>(std::move(g_arena));
    g_forked = true;
  }
  g_arena_mu.unlock();  // (locked by this thread in BeforeFork)
}

// The arena, or null in a forked child that runs its kernels serially.
std::shared_ptr<tbb::task_arena> Arena() {
  static const int fork_handlers = pthread_atfork(BeforeFork, AfterForkInParent, AfterForkInChild);
  (void)fork_handlers;
  std::lock_guard<std::mutex> lock(g_arena_mu);
  if (g_forked) return nullptr;
  if (!g_arena) {
    if (g_threads <= 0) g_threads = ThreadsNow();
    g_arena = std::make_shared<tbb::task_arena>(g_threads);
  }
  return g_arena;
}

// A new arena where the size changes (under g_arena_mu): the next kernel
// makes it.
void Resize(int threads) {
  if (threads != g_threads) g_arena.reset();
  g_threads = threads;
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

uint64_t AffinityMaskKey() {
  for (int cpus = 1024; cpus <= (1 << 16); cpus *= 4) {
    cpu_set_t* set = CPU_ALLOC(cpus);
    const size_t bytes = CPU_ALLOC_SIZE(cpus);
    CPU_ZERO_S(bytes, set);
    const int rc = sched_getaffinity(0, bytes, set);
    uint64_t key = 1469598103934665603ull;  // FNV-1a over the mask's bytes, trailing zeros left out
    if (rc == 0) {
      const auto* b = reinterpret_cast<const unsigned char*>(set);
      size_t n = bytes;
      while (n > 0 && b[n - 1] == 0) --n;
      for (size_t i = 0; i < n; ++i) key = (key ^ b[i]) * 1099511628211ull;
    }
    CPU_FREE(set);
    if (rc == 0) return key;
    if (errno != EINVAL) break;
  }
  return 0;
}

int CpuKernelThreadsFor(int affinity_cpus, double cgroup_cpus, int mask_sharers, int limit_sharers) {
  const int mask = affinity_cpus > 0 ? affinity_cpus : 1;
  const int on_mask = (mask + std::max(mask_sharers, 1) - 1) / std::max(mask_sharers, 1);
  if (!(cgroup_cpus > 0)) return on_mask;
  const double up = std::ceil(cgroup_cpus / std::max(limit_sharers, 1));
  return up < on_mask ? std::max(1, static_cast<int>(up)) : on_mask;
}

int CpuKernelThreads() {
  const auto arena = Arena();
  return arena ? arena->max_concurrency() : 1;
}

void ShareCpuKernels(int mask_sharers, int limit_sharers) {
  std::lock_guard<std::mutex> lock(g_arena_mu);
  g_mask_sharers = std::max(mask_sharers, 1);
  g_limit_sharers = std::max(limit_sharers, 1);
  Resize(ThreadsNow());
}

void SetCpuKernelThreads(int threads) {
  std::lock_guard<std::mutex> lock(g_arena_mu);
  g_forced = std::max(threads, 0);
  g_threads = 0;  // (the default's size is worked out again, and said, when next made)
  g_arena.reset();
}

void ParallelForTiles(size_t n, size_t tile, const std::function<void(size_t, size_t)>& fn) {
  STRATA_CHECK(tile > 0 && tile % 64 == 0);
  if (n <= tile) {
    if (n > 0) fn(0, n);
    return;
  }
  const size_t tiles = (n + tile - 1) / tile;
  const auto arena = Arena();
  if (!arena) {
    for (size_t t = 0; t < tiles; ++t) fn(t * tile, std::min(n, (t + 1) * tile));
    return;
  }
  arena->execute([&] {
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
  const auto arena = Arena();
  if (!arena) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  arena->execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, n, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          for (size_t i = r.begin(); i != r.end(); ++i) fn(i);
        },
        tbb::simple_partitioner());
  });
}

}  // namespace strata::kernels
