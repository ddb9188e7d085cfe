// HostTier: mapping, binding, locking and registering host buffers.
#include "tiers/host_tier.h"

#include <hwloc.h>
#include <sys/mman.h>

#include <fstream>
#include <new>

#include "base/align.h"
#include "base/check.h"
#include "base/log.h"
#include "base/sizes.h"
#include "tiers/gpu.h"

namespace strata {

static bool HugePagesReserved() {
  std::ifstream f("/proc/sys/vm/nr_hugepages");
  long n = 0;
  return (f >> n) && n > 0;
}

HostTier::HostTier(const HostTierOptions& options)
    : Tier(TierKind::kHost, options.budget), options_(options) {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) == 0) {
    if (hwloc_topology_load(topo) == 0) topology_ = topo;
    else hwloc_topology_destroy(topo);
  }
  if (!options.numa_bind) return;  // node_ stays -1: nothing is bound
  node_ = options.numa_node;
  if (node_ < 0 && gpu::Available()) node_ = gpu::NumaNodeOfDevice(options.device);
  if (node_ < 0 && topology_) {
    hwloc_cpuset_t cpus = hwloc_bitmap_alloc();
    hwloc_nodeset_t nodes = hwloc_bitmap_alloc();
    if (hwloc_get_last_cpu_location(topo, cpus, HWLOC_CPUBIND_THREAD) == 0) {
      hwloc_cpuset_to_nodeset(topo, cpus, nodes);
      node_ = hwloc_bitmap_first(nodes);
    }
    hwloc_bitmap_free(cpus);
    hwloc_bitmap_free(nodes);
  }
}

HostTier::~HostTier() {
  std::map<void*, Mapping> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(maps_);
  }
  for (auto& [p, m] : left) {
    if (options_.storage) options_.storage->UnregisterBuffer(p);
    if (m.cuda_registered) {
      gpu::SetDevice(options_.device).IgnoreError();  // it worked at registration
      gpu::HostUnregister(p).IgnoreError();
    }
    ::munmap(p, m.len);
  }
  if (topology_) hwloc_topology_destroy(static_cast<hwloc_topology_t>(topology_));
}

void HostTier::Bind(void* p, uint64_t len) {
  if (!topology_ || node_ < 0) return;
  auto topo = static_cast<hwloc_topology_t>(topology_);
  hwloc_nodeset_t nodes = hwloc_bitmap_alloc();
  hwloc_bitmap_only(nodes, static_cast<unsigned>(node_));
  if (hwloc_set_area_membind(topo, p, len, nodes, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET) != 0) {
    bind_failed_ = true;
    WarnOnce("host-membind", "host tier: cannot bind memory to NUMA node " + std::to_string(node_) +
                                 " (" + std::strerror(errno) + "); memory is not NUMA-bound");
  }
  hwloc_bitmap_free(nodes);
}

void HostTier::Lock(void* p, uint64_t len, Mapping* m) {
  if (!options_.pin) return;
  if (gpu::Available()) {
    // cudaHostRegister works in the current device's context (and would
    // create one on GPU 0 for a thread that never chose): ours first.
    Status st = gpu::SetDevice(options_.device);
    if (st.ok()) st = gpu::HostRegister(p, len);
    m->cuda_registered = st.ok();
    if (st.ok()) return;
    WarnOnce("host-cudareg", "host tier: cudaHostRegister failed (" + st.message() + "); trying mlock");
  }
  if (::mlock(p, len) == 0) {
    m->locked = true;
    return;
  }
  WarnOnce("host-mlock", "host tier: cannot lock " + FormatBytes(len) + " in memory (" +
                             std::strerror(errno) +
                             "; raise RLIMIT_MEMLOCK, e.g. ulimit -l unlimited); continuing unlocked");
}

Result<Allocation> HostTier::Allocate(uint64_t bytes) {
  if (bytes == 0) return InvalidError("host tier: allocation of 0 bytes");
  if (bool throws = false; options_.faults && options_.faults->FailHostAllocation(bytes, &throws)) {
    if (throws) throw std::bad_alloc();
    return NoMemError("host tier: an allocation of " + FormatBytes(bytes) + " failed (injected)");
  }
  // Over the budget before rounding: a size near 2^64 would round to a small one.
  if (bytes > budget()) STRATA_RETURN_IF_ERROR(Charge(bytes));
  const uint64_t len = AlignUp(bytes, 4096);
  STRATA_RETURN_IF_ERROR(Charge(len));
  void* p = MAP_FAILED;
  if (options_.huge_pages && len % kHugePage == 0 && HugePagesReserved())
    p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
  if (p == MAP_FAILED) {
    // Over-map by 2 MiB and trim so the start is 2 MiB-aligned.
    const uint64_t slack = options_.huge_pages ? kHugePage : 0;
    void* raw = ::mmap(nullptr, len + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
      Uncharge(len);
      return NoMemError("host tier: mmap of " + FormatBytes(len) + " failed: " + std::strerror(errno));
    }
    const auto start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = slack ? AlignUp(start, kHugePage) : start;
    if (aligned > start) ::munmap(raw, aligned - start);
    if (start + slack > aligned) ::munmap(reinterpret_cast<void*>(aligned + len), start + slack - aligned);
    p = reinterpret_cast<void*>(aligned);
    if (options_.huge_pages) ::madvise(p, len, MADV_HUGEPAGE);  // advisory: failure is harmless
  }
  Mapping m{len, false, false};
  Bind(p, len);
  Lock(p, len, &m);
  if (options_.storage) options_.storage->RegisterBuffer(p, len);
  {
    std::lock_guard<std::mutex> lock(mu_);
    maps_[p] = m;
  }
  return Allocation{p, 0, bytes, len};
}

void HostTier::Free(const Allocation& a) {
  Mapping m;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = maps_.find(a.ptr);
    STRATA_CHECK_MSG(it != maps_.end(), "host tier: freeing a pointer it did not allocate");
    m = it->second;
    maps_.erase(it);
  }
  if (options_.storage) options_.storage->UnregisterBuffer(a.ptr);
  if (m.cuda_registered) {
    gpu::SetDevice(options_.device).IgnoreError();  // it worked at registration
    gpu::HostUnregister(a.ptr).IgnoreError();
  }
  ::munmap(a.ptr, m.len);  // also unlocks
  Uncharge(m.len);
}

}  // namespace strata
