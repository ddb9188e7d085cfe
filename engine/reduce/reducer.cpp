// GradReducer (reducer.h): the engine's reductions and gathers, and the
// communication thread that runs them beside the trainer's backward.
#include "engine/reduce/reducer.h"

#include <time.h>

#include <algorithm>
#include <chrono>

#include "base/log.h"
#include "base/sizes.h"
#include "base/worker.h"

namespace strata {
namespace {

// The calling thread's CPU seconds (CLOCK_THREAD_CPUTIME_ID: it cannot fail
// for the calling thread on Linux; were it to, the figure would read 0).
double ThreadCpuSeconds() {
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// One collective's wall and CPU seconds, from construction to Report, for
// hooks.collective (no clock is read where it is not set: one rank).
class CollectiveClock {
 public:
  explicit CollectiveClock(const GradReducer::Hooks& hooks) : hooks_(hooks) {
    if (!hooks_.collective) return;
    wall_ = std::chrono::steady_clock::now();
    cpu_ = ThreadCpuSeconds();
  }
  void Report(bool gather, uint64_t bytes) const {
    if (!hooks_.collective) return;
    const double cpu = std::max(0.0, ThreadCpuSeconds() - cpu_);
    hooks_.collective(gather, bytes,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_).count(), cpu);
  }

 private:
  const GradReducer::Hooks& hooks_;
  std::chrono::steady_clock::time_point wall_;
  double cpu_ = 0;
};

}  // namespace

GradReducer::GradReducer(const Layout& layout, net::Communicator& comm, DeviceTier& device,
                         StagingPool& grad_staging, bool g_staged, Hooks hooks)
    : layout_(layout),
      comm_(comm),
      device_(device),
      grad_staging_(grad_staging),
      g_staged_(g_staged),
      hooks_(std::move(hooks)),
      scatter_(layout.config->zero.stage >= 2) {}

GradReducer::~GradReducer() { Stop(); }

// Host buffers: the gradient staging pool (PlanStaging gives it a slot for
// the group being packed, one for the group being reduced with
// overlap_comm, and one for G's staging). Device buffers: Init's.
float* GradReducer::AcquirePacked() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!mem_->on_device()) {
    cv_.wait(lock, [&] { return packed_in_use_ < max_packed_; });
    ++packed_in_use_;
    lock.unlock();
    return static_cast<float*>(grad_staging_.Acquire());
  }
  cv_.wait(lock, [&] { return !device_free_.empty(); });
  float* p = device_free_.back();
  device_free_.pop_back();
  return p;
}

void GradReducer::ReleasePacked(float* p) {
  if (!mem_->on_device()) {
    grad_staging_.Release(p);
    {
      std::lock_guard<std::mutex> lock(mu_);
      --packed_in_use_;
    }
    cv_.notify_all();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    device_free_.push_back(p);
  }
  cv_.notify_all();
}

Status GradReducer::Init() {
  const bool device = comm_.device_buffers();
  if (device) {
    mem_ = device_.on_gpu() ? MakeDeviceReduceMemory(nullptr) : nullptr;
    if (!mem_)
      return UnsupportedError("a communicator on device buffers (" + std::string(comm_.backend()) +
                              ") needs a GPU device tier and a CUDA build");
  } else {
    mem_ = MakeHostReduceMemory();
    // PlanStaging's slots: the packed groups, and one for G's staging when
    // G is not addressable in place (accumulate on the communication thread).
    max_packed_ = std::max(1, grad_staging_.count() - (g_staged_ ? 1 : 0));
  }
  packed_in_use_ = 0;
  const bool overlap = layout_.config->zero.overlap_comm;
  if (device) {
    const uint64_t largest = layout_.LargestTrainable(Layout::Size::kPadded);  // frozen groups take no gradients
    const int count = largest == 0 ? 0 : overlap ? 2 : 1;
    for (int i = 0; i < count; ++i) {
      auto a = device_.Allocate(largest * 4);
      if (!a.ok())
        return a.status().WithContext("build: " + std::to_string(count) + " gradient reduction buffer(s) of " +
                                      FormatBytes(largest * 4) + " on the device (the largest group's fp32 "
                                      "gradients; strata.device_budget " + FormatBytes(device_.budget()) + ")");
      device_bufs_.push_back(*a);
      device_free_.push_back(static_cast<float*>(a->ptr));
    }
  }
  if (!overlap) return Status::Ok();
  thread_ = std::thread([this] { Run(); });
  return Status::Ok();
}

