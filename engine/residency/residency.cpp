// Residency (residency.h): fetch and release, the prefetch thread, eviction
// of the copy used farthest ahead.
#include "engine/residency/residency.h"

#include <algorithm>
#include <cstring>

#include "base/check.h"
#include "base/sizes.h"
#include "base/worker.h"

namespace strata {

Residency::Residency(ResidencyOptions options, DeviceTier& device, PSource& source, StatsRecorder& stats,
                     Gatherer gatherer)
    : options_(std::move(options)),
      device_(device),
      source_(source),
      stats_(stats),
      gatherer_(std::move(gatherer)),
      copies_(static_cast<size_t>(options_.groups)),
      queued_in_pass_(static_cast<size_t>(options_.groups), 0) {}

Residency::~Residency() {
  Stop();
  for (Copy& c : copies_) DropCopy(c);
}

void Residency::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

void Residency::Run() {
  if (options_.on_thread_start) options_.on_thread_start();
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const int g = queue_.front();
    queue_.pop_front();
    if (copies_[static_cast<size_t>(g)].state != Copy::kAbsent) continue;
    if (!Allocate(g, lock, /*demand=*/false).ok()) continue;  // no room now: a fetch will load it
    LoadAllocated(g, lock).IgnoreError();  // a failure leaves it absent: the fetch loads again and reports
  }
}

void Residency::Stop() {
  StopWorker(mu_, cv_, stop_, thread_);
  std::lock_guard<std::mutex> lock(mu_);
  queue_.clear();
}

void Residency::Prefetch(const std::vector<int>& groups) {
  if (options_.home) return;  // nothing to fetch
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int g : groups)
      if (copies_[static_cast<size_t>(g)].state == Copy::kAbsent &&
          std::find(queue_.begin(), queue_.end(), g) == queue_.end())
        queue_.push_back(g);
  }
  cv_.notify_all();
}

void Residency::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  queue_.clear();
  cv_.wait(lock, [&] { return loads_in_flight_ == 0; });
}

std::vector<int> Residency::OnStep() {
  std::lock_guard<std::mutex> lock(mu_);
  schedule_.OnStep();
  return schedule_.Ahead(options_.window, options_.bytes);
}

int Residency::pins(int g) const {
  std::lock_guard<std::mutex> lock(mu_);
  return copies_[static_cast<size_t>(g)].pins;
}

bool Residency::resident(int g) const {
  std::lock_guard<std::mutex> lock(mu_);
  return copies_[static_cast<size_t>(g)].state == Copy::kResident;
}

bool Residency::KeepsCopies() const {
  return options_.sharded && options_.keep_gathered && !options_.home && !device_.separate();
}

Status Residency::LoadAllocated(int g, std::unique_lock<std::mutex>& lock) {
  Copy& c = copies_[static_cast<size_t>(g)];
  c.state = Copy::kLoading;
  ++loads_in_flight_;
  lock.unlock();
  Status st = source_.Load(g, c.alloc.ptr);
  lock.lock();
  --loads_in_flight_;
  if (st.ok()) {
    c.state = Copy::kResident;
  } else {
    DropCopy(c);
  }
  cv_.notify_all();
  return st;
}

Status Residency::Allocate(int g, std::unique_lock<std::mutex>& lock, bool demand) {
  Copy& c = copies_[static_cast<size_t>(g)];
  const uint64_t bytes = options_.bytes(g);
  for (;;) {
    auto a = device_.Allocate(bytes);
    if (a.ok()) {
      c.alloc = *a;
      return Status::Ok();
    }
    // Victim: an unpinned resident copy, the one used farthest ahead (or least recently).
    int victim = -1;
    uint64_t best = 0;
    const uint64_t mine = schedule_.NextUse(g);
    for (int h = 0; h < options_.groups; ++h) {
      const Copy& o = copies_[static_cast<size_t>(h)];
      if (h == g || o.state != Copy::kResident || o.pins > 0 || (options_.keep_gathered && o.gathered)) continue;
      const uint64_t score = schedule_.has_trace() ? schedule_.NextUse(h) : UINT64_MAX - o.last_use;
      if (victim < 0 || score > best) { victim = h; best = score; }
    }
    if (victim >= 0 && (demand || !schedule_.has_trace() || best > mine)) {
      DropCopy(copies_[static_cast<size_t>(victim)]);
      continue;
    }
    if (!demand) return a.status();
    if (loads_in_flight_ > 0) {  // a prefetch will finish and become evictable
      cv_.wait(lock);
      if (c.state != Copy::kAbsent) return Status::Ok();  // someone loaded it meanwhile
      continue;
    }
    int pinned = 0;
    for (const Copy& o : copies_) pinned += o.pins > 0;
    return NoMemError("fetch of group " + std::to_string(g) + " (" + FormatBytes(bytes) + "): device tier budget " +
                      FormatBytes(device_.budget()) + " is full: " + FormatBytes(device_.used()) + " in use, " +
                      std::to_string(pinned) + " groups fetched and not released; nothing can be evicted");
  }
}

