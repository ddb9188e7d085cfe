// ActivationStore (activation_store.h).
#include "engine/activations/activation_store.h"

#include <algorithm>
#include <cstring>

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"

namespace strata {

ActivationStore::ActivationStore(ActivationOptions options, DeviceTier& device, HostTier& host, NvmeTier* nvme,
                                 StatsRecorder& stats)
    : options_(options), device_(device), host_(host), nvme_(options.nvme_bytes > 0 ? nvme : nullptr),
      stats_(stats) {}

ActivationStore::~ActivationStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    jobs_.clear();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();  // its job in flight ends first
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [h, it] : items_) FreeItem(it);
  items_.clear();
  if (arena_.charged) host_.Free(arena_);
}

Status ActivationStore::Init() {
  if (options_.host_bytes == 0) return Status::Ok();  // no store: Stash says how to make one
  auto a = host_.Allocate(options_.host_bytes);
  if (!a.ok())
    return a.status().WithContext("activations: the arena of strata.activation_host_bytes (" +
                                  FormatBytes(options_.host_bytes) + ") from the host budget");
  arena_ = *a;
  extents_ = std::make_unique<ExtentAllocator>(options_.host_bytes / 4096 * 4096, 4096);
  thread_ = std::thread([this] { Run(); });
  return Status::Ok();
}

uint64_t ActivationStore::ArenaBytes(uint64_t bytes) const {
  return AlignUp(nvme_ ? nvme_->BufferSize(bytes) : bytes, 4096);
}

uint64_t ActivationStore::DiskBytes(uint64_t bytes) const { return nvme_->PaddedSize(bytes); }

uint64_t ActivationStore::TakeArena(std::unique_lock<std::mutex>& lock, uint64_t bytes) {
  for (;;) {
    const uint64_t off = extents_->Allocate(bytes);
    if (off != ~uint64_t{0}) return off;
    // Make room, cheapest first: a write in flight gives its room back when
    // done; a stash read ahead goes back to being on the disk (its data is
    // there); a stash kept here goes on to the disk (the earliest: backward
    // needs it last). Else a read in flight may end; else there is none.
    bool writing = false, reading = false;
    Item* read = nullptr;
    uint64_t kept = 0;  // the earliest stash kept here (0: none)
    for (auto& [h, it] : items_) {
      writing = writing || it.where == Where::kWriting;
      reading = reading || it.where == Where::kReading;
      if (it.where == Where::kRead && !it.dropped && it.io.ok() && !read) read = &it;
      if (it.where == Where::kArena && !it.dropped && !it.spill_failed && !kept) kept = h;
    }
    if (!writing && read) {
      extents_->Free(read->arena, ArenaBytes(read->bytes));
      read->arena = ~uint64_t{0};
      read->where = Where::kDisk;
      continue;
    }
    if (!writing && kept && Spill(kept, /*first=*/true)) {
      cv_.notify_all();
      writing = true;
    }
    if (!writing && !reading) return ~uint64_t{0};
    cv_.wait(lock);
  }
}

bool ActivationStore::Spill(uint64_t handle, bool first) {
  Item& it = items_.at(handle);
  if (!nvme_) return false;
  const uint64_t p = DiskBytes(it.bytes);
  if (nvme_used_ + p > options_.nvme_bytes) return false;
  auto d = nvme_->Allocate(it.bytes);
  if (!d.ok()) return false;
  it.disk = *d;
  nvme_used_ += p;
  it.where = Where::kWriting;
  st_.stashed_nvme_bytes += it.bytes;  // it goes on to NVMe after all
  if (first) jobs_.push_front({handle, true});
  else jobs_.push_back({handle, true});
  return true;
}

std::string ActivationStore::SpillFailure() const {
  return spill_error_.ok() ? std::string()
                           : "; stashes whose write to NVMe failed stay in the arena until redeemed or dropped (the "
                             "last failure: " + spill_error_.ToString() + ")";
}