void GradReducer::Run() {
  if (hooks_.on_thread_start) hooks_.on_thread_start();  // the casts and copies of NCCL's buffers
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) {  // what is queued is dropped: the engine is going away
      for (const Job& j : queue_) {
        if (!j.packed) continue;
        lock.unlock();
        ReleasePacked(j.packed);
        lock.lock();
      }
      queue_.clear();
      cv_.notify_all();
      return;
    }
    const Job job = queue_.front();
    queue_.pop_front();
    busy_ = true;
    current_ = job;
    const bool failed = !error_.ok();
    lock.unlock();
    const bool traced = hooks_.now && hooks_.span;
    const double start = traced ? hooks_.now() : 0;
    // After a failure nothing more is reduced: the ranks no longer agree.
    Status st = failed              ? Status::Ok()
                : job.gather_ahead() ? GatherAhead(job.group)
                                     : Reduce(job);
    if (traced && !failed) hooks_.span(job.gather_ahead() ? "gather ahead" : "reduce", job.group, start, hooks_.now());
    if (job.packed) ReleasePacked(job.packed);
    lock.lock();
    busy_ = false;
    current_ = {};
    if (!st.ok() && error_.ok()) error_ = std::move(st);
    cv_.notify_all();
  }
}

void GradReducer::DropParts() {
  if (parts_packed_) ReleasePacked(parts_packed_);
  parts_packed_ = nullptr;
  parts_lent_.reset();
  parts_group_ = -1;
}

bool GradReducer::ReadsLent(int g) {
  if (parts_group_ == g && parts_lent_) return true;
  const auto lent_of_g = [g](const Job& j) { return j.lent != nullptr && j.group == g; };
  std::lock_guard<std::mutex> lock(mu_);
  return (busy_ && lent_of_g(current_)) || std::any_of(queue_.begin(), queue_.end(), lent_of_g);
}

void GradReducer::SettleLent() {
  if (!parts_lent_) return;
  if (Status st = PackLent(); !st.ok()) {  // (fp32 pieces: copies, which do not fail)
    STRATA_LOG_ERROR("grads_part: group {}: packing its lent parts failed ({}); the call in parts is dropped",
                     parts_group_, st.ToString());
    DropParts();
  }
}

void GradReducer::Stop() {
  StopWorker(mu_, cv_, stop_, thread_);
  DropParts();  // a grads call in parts never ended
  std::lock_guard<std::mutex> lock(mu_);
  queue_.clear();
  error_ = Status::Ok();
  for (auto& a : device_bufs_) device_.Free(a);
  device_bufs_.clear();
  device_free_.clear();
  mem_.reset();
}

Status GradReducer::Drain(bool wait, bool take) {
  if (!thread_.joinable()) return Status::Ok();
  std::unique_lock<std::mutex> lock(mu_);
  if (wait) cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  if (!take) return error_;
  Status st = std::move(error_);
  error_ = Status::Ok();
  return st;
}

std::vector<ReduceBucket> GradReducer::PlanOf(int g) const {
  const GroupLayout& L = layout_.group(g);
  const uint64_t bucket = layout_.config->zero.reduce_bucket_size;
  return scatter_ ? PlanReduceBuckets(L.shard_numel, comm_.world_size(), bucket, true)
                  : PlanReduceBuckets(L.padded, comm_.world_size(), bucket, false);
}

// The group's reduction and its accumulation into G, on the communication
// thread or the caller's. Its input: `packed` (PackGradients' layout), or
// lent parts, read where they lie, in that layout's order.
Status GradReducer::Reduce(const Job& job) {
  const int g = job.group;
  const GroupLayout& L = layout_.group(g);
  const auto buckets = PlanOf(g);
  comm_.SetLabel("grads g" + std::to_string(g) + " s" + std::to_string(hooks_.step()) + " #" +
                 std::to_string(hooks_.grad_calls(g) + 1));
  // Host memory: the sums straight into G where it takes them (no copy after).
  float* const target = !mem_->on_device() && hooks_.sums_target ? hooks_.sums_target(g) : nullptr;
  if (job.lent && target == nullptr)  // (LendsParts said G takes them)
    return InternalError("grads: group " + std::to_string(g) + ": lent parts and nowhere to put the sums");
  float* out = target ? target : job.packed;
  void* host = nullptr;
  if (mem_->on_device()) out = static_cast<float*>(host = grad_staging_.Acquire());
  const CollectiveClock clock(hooks_);
  Status st;
  if (job.lent) {  // PackGradients' bucket b of rank r: elements [r * shard + b.first, + b.columns)
    for (const ReduceBucket& b : buckets) {
      st = comm_.ReduceScatterPieces(*job.lent, L.shard_numel, b.first, out + b.first, b.columns);
      if (!st.ok()) break;
    }
  } else {
    st = ReduceBuckets(comm_, *mem_, buckets, scatter_, L.shard_numel, layout_.srank, job.packed, out);
  }
  // The packed input: the padded group (every rank's shard, for a reduce-scatter).
  if (st.ok()) clock.Report(/*gather=*/false, L.padded * sizeof(float));
  if (st.ok() && job.lent) lent_reduced_bytes_ += L.padded * sizeof(float);
  if (st.ok()) st = hooks_.accumulate(g, out, L.shard_numel);
  grad_staging_.Release(host);
  return st.WithContext("grads: group " + std::to_string(g) + " (" + std::to_string(buckets.size()) +
                        (scatter_ ? " reduce-scatter" : " all-reduce") + " bucket(s))");
}

