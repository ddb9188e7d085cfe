// The device copies of P: fetch and release, the prefetch thread that loads
// them ahead on the trace, and eviction of the copy used farthest ahead
// (least recently used before a trace exists). Budgets are never exceeded:
// a copy is allocated from the device tier or not at all.
#include <algorithm>
#include <chrono>

#include "base/log.h"
#include "base/sizes.h"
#include "engine/engine_impl.h"
#include "tiers/gpu.h"

namespace strata {

void Engine::Impl::UseDeviceOnThisThread() const {
  if (placement_.device < 0) return;
  // The device tier sets it again before each of its CUDA calls; a failure
  // here shows there too, so a warning is enough.
  const Status st = gpu::SetDevice(placement_.device);
  if (!st.ok()) STRATA_LOG_WARN("engine thread: {}", st.ToString());
}

void Engine::Impl::StartPrefetcher() {
  prefetcher_ = std::thread([this] {
    UseDeviceOnThisThread();
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !prefetch_queue_.empty(); });
      if (stop_) return;
      const int g = prefetch_queue_.front();
      prefetch_queue_.pop_front();
      DeviceCopy& d = groups_[static_cast<size_t>(g)].dev;
      if (d.state != DeviceCopy::kAbsent) continue;
      if (!AllocateDeviceCopy(g, lock, /*demand=*/false).ok()) continue;  // no room now: a fetch will load it
      LoadAllocated(g, lock).IgnoreError();  // a failure leaves it absent: the fetch loads again and reports
    }
  });
}

void Engine::Impl::StopPrefetcher() {
  if (!prefetcher_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  prefetcher_.join();
}

void Engine::Impl::EnqueuePrefetch(const std::vector<int>& groups) {
  if (p_whole_on_device()) return;  // nothing to fetch
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int g : groups)
      if (groups_[static_cast<size_t>(g)].dev.state == DeviceCopy::kAbsent &&
          std::find(prefetch_queue_.begin(), prefetch_queue_.end(), g) == prefetch_queue_.end())
        prefetch_queue_.push_back(g);
  }
  cv_.notify_all();
}

void Engine::Impl::WaitPrefetchIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  prefetch_queue_.clear();
  cv_.wait(lock, [&] { return loads_in_flight_ == 0; });
}

Status Engine::Impl::LoadAllocated(int g, std::unique_lock<std::mutex>& lock) {
  DeviceCopy& d = groups_[static_cast<size_t>(g)].dev;
  d.state = DeviceCopy::kLoading;
  ++loads_in_flight_;
  lock.unlock();
  Status st = LoadDeviceCopy(g);
  lock.lock();
  --loads_in_flight_;
  if (st.ok()) {
    d.state = DeviceCopy::kResident;
  } else {
    DropCopy(d);
  }
  cv_.notify_all();
  return st;
}

Status Engine::Impl::LoadDeviceCopy(int g) {
  GroupState& gs = groups_[static_cast<size_t>(g)];
  const StateBlock& p = gs.blocks[int(StateKind::kP)];
  void* dst = gs.dev.alloc.ptr;
  uint64_t bytes = PBytes(g);
  if (p_sharded_) {  // stage 3, several ranks: our shard now, the others' at Fetch
    bytes = p.bytes;
    dst = static_cast<char*>(dst) + static_cast<uint64_t>(srank_) * bytes;
  }
  if (!device_->on_gpu()) {
    // The device tier is host memory: read or copy straight into it.
    if (p.home == TierKind::kNvme) return io_->Load(p, dst);
    stats_->Begin(Resource::kCopy);
    std::memcpy(dst, io_->DirectPtr(p), bytes);
    stats_->End(Resource::kCopy);
    stats_->AddMoved(TierKind::kHost, TierKind::kDevice, bytes);
    return Status::Ok();
  }
  void* src = p.home == TierKind::kHost ? io_->DirectPtr(p) : nullptr;
  if (!src) {
    src = param_staging_.Acquire();
    Status st = io_->Load(p, src);
    if (!st.ok()) { param_staging_.Release(src); return st; }
  }
  stats_->Begin(Resource::kCopy);
  auto t = device_->CopyIn(dst, src, bytes);
  Status st = t.ok() ? (*t)->Wait() : t.status();
  stats_->End(Resource::kCopy);
  stats_->AddMoved(TierKind::kHost, TierKind::kDevice, bytes);
  if (p.home != TierKind::kHost) param_staging_.Release(src);
  return st;
}

