// The machine's NUMA nodes as hwloc sees them, and binding this whole
// process's CPUs to one of them (the node nearest its GPU), so that its
// threads, and the memory they first touch, stay near the GPU.
#pragma once

#include <string>

namespace strata {

// NUMA nodes of this machine; 0 when hwloc cannot load the topology.
int NumaNodeCount();

// What BindProcessToNumaNode did.
struct NumaCpuBinding {
  bool bound = false;
  std::string cpus;   // the node's CPUs as a list ("0-15,32-47"), when bound
  std::string error;  // what failed, when not bound
};

// Binds every thread of this process (hwloc_set_cpubind, HWLOC_CPUBIND_PROCESS),
// and the threads it starts later, to the CPUs of NUMA node `node` (its OS
// index), replacing any binding they had (numactl, taskset, mpirun's). Fails, saying what failed, for a node hwloc does not know, a node
// without CPUs (memory only) or a refusal by the OS (a cgroup's cpuset).
NumaCpuBinding BindProcessToNumaNode(int node);

}  // namespace strata
