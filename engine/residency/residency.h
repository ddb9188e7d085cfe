// Residency: the device copies of P. A fetch hands the trainer a device
// pointer to a whole group's parameters and pins it until release; a
// prefetch thread loads the groups the trace says come next; eviction drops
// the unpinned copy used farthest ahead (least recently used before a trace
// exists).
//
// Invariants:
// - A copy's memory comes from the device tier or not at all: the device
//   budget is never exceeded. A fetch that finds no room and nothing to
//   evict fails (NOMEM, naming the budget and the pins), never waits forever.
// - A pinned copy (fetched and not released, or gathered ahead for the next
//   fetch) is never evicted; a copy is loaded by one thread at a time.
// - Sharded P (stage 3, several ranks): a copy is gathered (every rank's
//   shard in) by its fetch from zero pins, in the caller's thread, and stays
//   gathered only while pinned, so that every rank issues the same
//   collectives whatever its prefetch timing. The prefetch thread loads this
//   rank's shard only and never runs a collective.
//
// Lock: mu_ guards every field below it (copies_, schedule_, queue_,
// loads_in_flight_, stop_, fetch_counter_). The prefetch thread is this
// component's own. What it uses of others is what its constructor takes:
// the device tier, the source of P's home (PSource), the stats, and (sharded
// P) the Gatherer's calls, which the composition wires to the reduction.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/residency/prefetch.h"
#include "engine/stats/stats.h"
#include "tiers/device_tier.h"

namespace strata {

// Where a device copy's contents come from: P's home.
class PSource {
 public:
  virtual ~PSource() = default;
  // Fills `copy` (device memory of the group's PBytes) with this rank's part
  // of group g's P: the whole group, or (sharded) this rank's shard at its offset.
  virtual Status Load(int g, void* copy) = 0;
};

struct ResidencyOptions {
  int groups = 0;
  std::function<uint64_t(int)> bytes;  // a group's device copy (its whole padded P)
  uint64_t window = 0;                 // prefetch window, bytes (zero_optimization.stage3_prefetch_bucket_size)
  bool sharded = false;                // stage 3 with several ranks: fetches gather
  int shards = 1, shard_rank = 0;      // sharded: the ranks, and which shard of a copy is this rank's
  // Sharded: a gathered copy stays gathered after its last release, until
  // it is dropped (a step, a load), and is never evicted: backward finds
  // forward's gather still there and gathers nothing. Only where every
  // rank's device budget holds every group's copy at once, agreed by the
  // ranks at build (wiring.cpp): then no rank's prefetch timing can make it
  // evict, and so gather, where another does not. A fetch that finds no room
  // with every gathered copy kept is NOMEM, naming the budget.
  bool keep_gathered = false;
  // The strict device tier: a copy whose last pin goes is dropped at once
  // (its block poisoned), so that a use after release reads NaN.
  bool evict_at_release = false;
  // Set when P's home is the device and holds whole groups: a fetch hands
  // out the home itself (nothing is copied, evicted or prefetched).
  std::function<void*(int)> home;
  std::function<void()> on_thread_start;  // the prefetch thread's first call (the CUDA device)
};

// What residency asks of the ranks when P is sharded; the composition wires
// these to the gradient reduction's communication thread.
struct Gatherer {
  std::function<Status(int g, void* copy)> gather;  // all-gather the shards into the copy, now
  // This rank's copy of g could not be made (`why`): enters the gather its
  // peers are in, refusing it (they fail at once), and returns `why`.
  std::function<Status(int g, const Status& why)> refuse;
  std::function<Status(int g)> before_fetch;        // waits for gathers ahead of g; reports a background failure
  std::function<void(int g)> queue_ahead;           // null: no gathers ahead (no communication thread)
};

class Residency {
 public:
  Residency(ResidencyOptions options, DeviceTier& device, PSource& source, StatsRecorder& stats, Gatherer gatherer);
  ~Residency();  // stops the thread; frees every copy
  Residency(const Residency&) = delete;
  Residency& operator=(const Residency&) = delete;

