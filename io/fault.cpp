// Applying injected faults to completion results.
#include "io/fault.h"

#include "base/align.h"

namespace strata {

int FaultPlan::Apply(uint64_t seq, int res, uint64_t len, uint64_t align) {
  for (const Fault& f : faults_) {
    if (f.at_op != seq) continue;
    std::lock_guard<std::mutex> lock(mu_);
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

int FaultPlan::fired() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fired_;
}

}  // namespace strata