Status Engine::Impl::AllocateDeviceCopy(int g, std::unique_lock<std::mutex>& lock, bool demand) {
  DeviceCopy& d = groups_[static_cast<size_t>(g)].dev;
  const uint64_t bytes = PBytes(g);
  for (;;) {
    auto a = device_->Allocate(bytes);
    if (a.ok()) {
      d.alloc = *a;
      return Status::Ok();
    }
    // Victim: an unpinned resident copy, the one used farthest ahead (or least recently).
    int victim = -1;
    uint64_t best = 0;
    const uint64_t mine = schedule_.NextUse(g);
    for (int h = 0; h < part_.num_groups(); ++h) {
      const DeviceCopy& c = groups_[static_cast<size_t>(h)].dev;
      if (h == g || c.state != DeviceCopy::kResident || c.pins > 0) continue;
      const uint64_t score = schedule_.has_trace() ? schedule_.NextUse(h) : UINT64_MAX - c.last_use;
      if (victim < 0 || score > best) { victim = h; best = score; }
    }
    if (victim >= 0 && (demand || !schedule_.has_trace() || best > mine)) {
      DropCopy(groups_[static_cast<size_t>(victim)].dev);
      continue;
    }
    if (!demand) return a.status();
    if (loads_in_flight_ > 0) {  // a prefetch will finish and become evictable
      cv_.wait(lock);
      if (d.state != DeviceCopy::kAbsent) return Status::Ok();  // someone loaded it meanwhile
      continue;
    }
    int pinned = 0;
    for (const auto& gs : groups_) pinned += gs.dev.pins > 0;
    return NoMemError("fetch of group " + std::to_string(g) + " (" + FormatBytes(bytes) + "): device tier budget " +
                      FormatBytes(device_->budget()) + " is full: " + FormatBytes(device_->used()) + " in use, " +
                      std::to_string(pinned) + " groups fetched and not released; nothing can be evicted");
  }
}

void Engine::Impl::DropDeviceCopies(bool keep_frozen) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t g = 0; g < groups_.size(); ++g)
    if (!keep_frozen || !frozen(static_cast<int>(g))) DropCopy(groups_[g].dev);
}

void Engine::Impl::DropCopy(DeviceCopy& d) {
  if (d.alloc.charged) device_->Free(d.alloc);
  d.alloc = {};
  d.state = DeviceCopy::kAbsent;
  d.gathered = false;
}