  void Start();  // the prefetch thread
  void Stop();

  Result<void*> Fetch(int g);
  Status Release(int g);
  int pins(int g) const;
  bool resident(int g) const;
  // Whether copies stay from step to step, each taking the step's new P
  // (Refresh): sharded with keep_gathered (never evicted), in host memory
  // (the device tier's arena), not P's home itself. Then a fetch after a
  // step whose copies are all resident and refreshed loads nothing from P's
  // home.
  bool KeepsCopies() const;

  // At the end of a step: the recorded trace takes effect; returns the groups
  // to prefetch for the next step's first fetches.
  std::vector<int> OnStep();
  void Prefetch(const std::vector<int>& groups);
  // Clears what is queued and waits for the loads in flight.
  void WaitIdle();
  // The step wrote group g's new P (`src`, host memory, in the compute
  // dtype: the whole padded group, or (sharded) this rank's shard): a
  // resident copy takes it, so the next fetch reads nothing from P's home.
  // Sharded, the shard goes to its place in the copy and the copy is no
  // longer gathered (the other ranks' shards are old): the next fetch
  // gathers, as it would after a load, and reads nothing. Only where copies
  // are host memory (the device tier's plain arena); returns whether the
  // copy took it (then the caller keeps it at Drop).
  // `bytes` nonzero: only `bytes` of it from byte `at` of that P (a group
  // stepped in units, a unit at a time).
  // REQUIRES: g not pinned.
  bool Refresh(int g, const void* src, uint64_t at = 0, uint64_t bytes = 0);
  // Group g's P went back (a discarded speculation after Refresh): its copy,
  // resident and unpinned, is dropped, so the next fetch reads P's home; a
  // load in flight reads the home as it is now and stays. Returns false
  // when the copy is pinned (it cannot be dropped).
  bool Invalidate(int g);
  // P changed: every copy but those `keep` names is dropped.
  // REQUIRES: none of them pinned, no load in flight (WaitIdle).
  void Drop(const std::function<bool(int)>& keep = nullptr);

  // Gathers ahead (the communication thread). Waits until g's load, if any,
  // has ended; when its copy is resident, not gathered and not already
  // ahead, pins it and returns it, else null.
  void* PinForAhead(int g);
  // After the ranks' decision on a copy PinForAhead returned: `gathered`,
  // its pin waits for the next fetch; else the pin is given back.
  void EndAhead(int g, bool gathered);
  // Gives back the pins of copies gathered ahead that no fetch took.
  void DropAheadPins();

 private:
  struct Copy {
    enum State : uint8_t { kAbsent, kLoading, kResident } state = kAbsent;
    Allocation alloc;
    int pins = 0;           // fetches without release (and a gather ahead's)
    bool gathered = false;  // sharded: the other ranks' shards are in
    bool ahead = false;     // gathered ahead, holding a pin for the next fetch
    // keep_gathered: a fetch found or made the copy gathered, and nothing
    // has changed it since. Set and cleared only in program order (a fetch;
    // a refresh, a drop at a step), never by a thread's timing, so every
    // rank sees it alike: a fetch queues no gather ahead of a kept copy.
    bool kept = false;
    uint64_t last_use = 0;  // fetch counter, for LRU before a trace exists
  };
  Status Allocate(int g, std::unique_lock<std::mutex>& lock, bool demand);
  Status LoadAllocated(int g, std::unique_lock<std::mutex>& lock);
  void DropCopy(Copy& c);
  void DropAheadPinsLocked(int keep);
  void Run();  // the prefetch thread

  const ResidencyOptions options_;
  DeviceTier& device_;
  PSource& source_;
  StatsRecorder& stats_;
  const Gatherer gatherer_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Copy> copies_;
  PrefetchSchedule schedule_;
  std::deque<int> queue_;
  int loads_in_flight_ = 0;
  bool stop_ = false;
  uint64_t fetch_counter_ = 0;
  std::vector<uint64_t> queued_in_pass_;  // keep_gathered: per group, the pass + 1 it was last queued ahead in
  std::thread thread_;
};

}  // namespace strata
