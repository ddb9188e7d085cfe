// StagingPool: a fixed set of equal host buffers taken from the HostTier at
// build time (so budgets are settled before training), handed out and
// returned without allocating. Acquire blocks while all are in use; an empty
// pool (nothing needs staging) hands out null.
//
// Pieces (SetPieces): a buffer may instead be lent in pieces of any size,
// for users whose work comes in smaller units (the step's units,
// StepPipeline): they are cut from one buffer after another, in order, and
// a buffer comes back whole once all its pieces are back; Acquire of a
// whole buffer waits for that. Users that take pieces in order and give
// them back in about the order taken (a pipeline) reuse the memory fully.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

#include "base/check.h"
#include "tiers/host_tier.h"

namespace strata {

// Next fit, as StagingPool cuts pieces: each piece (rounded up to 4096)
// goes at the end of the current buffer if it fits there, else at the start
// of a whole buffer, which becomes the current one. How many whole buffers
// of `slot_bytes` the `pieces`, in this order, open after `used` bytes of
// the current buffer (`used` = `slot_bytes`: no current buffer); -1 when a
// piece is larger than a buffer.
inline int64_t PiecesOpen(const std::vector<uint64_t>& pieces, uint64_t slot_bytes, uint64_t used) {
  int64_t opened = 0;
  for (uint64_t p : pieces) {
    const uint64_t a = (p + 4095) / 4096 * 4096;
    if (a > slot_bytes) return -1;
    if (used + a > slot_bytes) {
      ++opened;
      used = 0;
    }
    used += a;
  }
  return opened;
}
// How many buffers of `slot_bytes` hold `pieces` at once when they are cut
// in this order from whole buffers (the plan of write-behind's staging;
// tools/plan counts it too); -1 when a piece does not fit a buffer.
inline int64_t BuffersForPieces(const std::vector<uint64_t>& pieces, uint64_t slot_bytes) {
  return PiecesOpen(pieces, slot_bytes, slot_bytes);
}

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
  // Adds `extra` buffers of bytes() each from the host tier Init was given
  // (after Init, before use: nothing is lent; pieces or not, as set).
  // Buffers added before a failure stay.
  Status Grow(int extra) {
    if (!host_ || bytes_ == 0) return InternalError("staging: Grow before Init");
    for (int i = 0; i < extra; ++i) {
      auto a = host_->Allocate(bytes_);
      if (!a.ok()) return a.status().WithContext("staging: " + std::to_string(extra) + " more buffers of " + std::to_string(bytes_) + " bytes");
      std::lock_guard<std::mutex> lock(mu_);
      all_.push_back(*a);
      free_.push_back(a->ptr);
      if (pieces_) {
        lent_.push_back(0);
        used_.push_back(0);
      }
    }
    cv_.notify_all();
    return Status::Ok();
  }
  // Lends buffers in pieces (regions of any size up to bytes(), each at a
  // multiple of 4096). Once, after Init and before use.
  void SetPieces() {
    std::lock_guard<std::mutex> lock(mu_);
    pieces_ = true;
    lent_.assign(all_.size(), 0);
    used_.assign(all_.size(), 0);
    current_ = -1;
  }
  bool pieces() const { return pieces_; }
  // A piece of `bytes`, blocking like Acquire (buffers lent ahead are
  // reclaimed first); null when the pool has no buffers, no pieces were
  // set, or `bytes` is more than a buffer holds.
  void* AcquirePiece(uint64_t bytes) {
    if (all_.empty() || !pieces_ || bytes > bytes_) return nullptr;
    std::unique_lock<std::mutex> lock(mu_);
    void* p = TakePieceLocked(bytes);
    if (!p && reclaim_) {
      lock.unlock();
      reclaim_();
      lock.lock();
      p = TakePieceLocked(bytes);
    }
    while (!p) {
      cv_.wait(lock);
      p = TakePieceLocked(bytes);
    }
    return p;
  }
  // A piece when one fits now, else null (never blocks).
  void* TryAcquirePiece(uint64_t bytes) {
    if (!pieces_ || bytes > bytes_) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    return TakePieceLocked(bytes);
  }
  void ReleasePiece(void* p) {
    if (!p) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const size_t b = OwnerLocked(p);
      if (--lent_[b] == 0) {  // every piece back: the buffer is whole again
        used_[b] = 0;
        if (current_ == static_cast<int>(b)) current_ = -1;
        free_.push_back(all_[b].ptr);
      }
    }
    cv_.notify_all();
  }
  // Whether `pieces`, cut in this order from now on (TryAcquirePiece, with
  // none given back meanwhile), all fit: the current buffer's room, then
  // whole buffers (PiecesOpen). Exact while no other thread cuts pieces.
  bool HoldsInOrder(const std::vector<uint64_t>& pieces) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pieces_) return false;
    const uint64_t used = current_ < 0 ? bytes_ : used_[static_cast<size_t>(current_)];
    const int64_t opens = PiecesOpen(pieces, bytes_, used);
    return opens >= 0 && static_cast<uint64_t>(opens) <= free_.size();
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
    lent_.clear();
    used_.clear();
    pieces_ = false;
    current_ = -1;
  }
  // Pieces come from one buffer at a time, in order (the last split, while
  // it has room); a buffer comes back whole when its last piece does.
  void* TakePieceLocked(uint64_t bytes) {
    const uint64_t a = (bytes + 4095) / 4096 * 4096;
    if (current_ < 0 || used_[static_cast<size_t>(current_)] + a > bytes_) {
      if (free_.empty()) return nullptr;
      void* base = free_.back();
      free_.pop_back();
      current_ = static_cast<int>(OwnerLocked(base));
      used_[static_cast<size_t>(current_)] = 0;
    }
    const size_t b = static_cast<size_t>(current_);
    void* p = static_cast<char*>(all_[b].ptr) + used_[b];
    used_[b] += a;
    ++lent_[b];
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
  std::mutex mu_;  // guards free_, lent_, used_, current_
  std::condition_variable cv_;
  std::vector<void*> free_;       // whole buffers
  bool pieces_ = false;
  std::vector<int> lent_;         // per buffer: its pieces lent
  std::vector<uint64_t> used_;    // per split buffer: bytes handed out from its start
  int current_ = -1;              // the buffer pieces come from now (-1: none)
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
