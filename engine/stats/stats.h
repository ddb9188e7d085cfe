// Stats and trace: per-step counters, busy time per resource (disk, copy,
// CPU optimizer) and, with strata.trace_path, a Chrome trace JSON that
// Perfetto opens: one track per resource, one for the engine's calls (fetch,
// stall, grads, step), one for the communication thread's collectives,
// one per trainer thread for the trainer's own spans;
// pid = rank. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/stats/engine_stats.h"
#include "tiers/tier.h"

namespace strata {

// kComm: the communication thread's collectives (trace only).
enum class Resource : int { kDisk = 0, kCopy = 1, kCpuOptimizer = 2, kCaller = 3, kComm = 4 };

class StatsRecorder {
 public:
  // max_events: how many spans the trace holds (the newest; kMaxEvents
  // unless a test asks for fewer).
  StatsRecorder(int rank, std::string trace_path, size_t max_events = kMaxEvents);
  ~StatsRecorder();  // writes the trace a last time (a failure is logged)

  // Busy intervals: overlapping intervals of one resource count once.
  void Begin(Resource r);
  void End(Resource r);
  // A completed span for the trace (and nothing else).
  void Span(Resource r, const char* name, double start_s, double end_s, uint64_t bytes);
  // An engine call's span on the caller's track: "fetch", "stall", "grads",
  // with the group it was for (args.group in the trace).
  void CallSpan(const char* name, int group, double start_s, double end_s) {
    GroupSpan(Resource::kCaller, name, group, start_s, end_s);
  }
  // A collective of the communication thread (a reduction, a gather ahead),
  // with its group, on the trace's "comm" track.
  void CommSpan(const char* name, int group, double start_s, double end_s) {
    GroupSpan(Resource::kComm, name, group, start_s, end_s);
  }
  double Now() const;  // seconds since the recorder started

  // The trainer's own spans (strata_engine_span_begin / _end), on one track
  // per thread that begins them; recorded only with a trace path, checked
  // always. Begin refuses a name that is empty, longer than kMaxSpanName
  // bytes or not UTF-8, and more than kMaxOpenSpans open spans; it returns a
  // token (never 0). End takes a token of an open span, from any thread, and
  // refuses one that is not open, or not the innermost open span of the
  // thread that began it (spans of one thread nest). A refusal changes nothing.
  static constexpr size_t kMaxSpanName = 256;
  static constexpr size_t kMaxOpenSpans = 100'000;
  Result<uint64_t> BeginUserSpan(const char* name);
  Status EndUserSpan(uint64_t token);

  void AddMoved(TierKind from, TierKind to, uint64_t bytes);
  void OnFetch(bool counted, bool hit, double stall_s);
  // Stage 3 with several ranks: a group's parameters all-gathered for a
  // fetch (in the fetch, or ahead of it).
  void OnGather();
  // A collective of gradients or parameters (engine_stats.h, comm_s): its
  // wall and CPU seconds, and its bytes (reduced or gathered).
  void OnCollective(bool gather, uint64_t bytes, double wall_s, double cpu_s);
  // Starts / ends a step's accounting window.
  void StepBegin();
  void StepEnd(bool skipped);
  // overlap_step's outcome for a step (engine_stats.h), with the groups it
  // updated early; and the step's exposed time.
  enum class Speculated { kNone, kCommitted, kReplayed, kDiscarded };
  void OnOverlap(Speculated outcome, int early_groups);
  void OnSpeculationDeclined();
  void OnReadAheadUsed(uint64_t bytes);
  void OnWriteBehind();
  void OnBehindWait(double seconds);
  void SetExposed(double seconds);
  // Figures so far; the tier fields are filled by the engine.
  EngineStats Snapshot() const;
  // Writes every span so far to the trace path (a temporary file renamed
  // into place: the file is whole JSON after every write). Spans still open
  // are written as ending now, with args.unfinished. No trace path: nothing.
  Status WriteTrace() const;
  bool tracing() const { return !trace_path_.empty(); }
  // What the trace holds now: spans, their distinct names (at most twice
  // max_events: names no held span uses are let go), spans overwritten.
  struct TraceHeld { size_t events, names; uint64_t dropped; };
  TraceHeld Held() const;
  static constexpr size_t kMaxEvents = 4'000'000;

 private:
  static constexpr int kUserTrack0 = 5;  // tid of the first trainer thread's track
  struct Clock { int active = 0; double since = 0, total = 0; };
  struct Event {
    int track;
    uint32_t name;  // into names_
    double start, end;
    uint64_t bytes;
    int64_t group;  // -1: none
  };
  struct OpenSpan {
    std::string name;
    int track;
    double start;
  };
  // Records a span (its name interned only then, so that names of spans not
  // recorded take no memory). REQUIRES: mu_ held.
  void Add(int track, const std::string& name, double start, double end, uint64_t bytes, int64_t group);
  // Keeps only the names the held spans use (renumbered). REQUIRES: mu_ held.
  void CompactNames();
  int TrackOfThisThread();  // REQUIRES: mu_ held
  void GroupSpan(Resource r, const char* name, int group, double start_s, double end_s);

  const int rank_;
  const std::string trace_path_;
  const std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  mutable std::mutex mu_;  // guards everything below
  Clock clocks_[5];
  double step_start_ = 0;
  EngineStats stats_;
  // A ring of the newest max_events_ spans: once full, events_[next_] is
  // the oldest, overwritten by the next span.
  const size_t max_events_;
  std::vector<Event> events_;
  size_t next_ = 0;
  uint64_t dropped_ = 0;  // spans overwritten (said in the trace and a warning)
  std::vector<std::string> names_;
  std::unordered_map<std::string, uint32_t> name_ids_;
  std::map<std::thread::id, int> thread_tracks_;    // trainer thread -> its track (0-based)
  std::vector<std::vector<uint64_t>> open_stacks_;  // per trainer track: open tokens, innermost last
  std::unordered_map<uint64_t, OpenSpan> open_;
  uint64_t next_token_ = 1;
  mutable std::mutex write_mu_;  // one writer of the trace file at a time (its temporary name)
};

// Records an engine call's span (StatsRecorder::CallSpan) from its
// construction to its destruction, whatever the call returns.
class CallSpanScope {
 public:
  CallSpanScope(StatsRecorder& stats, const char* name, int group)
      : stats_(stats), name_(name), group_(group), start_(stats.tracing() ? stats.Now() : 0) {}
  ~CallSpanScope() {
    if (stats_.tracing()) stats_.CallSpan(name_, group_, start_, stats_.Now());
  }
  CallSpanScope(const CallSpanScope&) = delete;
  CallSpanScope& operator=(const CallSpanScope&) = delete;

 private:
  StatsRecorder& stats_;
  const char* name_;
  int group_;
  double start_;
};

}  // namespace strata
