// StagingPool: a fixed set of equal host buffers taken from the HostTier at
// build time (so budgets are settled before training), handed out and
// returned without allocating. Acquire blocks while all are in use; an empty
// pool (nothing needs staging) hands out null.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

#include "tiers/host_tier.h"

namespace strata {

class StagingPool {
 public:
  StagingPool() = default;
  ~StagingPool() { Reset(); }
  // Allocates `count` buffers of `bytes` each from `host`.
  Status Init(HostTier* host, int count, uint64_t bytes) {
    Reset();
    host_ = host;
    bytes_ = bytes;
    for (int i = 0; i < count; ++i) {
      auto a = host->Allocate(bytes);
      if (!a.ok()) return a.status().WithContext("staging buffers (" + std::to_string(count) + " x " + std::to_string(bytes) + " bytes)");
      all_.push_back(*a);
      free_.push_back(a->ptr);
    }
    return Status::Ok();
  }
  void* Acquire() {
    if (all_.empty()) return nullptr;
    std::unique_lock<std::mutex> lock(mu_);
    if (free_.empty() && reclaim_) {  // buffers lent ahead come back first (SetReclaim)
      lock.unlock();
      reclaim_();
      lock.lock();
    }
    cv_.wait(lock, [&] { return !free_.empty(); });
    void* p = free_.back();
    free_.pop_back();
    return p;
  }
  // Called by an Acquire that finds no buffer free, before it waits: the
  // owner of buffers taken ahead of need (StepPipeline::ReadAhead) gives
  // them back, so that nobody waits on a buffer only a later call returns.
  // Must not Acquire. Set once, before use.
  void SetReclaim(std::function<void()> f) { reclaim_ = std::move(f); }
  // A buffer when one is free now, else null (never blocks).
  void* TryAcquire() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return nullptr;
    void* p = free_.back();
    free_.pop_back();
    return p;
  }
  void Release(void* p) {
    if (!p) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(p);
    }
    cv_.notify_one();
  }
  // Returns every buffer to the host tier. REQUIRES: none handed out.
  void Clear() { Reset(); }
  uint64_t bytes() const { return bytes_; }
  int count() const { return static_cast<int>(all_.size()); }

 private:
  void Reset() {
    for (auto& a : all_) host_->Free(a);
    all_.clear();
    free_.clear();
  }
  HostTier* host_ = nullptr;
  uint64_t bytes_ = 0;
  std::vector<Allocation> all_;
  std::mutex mu_;  // guards free_
  std::condition_variable cv_;
  std::vector<void*> free_;
  std::function<void()> reclaim_;
};

// The engine's four pools (sized by staging_plan.h's PlanStaging).
struct StagingPools {
  StagingPool param;   // P: nvme -> host -> device
  StagingPool opt;     // W, M, V, G (and P) slots of the step pipeline
  StagingPool grad;    // G when not addressable in place, grads off the GPU
  StagingPool frozen;  // a frozen group's P off the CPU's reach (build, read, write, checkpoints)
};

}  // namespace strata
