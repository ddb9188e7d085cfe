// Budget accounting shared by every tier.
#include "tiers/tier.h"

#include "base/check.h"
#include "base/sizes.h"

namespace strata {

const char* TierName(TierKind k) {
  switch (k) {
    case TierKind::kDevice: return "device";
    case TierKind::kHost: return "host";
    case TierKind::kNvme: return "nvme";
  }
  return "?";
}

Status Tier::Charge(uint64_t bytes, Code code_when_full) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t used = used_.load(std::memory_order_relaxed);
  if (bytes > budget_ || used > budget_ - bytes) {
    return Status(code_when_full, std::string(name()) + " tier budget exceeded: asked for " +
                                      FormatBytes(bytes) + " with " + FormatBytes(used) + " of its " +
                                      FormatBytes(budget_) + " budget in use");
  }
  used_.store(used + bytes, std::memory_order_relaxed);
  if (used + bytes > peak_.load(std::memory_order_relaxed)) peak_.store(used + bytes);
  return Status::Ok();
}

void Tier::Uncharge(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_CHECK_MSG(used_.load() >= bytes, "tier freed more than it allocated");
  used_.fetch_sub(bytes, std::memory_order_relaxed);
}

}  // namespace strata
