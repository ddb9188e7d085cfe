// DeviceTier: GPU memory when a GPU is present; otherwise a host arena with
// the same budget and the same asynchronous copy interface (a copy thread
// per direction standing in for the copy-in and copy-out streams), so every
// test runs on a machine without a GPU. Thread-safe.
//
// A pool: Free keeps the block for the next Allocate instead of returning
// it (cudaFree synchronizes the whole device). The size classes are the
// exact sizes asked, 256-byte aligned: the engine's device copies repeat
// their groups' sizes every step, so after the first step every allocation
// is served from the cache, and a tight budget loses nothing to rounding. A
// request takes a cached block up to 1/8 larger when none is its size.
// Cached blocks stay counted against the budget; when a new block does not
// fit, cached ones are released (the largest first) until it does.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "io/fault.h"
#include "tiers/gpu.h"
#include "tiers/tier.h"

namespace strata {

// Completion of one asynchronous copy. Wait() may be called once or more.
class CopyFence {
 public:
  virtual ~CopyFence() = default;
  virtual Status Wait() = 0;
  virtual bool Done() = 0;
};
using CopyTicket = std::shared_ptr<CopyFence>;

struct DeviceTierOptions {
  uint64_t budget = 0;
  // The GPU. The CUDA current device is per thread, so before each CUDA
  // call (cudaMalloc, cudaFree, a copy and its event, the streams) the tier
  // makes it current on the calling thread, which is left with it current.
  int device = 0;
  bool force_host_arena = false;  // tests: behave as if there were no GPU
  bool pool = true;  // false: Free returns the block at once (strata.device_pool)
  // Tests without a GPU (STRATA_STRICT_DEVICE=1): the host arena behaves as
  // a GPU's memory would punish a missing wait. It is separate() (the engine
  // copies into and out of it through CopyIn/CopyOut and waits, as on a
  // GPU, instead of reading it in place); every copy lags on its thread and
  // lands in two halves; a new block and a freed block are filled with NaN
  // (0xFF bytes: NaN as f32, bf16 and f16), and a freed block is the first
  // handed out again. Ignored on a GPU.
  bool strict = false;
  // Tests: CopyIn / CopyOut fail where the plan says (FaultPlan::ArmDeviceCopies).
  std::shared_ptr<FaultPlan> faults = nullptr;
};

struct DevicePoolStats {
  uint64_t in_use = 0;      // bytes handed out (as charged)
  uint64_t cached = 0;      // bytes of free blocks kept for reuse (charged too)
  uint64_t raw_allocs = 0;  // cudaMalloc (aligned_alloc) calls so far
  uint64_t raw_frees = 0;   // cudaFree (free) calls so far
  uint64_t hits = 0;        // allocations served from the cache
};

class DeviceTier final : public Tier {
 public:
  static Result<std::unique_ptr<DeviceTier>> Create(const DeviceTierOptions& options);
  // The most an Allocate of `bytes` is charged: 256-byte aligned, or a
  // cached block up to 1/8 larger (the pool's rule above).
  static uint64_t MostCharged(uint64_t bytes) {
    const uint64_t len = (bytes + 255) / 256 * 256;
    return len + len / 8;
  }
  ~DeviceTier() override;
  Result<Allocation> Allocate(uint64_t bytes) override;
  void Free(const Allocation& a) override;

  // Host -> device and device -> host, in order per direction. `host` should
  // be HostTier memory (pinned) for full speed.
  Result<CopyTicket> CopyIn(void* device_dst, const void* host_src, uint64_t bytes);
  Result<CopyTicket> CopyOut(void* host_dst, const void* device_src, uint64_t bytes);

  bool on_gpu() const { return on_gpu_; }
  // Whether the CPU must copy to and from this tier (a GPU, or the strict
  // host arena) rather than address its blocks in place.
  bool separate() const { return on_gpu_ || strict_; }
  bool strict() const { return strict_; }
  int device() const { return options_.device; }  // meaningful when on_gpu()
  DevicePoolStats pool_stats() const;
  // Returns every cached block to the device (or the host).
  void Trim();

 private:
  class CopyQueue;  // one direction without a GPU
  explicit DeviceTier(const DeviceTierOptions& options);
  Result<CopyTicket> Copy(void* dst, const void* src, uint64_t bytes, bool to_device);

  DeviceTierOptions options_;
  bool on_gpu_ = false;
  bool strict_ = false;
  std::shared_ptr<FaultPlan> faults_;  // tests
  gpu::Stream in_stream_ = nullptr, out_stream_ = nullptr;
  std::unique_ptr<CopyQueue> in_queue_, out_queue_;
  // Makes options_.device current on this thread (on a GPU; else nothing).
  Status UseDevice() const;
  Result<void*> RawAlloc(uint64_t len);
  void RawFree(void* p);
  // Releases the largest cached block. REQUIRES: mu_ held; false when none.
  bool ReleaseLargestCached();

  mutable std::mutex mu_;  // guards sizes_, cache_ and pool_
  std::map<void*, uint64_t> sizes_;        // blocks handed out -> their length
  std::multimap<uint64_t, void*> cache_;   // free blocks by length
  void* last_freed_ = nullptr;             // strict: handed out first
  DevicePoolStats pool_;
};

}  // namespace strata
