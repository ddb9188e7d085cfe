// Trace recording and look-ahead.
#include "engine/residency/prefetch.h"

#include <algorithm>

#include "base/log.h"

namespace strata {

bool PrefetchSchedule::OnFetch(int group) {
  // Bounded without steps (a model only evaluated: fetches for days, no
  // OnStep): the fetches held are what a departure would record from; past
  // the bound the oldest go (a trace recorded then starts later in the pass,
  // and a later departure records it again: numerics are unaffected).
  const size_t bound = std::max<size_t>(kMinHeld, 4 * trace_.size());
  if (current_.size() >= bound) current_.erase(current_.begin(), current_.begin() + static_cast<std::ptrdiff_t>(bound / 2));
  current_.push_back(group);
  if (recording_) return true;
  // A pass may start again from the trace's first fetch (an eval pass
  // under no_grad, one more micro-batch): `alt_` reads the fetches as if the
  // latest fetch of trace_[0] had started one, for when `pos_` loses its way.
  const size_t alt = alt_ < trace_.size() && trace_[alt_] == group ? alt_ + 1 : kNowhere;
  alt_ = trace_[0] == group ? 1 : alt;
  if (pos_ < trace_.size() && trace_[pos_] == group) {
    ++pos_;
    return true;
  }
  if (alt != kNowhere || trace_[0] == group) {
    pos_ = alt != kNowhere ? alt : 1;
    ++pass_;
    return true;
  }
  WarnOnce("trace-departure",
           "this step fetches in another order than the recorded trace; prefetch restarts from a new "
           "recording (numerics are unaffected)");
  recording_ = true;
  ++pass_;
  return false;
}

void PrefetchSchedule::OnStep() {
  // Only a departure re-records: passes that restart from the trace's
  // first fetch (see OnFetch) leave it as it is.
  if (recording_) {
    trace_ = current_;
    recording_ = trace_.empty();
    uses_.clear();
    for (size_t i = 0; i < trace_.size(); ++i) {
      const auto g = static_cast<size_t>(trace_[i]);
      if (g >= uses_.size()) uses_.resize(g + 1);
      uses_[g].push_back(i);
    }
  }
  current_.clear();
  pos_ = 0;
  ++pass_;
  alt_ = kNowhere;
}

std::vector<int> PrefetchSchedule::Ahead(uint64_t window, const std::function<uint64_t(int)>& bytes_of) const {
  std::vector<int> out;
  if (!has_trace()) return out;
  uint64_t total = 0;
  for (size_t i = pos_; i < trace_.size(); ++i) {
    const uint64_t b = bytes_of(trace_[i]);
    if (!out.empty() && total + b > window) break;
    total += b;
    out.push_back(trace_[i]);
  }
  return out;
}

uint64_t PrefetchSchedule::NextUse(int group) const {
  if (!has_trace() || group < 0 || static_cast<size_t>(group) >= uses_.size() || uses_[static_cast<size_t>(group)].empty())
    return UINT64_MAX / 2;
  const std::vector<size_t>& at = uses_[static_cast<size_t>(group)];
  auto it = std::lower_bound(at.begin(), at.end(), pos_);
  if (it != at.end()) return *it - pos_;
  return trace_.size() - pos_ + at.front();  // next step
}

}  // namespace strata
