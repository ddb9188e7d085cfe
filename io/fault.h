// FaultPlan: faults injected into the completions of a real io_uring, for
// tests. The k-th operation (counted over every SQE the storage submits,
// retries included, from 0) has its result replaced.
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
  FaultPlan() = default;
  explicit FaultPlan(std::vector<Fault> faults) : faults_(std::move(faults)) {}
  // The result the completion of op number `seq` should report, given the
  // kernel's `res` for a request of `len` bytes. Thread-safe.
  int Apply(uint64_t seq, int res, uint64_t len, uint64_t align);
  int fired() const;

 private:
  mutable std::mutex mu_;  // guards fired_
  std::vector<Fault> faults_;
  int fired_ = 0;
};

}  // namespace strata