bool Residency::Refresh(int g, const void* src, uint64_t from, uint64_t len) {
  if (options_.home || device_.separate()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  Copy& c = copies_[static_cast<size_t>(g)];
  if (c.state != Copy::kResident || c.pins > 0) return false;
  // Sharded: this rank's shard, at PHome::Load's place; the rest is
  // gathered by the next fetch (every rank gathers from zero pins).
  const uint64_t bytes = options_.bytes(g) / static_cast<uint64_t>(options_.sharded ? options_.shards : 1);
  const uint64_t at = options_.sharded ? static_cast<uint64_t>(options_.shard_rank) * bytes : 0;
  STRATA_CHECK_MSG(len == 0 || from + len <= bytes, "a refresh past the end of the shard");
  std::memcpy(static_cast<char*>(c.alloc.ptr) + at + from, src, len == 0 ? bytes : len);
  c.gathered = c.kept = false;  // (not sharded: never set)
  return true;
}

bool Residency::Invalidate(int g) {
  std::lock_guard<std::mutex> lock(mu_);
  Copy& c = copies_[static_cast<size_t>(g)];
  if (c.state != Copy::kResident) return true;
  if (c.pins > 0) return false;
  DropCopy(c);
  return true;
}

void Residency::Drop(const std::function<bool(int)>& keep) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t g = 0; g < copies_.size(); ++g)
    if (!keep || !keep(static_cast<int>(g))) DropCopy(copies_[g]);
}

void Residency::DropCopy(Copy& c) {
  if (c.alloc.charged) device_.Free(c.alloc);
  c.alloc = {};
  c.state = Copy::kAbsent;
  c.gathered = c.kept = false;
}

Result<void*> Residency::Fetch(int g) {
  // Sharded: whether this fetch gathers depends on the communication
  // thread's gathers ahead of this group: they are done first, on every
  // rank alike (a gather here then waits for everything queued before it).
  if (options_.sharded && gatherer_.before_fetch) STRATA_RETURN_IF_ERROR(gatherer_.before_fetch(g));
  std::unique_lock<std::mutex> lock(mu_);
  const bool counted = schedule_.has_trace();
  // Off the recorded order (on every rank alike): copies gathered ahead for
  // fetches that will not come give their pins back.
  if (!schedule_.OnFetch(g) && options_.sharded) DropAheadPinsLocked(g);
  Copy& c = copies_[static_cast<size_t>(g)];
  if (options_.home) {
    ++c.pins;
    lock.unlock();
    stats_.OnFetch(counted, true, 0);
    return options_.home(g);
  }
  // A hit: the schedule foresaw this fetch and issued its load (resident,
  // loading, or queued). Whether the load was done in time shows in stalls.
  auto queued = std::find(queue_.begin(), queue_.end(), g);
  const bool hit = c.state != Copy::kAbsent || queued != queue_.end();
  if (queued != queue_.end()) queue_.erase(queued);  // loaded below, now
  const double t0 = stats_.Now();
  bool stalled = false;
  for (;;) {
    if (c.state == Copy::kResident) break;
    if (c.state == Copy::kLoading) {
      stalled = true;
      cv_.wait(lock);
      continue;
    }
    // Absent: load it now, in this thread.
    stalled = true;
    Status st = Allocate(g, lock, /*demand=*/true);
    if (st.ok() && c.state != Copy::kAbsent) continue;
    if (st.ok()) st = LoadAllocated(g, lock).WithContext("fetch: group " + std::to_string(g));
    if (st.ok()) continue;
    // Sharded, the peers are entering this group's gather (a copy that
    // could not be allocated or loaded is this rank's alone: its device
    // budget, its disk): this rank enters it refusing, so that they fail at
    // once instead of waiting for it until strata.timeout.
    if (options_.sharded && gatherer_.refuse && !c.gathered) {
      lock.unlock();
      st = gatherer_.refuse(g, st);
      lock.lock();
    }
    return st;
  }
  // Gathered ahead: the communication thread's pin becomes this fetch's.
  const bool took_ahead_pin = c.ahead;
  c.ahead = false;
  if (options_.sharded && !c.gathered) {
    // The all-gather runs here, in the caller's thread, so that every rank
    // issues its collectives in one program order.
    ++c.pins;
    lock.unlock();
    Status st = gatherer_.gather(g, c.alloc.ptr);
    lock.lock();
    --c.pins;
    if (!st.ok()) return st.WithContext("fetch");
    c.gathered = true;
    stats_.OnGather();
  }
  if (!took_ahead_pin) ++c.pins;
  c.kept = options_.sharded && options_.keep_gathered;
  c.last_use = ++fetch_counter_;
  void* ptr = c.alloc.ptr;
  std::vector<int> ahead = schedule_.Ahead(options_.window, options_.bytes);
  // Sharded with a communication thread: the next groups' gathers run
  // there while this one computes. Queued from the trace and from what the
  // fetches did (the same on every rank), never from what is resident here:
  // the next group, or with keep_gathered (every copy fits the budget at
  // once, so pins ahead cannot starve a fetch) every group of the prefetch
  // window, each once a pass. A kept copy (backward after forward) needs
  // none, and its fetch then waits for no reduction queued before a gather
  // ahead that every rank would decline.
  std::vector<int> gather_ahead;
  if (options_.sharded && gatherer_.queue_ahead && schedule_.has_trace()) {
    const size_t depth = options_.keep_gathered ? ahead.size() : std::min<size_t>(1, ahead.size());
    for (size_t i = 0; i < depth; ++i) {
      const int h = ahead[i];
      if (h == g || copies_[static_cast<size_t>(h)].kept) continue;
      if (options_.keep_gathered) {  // a copy once gathered stays so: once a pass (a group used twice ahead)
        uint64_t& q = queued_in_pass_[static_cast<size_t>(h)];
        if (q == schedule_.pass() + 1) continue;
        q = schedule_.pass() + 1;
      }
      gather_ahead.push_back(h);
    }
  }
  lock.unlock();
  const double t1 = stalled ? stats_.Now() : t0;
  if (stalled) stats_.CallSpan("stall", g, t0, t1);  // inside this fetch's span (Engine::Fetch)
  stats_.OnFetch(counted, hit, t1 - t0);
  Prefetch(ahead);  // first: the gather ahead waits for the shard these load
  for (int h : gather_ahead) gatherer_.queue_ahead(h);
  return ptr;
}

