// Tier: one memory tier (device, host or NVMe) with a hard byte budget.
// Allocation past the budget is refused with an error naming the tier, its
// budget, what it holds and what was asked; the peak is recorded so tests
// and stats can show peak <= budget. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "base/status.h"

namespace strata {

enum class TierKind : uint8_t { kDevice = 0, kHost = 1, kNvme = 2 };
const char* TierName(TierKind k);  // "device", "host", "nvme"

// What Allocate hands out. Memory tiers set `ptr`; the NVMe tier sets `id`.
struct Allocation {
  void* ptr = nullptr;
  uint64_t id = 0;
  uint64_t bytes = 0;   // as asked
  uint64_t charged = 0;  // as counted against the budget
};

class Tier {
 public:
  Tier(TierKind kind, uint64_t budget) : kind_(kind), budget_(budget) {}
  virtual ~Tier() = default;
  Tier(const Tier&) = delete;
  Tier& operator=(const Tier&) = delete;

  // Allocates `bytes` (> 0) or fails with kNoMem (memory tiers) or kNoSpace (NVMe).
  virtual Result<Allocation> Allocate(uint64_t bytes) = 0;
  // REQUIRES: `a` came from this tier's Allocate and was not freed.
  virtual void Free(const Allocation& a) = 0;

  TierKind kind() const { return kind_; }
  const char* name() const { return TierName(kind_); }
  uint64_t budget() const { return budget_; }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t peak() const { return peak_.load(std::memory_order_relaxed); }

 protected:
  // Counts `bytes` against the budget or refuses (nothing counted then).
  Status Charge(uint64_t bytes, Code code_when_full = Code::kNoMem);
  void Uncharge(uint64_t bytes);

 private:
  const TierKind kind_;
  const uint64_t budget_;
  std::mutex mu_;  // serializes Charge so used_ never passes budget_
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> peak_{0};
};

}  // namespace strata