Status GradReducer::Grads(int g, const void* grads, DType dtype) {
  const GroupLayout& L = layout_.group(g);
  const auto buckets = PlanOf(g);
  float* packed = AcquirePacked();
  Status st = scatter_ ? PackGradients(*mem_, grads, dtype, L.numel, L.shard_numel, comm_.world_size(), buckets,
                                       true, packed)
                       : PackGradients(*mem_, grads, dtype, L.numel, L.padded, 1, buckets, false, packed);
  if (!st.ok()) {
    ReleasePacked(packed);
    return st.WithContext("grads: group " + std::to_string(g) + ": packing its gradients");
  }
  return Queue(Job{g, packed, nullptr});
}

std::string GradReducer::PartsRefused() const {
  if (!mem_) return "the reducer is not built";
  if (mem_->on_device())
    return "the reduction's buffers are device memory (" + std::string(comm_.backend()) +
           "): it takes a group's gradients whole";
  if (!thread_.joinable())
    return "zero_optimization.overlap_comm is off: the reduction's one buffer takes a group's gradients whole";
  return "";
}

bool GradReducer::LendsParts(int g) const {
  // Read where they lie by the reduce-scatter, the sums written into G
  // (sums_target): no buffer of the reducer's on either side.
  return scatter_ && mem_ && !mem_->on_device() && thread_.joinable() && comm_.reads_pieces() &&
         hooks_.sums_target && hooks_.sums_target(g) != nullptr;
}

Status GradReducer::PartsBegin(int g, bool lend) {
  if (const std::string why = PartsRefused(); !why.empty()) return InvalidError("grads_part: " + why);
  if (parts_group_ >= 0)
    return InvalidError("grads_part: group " + std::to_string(parts_group_) +
                        " has a grads call in parts open; with several ranks one group's parts at a time "
                        "(grads_end group " + std::to_string(parts_group_) + " first, or hand group " +
                        std::to_string(g) + " whole with grads)");
  // The group's packing, planned once for all its parts.
  const GroupLayout& L = layout_.group(g);
  parts_buckets_ = PlanOf(g);
  parts_n_ = scatter_ ? L.shard_numel : L.padded;
  parts_world_ = scatter_ ? comm_.world_size() : 1;
  if (lend && LendsParts(g)) parts_lent_ = std::make_shared<net::FloatPieces>();
  else parts_packed_ = AcquirePacked();
  parts_group_ = g;
  return Status::Ok();
}

Status GradReducer::PackLent() {
  float* packed = AcquirePacked();
  for (const net::FloatPieces::Piece& p : parts_lent_->pieces()) {
    Status st = PackPart(p.data, DType::kF32, p.first, p.count, parts_n_, parts_world_, parts_buckets_, scatter_,
                         packed, /*add=*/false);
    if (!st.ok()) {
      ReleasePacked(packed);
      return st;
    }
  }
  parts_lent_.reset();
  parts_packed_ = packed;
  return Status::Ok();
}

Status GradReducer::Part(int g, uint64_t first, uint64_t count, const void* src, DType dtype, bool again, bool lend) {
  if (g != parts_group_ || (!parts_packed_ && !parts_lent_))
    return InternalError("grads_part: group " + std::to_string(g) + " has no packed buffer open");
  const std::string where = "grads_part: group " + std::to_string(g) + ": packing its gradients";
  if (parts_lent_) {
    if (lend && dtype == DType::kF32 && !again &&
        parts_lent_->Add(first, count, static_cast<const float*>(src)))
      return Status::Ok();
    STRATA_RETURN_IF_ERROR(PackLent().WithContext(where));
  }
  return PackPart(src, dtype, first, count, parts_n_, parts_world_, parts_buckets_, scatter_, parts_packed_, again)
      .WithContext(where);
}

