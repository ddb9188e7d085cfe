// Stats and trace: per-step counters, busy time per resource (disk, copy,
// CPU optimizer) and, with strata.trace_path, a Chrome trace JSON that
// Perfetto opens: one track per resource, pid = rank. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "tiers/tier.h"

namespace strata {

enum class Resource : int { kDisk = 0, kCopy = 1, kCpuOptimizer = 2, kCaller = 3 };

class StatsRecorder {
 public:
  StatsRecorder(int rank, std::string trace_path);
  ~StatsRecorder();

  // Busy intervals: overlapping intervals of one resource count once.
  void Begin(Resource r);
  void End(Resource r);
  // A completed span for the trace (and nothing else).
  void Span(Resource r, const char* name, double start_s, double end_s, uint64_t bytes);
  double Now() const;  // seconds since the recorder started

  void AddMoved(TierKind from, TierKind to, uint64_t bytes);
  void OnFetch(bool counted, bool hit, double stall_s);
  // Starts / ends a step's accounting window.
  void StepBegin();
  void StepEnd(bool skipped);
  // Figures so far; the tier fields are filled by the engine.
  EngineStats Snapshot() const;
  Status WriteTrace() const;

 private:
  struct Clock { int active = 0; double since = 0, total = 0; };
  const int rank_;
  const std::string trace_path_;
  const std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  mutable std::mutex mu_;  // guards everything below
  Clock clocks_[4];
  double step_start_ = 0;
  EngineStats stats_;
  struct Event { int track; const char* name; double start, end; uint64_t bytes; };
  std::vector<Event> events_;
};

}  // namespace strata
