// DeviceTier: CUDA allocations and streams, or the host arena and its copy
// threads.
#include "tiers/device_tier.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>

#include "base/align.h"
#include "base/check.h"
#include "base/sizes.h"

namespace strata {

namespace {

// A fence that a copy thread signals.
class ThreadFence final : public CopyFence {
 public:
  Status Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    return Status::Ok();
  }
  bool Done() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  void Signal() {
    std::lock_guard<std::mutex> lock(mu_);  // guards done_
    done_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

// A fence on a CUDA event.
class EventFence final : public CopyFence {
 public:
  explicit EventFence(gpu::Event e) : event_(e) {}
  ~EventFence() override {
    if (event_) gpu::EventSynchronize(event_).IgnoreError();
  }
  Status Wait() override {
    std::lock_guard<std::mutex> lock(mu_);  // the event is destroyed once
    if (!event_) return status_;
    status_ = gpu::EventSynchronize(event_);
    event_ = nullptr;
    return status_;
  }
  bool Done() override {
    std::lock_guard<std::mutex> lock(mu_);
    return !event_ || gpu::EventQuery(event_);
  }

 private:
  std::mutex mu_;
  gpu::Event event_;
  Status status_;
};

}  // namespace

// One direction of copies without a GPU: a thread running memcpy in order.
class DeviceTier::CopyQueue {
 public:
  // strict: each copy waits a little (0.2 to 3 ms) on this thread and
  // lands in two halves with a pause between, so that a reader that did
  // not wait for the fence sees old or half-copied data.
  explicit CopyQueue(bool strict) : strict_(strict), thread_([this] { Loop(); }) {}
  ~CopyQueue() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  CopyTicket Push(void* dst, const void* src, uint64_t n) {
    auto fence = std::make_shared<ThreadFence>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back({dst, src, n, fence});
    }
    cv_.notify_one();
    return fence;
  }

 private:
  struct Job { void* dst; const void* src; uint64_t n; std::shared_ptr<ThreadFence> fence; };
  void Loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = jobs_.front();
        jobs_.pop_front();
      }
      if (strict_) {
        std::this_thread::sleep_for(std::chrono::microseconds(lag_(rng_)));
        const uint64_t half = job.n / 2;
        std::memcpy(job.dst, job.src, half);
        std::this_thread::sleep_for(std::chrono::microseconds(lag_(rng_)));
        std::memcpy(static_cast<char*>(job.dst) + half, static_cast<const char*>(job.src) + half, job.n - half);
      } else {
        std::memcpy(job.dst, job.src, job.n);
      }
      job.fence->Signal();
    }
  }
  std::mutex mu_;  // guards jobs_ and stop_
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  const bool strict_;
  std::minstd_rand rng_{12345};  // this thread's only
  std::uniform_int_distribution<int> lag_{200, 1500};
  std::thread thread_;  // last: started once the fields above are
};

DeviceTier::DeviceTier(const DeviceTierOptions& options)
    : Tier(TierKind::kDevice, options.budget), options_(options) {}

Result<std::unique_ptr<DeviceTier>> DeviceTier::Create(const DeviceTierOptions& options) {
  std::unique_ptr<DeviceTier> t(new DeviceTier(options));
  t->on_gpu_ = !options.force_host_arena && gpu::Available();
  t->strict_ = options.strict && !t->on_gpu_;
  t->faults_ = options.faults;
  if (t->on_gpu_) {
    STRATA_RETURN_IF_ERROR(t->UseDevice().WithContext("device tier"));
    STRATA_ASSIGN_OR_RETURN(t->in_stream_, gpu::StreamCreate());
    STRATA_ASSIGN_OR_RETURN(t->out_stream_, gpu::StreamCreate());
  } else {
    t->in_queue_ = std::make_unique<CopyQueue>(t->strict_);
    t->out_queue_ = std::make_unique<CopyQueue>(t->strict_);
  }
  return t;
}

DeviceTier::~DeviceTier() {
  in_queue_.reset();
  out_queue_.reset();
  UseDevice().IgnoreError();  // for the stream destroys below; it succeeded at Create
  for (auto& [p, n] : sizes_) RawFree(p);
  for (auto& [n, p] : cache_) RawFree(p);
  if (in_stream_) gpu::StreamDestroy(in_stream_).IgnoreError();
  if (out_stream_) gpu::StreamDestroy(out_stream_).IgnoreError();
}

Status DeviceTier::UseDevice() const {
  if (!on_gpu_) return Status::Ok();
  return gpu::SetDevice(options_.device);
}

Result<void*> DeviceTier::RawAlloc(uint64_t len) {
  if (on_gpu_) {
    // cudaMalloc allocates on the calling thread's current device.
    STRATA_RETURN_IF_ERROR(UseDevice());
    STRATA_ASSIGN_OR_RETURN(void* p, gpu::Malloc(len));
    ++pool_.raw_allocs;
    return p;
  }
  // 4 KiB-aligned so the disk can read straight into it (O_DIRECT).
  void* p = std::aligned_alloc(4096, AlignUp(len, 4096));
  if (!p) return NoMemError("device tier (host arena): cannot allocate " + FormatBytes(len));
  if (strict_) std::memset(p, 0xFF, len);  // what a GPU's fresh memory promises: nothing
  ++pool_.raw_allocs;
  return p;
}