Status Residency::Release(int g) {
  std::lock_guard<std::mutex> lock(mu_);
  Copy& c = copies_[static_cast<size_t>(g)];
  // A pin held for a gather ahead is the next fetch's, not the trainer's.
  if (c.pins - (c.ahead ? 1 : 0) == 0) return StateError("release: group " + std::to_string(g) + " is not fetched");
  --c.pins;
  // Sharded: whether a copy is still resident at the next fetch depends on
  // this rank's prefetch timing, so whether that fetch gathers must not:
  // every fetch from zero pins gathers again (as DeepSpeed gathers in
  // forward and again in backward). A copy kept gathered would let one rank
  // skip an all-gather that another issues, unless no rank ever evicts one
  // (keep_gathered).
  if (c.pins == 0 && options_.sharded && !options_.keep_gathered) c.gathered = false;
  if (c.pins == 0 && options_.evict_at_release && c.state == Copy::kResident) DropCopy(c);
  return Status::Ok();
}

void* Residency::PinForAhead(int g) {
  std::unique_lock<std::mutex> lock(mu_);
  Copy& c = copies_[static_cast<size_t>(g)];
  // Its shard may be on its way (queued or loading): the prefetcher ends
  // either way, resident or absent.
  cv_.wait(lock, [&] {
    return stop_ || (c.state != Copy::kLoading && std::find(queue_.begin(), queue_.end(), g) == queue_.end());
  });
  if (c.state != Copy::kResident || c.gathered || c.ahead) return nullptr;
  ++c.pins;  // kept while the ranks decide, and after for the fetch
  return c.alloc.ptr;
}

void Residency::EndAhead(int g, bool gathered) {
  std::lock_guard<std::mutex> lock(mu_);
  Copy& c = copies_[static_cast<size_t>(g)];
  if (gathered) {
    c.gathered = c.ahead = true;
    stats_.OnGather();
  } else {
    --c.pins;
  }
  cv_.notify_all();
}

void Residency::DropAheadPins() {
  std::lock_guard<std::mutex> lock(mu_);
  DropAheadPinsLocked(-1);
}

void Residency::DropAheadPinsLocked(int keep) {
  for (int h = 0; h < options_.groups; ++h) {
    Copy& c = copies_[static_cast<size_t>(h)];
    if (h == keep || !c.ahead) continue;
    c.ahead = false;
    if (--c.pins == 0 && !options_.keep_gathered) c.gathered = false;
  }
}

}  // namespace strata
