// The optimizer step as a pipeline over shards, each shard's W, M, V, G in a
// staging slot while it is read, updated and written back. strata.step_io
// picks the disk's schedule (config.h):
//   alternate:  update i | write i-1 ; read i+1 ; write i | update i+1 ...
//               the disk never reads and writes at once (two slots suffice);
//   concurrent: while shard i is updated, shard i+1 is read and shard i-1
//               written (three slots or more; reads run up to K-2 ahead).
// States the CPU addresses in place (host-homed, or the device tier's host
// arena) are not moved at all.
#include <algorithm>
#include <cstring>

#include "engine/engine_impl.h"
#include "kernels/cpu/adagrad.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/lion.h"

namespace strata {

namespace {

struct Job {
  int group = -1;
  void* slot = nullptr;
  float* ptr[kNumStates] = {};  // where each state is during the update
  std::vector<BlockMove> loads, stores;
};

}  // namespace

Status Engine::Impl::RunOptimizer(const std::vector<int>& order, double grad_scale, const StepOptions& so,
                                  int64_t step) {
  const int n = static_cast<int>(order.size());
  const OptimizerConfig& oc = config_.optimizer;
  auto pick = [](double v, double dflt) { return v >= 0 ? v : dflt; };
  const double lr = pick(so.lr, oc.lr), b1 = pick(so.beta1, oc.beta1), b2 = pick(so.beta2, oc.beta2);
  const double eps = pick(so.eps, oc.eps), wd = pick(so.weight_decay, oc.weight_decay);
  std::vector<Job> jobs(static_cast<size_t>(n));
  Status first_error;
  auto keep = [&](Status s) { if (first_error.ok() && !s.ok()) first_error = std::move(s); };

  auto finish_stores = [&](Job& j) {
    for (auto& m : j.stores) keep(io_->Finish(m));
    j.stores.clear();
    if (j.slot) { opt_staging_.Release(j.slot); j.slot = nullptr; }
  };
  auto start_loads = [&](int i) {
    Job& j = jobs[static_cast<size_t>(i)];
    j.group = order[static_cast<size_t>(i)];
    GroupState& gs = groups_[static_cast<size_t>(j.group)];
    const bool has_grads = gs.grad_calls > 0;
    for (int s = 0; s < kNumStates; ++s) {
      StateBlock& b = gs.blocks[static_cast<size_t>(s)];
      if (b.alloc.charged == 0) continue;  // state unused by this optimizer
      if (io_->Direct(b)) { j.ptr[s] = static_cast<float*>(io_->DirectPtr(b)); continue; }
      if (!j.slot) j.slot = opt_staging_.Acquire();  // blocks until a slot's writes are done
      j.ptr[s] = reinterpret_cast<float*>(static_cast<char*>(j.slot) + opt_slot_offsets_[s]);
      if (s == int(StateKind::kP) || (s == int(StateKind::kG) && !has_grads)) continue;  // written, not read
      auto m = io_->StartLoad(b, j.ptr[s]);
      if (m.ok()) j.loads.push_back(std::move(m).value());
      else keep(m.status());
    }
  };

  auto finish_loads = [&](Job& j) {
    for (auto& m : j.loads) keep(io_->Finish(m));
    j.loads.clear();
  };
  static constexpr int kStored[] = {int(StateKind::kP), int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)};
  // sums: the blocks' checksums computed ahead (alternate), or null.
  auto start_stores = [&](Job& j, const uint64_t* sums) {
    GroupState& gs = groups_[static_cast<size_t>(j.group)];
    for (int s : kStored) {
      StateBlock& b = gs.blocks[static_cast<size_t>(s)];
      if (b.alloc.charged == 0 || io_->Direct(b)) continue;
      auto m = io_->StartStore(b, j.ptr[s], sums ? &sums[s] : nullptr);
      if (m.ok()) j.stores.push_back(std::move(m).value());
      else keep(m.status());
    }
  };
  const bool alternate = config_.strata.step_io == "alternate";

