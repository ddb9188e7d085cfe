// Bucketed gradient reduction over the ranks (grad_reduce.h), and the
// engine's use of it: Engine::Impl::GradsMulti and the communication thread
// that runs a group's reduction beside the trainer's backward
// (zero_optimization.overlap_comm).
#include "engine/reduce/grad_reduce.h"

#include <algorithm>
#include <cstring>

#include "base/sizes.h"
#include "engine/engine_impl.h"
#include "kernels/cpu/cast.h"

namespace strata {

std::vector<ReduceBucket> PlanReduceBuckets(uint64_t n, int world, uint64_t bucket_elems, bool scatter) {
  const uint64_t w = scatter ? static_cast<uint64_t>(std::max(world, 1)) : 1;
  const uint64_t step = std::max<uint64_t>(bucket_elems / w, 1);
  std::vector<ReduceBucket> out;
  for (uint64_t at = 0; at < n; at += step) out.push_back({at, std::min(step, n - at)});
  return out;
}

namespace {

class HostReduceMemory final : public ReduceMemory {
 public:
  bool on_device() const override { return false; }
  Status Cast(DType dtype, const void* src, float* dst, uint64_t n) override {
    if (dtype == DType::kF32) {
      std::memcpy(dst, src, n * 4);
      return Status::Ok();
    }
    return kernels::Cast(dtype, src, DType::kF32, dst, n);
  }
  Status Zero(float* dst, uint64_t n) override {
    std::memset(dst, 0, n * 4);
    return Status::Ok();
  }
  Status Sync() override { return Status::Ok(); }
  Status ToHost(float* host_dst, const float* src, uint64_t n) override {
    if (host_dst != src) std::memmove(host_dst, src, n * 4);
    return Status::Ok();
  }
};

}  // namespace

std::unique_ptr<ReduceMemory> MakeHostReduceMemory() { return std::make_unique<HostReduceMemory>(); }

Status PackGradients(ReduceMemory& mem, const void* src, DType dtype, uint64_t numel, uint64_t n, int world,
                     const std::vector<ReduceBucket>& buckets, bool scatter, float* packed) {
  const uint64_t esize = DTypeSize(dtype);
  const auto* s = static_cast<const char*>(src);
  // dst[0..count) := the gradient's elements [from, from+count), zeros past numel.
  auto piece = [&](uint64_t from, uint64_t count, float* dst) -> Status {
    const uint64_t real = from >= numel ? 0 : std::min(count, numel - from);
    if (real) STRATA_RETURN_IF_ERROR(mem.Cast(dtype, s + from * esize, dst, real));
    if (real < count) STRATA_RETURN_IF_ERROR(mem.Zero(dst + real, count - real));
    return Status::Ok();
  };
  if (!scatter) {
    STRATA_RETURN_IF_ERROR(piece(0, n, packed));
  } else {
    const uint64_t w = static_cast<uint64_t>(world);
    for (const ReduceBucket& b : buckets)
      for (uint64_t r = 0; r < w; ++r)
        STRATA_RETURN_IF_ERROR(piece(r * n + b.first, b.columns, packed + w * b.first + r * b.columns));
  }
  return mem.Sync();
}

Status ReduceBuckets(net::Communicator& comm, ReduceMemory& mem, const std::vector<ReduceBucket>& buckets,
                     bool scatter, uint64_t n, int piece, float* packed, float* out) {
  const uint64_t w = static_cast<uint64_t>(comm.world_size());
  for (const ReduceBucket& b : buckets) {
    if (scatter) {
      float* in = packed + w * b.first;
      float* mine = in + static_cast<uint64_t>(comm.rank()) * b.columns;
      STRATA_RETURN_IF_ERROR(comm.ReduceScatter(in, mine, b.columns));
      // Host memory: moves left, onto columns whose buckets are done.
      STRATA_RETURN_IF_ERROR(mem.ToHost(out + b.first, mine, b.columns));
    } else {
      STRATA_RETURN_IF_ERROR(comm.AllReduce(packed + b.first, b.columns));
    }
  }
  if (!scatter) STRATA_RETURN_IF_ERROR(mem.ToHost(out, packed + static_cast<uint64_t>(piece) * n, n));
  return Status::Ok();
}

#if !STRATA_HAVE_CUDA
std::unique_ptr<ReduceMemory> MakeDeviceReduceMemory(void*) { return nullptr; }
#endif

// ---- The engine's use ----

// Host buffers: the gradient staging pool (PlanStaging gives it a slot for
// the group being packed, one for the group being reduced with
// overlap_comm, and one for G's staging). Device buffers: InitReduce's.
float* Engine::Impl::AcquirePacked() {
  std::unique_lock<std::mutex> lock(comm_mu_);
  if (!reduce_mem_->on_device()) {
    comm_cv_.wait(lock, [&] { return packed_in_use_ < max_packed_; });
    ++packed_in_use_;
    lock.unlock();
    return static_cast<float*>(grad_staging_.Acquire());
  }
  comm_cv_.wait(lock, [&] { return !reduce_dev_free_.empty(); });
  float* p = reduce_dev_free_.back();
  reduce_dev_free_.pop_back();
  return p;
}

void Engine::Impl::ReleasePacked(float* p) {
  if (!reduce_mem_->on_device()) {
    grad_staging_.Release(p);
    {
      std::lock_guard<std::mutex> lock(comm_mu_);
      --packed_in_use_;
    }
    comm_cv_.notify_all();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    reduce_dev_free_.push_back(p);
  }
  comm_cv_.notify_all();
}

Status Engine::Impl::InitReduce() {
  if (!reduces()) return Status::Ok();
  const bool device = comm_->device_buffers();
  if (device) {
    reduce_mem_ = device_->on_gpu() ? MakeDeviceReduceMemory(nullptr) : nullptr;
    if (!reduce_mem_)
      return UnsupportedError("a communicator on device buffers (" + std::string(comm_->backend()) +
                              ") needs a GPU device tier and a CUDA build");
  } else {
    reduce_mem_ = MakeHostReduceMemory();
    // PlanStaging's slots: the packed groups, and one for G's staging when
    // G is not addressable in place (AccumulateG on the communication thread).
    const bool g_staged = !BlockIo::DirectAt(home_[int(StateKind::kG)], device_->on_gpu());
    max_packed_ = std::max(1, grad_staging_.count() - (g_staged ? 1 : 0));
  }
  packed_in_use_ = 0;
  comm_overlap_ = config_.zero.overlap_comm;
  if (device) {
    const uint64_t largest = LargestTrainable(true);  // frozen groups take no gradients
    const int count = largest == 0 ? 0 : comm_overlap_ ? 2 : 1;
    for (int i = 0; i < count; ++i) {
      auto a = device_->Allocate(largest * 4);
      if (!a.ok())
        return a.status().WithContext("build: " + std::to_string(count) + " gradient reduction buffer(s) of " +
                                      FormatBytes(largest * 4) + " on the device (the largest group's fp32 "
                                      "gradients; strata.device_budget " + FormatBytes(device_->budget()) + ")");
      reduce_dev_.push_back(*a);
      reduce_dev_free_.push_back(static_cast<float*>(a->ptr));
    }
  }
  if (!comm_overlap_) return Status::Ok();
  comm_stop_ = false;
  comm_thread_ = std::thread([this] {
    UseDeviceOnThisThread();  // the casts and copies of NCCL's buffers
    std::unique_lock<std::mutex> lock(comm_mu_);
    for (;;) {
      comm_cv_.wait(lock, [&] { return comm_stop_ || !comm_queue_.empty(); });
      if (comm_stop_) {  // what is queued is dropped: the engine is going away
        for (const CommJob& j : comm_queue_) {
          if (!j.packed) continue;
          lock.unlock();
          ReleasePacked(j.packed);
          lock.lock();
        }
        comm_queue_.clear();
        comm_cv_.notify_all();
        return;
      }
      const CommJob job = comm_queue_.front();
      comm_queue_.pop_front();
      comm_busy_ = true;
      comm_current_ = job;
      const bool failed = !comm_error_.ok();
      lock.unlock();
      // After a failure nothing more is reduced: the ranks no longer agree.
      Status st = failed                ? Status::Ok()
                  : job.gather_ahead() ? GatherAhead(job.group)
                                       : ReduceGroup(job.group, job.packed);
      if (job.packed) ReleasePacked(job.packed);
      lock.lock();
      comm_busy_ = false;
      comm_current_ = {};
      if (!st.ok() && comm_error_.ok()) comm_error_ = std::move(st);
      comm_cv_.notify_all();
    }
  });
  return Status::Ok();
}

void Engine::Impl::StopComm() {
  if (comm_thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(comm_mu_);
      comm_stop_ = true;
    }
    comm_cv_.notify_all();
    comm_thread_.join();
  }
  comm_queue_.clear();
  comm_error_ = Status::Ok();
  for (auto& a : reduce_dev_) device_->Free(a);
  reduce_dev_.clear();
  reduce_dev_free_.clear();
  reduce_mem_.reset();
}

