// PrefetchSchedule: the order of fetches in one training step, recorded in
// the first step and replayed afterwards. It answers "what comes next within
// this many bytes" (for prefetch) and "when is this group next used" (for
// eviction: the block used farthest in the future goes first). A step that
// departs from the trace drops it, with one warning, and records anew.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace strata {

class PrefetchSchedule {
 public:
  // Called on every fetch; returns false when the fetch departs from the trace.
  bool OnFetch(int group);
  // Called at the end of a step: a recorded or re-recorded trace takes effect.
  void OnStep();

  bool has_trace() const { return !trace_.empty() && !recording_; }
  // The next groups, in order, from the current position, whose sizes (from
  // `bytes_of`) add up to at most `window` bytes (always at least one).
  std::vector<int> Ahead(uint64_t window, const std::function<uint64_t(int)>& bytes_of) const;
  // How many fetches from now `group` is next used; large when never.
  // O(log uses) (the eviction scan asks it for every candidate).
  uint64_t NextUse(int group) const;
  // The pass of the trace in progress: a new one (a step, a restart from
  // the trace's first fetch, a departure) counts up.
  uint64_t pass() const { return pass_; }
  // The fetches held since the last step (bounded: OnFetch).
  size_t held() const { return current_.size(); }
  static constexpr size_t kMinHeld = size_t{1} << 16;

 private:
  std::vector<int> trace_;    // the replayed step
  std::vector<std::vector<size_t>> uses_;  // per group, its positions in trace_ (ascending)
  std::vector<int> current_;  // fetches of the step in progress
  static constexpr size_t kNowhere = SIZE_MAX;
  size_t pos_ = 0;            // position in trace_ of the next expected fetch
  size_t alt_ = kNowhere;     // pos_ had a pass restarted at the latest fetch of trace_[0]
  bool recording_ = true;
  uint64_t pass_ = 0;
};

}  // namespace strata