  if (n > 0) start_loads(0);
  for (int i = 0; i < n && first_error.ok(); ++i) {
    Job& j = jobs[static_cast<size_t>(i)];
    if (!alternate) {
      // Slot reuse: with K slots, job i+1 takes the slot of job i+1-K, once its
      // writes finish; reads run up to K-2 shards ahead of the update.
      const int k = std::max(opt_staging_.count(), 3);
      if (i + 2 - k >= 0) finish_stores(jobs[static_cast<size_t>(i + 2 - k)]);
      for (int a = i + 1; a <= std::min(i + k - 2, n - 1); ++a)
        if (jobs[static_cast<size_t>(a)].group < 0) start_loads(a);
    }
    finish_loads(j);  // alternate: already done, before shard i-1's writes began
    if (!first_error.ok()) break;
    GroupState& gs = groups_[static_cast<size_t>(j.group)];
    const uint64_t len = part_.group(j.group).shard_numel;
    if (gs.grad_calls == 0) std::memset(j.ptr[int(StateKind::kG)], 0, len * 4);
    float* W = j.ptr[int(StateKind::kW)];
    void* P = static_cast<char*>(static_cast<void*>(j.ptr[int(StateKind::kP)])) + PSliceOffset(j.group);
    const bool copy_f32 = dtype_ == DType::kF32;
    stats_->Begin(Resource::kCpuOptimizer);
    const double t0 = stats_->Now();
    Status st;
    if (oc.type == "lion") {
      kernels::LionOptions o{lr, b1, b2, wd, grad_scale, DType::kF32, copy_f32 ? DType::kBF16 : dtype_};
      st = kernels::LionStep(o, len, W, j.ptr[int(StateKind::kM)], j.ptr[int(StateKind::kG)], copy_f32 ? nullptr : P);
    } else if (oc.type == "adagrad") {
      kernels::AdagradOptions o;
      o.lr = lr; o.weight_decay = wd; o.eps = eps; o.step = step; o.grad_scale = grad_scale;
      o.param_copy_dtype = copy_f32 ? DType::kBF16 : dtype_;
      st = kernels::AdagradStep(o, len, W, j.ptr[int(StateKind::kM)], j.ptr[int(StateKind::kG)], copy_f32 ? nullptr : P);
    } else {
      kernels::AdamOptions o;
      o.lr = lr; o.beta1 = b1; o.beta2 = b2; o.eps = eps; o.weight_decay = wd; o.step = step;
      o.mode = (oc.type == "adamw" || oc.adam_w_mode) ? kernels::AdamMode::kAdamW : kernels::AdamMode::kAdam;
      o.grad_scale = grad_scale;
      o.param_copy_dtype = copy_f32 ? DType::kBF16 : dtype_;
      st = kernels::AdamStep(o, len, W, j.ptr[int(StateKind::kM)], j.ptr[int(StateKind::kV)],
                             j.ptr[int(StateKind::kG)], copy_f32 ? nullptr : P);
    }
    if (copy_f32) std::memcpy(P, W, len * 4);
    stats_->End(Resource::kCpuOptimizer);
    stats_->Span(Resource::kCpuOptimizer, "update", t0, stats_->Now(), len);
    keep(st);
    if (!first_error.ok()) break;
    if (!alternate) {
      start_stores(j, nullptr);
      continue;
    }
    // The update above ran beside shard i-1's writes; now the disk reads
    // shard i+1 alone, then writes shard i alone (beside update i+1). During
    // the read the CPU checksums shard i's blocks and verifies each of shard
    // i+1's as it lands; the last one it verifies beside the writes, so the
    // disk never waits for a hash.
    if (i > 0) finish_stores(jobs[static_cast<size_t>(i - 1)]);
    Job* next = i + 1 < n ? &jobs[static_cast<size_t>(i + 1)] : nullptr;
    if (next) start_loads(i + 1);
    uint64_t sums[kNumStates] = {};
    for (int s : kStored) {
      const StateBlock& b = gs.blocks[static_cast<size_t>(s)];
      if (b.alloc.charged != 0 && !io_->Direct(b)) sums[s] = io_->StoreChecksum(b, j.ptr[s]);
    }
    if (next && !next->loads.empty()) {
      for (size_t q = 0; q + 1 < next->loads.size(); ++q) keep(io_->Finish(next->loads[q]));
      io_->WaitIo(next->loads.back());
    }
    start_stores(j, sums);
    if (next) finish_loads(*next);
    if (!first_error.ok()) break;
  }
  // Drain: every load and store in flight finishes before the slots return.
  for (auto& j : jobs) {
    finish_loads(j);
    finish_stores(j);
  }
  return first_error.WithContext("step");
}

void Engine::Impl::StartOverlap() {
  overlap_thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(overlap_mu_);
    for (;;) {
      overlap_cv_.wait(lock, [&] { return overlap_stop_ || !overlap_queue_.empty(); });
      if (overlap_stop_) return;
      const int g = overlap_queue_.front();
      overlap_queue_.pop_front();
      overlap_busy_ = true;
      lock.unlock();
      Status st = RunOptimizer({g}, 1.0, prepared_opts_, step_count_ + 1);
      lock.lock();
      overlap_busy_ = false;
      if (!st.ok() && overlap_error_.ok()) overlap_error_ = st;
      overlap_cv_.notify_all();
    }
  });
}

void Engine::Impl::StopOverlap() {
  if (!overlap_thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(overlap_mu_);
    overlap_stop_ = true;
  }
  overlap_cv_.notify_all();
  overlap_thread_.join();
}

void Engine::Impl::EnqueueUpdate(int group) {
  {
    std::lock_guard<std::mutex> lock(overlap_mu_);
    overlap_queue_.push_back(group);
  }
  overlap_cv_.notify_all();
}

Status Engine::Impl::WaitOverlapIdle() {
  std::unique_lock<std::mutex> lock(overlap_mu_);
  overlap_cv_.wait(lock, [&] { return overlap_queue_.empty() && !overlap_busy_; });
  Status st = overlap_error_;
  overlap_error_ = Status::Ok();
  return st;
}

}  // namespace strata
