// Timeline: the busy intervals of one simulated resource (a disk, a link,
// the CPU optimizer), for tools/plan/simulator.cpp: work is booked into the
// first gap that fits (Book) or spread over the gaps (Fill).
#pragma once

#include <algorithm>
#include <iterator>
#include <vector>

namespace strata::plan {

// Busy intervals of one resource, sorted and disjoint.
class Timeline {
 public:
  // Books `dur` seconds in the first gap that starts at or after `ready`;
  // returns the end.
  double Book(double ready, double dur) {
    if (dur <= 0) return ready;
    busy_ += dur;
    auto it = std::lower_bound(iv_.begin(), iv_.end(), ready,
                               [](const Interval& a, double t) { return a.end <= t; });
    double start = ready;
    for (; it != iv_.end() && start + dur > it->start; ++it) start = std::max(start, it->end);
    const double end = start + dur;
    Insert(it, start, end);
    return end;
  }
  // Books `dur` seconds from `ready` in whatever gaps there are, split
  // across them (work that yields to what is already booked); returns when
  // the last piece ends.
  double Fill(double ready, double dur) {
    if (dur <= 0) return ready;
    busy_ += dur;
    double t = ready, left = dur;
    for (;;) {
      auto it =
          std::lower_bound(iv_.begin(), iv_.end(), t, [](const Interval& a, double x) { return a.end <= x; });
      if (it != iv_.end() && it->start <= t) {  // t is inside a busy interval: skip to its end
        t = it->end;
        continue;
      }
      const double gap = it == iv_.end() ? left : std::min(left, it->start - t);
      Insert(it, t, t + gap);
      t += gap;
      left -= gap;
      if (left <= 0) return t;
    }
  }
  double busy() const { return busy_; }

 private:
  struct Interval {
    double start, end;
  };
  // Inserts [start, end) before `it` (the first interval after it), merged
  // with touching neighbours so that a backlogged resource stays one interval.
  void Insert(std::vector<Interval>::iterator it, double start, double end) {
    const bool joins_prev = it != iv_.begin() && std::prev(it)->end == start;
    const bool joins_next = it != iv_.end() && it->start == end;
    if (joins_prev && joins_next) {
      std::prev(it)->end = it->end;
      iv_.erase(it);
    } else if (joins_prev) {
      std::prev(it)->end = end;
    } else if (joins_next) {
      it->start = start;
    } else {
      iv_.insert(it, {start, end});
    }
  }

  std::vector<Interval> iv_;
  double busy_ = 0;
};

}  // namespace strata::plan
