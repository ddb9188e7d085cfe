// Applying injected faults to completion results.
#include "io/fault.h"

#include <chrono>
#include <thread>

#include "base/align.h"

namespace strata {

void FaultPlan::SlowWrites(int ms) {
  std::lock_guard<std::mutex> lock(mu_);
  slow_write_ms_ = ms;
}

int FaultPlan::Apply(uint64_t seq, bool is_write, int res, uint64_t len, uint64_t align) {
  int slow = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    slow = is_write ? slow_write_ms_ : 0;
  }
  if (slow > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow));
  std::lock_guard<std::mutex> lock(mu_);
  if (armed_ && (armed_ops_ == Ops::kBoth || (armed_ops_ == Ops::kWrites) == is_write)) {
    if (armed_skip_ > 0) {
      --armed_skip_;
    } else if (armed_count_ != 0) {
      if (armed_count_ > 0 && --armed_count_ == 0) armed_ = false;
      ++fired_;
      return -armed_err_;
    }
  }
  for (const Fault& f : faults_) {
    if (f.at_op != seq) continue;
    ++fired_;
    if (f.kind == Fault::kErrno) return -f.err;
    // A short completion: report about half, not aligned, so the caller must
    // continue from the aligned offset below it.
    if (res <= 0 || len < 2) return res;
    const uint64_t half = static_cast<uint64_t>(res) / 2 + (align > 1 ? align / 2 : 0);
    return static_cast<int>(half < static_cast<uint64_t>(res) ? half : static_cast<uint64_t>(res) / 2);
  }
  return res;
}

void FaultPlan::Arm(Ops ops, int err, uint64_t skip, int64_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = count != 0;
  armed_ops_ = ops;
  armed_err_ = err;
  armed_skip_ = skip;
  armed_count_ = count;
}

void FaultPlan::Disarm() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
  copies_armed_ = false;
  allocs_armed_ = false;
}

void FaultPlan::ArmHostAllocations(uint64_t bytes, int64_t count, bool throws) {
  std::lock_guard<std::mutex> lock(mu_);
  allocs_armed_ = count != 0;
  allocs_bytes_ = bytes;
  allocs_count_ = count;
  allocs_throw_ = throws;
}

bool FaultPlan::FailHostAllocation(uint64_t bytes, bool* throws) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!allocs_armed_ || bytes != allocs_bytes_) return false;
  if (allocs_count_ > 0 && --allocs_count_ == 0) allocs_armed_ = false;
  ++fired_;
  *throws = allocs_throw_;
  return true;
}

void FaultPlan::ArmDeviceCopies(bool to_device, uint64_t skip, int64_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  copies_armed_ = count != 0;
  copies_to_device_ = to_device;
  copies_skip_ = skip;
  copies_count_ = count;
}

bool FaultPlan::FailDeviceCopy(bool to_device) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!copies_armed_ || to_device != copies_to_device_) return false;
  if (copies_skip_ > 0) {
    --copies_skip_;
    return false;
  }
  if (copies_count_ > 0 && --copies_count_ == 0) copies_armed_ = false;
  ++fired_;
  return true;
}

int FaultPlan::fired() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fired_;
}

}  // namespace strata
