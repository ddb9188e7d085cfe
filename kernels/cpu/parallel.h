// Runs the CPU kernels over fixed, cache-sized tiles in one oneTBB arena whose
// size is the number of CPUs this process may run on (sched_getaffinity), at
// most its cgroup's CPU limit rounded up (a container's --cpus, a
// Kubernetes CPU limit: more threads than that only queue for the quota),
// not OMP_NUM_THREADS. Tiles are fixed by the element count alone, so results never
// depend on the thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace strata::kernels {

// Elements per tile of the element-wise kernels: a multiple of 64 so that only
// the last tile has a SIMD tail; 16K elements × 28 bytes of Adam state fit L2.
inline constexpr size_t kElementTile = 16384;
// Elements per tile of reductions (one fp64 partial per tile).
inline constexpr size_t kReduceTile = 65536;

// CPUs in this process's affinity mask (at least 1).
int AffinityCpuCount();
// The affinity mask's bits hashed: processes with equal keys run on the
// same CPUs (0 where the mask cannot be read).
uint64_t AffinityMaskKey();
// Threads for `affinity_cpus` CPUs in the mask under a cgroup limit of
// `cgroup_cpus` CPUs (0: none), where `mask_sharers` processes (this one
// among them) run on the same CPUs and `limit_sharers` under the same
// limit (ranks on one host, each with kernels of its own): this process's
// share of each, rounded up, the smaller, at least 1. Sharers below 1 count
// as 1.
int CpuKernelThreadsFor(int affinity_cpus, double cgroup_cpus, int mask_sharers = 1, int limit_sharers = 1);
// Threads the kernels use: CpuKernelThreadsFor(AffinityCpuCount(), this
// process's cgroup CPU limit, the sharers ShareCpuKernels last said) unless
// SetCpuKernelThreads set it.
int CpuKernelThreads();
// This process shares its CPUs with other processes (the engine says so at
// create, from the ranks on its host). Re-reads the mask and the limit
// (the engine may have bound the process to a NUMA node since). Kernels
// running on other threads at the time finish on the arena they started in.
void ShareCpuKernels(int mask_sharers, int limit_sharers);
// 0 restores the default. For tests and benchmarks. Kernels running on
// other threads at the time finish on the arena they started in.
void SetCpuKernelThreads(int threads);

// Calls fn(begin, end) once per tile [k*tile, min(n, (k+1)*tile)), tiles in
// parallel. REQUIRES: tile is a multiple of 64. Runs inline when n <= tile.
void ParallelForTiles(size_t n, size_t tile, const std::function<void(size_t, size_t)>& fn);

// Calls fn(i) once for each i in [0, n), each a task of its own in the same
// arena: a few coarse, independent jobs (one block's checksum each, say).
// Runs inline when n <= 1.
void ParallelForEach(size_t n, const std::function<void(size_t)>& fn);

}  // namespace strata::kernels
