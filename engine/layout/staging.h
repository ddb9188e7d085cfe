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

// Room in one buffer of `slot_bytes` for pieces of at most `each` bytes,
// whatever the order they come in: its bytes less the most a piece that does
// not fit can leave unused at its end (each piece at a multiple of 4096).
// 0: such a piece does not fit a buffer.
inline uint64_t SlotPieceCapacity(uint64_t slot_bytes, uint64_t each) {
  const uint64_t a = (each + 4095) / 4096 * 4096;
  return a > slot_bytes ? 0 : slot_bytes - a + 4096;
}
// How many buffers of `slot_bytes`, beyond the `have` there are, hold
// `total` bytes of such pieces at once: 0 when those do, -1 when no number
// does. (The pool grows by it; the plan, tools/plan, counts it.)
inline int64_t SlotsToHold(uint64_t total, uint64_t each, uint64_t slot_bytes, uint64_t have) {
  const uint64_t one = SlotPieceCapacity(slot_bytes, each), held = have * one;
  if (total <= held) return 0;
  if (one == 0) return -1;
  return static_cast<int64_t>((total - held + one - 1) / one);
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
  // What pieces of `each` bytes (at most) the buffers surely hold at once,
  // whatever the order they come in: each buffer's bytes less the most a
  // piece that does not fit can leave unused at its end.
  uint64_t PieceCapacity(uint64_t each) const {
    return static_cast<uint64_t>(all_.size()) * SlotPieceCapacity(bytes_, each);
  }
  // How many more buffers (Grow) make PieceCapacity(each) at least `total`;
  // -1 when no number does (a piece of `each` does not fit a buffer).
  int64_t BuffersToHold(uint64_t total, uint64_t each) const { return SlotsToHold(total, each, bytes_, all_.size()); }
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
