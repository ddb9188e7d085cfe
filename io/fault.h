// FaultPlan: faults injected into the completions of a real io_uring, for
// tests. Two ways to aim them:
//   - by number: the k-th operation (counted over every SQE the storage
//     submits, retries included, from 0) has its result replaced;
//   - armed at run time: from now on, after `skip` matching operations pass,
//     the next `count` reads or writes (or both; count < 0: every one until
//     Disarm) fail with -err — "the disk went bad, later it came back".
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

namespace strata {

struct Fault {
  enum Kind : uint8_t {
    kShort,  // the completion reports fewer bytes than were moved
    kErrno,  // the completion reports -err (EAGAIN, EINTR, EIO, ENOSPC, EFBIG...)
  };
  uint64_t at_op = 0;
  Kind kind = kErrno;
  int err = 0;
};

class FaultPlan {
 public:
  enum class Ops : uint8_t { kReads, kWrites, kBoth };
  FaultPlan() = default;
  explicit FaultPlan(std::vector<Fault> faults) : faults_(std::move(faults)) {}
  // The result the completion of op number `seq` (a write when `is_write`)
  // should report, given the kernel's `res` for a request of `len` bytes.
  // Thread-safe.
  int Apply(uint64_t seq, bool is_write, int res, uint64_t len, uint64_t align);
  // Arms the run-time fault (replacing any armed one).
  void Arm(Ops ops, int err, uint64_t skip = 0, int64_t count = -1);
  void Disarm();
  int fired() const;
  // Every write's completion is held back this long before it is reported
  // (a slow disk), from now on; 0: none.
  void SlowWrites(int ms);
  // The device tier's copies (DeviceTier::CopyIn / CopyOut, on a GPU or the
  // host arena): from now on, after `skip` copies in that direction pass,
  // the next `count` (< 0: every one until Disarm) fail with EIO. Disarm
  // disarms these too.
  void ArmDeviceCopies(bool to_device, uint64_t skip, int64_t count = 1);
  // Whether this copy fails (counted in fired()). Thread-safe.
  bool FailDeviceCopy(bool to_device);
  // The host tier's allocations of exactly `bytes` (HostTier::Allocate):
  // from now on the next `count` (< 0: every one until Disarm) fail, with
  // NOMEM, or by throwing std::bad_alloc where `throws` (a C++ allocation
  // failing inside the engine). Disarm disarms these too.
  void ArmHostAllocations(uint64_t bytes, int64_t count = 1, bool throws = false);
  // Whether this allocation fails (counted in fired()); *throws: how. Thread-safe.
  bool FailHostAllocation(uint64_t bytes, bool* throws);

 private:
  mutable std::mutex mu_;  // guards fired_ and the armed fault
  std::vector<Fault> faults_;
  int fired_ = 0;
  bool armed_ = false;
  Ops armed_ops_ = Ops::kBoth;
  int armed_err_ = 0;
  uint64_t armed_skip_ = 0;
  int64_t armed_count_ = 0;
  int slow_write_ms_ = 0;
  bool copies_armed_ = false, copies_to_device_ = false;
  uint64_t copies_skip_ = 0;
  int64_t copies_count_ = 0;
  bool allocs_armed_ = false, allocs_throw_ = false;
  uint64_t allocs_bytes_ = 0;
  int64_t allocs_count_ = 0;
};

}  // namespace strata
