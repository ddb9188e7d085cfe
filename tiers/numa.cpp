// NUMA nodes and process CPU binding through hwloc.
#include "tiers/numa.h"

#include <hwloc.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace strata {
namespace {

// A loaded hwloc topology, destroyed with the scope.
class Topology {
 public:
  Topology() {
    if (hwloc_topology_init(&topo_) != 0) return;
    if (hwloc_topology_load(topo_) != 0) {
      hwloc_topology_destroy(topo_);
      return;
    }
    loaded_ = true;
  }
  ~Topology() {
    if (loaded_) hwloc_topology_destroy(topo_);
  }
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;
  bool loaded() const { return loaded_; }
  hwloc_topology_t get() const { return topo_; }

 private:
  hwloc_topology_t topo_ = nullptr;
  bool loaded_ = false;
};

std::string CpuList(hwloc_const_bitmap_t set) {
  char* s = nullptr;
  if (hwloc_bitmap_list_asprintf(&s, set) < 0 || s == nullptr) return "?";
  std::string out(s);
  std::free(s);
  return out;
}

}  // namespace

int NumaNodeCount() {
  Topology t;
  if (!t.loaded()) return 0;
  const int n = hwloc_get_nbobjs_by_type(t.get(), HWLOC_OBJ_NUMANODE);
  return n > 0 ? n : 0;
}

NumaCpuBinding BindProcessToNumaNode(int node) {
  NumaCpuBinding b;
  Topology t;
  if (!t.loaded()) {
    b.error = "hwloc cannot load the machine's topology";
    return b;
  }
  hwloc_obj_t obj =
      node < 0 ? nullptr : hwloc_get_numanode_obj_by_os_index(t.get(), static_cast<unsigned>(node));
  if (obj == nullptr) {
    b.error = "hwloc knows no NUMA node " + std::to_string(node);
    return b;
  }
  if (obj->cpuset == nullptr || hwloc_bitmap_iszero(obj->cpuset)) {
    b.error = "NUMA node " + std::to_string(node) + " has no CPUs (memory only)";
    return b;
  }
  if (hwloc_set_cpubind(t.get(), obj->cpuset, HWLOC_CPUBIND_PROCESS) != 0) {
    const int err = errno;
    b.error = "hwloc_set_cpubind to the CPUs " + CpuList(obj->cpuset) + " of NUMA node " +
              std::to_string(node) + ": " + std::strerror(err);
    return b;
  }
  b.bound = true;
  b.cpus = CpuList(obj->cpuset);
  return b;
}

}  // namespace strata
