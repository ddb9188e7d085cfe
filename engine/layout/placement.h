// Where this process runs: which GPU it drives (one process per GPU, local
// rank i on GPU i), which NUMA node its threads and pinned memory are bound
// to (the GPU's), and the one line that says so. The choices are pure
// functions, tested without a GPU; Place* apply them.
#pragma once

#include <string>

#include "base/status.h"

namespace strata {

struct Placement {
  int rank = 0, world_size = 1;
  int local_rank = 0;
  std::string rank_source = "none";  // the launcher family that gave local_rank (RankInfo::source)
  int device = -1;                   // the GPU driven, -1: none (the device tier is a host arena)
  std::string no_gpu_why;            // with device -1: "force_no_gpu", "built without CUDA", ...
  std::string device_name;           // "NVIDIA H200"
  int gpu_node = -1;                 // NUMA node of the GPU, -1: unknown
  int numa_nodes = 0;                // as hwloc sees them (0: unknown)
  int cpu_node = -1;                 // node the process's CPUs are bound to, -1: none
  std::string cpus;                  // those CPUs ("0-15"), when bound
  std::string no_bind_why;           // with cpu_node -1: why not
  int memory_node = -1;              // node the host tier's memory is bound to, -1: none
  bool pinned = false;               // the host tier's memory is pinned (with a GPU)
  int cpu_kernel_threads = 0;        // the CPU kernels' threads (0: not set yet)
  int cpu_sharers = 1;               // processes of the job running their kernels on these CPUs
};

// "rank 1/4: GPU 1 (NVIDIA H200, NUMA node 0); cores 0-15 bound to node 0;
// pinned memory on node 0; CPU kernels: 4 threads (4 processes share these
// CPUs)", or "rank 0/1: no GPU (built without CUDA): device tier is a host
// arena; no NUMA binding (no GPU); host memory on node 0; CPU kernels: 16
// threads".
std::string DescribePlacement(const Placement& p);

// The GPU index: `requested` (>= 0, EngineOptions::device) or, with -1, the
// launcher's local rank; -1 (no GPU) when device_count is 0. INVALID, naming
// both numbers, for an index past the last GPU or below -1.
Result<int> ChooseDevice(int requested, int local_rank, int device_count, const std::string& rank_source);

// The NUMA node to bind to, or -1 and why not: strata.numa_bind `mode`
// ("auto" or "off"), the chosen GPU (-1: none), its node (-1: unknown) and
// the machine's node count.
struct NumaChoice {
  int node = -1;
  std::string why_not;
};
NumaChoice ChooseNumaNode(const std::string& mode, int device, int gpu_node, int node_count);

// Fills p's GPU fields and makes the GPU current on the calling thread.
// `force_no_gpu`: none, whatever the machine has. Errors: INVALID (the index),
// the CUDA error of cudaSetDevice.
Status PlaceOnGpu(bool force_no_gpu, int requested, Placement* p);
// Binds the process's CPUs to the GPU's node as ChooseNumaNode says; a
// binding that fails is a warning naming what failed, and p says why.
void PlaceOnNumaNode(const std::string& mode, Placement* p);

}  // namespace strata