Result<void*> Engine::Impl::Fetch(int g) {
  // Stage 3: whether this fetch gathers depends on the communication
  // thread's gathers ahead of this group: they are done first, on every
  // rank alike (a gather here then waits for everything queued before it).
  if (p_sharded_) {
    WaitAheadOf(g);
    STRATA_RETURN_IF_ERROR(DrainComm(/*wait=*/false).WithContext("fetch"));
  }
  GroupState& gs = groups_[static_cast<size_t>(g)];
  if (gs.updated)
    return StateError("fetch: group " + std::to_string(g) + " was already updated by the overlapped step; "
                      "with overlap_step a group is not fetched after its gradients are complete");
  std::unique_lock<std::mutex> lock(mu_);
  const bool counted = schedule_.has_trace();
  if (!schedule_.OnFetch(g) && p_sharded_) {
    // Off the recorded order (on every rank alike): copies gathered ahead
    // for fetches that will not come give their pins back.
    DropAheadPinsLocked(g);
  }
  if (p_whole_on_device()) {
    ++gs.dev.pins;
    lock.unlock();
    stats_->OnFetch(counted, true, 0);
    return io_->DirectPtr(gs.blocks[int(StateKind::kP)]);
  }
  DeviceCopy& d = gs.dev;
  // A hit: the schedule foresaw this fetch and issued its load (resident,
  // loading, or queued). Whether the load was done in time shows in stalls.
  auto queued = std::find(prefetch_queue_.begin(), prefetch_queue_.end(), g);
  const bool hit = d.state != DeviceCopy::kAbsent || queued != prefetch_queue_.end();
  if (queued != prefetch_queue_.end()) prefetch_queue_.erase(queued);  // loaded below, now
  const double t0 = stats_->Now();
  bool stalled = false;
  for (;;) {
    if (d.state == DeviceCopy::kResident) break;
    if (d.state == DeviceCopy::kLoading) {
      stalled = true;
      cv_.wait(lock);
      continue;
    }
    // Absent: load it now, in this thread.
    stalled = true;
    STRATA_RETURN_IF_ERROR(AllocateDeviceCopy(g, lock, /*demand=*/true));
    if (d.state != DeviceCopy::kAbsent) continue;
    if (Status st = LoadAllocated(g, lock); !st.ok()) return st.WithContext("fetch: group " + std::to_string(g));
  }
  // Gathered ahead: the communication thread's pin becomes this fetch's.
  const bool took_ahead_pin = d.ahead;
  d.ahead = false;
  if (p_sharded_ && !d.gathered) {
    // The all-gather runs here, in the caller's thread, so that every rank
    // issues its collectives in one program order (the prefetch thread only
    // reads this rank's shard ahead of time).
    ++d.pins;
    lock.unlock();
    Status st = GatherP(g, d.alloc.ptr);
    lock.lock();
    --d.pins;
    if (!st.ok()) return st.WithContext("fetch");
    d.gathered = true;
  }
  if (!took_ahead_pin) ++d.pins;
  d.last_use = ++fetch_counter_;
  void* ptr = d.alloc.ptr;
  const uint64_t window = config_.zero.prefetch_bucket_size * DTypeSize(dtype_);
  std::vector<int> ahead = schedule_.Ahead(window, [&](int h) { return PBytes(h); });
  // Stage 3 with overlap_comm: the next group's gather runs on the
  // communication thread while this one computes. Queued from the trace
  // alone (the same on every rank), never from what is resident here.
  const int next = p_sharded_ && comm_thread_.joinable() && schedule_.has_trace() && !ahead.empty() ? ahead[0] : -1;
  lock.unlock();
  const double t1 = stalled ? stats_->Now() : t0;
  if (stalled) stats_->CallSpan("stall", g, t0, t1);  // inside this fetch's span (Engine::Fetch)
  stats_->OnFetch(counted, hit, t1 - t0);
  EnqueuePrefetch(ahead);  // first: the gather ahead waits for the shard these load
  if (next >= 0 && next != g) {
    {
      std::lock_guard<std::mutex> cl(comm_mu_);
      comm_queue_.push_back(CommJob{next, nullptr});  // a gather ahead
    }
    comm_cv_.notify_all();
  }
  return ptr;
}

Status Engine::Impl::Release(int g) {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceCopy& d = groups_[static_cast<size_t>(g)].dev;
  if (d.pins == 0) return StateError("release: group " + std::to_string(g) + " is not fetched");
  --d.pins;
  // Stage 3, several ranks: whether a copy is still resident at the next
  // fetch depends on this rank's prefetch timing, so whether that fetch
  // gathers must not: every fetch from zero pins gathers again (as
  // DeepSpeed gathers in forward and again in backward). A copy kept
  // gathered would let one rank skip an all-gather that another issues.
  if (d.pins == 0 && p_sharded_) d.gathered = false;
  return Status::Ok();
}

}  // namespace strata