Status GradReducer::PartsEnd(int g, const std::map<uint64_t, uint64_t>& given) {
  if (g != parts_group_ || (!parts_packed_ && !parts_lent_))
    return InternalError("grads_end: group " + std::to_string(g) + " has no packed buffer open");
  parts_group_ = -1;
  if (parts_lent_) {  // what no part gave reads as zero (FloatPieces)
    return Queue(Job{g, nullptr, std::move(parts_lent_)});  // (a moved-from shared_ptr is null)
  }
  float* packed = parts_packed_;
  parts_packed_ = nullptr;
  Status st = PackGaps(given, parts_n_, parts_world_, parts_buckets_, scatter_, packed);
  if (!st.ok()) {
    ReleasePacked(packed);
    return st.WithContext("grads_end: group " + std::to_string(g));
  }
  return Queue(Job{g, packed, nullptr});
}

Status GradReducer::Queue(Job job) {
  if (!thread_.joinable()) {
    Status st = Reduce(job);
    if (job.packed) ReleasePacked(job.packed);
    return st;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_all();
  return Status::Ok();
}

Status GradReducer::Gather(int g, void* full) {
  // The queue's collectives first (one order on every rank). A failure
  // among them is left for DrainComm, not taken: it breaks the engine
  // there. Taken here, it failed one fetch and the next step went on with
  // the groups queued after it, whose gradients were never reduced.
  STRATA_RETURN_IF_ERROR(Drain(/*wait=*/true, /*take=*/false)
                             .WithContext("gathering the parameters of group " + std::to_string(g) +
                                          ": a background gradient reduction failed before it"));
  return GatherNow(g, full);
}

Status GradReducer::GatherNow(int g, void* full) {
  const uint64_t slice = layout_.group(g).shard_numel * DTypeSize(layout_.dtype);
  comm_.SetLabel("P of g" + std::to_string(g) + " s" + std::to_string(hooks_.step() - 1));
  const CollectiveClock clock(hooks_);
  Status st = comm_.AllGather(static_cast<char*>(full) + static_cast<uint64_t>(layout_.srank) * slice, full, slice);
  if (st.ok()) clock.Report(/*gather=*/true, slice * static_cast<uint64_t>(comm_.world_size()));
  return st.WithContext("gathering the parameters of group " + std::to_string(g));
}

Status GradReducer::RefuseGather(int g, const Status& why) {
  // The queue first, as Gather: the peers' gather comes after theirs.
  Status drained = Drain(/*wait=*/true, /*take=*/false);
  if (!drained.ok()) return why;  // (DrainComm breaks the engine; the peers fail there too)
  const uint64_t slice = layout_.group(g).shard_numel * DTypeSize(layout_.dtype);
  comm_.SetLabel("P of g" + std::to_string(g) + " s" + std::to_string(hooks_.step() - 1));
  return comm_.AllGatherRefused(slice, why);
}

void GradReducer::QueueGatherAhead(int g) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Job{g, nullptr, nullptr});
  }
  cv_.notify_all();
}

Status GradReducer::GatherAhead(int g) {
  void* copy = hooks_.pin_ahead(g);
  // Whether a copy is ready depends on this rank's prefetch timing: the
  // ranks agree, and all gather or none does (the fetch then gathers).
  const int w = comm_.world_size(), r = comm_.rank();
  std::vector<int32_t> all(static_cast<size_t>(w), 0);
  all[static_cast<size_t>(r)] = copy ? 1 : 0;
  comm_.SetLabel("ahead P of g" + std::to_string(g) + " s" + std::to_string(hooks_.step() - 1));
  Status st = comm_.AllGather(&all[static_cast<size_t>(r)], all.data(), sizeof(int32_t));
  const bool go = st.ok() && std::all_of(all.begin(), all.end(), [](int32_t x) { return x == 1; });
  if (go) st = GatherNow(g, copy);
  const bool gathered = go && st.ok();
  if (copy) hooks_.end_ahead(g, gathered);
  if (gathered) ++gathers_ahead_;
  else if (st.ok()) ++gathers_ahead_declined_;
  return st.WithContext("gathering group " + std::to_string(g) + " ahead (zero_optimization.overlap_comm)");
}

void GradReducer::WaitAheadOf(int g) {
  if (!thread_.joinable()) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    if (busy_ && current_.gather_ahead() && current_.group == g) return false;
    return std::none_of(queue_.begin(), queue_.end(), [&](const Job& j) { return j.gather_ahead() && j.group == g; });
  });
}

}  // namespace strata