void DeviceTier::RawFree(void* p) {
  if (on_gpu_) {
    UseDevice().IgnoreError();   // it worked when p was allocated
    gpu::Free(p).IgnoreError();  // cudaFree fails only on a broken context
  } else {
    std::free(p);
  }
  ++pool_.raw_frees;
}

bool DeviceTier::ReleaseLargestCached() {
  if (cache_.empty()) return false;
  auto it = std::prev(cache_.end());
  const uint64_t len = it->first;
  RawFree(it->second);
  cache_.erase(it);
  pool_.cached -= len;
  Uncharge(len);
  return true;
}

Result<Allocation> DeviceTier::Allocate(uint64_t bytes) {
  if (bytes == 0) return InvalidError("device tier: allocation of 0 bytes");
  // Over the budget before rounding: a size near 2^64 would round to a small one.
  if (bytes > budget()) STRATA_RETURN_IF_ERROR(Charge(bytes));
  const uint64_t len = AlignUp(bytes, 256);  // cudaMalloc's granularity
  std::lock_guard<std::mutex> lock(mu_);
  auto it = cache_.lower_bound(len);
  // strict: the block freed last, if it is large enough, whatever its size.
  if (strict_ && last_freed_ && sizes_.count(last_freed_) == 0) {
    for (auto c = cache_.begin(); c != cache_.end(); ++c)
      if (c->second == last_freed_ && c->first >= len) { it = c; break; }
  }
  if (it != cache_.end() && (it->first <= MostCharged(bytes) || (strict_ && it->second == last_freed_))) {  // a cached block: no cudaMalloc
    const uint64_t blen = it->first;
    void* p = it->second;
    cache_.erase(it);
    pool_.cached -= blen;
    pool_.in_use += blen;
    ++pool_.hits;
    sizes_[p] = blen;
    return Allocation{p, 0, bytes, blen};
  }
  Status charged = Charge(len);
  while (!charged.ok() && ReleaseLargestCached()) charged = Charge(len);
  STRATA_RETURN_IF_ERROR(charged);
  auto r = RawAlloc(len);
  while (!r.ok() && ReleaseLargestCached()) r = RawAlloc(len);  // the device is fuller than the budget says
  if (!r.ok()) {
    Uncharge(len);
    return r.status().WithContext("device tier");
  }
  pool_.in_use += len;
  sizes_[*r] = len;
  return Allocation{*r, 0, bytes, len};
}

void DeviceTier::Free(const Allocation& a) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sizes_.find(a.ptr);
  STRATA_CHECK_MSG(it != sizes_.end(), "device tier: freeing a pointer it did not allocate");
  const uint64_t len = it->second;
  sizes_.erase(it);
  pool_.in_use -= len;
  if (strict_) {  // a use after this free reads NaN, at once
    std::memset(a.ptr, 0xFF, len);
    last_freed_ = a.ptr;
  }
  if (!options_.pool) {
    RawFree(a.ptr);
    Uncharge(len);
    return;
  }
  cache_.emplace(len, a.ptr);  // still charged: the next Allocate of its size takes it
  pool_.cached += len;
}

void DeviceTier::Trim() {
  std::lock_guard<std::mutex> lock(mu_);
  while (ReleaseLargestCached()) {
  }
}

DevicePoolStats DeviceTier::pool_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pool_;
}

Result<CopyTicket> DeviceTier::Copy(void* dst, const void* src, uint64_t bytes, bool to_device) {
  if (faults_ && faults_->FailDeviceCopy(to_device))
    return IoError(std::string("device tier: copy ") + (to_device ? "in" : "out") + " of " + FormatBytes(bytes) +
                   " failed (an injected fault)");
  if (!on_gpu_) return (to_device ? in_queue_ : out_queue_)->Push(dst, src, bytes);
  gpu::Stream s = to_device ? in_stream_ : out_stream_;
  // The event is created on the current device and must be the stream's.
  STRATA_RETURN_IF_ERROR(UseDevice());
  STRATA_RETURN_IF_ERROR(gpu::MemcpyAsync(dst, src, bytes, to_device, s));
  Result<gpu::Event> e = gpu::EventRecord(s);
  if (!e.ok()) {
    // The copy is queued but has no fence: the caller, told it failed, may
    // free or reuse both buffers at once, so it must have finished first.
    (void)gpu::StreamSynchronize(s);
    return e.status();
  }
  return CopyTicket(std::make_shared<EventFence>(*e));
}

Result<CopyTicket> DeviceTier::CopyIn(void* device_dst, const void* host_src, uint64_t bytes) {
  return Copy(device_dst, host_src, bytes, true);
}

Result<CopyTicket> DeviceTier::CopyOut(void* host_dst, const void* device_src, uint64_t bytes) {
  return Copy(host_dst, device_src, bytes, false);
}

}  // namespace strata