void ActivationStore::FreeItem(Item& it) {
  if (it.arena != ~uint64_t{0}) extents_->Free(it.arena, ArenaBytes(it.bytes));
  it.arena = ~uint64_t{0};
  if (it.disk.charged) {
    nvme_->Free(it.disk);
    nvme_used_ -= DiskBytes(it.bytes);
    it.disk = {};
  }
}

Status ActivationStore::CopyIn(const void* src, void* dst, uint64_t bytes) {
  if (!device_.separate()) {
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  STRATA_ASSIGN_OR_RETURN(CopyTicket t, device_.CopyOut(dst, src, bytes));  // the device's buffer to the arena
  return t->Wait();
}

Status ActivationStore::CopyOut(const void* src, void* dst, uint64_t bytes) {
  if (!device_.separate()) {
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  STRATA_ASSIGN_OR_RETURN(CopyTicket t, device_.CopyIn(dst, src, bytes));  // the arena to the device's buffer
  return t->Wait();
}

Result<uint64_t> ActivationStore::Stash(const void* src, uint64_t bytes) {
  if (!src) return InvalidError("stash: null buffer");
  if (bytes == 0) return InvalidError("stash: 0 bytes");
  if (!arena_.ptr)
    return StateError("stash: no room for activations: strata.activation_host_bytes is 0 (set it, and "
                      "strata.activation_nvme_bytes to go on to NVMe; docs/config.md)");
  // (bytes first: padding a count near 2^64 would wrap to a small one)
  const uint64_t arena = options_.host_bytes / 4096 * 4096;
  const uint64_t padded = bytes > arena ? arena + 1 : ArenaBytes(bytes);  // its room in the arena
  if (padded > arena)
    return InvalidError("stash: an activation of " + FormatBytes(bytes) + " is larger than strata.activation_host_bytes (" +
                        FormatBytes(options_.host_bytes) + "), the arena every stash passes through");
  std::unique_lock<std::mutex> lock(mu_);
  // The arena keeps the prefetch window free for the NVMe stashes' way
  // through it; a stash that would eat into it goes on to NVMe.
  const uint64_t reserve = nvme_ ? std::min(options_.window, options_.host_bytes / 2) : 0;
  bool room = extents_->free_bytes() >= padded + reserve && extents_->largest_free() >= padded;
  if (!room && nvme_) {
    // The newest stash stays here (backward redeems it first): the earliest
    // ones kept here go on to NVMe to make room (their writes end before the
    // arena takes the new one: TakeArena waits for them).
    uint64_t freeing = 0;
    for (auto& [h, it] : items_) {  // in stash order
      if (extents_->free_bytes() + freeing >= padded + reserve) break;
      if (it.where != Where::kArena || it.dropped || it.spill_failed) continue;
      if (!Spill(h, /*first=*/false)) break;
      freeing += ArenaBytes(it.bytes);
    }
    cv_.notify_all();
    room = extents_->free_bytes() + freeing >= padded + reserve;
  }
  const bool to_disk = nvme_ && !room;
  if (to_disk && nvme_used_ + DiskBytes(bytes) > options_.nvme_bytes)
    return NoMemError("stash of " + FormatBytes(bytes) + ": the activations' swap (strata.activation_nvme_bytes " +
                      FormatBytes(options_.nvme_bytes) + ") holds " + FormatBytes(nvme_used_) +
                      " and the arena (strata.activation_host_bytes " + FormatBytes(options_.host_bytes) +
                      ") is full: redeem or drop stashes, or give more room");
  const uint64_t off = TakeArena(lock, padded);
  if (off == ~uint64_t{0})
    return NoMemError("stash of " + FormatBytes(bytes) + ": the activations' arena (strata.activation_host_bytes " +
                      FormatBytes(options_.host_bytes) + ") holds " + FormatBytes(st_.live_bytes) + " of stashes" +
                      (nvme_ ? "" : " and there is no swap for them (strata.activation_nvme_bytes 0)") +
                      SpillFailure());
  Allocation disk;
  if (to_disk) {
    auto d = nvme_->Allocate(bytes);
    if (!d.ok()) {
      extents_->Free(off, padded);
      return d.status().WithContext("stash: the activations' swap");
    }
    disk = *d;
    nvme_used_ += DiskBytes(bytes);
  }
  lock.unlock();
  Status copied = CopyIn(src, ArenaAt(off), bytes);
  lock.lock();
  if (!copied.ok()) {
    extents_->Free(off, padded);
    if (disk.charged) {
      nvme_->Free(disk);
      nvme_used_ -= DiskBytes(bytes);
    }
    return copied.WithContext("stash");
  }
  const uint64_t h = next_handle_++;
  Item& it = items_[h];
  it.bytes = bytes;
  it.seq = next_seq_++;
  it.arena = off;
  st_.live_bytes += bytes;
  // Every stash is counted as stashed into host memory (it is copied into
  // the arena first); those sent on to NVMe, here or by a later Spill, also
  // as NVMe bytes (strata.h: act_host_bytes, act_nvme_bytes). Before, a
  // stash sent at once counted as NVMe only, and a spilled one as both.
  st_.stashed_host_bytes += bytes;
  if (to_disk) {
    it.where = Where::kWriting;
    it.disk = disk;
    st_.stashed_nvme_bytes += bytes;
    jobs_.push_back({h, true});
    cv_.notify_all();
  }
  return h;
}

void ActivationStore::QueueReadsBefore(uint64_t handle) {
  uint64_t ahead = 0;
  auto it = items_.lower_bound(handle);  // handles grow with the stash order
  while (it != items_.begin() && ahead < options_.window) {
    --it;
    Item& x = it->second;
    if (x.dropped) continue;
    if (x.where == Where::kReading || x.where == Where::kRead) {
      ahead += x.bytes;
      continue;
    }
    if (x.where != Where::kDisk) continue;
    const uint64_t off = extents_->Allocate(ArenaBytes(x.bytes));
    if (off == ~uint64_t{0}) break;  // the arena is full: the redeem reads it itself
    x.arena = off;
    x.where = Where::kReading;
    ahead += x.bytes;
    jobs_.push_back({it->first, false});
  }
  cv_.notify_all();
}

Status ActivationStore::Redeem(uint64_t handle, void* dst, uint64_t bytes) {
  if (!dst) return InvalidError("redeem: null buffer");
  std::unique_lock<std::mutex> lock(mu_);
  auto found = items_.find(handle);
  if (found == items_.end() || found->second.dropped)
    return InvalidError("redeem: no stash " + std::to_string(handle) + " (never stashed, or redeemed or dropped already)");
  Item& it = found->second;
  if (it.bytes != bytes)
    return InvalidError("redeem: stash " + std::to_string(handle) + " holds " + std::to_string(it.bytes) +
                        " bytes, not " + std::to_string(bytes));
  // Its data: in the arena (kept there, or on its way to NVMe, or read
  // ahead), or on the disk (read now: a stall).
  bool stalled = false;
  const double t0 = stats_.Now();
  if (it.where == Where::kDisk) {
    const uint64_t off = TakeArena(lock, ArenaBytes(it.bytes));
    if (off == ~uint64_t{0})
      return NoMemError("redeem: no room in the activations' arena (strata.activation_host_bytes " +
                        FormatBytes(options_.host_bytes) + ") to read stash " + std::to_string(handle) + " back" +
                        SpillFailure());
    it.arena = off;
    it.where = Where::kReading;
    jobs_.push_front({handle, false});
    cv_.notify_all();
  }
  if (it.where == Where::kReading) {
    stalled = true;
    cv_.wait(lock, [&] { return it.where != Where::kReading; });
  } else if (it.where == Where::kRead) {
    ++st_.prefetch_hits;
  }
  if (stalled) {
    ++st_.stalls;
    st_.stall_s += stats_.Now() - t0;
    stats_.CallSpan("activation stall", -1, t0, stats_.Now());
  }
  Status st = it.io;
  if (st.ok() && it.arena == ~uint64_t{0}) st = InternalError("redeem: stash " + std::to_string(handle) + " has no data");
  if (st.ok()) {
    const uint64_t off = it.arena;
    const bool writing = it.where == Where::kWriting;
    it.dropped = writing;  // the thread frees it once its write is done
    lock.unlock();
    st = CopyOut(ArenaAt(off), dst, bytes);
    lock.lock();
    if (writing) {
      QueueReadsBefore(handle);
      ++st_.redeemed;
      st_.live_bytes -= bytes;
      return st.WithContext("redeem");
    }
  }
  auto again = items_.find(handle);
  FreeItem(again->second);  // first: its arena room may take the next read ahead
  items_.erase(again);
  QueueReadsBefore(handle);
  st_.live_bytes -= bytes;
  ++st_.redeemed;
  return st.ok() ? st : st.WithContext("redeem: stash " + std::to_string(handle));
}

Status ActivationStore::Drop(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = items_.find(handle);
  if (found == items_.end() || found->second.dropped)
    return InvalidError("drop: no stash " + std::to_string(handle) + " (never stashed, or redeemed or dropped already)");
  Item& it = found->second;
  st_.live_bytes -= it.bytes;
  if (it.where == Where::kWriting || it.where == Where::kReading) {
    it.dropped = true;  // the thread frees it once its I/O is done
    return Status::Ok();
  }
  FreeItem(it);
  items_.erase(found);
  return Status::Ok();
}

void ActivationStore::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return jobs_.empty() && in_flight_ == 0; });
}

