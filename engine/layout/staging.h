// StagingPool: a fixed set of equal host buffers taken from the HostTier at
// build time (so budgets are settled before training), handed out and
// returned without allocating. Acquire blocks while all are in use; an empty
// pool (nothing needs staging) hands out null.
//
// Pieces (SetPieces): a buffer may instead be lent a piece at a time, each
// `piece_bytes` at a multiple of it from the buffer's start, for users whose
// work comes in smaller units (the step's units, StepPipeline). A buffer is
// split when a piece is wanted and none is free, and comes back whole once
// all its pieces are back; Acquire of a whole buffer waits for that.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

#include "base/check.h"
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
  // Lends buffers in pieces of `piece_bytes` (a multiple of 4096, at most
  // bytes()): per_buffer() of them each. Once, after Init and before use.
  void SetPieces(uint64_t piece_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    piece_bytes_ = piece_bytes;
    per_ = piece_bytes ? static_cast<int>(bytes_ / piece_bytes) : 0;
    lent_.assign(all_.size(), 0);
  }
  // A piece, blocking like Acquire (buffers lent ahead are reclaimed first);
  // null when the pool has no buffers or no pieces were set.
  void* AcquirePiece() {
    if (all_.empty() || per_ == 0) return nullptr;
    std::unique_lock<std::mutex> lock(mu_);
    void* p = TakePieceLocked();
    if (!p && reclaim_) {
      lock.unlock();
      reclaim_();
      lock.lock();
      p = TakePieceLocked();
    }
    while (!p) {
      cv_.wait(lock);
      p = TakePieceLocked();
    }
    return p;
  }
  // A piece when one is free now (or a buffer to split), else null.
  void* TryAcquirePiece() {
    if (per_ == 0) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    return TakePieceLocked();
  }
  void ReleasePiece(void* p) {
    if (!p) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const size_t b = OwnerLocked(p);
      free_pieces_.push_back(p);
      if (--lent_[b] == 0) {  // every piece back: the buffer is whole again
        char* base = static_cast<char*>(all_[b].ptr);
        std::erase_if(free_pieces_, [&](void* q) { return q >= base && q < base + bytes_; });
        free_.push_back(base);
      }
    }
    cv_.notify_all();
  }
  uint64_t piece_bytes() const { return piece_bytes_; }
  int per_buffer() const { return per_; }
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
    cv_.notify_all();  // (whole buffers and pieces share the wait)
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
    free_pieces_.clear();
    lent_.clear();
    per_ = 0;
    piece_bytes_ = 0;
  }
  void* TakePieceLocked() {
    if (free_pieces_.empty()) {
      if (free_.empty()) return nullptr;
      char* base = static_cast<char*>(free_.back());
      free_.pop_back();
      for (int i = per_ - 1; i >= 0; --i) free_pieces_.push_back(base + static_cast<uint64_t>(i) * piece_bytes_);
    }
    void* p = free_pieces_.back();
    free_pieces_.pop_back();
    ++lent_[OwnerLocked(p)];
    return p;
  }
  size_t OwnerLocked(const void* p) const {
    const char* q = static_cast<const char*>(p);
    for (size_t b = 0; b < all_.size(); ++b) {
      const char* base = static_cast<const char*>(all_[b].ptr);
      if (q >= base && q < base + bytes_) return b;
    }
    STRATA_CHECK_MSG(false, "staging: a piece the pool did not lend");
    return 0;
  }
  HostTier* host_ = nullptr;
  uint64_t bytes_ = 0;
  std::vector<Allocation> all_;
  std::mutex mu_;  // guards free_, free_pieces_, lent_
  std::condition_variable cv_;
  std::vector<void*> free_;         // whole buffers
  std::vector<void*> free_pieces_;  // pieces of split buffers
  std::vector<int> lent_;           // per buffer: its pieces lent
  uint64_t piece_bytes_ = 0;
  int per_ = 0;
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
