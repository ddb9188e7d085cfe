// SpeculationPolicy (speculation_policy.h).
#include "engine/step/speculation_policy.h"

#include <bitset>

namespace strata {

bool SpeculationPolicy::ParseMode(const std::string& s, Mode* out) {
  if (s == "auto") *out = Mode::kAuto;
  else if (s == "always") *out = Mode::kAlways;
  else if (s == "never") *out = Mode::kNever;
  else return false;
  return true;
}

bool SpeculationPolicy::Decide(std::string* why) const {
  auto no = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  if (mode_ == Mode::kAlways) return true;
  if (mode_ == Mode::kNever) return no("strata.speculation is \"never\"");
  if (!declined_.empty()) return no(declined_);
  if (seen_ == 0) return no("no step seen yet (the first steps are the ones most often clipped)");
  if (history_ & 1u) return no("the last step was clipped or skipped");
  const uint32_t window = history_ & ((1u << kWindow) - 1u);
  if (std::bitset<32>(window).count() > 1) return no("more than one of the last 4 steps was clipped or skipped");
  return true;
}

void SpeculationPolicy::Record(bool kept) {
  history_ = (history_ << 1) | (kept ? 0u : 1u);
  if (seen_ < (1 << 30)) ++seen_;
}

}  // namespace strata