ActivationStats ActivationStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return st_;
}

void ActivationStore::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    const Job job = jobs_.front();
    jobs_.pop_front();
    auto found = items_.find(job.handle);
    if (found == items_.end()) continue;
    Item& it = found->second;
    const Allocation disk = it.disk;
    void* buf = ArenaAt(it.arena);
    ++in_flight_;
    lock.unlock();
    const double t0 = stats_.Now();
    Status st;
    auto p = job.write ? nvme_->StartWrite(disk, buf) : nvme_->StartRead(disk, buf);
    st = p.ok() ? nvme_->Finish(*p) : p.status();
    stats_.Span(Resource::kDisk, job.write ? "activation write" : "activation read", t0, stats_.Now(), it.bytes);
    lock.lock();
    --in_flight_;
    auto again = items_.find(job.handle);  // the caller may have dropped it meanwhile (kept until now)
    Item& x = again->second;
    if (job.write) {
      if (st.ok()) {
        stats_.AddMoved(TierKind::kHost, TierKind::kNvme, x.bytes);
        extents_->Free(x.arena, ArenaBytes(x.bytes));  // on the disk now: the arena room goes back
        x.arena = ~uint64_t{0};
        x.where = Where::kDisk;
      } else {
        // Kept in the arena: nothing is lost; the swap goes back.
        WarnOnce("activation-write", "activations: a write to NVMe failed (" + st.ToString() +
                                         "); the stash stays in host memory");
        nvme_->Free(x.disk);
        nvme_used_ -= DiskBytes(x.bytes);
        x.disk = {};
        x.where = Where::kArena;
        x.io = Status::Ok();
        x.spill_failed = true;
        spill_error_ = st;
      }
    } else {
      if (st.ok()) {
        stats_.AddMoved(TierKind::kNvme, TierKind::kHost, x.bytes);
        x.where = Where::kRead;
      } else {
        x.io = st.WithContext("reading stash " + std::to_string(job.handle) + " back from NVMe");
        x.where = Where::kRead;  // (its arena room holds nothing usable: the redeem reports x.io)
      }
    }
    if (x.dropped) {
      FreeItem(x);
      items_.erase(again);
    }
    cv_.notify_all();
  }
}

}  // namespace strata