Status Engine::Impl::DrainComm(bool wait) {
  if (!comm_thread_.joinable()) return Status::Ok();
  std::unique_lock<std::mutex> lock(comm_mu_);
  if (wait) comm_cv_.wait(lock, [&] { return comm_queue_.empty() && !comm_busy_; });
  if (comm_error_.ok()) return Status::Ok();
  Status st = std::move(comm_error_);
  comm_error_ = Status::Ok();
  lock.unlock();
  if (broken_.empty())
    broken_ = "gradients reduced in the background (zero_optimization.overlap_comm) were lost: " + st.message();
  return st.WithContext("a background gradient reduction (zero_optimization.overlap_comm) failed");
}

std::vector<ReduceBucket> Engine::Impl::ReducePlanOf(int group) const {
  const GroupLayout& L = part_.group(group);
  const int world = comm_->world_size();
  return config_.zero.stage >= 2 ? PlanReduceBuckets(L.shard_numel, world, config_.zero.reduce_bucket_size, true)
                                 : PlanReduceBuckets(L.padded, world, config_.zero.reduce_bucket_size, false);
}

// The group's reduction and its accumulation into G, on the communication
// thread or the caller's. `packed`: PackGradients' layout.
Status Engine::Impl::ReduceGroup(int group, float* packed) {
  const GroupLayout& L = part_.group(group);
  GroupState& gs = groups_[static_cast<size_t>(group)];
  const bool scatter = config_.zero.stage >= 2;
  const auto buckets = ReducePlanOf(group);
  comm_->SetLabel("grads g" + std::to_string(group) + " s" + std::to_string(step_count_ + 1) + " #" +
                  std::to_string(gs.grad_calls + 1));
  float* out = packed;
  void* host = nullptr;
  if (reduce_mem_->on_device()) out = static_cast<float*>(host = grad_staging_.Acquire());
  Status st = ReduceBuckets(*comm_, *reduce_mem_, buckets, scatter, L.shard_numel, srank_, packed, out);
  if (st.ok()) st = AccumulateG(group, out, DType::kF32, L.shard_numel);
  grad_staging_.Release(host);
  return st.WithContext("grads: group " + std::to_string(group) + " (" + std::to_string(buckets.size()) +
                        (scatter ? " reduce-scatter" : " all-reduce") + " bucket(s))");
}

