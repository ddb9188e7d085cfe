// HostTier: pinned, NUMA-local host memory for staging and host-homed state.
// Each allocation is its own mapping: 2 MiB-aligned, on transparent huge
// pages (MAP_HUGETLB where huge pages are reserved), bound with hwloc to the
// NUMA node nearest the GPU (else the node this process runs on; or not at
// all with numa_bind false), locked (mlock, or cudaHostRegister with a GPU)
// and registered with the storage so the disk reads into it with fixed
// buffers. Counted exactly (to the 4 KiB
// page), never rounded to a power of two. Thread-safe.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>

#include "io/fault.h"
#include "io/storage.h"
#include "tiers/tier.h"

namespace strata {

struct HostTierOptions {
  uint64_t budget = 0;
  bool pin = true;              // mlock / cudaHostRegister; failure warns once
  bool huge_pages = true;       // 2 MiB alignment + MADV_HUGEPAGE
  int numa_node = -1;           // -1: nearest GPU `device`, else where we run
  int device = 0;               // the GPU: pinned for it (made current first), its node for numa_node -1
  bool numa_bind = true;        // false: no binding at all (the OS places pages)
  Storage* storage = nullptr;   // registers buffers with it when set
  std::shared_ptr<FaultPlan> faults = nullptr;  // tests: allocations that fail
};

class HostTier final : public Tier {
 public:
  explicit HostTier(const HostTierOptions& options);
  ~HostTier() override;
  Result<Allocation> Allocate(uint64_t bytes) override;
  void Free(const Allocation& a) override;
  // The NUMA node allocations are bound to; -1 when they are not bound (or
  // a binding failed, with a warning).
  int numa_node() const { return topology_ && node_ >= 0 && !bind_failed_ ? node_ : -1; }

 private:
  struct Mapping { uint64_t len; bool locked; bool cuda_registered; };
  void Bind(void* p, uint64_t len);
  void Lock(void* p, uint64_t len, Mapping* m);

  HostTierOptions options_;
  int node_ = -1;
  std::atomic<bool> bind_failed_{false};
  void* topology_ = nullptr;  // hwloc_topology_t
  std::mutex mu_;  // guards maps_
  std::map<void*, Mapping> maps_;
};

}  // namespace strata