// Several ranks: the group's gradients are packed (cast to fp32, in the
// buckets' layout), then reduced and accumulated into this rank's G — here,
// or on the communication thread (overlap_comm), which runs one group's
// reduction while the trainer computes the next group's gradients.
Status Engine::Impl::GradsMulti(int group, const void* grads, DType dtype) {
  STRATA_RETURN_IF_ERROR(DrainComm(/*wait=*/false));  // an earlier background failure: now
  const GroupLayout& L = part_.group(group);
  const bool scatter = config_.zero.stage >= 2;
  const int world = comm_->world_size();
  const auto buckets = ReducePlanOf(group);
  float* packed = AcquirePacked();
  Status st = scatter ? PackGradients(*reduce_mem_, grads, dtype, L.numel, L.shard_numel, world, buckets, true, packed)
                      : PackGradients(*reduce_mem_, grads, dtype, L.numel, L.padded, 1, buckets, false, packed);
  if (!st.ok()) {
    ReleasePacked(packed);
    return st.WithContext("grads: group " + std::to_string(group) + ": packing its gradients");
  }
  if (!comm_thread_.joinable()) {
    st = ReduceGroup(group, packed);
    ReleasePacked(packed);
    return st;
  }
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    comm_queue_.push_back(CommJob{group, packed});
  }
  comm_cv_.notify_all();
  return Status::Ok();
}

}  // namespace strata

namespace strata {

Status Engine::Impl::GatherAhead(int h) {
  DeviceCopy& d = groups_[static_cast<size_t>(h)].dev;
  int32_t ready = 0;
  {
    // Its shard may be on its way (queued or loading): the prefetcher ends
    // either way, resident or absent.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      return stop_ || (d.state != DeviceCopy::kLoading &&
                       std::find(prefetch_queue_.begin(), prefetch_queue_.end(), h) == prefetch_queue_.end());
    });
    if (d.state == DeviceCopy::kResident && !d.gathered && !d.ahead) {
      ++d.pins;  // kept while the ranks decide, and after for the fetch
      ready = 1;
    }
  }
  // Whether a copy is ready depends on this rank's prefetch timing: the
  // ranks agree, and all gather or none does (the fetch then gathers).
  const int w = comm_->world_size(), r = comm_->rank();
  std::vector<int32_t> all(static_cast<size_t>(w), 0);
  all[static_cast<size_t>(r)] = ready;
  comm_->SetLabel("ahead P of g" + std::to_string(h) + " s" + std::to_string(step_count_));
  Status st = comm_->AllGather(&all[static_cast<size_t>(r)], all.data(), sizeof(int32_t));
  const bool go = st.ok() && std::all_of(all.begin(), all.end(), [](int32_t x) { return x == 1; });
  if (go) st = GatherPNow(h, d.alloc.ptr);
  std::lock_guard<std::mutex> lock(mu_);
  if (go && st.ok()) {
    d.gathered = d.ahead = true;
    ++gathers_ahead_;
  } else {
    if (ready) --d.pins;
    if (st.ok()) ++gathers_ahead_declined_;
  }
  cv_.notify_all();
  return st.WithContext("gathering group " + std::to_string(h) + " ahead (zero_optimization.overlap_comm)");
}

void Engine::Impl::WaitAheadOf(int g) {
  if (!comm_thread_.joinable()) return;
  std::unique_lock<std::mutex> lock(comm_mu_);
  comm_cv_.wait(lock, [&] {
    if (comm_busy_ && comm_current_.gather_ahead() && comm_current_.group == g) return false;
    return std::none_of(comm_queue_.begin(), comm_queue_.end(),
                        [&](const CommJob& j) { return j.gather_ahead() && j.group == g; });
  });
}

void Engine::Impl::DropAheadPins() {
  std::lock_guard<std::mutex> lock(mu_);
  DropAheadPinsLocked(-1);
}

void Engine::Impl::DropAheadPinsLocked(int keep) {
  for (int h = 0; h < part_.num_groups(); ++h) {
    DeviceCopy& d = groups_[static_cast<size_t>(h)].dev;
    if (h == keep || !d.ahead) continue;
    d.ahead = false;
    if (--d.pins == 0) d.gathered = false;
  }
}

}  // namespace strata
