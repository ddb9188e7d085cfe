// One step of the engine's schedule against the cost model. Each resource is
// a timeline that serves one transfer at a time at its full rate; work is
// booked into the earliest gap at or after it is ready, so that the caller
// and the prefetch thread share the resources the way their requests
// interleave; the overlapped step's thread takes what gaps they leave.
// Threads are serial chains, as in the engine.
#include "tools/plan/simulator.h"

#include <algorithm>
#include <deque>
#include <iterator>
#include <limits>
#include <span>
#include <vector>

#include "engine/residency/prefetch.h"
#include "tools/plan/activation_sim.h"
#include "tools/plan/speculation_mix.h"
#include "tools/plan/timeline.h"

namespace strata::plan {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

class StepSim {
 public:
  // How the step ends after backward: without overlap (the whole update),
  // or overlapped and then committed (the groups that did not speculate) or
  // replayed (restore the backups, the whole update again).
  enum class Finish { kPlain, kCommit, kReplay };

  StepSim(const ModelSpec& m, const Layout& l, const Capacity& cap, const ClusterSpec& c, const Config& cfg,
          const SimOptions& o, Finish finish)
      : m_(m), l_(l), c_(c), cfg_(cfg), o_(o), h_(HomesOf(cfg, c, cap.g_on_host)), spec_(cap.speculation), finish_(finish),
        behind_(cap.writes_behind && finish == Finish::kPlain) {
    n_ = static_cast<int>(l.group_numel.size());
    world_ = static_cast<double>(l.world_size);
    dp_ = static_cast<double>(DTypeSize(cfg.compute_dtype()));
    sb_ = StateBytesOf(cfg);
    fetched_ = h_.p != TierKind::kDevice || (cfg.zero.stage >= 3 && l.world_size > 1);
    cks_ = cfg.strata.checksums ? c.RankChecksum() : kInf;
    // The device's room for P copies: its capacity less everything else resident.
    const auto dev = static_cast<size_t>(TierKind::kDevice);
    uint64_t other = cap.Used(TierKind::kDevice) - cap.bytes[static_cast<size_t>(PlanState::kWork)][dev];
    if (c.has_gpu)
      other += l.largest_group * static_cast<uint64_t>(dp_);  // the trainer's gradient of one group
    else  // a CPU trainer keeps its activations and gradients in its own memory, not the engine's arena
      other -= cap.bytes[static_cast<size_t>(PlanState::kActivations)][dev];
    const uint64_t room = cap.capacity[dev] > other ? cap.capacity[dev] - other : 0;
    room_ = std::max<double>(static_cast<double>(room), static_cast<double>(l.largest_group) * dp_);
    state_.assign(static_cast<size_t>(n_), kAbsent);
    ready_.assign(static_cast<size_t>(n_), 0);
    grads_.assign(static_cast<size_t>(n_), 0);
  }

  SimResult Run() {
    double t = 0;
    // Write-behind: the last step's checksums and W, M, V writes (this
    // step's bytes, in steady state) go on at this step's start, beside the
    // forward; every NVMe read waits for them (the engine's gate: first
    // come, first served on the disk here).
    if (behind_) {
      step_unmixed_ = true;  // (nothing else on the disk: every other NVMe move waits for them)
      for (int g = 0; g < n_; ++g)
        ForEachStore(g, [&](TierKind home, double bytes) {
          if (home == TierKind::kNvme) writes_end_ = std::max(writes_end_, DiskWrite(Checksum(0, bytes), bytes));
        });
      step_unmixed_ = false;
    }
    if (!o_.optimizer_only)
      t = ForwardBackward();
    else
      std::fill(grads_.begin(), grads_.end(), 1);
    r_.forward_backward_s = t;
    // A step that does not speculate under overlap_step reads its W, M, V
    // ahead from prepare_step (before the step's first gradients: strata.torch
    // and strata-train call it as backward begins) into free step slots
    // (StepPipeline::ReadAhead), in what the disk leaves free, once the last
    // step's writes have landed (DiskRead); writing behind, the slots hold
    // every job's. (Elsewhere the slots hold a few jobs ahead: not modelled.)
    if (behind_ && o_.overlap_step && !o_.optimizer_only) {
      speculating_ = true;  // (into the gaps: backward's own reads go first)
      for (int g = 0; g < n_; ++g) ahead_.push_back(JobLoads(g, std::max(backward_start_, 0.0)));
      speculating_ = false;
    }
    std::vector<int> all(static_cast<size_t>(n_)), rest;
    for (int g = 0; g < n_; ++g) {
      all[static_cast<size_t>(g)] = g;
      if (!Speculates(g)) rest.push_back(g);
    }
    double end = t;
    if (finish_ == Finish::kPlain) {
      end = Optimizer(all, t);
    } else {
      end = std::max(t, overlap_free_);  // the speculation in flight
      if (finish_ == Finish::kCommit) {
        end = Optimizer(rest, end);  // commit: only the groups that did not speculate are left
      } else {
        for (int g = 0; g < n_; ++g)  // discard: the host-homed backups go back
          if (Speculates(g)) end = HostCopy(end, spec_.host[static_cast<size_t>(g)]);
        end = Optimizer(all, end);  // NVMe-homed state still has its old extents
      }
    }
    r_.step_s = end;
    r_.optimizer_s = end - t;
    for (int i = 0; i < kNumSimResources; ++i) r_.busy_s[static_cast<size_t>(i)] = res_[i].busy();
    r_.bound = SimResource(std::max_element(r_.busy_s.begin(), r_.busy_s.end()) - r_.busy_s.begin());
    return r_;
  }

 private:
  enum CopyState : uint8_t { kAbsent, kLoaded };  // kLoaded: resident once ready_ has passed

  Timeline& R(SimResource r) { return res_[static_cast<int>(r)]; }
  // Books work on a resource: first come first served, or, for the
  // overlapped step's worker (speculating_), into the gaps left (Fill).
  double Use(SimResource r, double t, double secs) {
    return speculating_ ? R(r).Fill(t, secs) : R(r).Book(t, secs);
  }
  double Numel(int g) const { return static_cast<double>(l_.group_numel[static_cast<size_t>(g)]); }
  double Shard(int g) const { return static_cast<double>(l_.group_shard[static_cast<size_t>(g)]); }
  // Elements of g that this rank's optimizer owns (stage >= 1 partitions them).
  double OptNumel(int g) const { return cfg_.zero.stage >= 1 ? Shard(g) : Numel(g); }
  double PHomeNumel(int g) const { return cfg_.zero.stage >= 3 ? Shard(g) : Numel(g); }
  // Bytes of g's W, M and V (strata.state_format) on this rank.
  double OptBytes(int g, uint64_t (StateBytes::*bytes)(uint64_t) const) const {
    return static_cast<double>((sb_.*bytes)(static_cast<uint64_t>(OptNumel(g))));
  }
  double CopyBytes(int g) const { return Numel(g) * dp_; }  // a gathered group on the device

  // Prefetch reads and gradient writes in backward overlap, and so do the
  // step's reads and writes with strata.step_io "concurrent": they run at the
  // calibrated mixed rate. "alternate" (the default) never mixes in the step.
  double DiskFactor() const { return step_unmixed_ ? 1.0 : c_.nvme_mixed_factor; }
  double DiskRead(double t, double bytes) {
    r_.disk_read_bytes += static_cast<uint64_t>(bytes);
    t = std::max(t, writes_end_);  // writing behind: every read waits for the last step's writes (the gate)
    return Use(SimResource::kDisk, t, DiskFactor() * bytes / c_.RankNvmeRead());
  }
  double DiskWrite(double t, double bytes) {
    r_.disk_write_bytes += static_cast<uint64_t>(bytes);
    return Use(SimResource::kDisk, t, DiskFactor() * bytes / c_.RankNvmeWrite());
  }
  double Pcie(double t, double bytes) {
    r_.pcie_bytes += static_cast<uint64_t>(bytes);
    return Use(SimResource::kPcie, t, bytes / c_.pcie_Bps);
  }
  double Net(double t, double bytes) {
    r_.network_bytes += static_cast<uint64_t>(bytes);
    return Use(SimResource::kNetwork, t, bytes / c_.RankCollectiveBps());
  }
  double Cpu(double t, double secs) { return Use(SimResource::kCpu, t, secs); }
  // A memcpy of `bytes` in host memory (read and written).
  double HostCopy(double t, double bytes) { return bytes > 0 ? Cpu(t, 2 * bytes / c_.RankHostMem()) : t; }
  bool Speculates(int g) const {
    return finish_ != Finish::kPlain && spec_.granted[static_cast<size_t>(g)] != 0;
  }
  double Checksum(double t, double bytes) { return Cpu(t, bytes / cks_); }

  // LoadDeviceCopy (+ the stage-3 all-gather): home -> host -> device, serial.
  double LoadChain(int g, double t) {
    const double pb = PHomeNumel(g) * dp_;
    if (h_.p == TierKind::kNvme) t = Checksum(DiskRead(t, pb), pb);
    if (h_.p != TierKind::kDevice) {
      if (c_.has_gpu)
        t = Pcie(t, pb);
      else if (h_.p == TierKind::kHost)
        t = Cpu(t, pb / c_.RankHostMem());
    }
    if (cfg_.zero.stage >= 3 && l_.world_size > 1) t = Net(t, Numel(g) * dp_ * (world_ - 1) / world_);
    return t;
  }

  bool Resident(int h, double now) const {
    return state_[static_cast<size_t>(h)] == kLoaded && ready_[static_cast<size_t>(h)] <= now;
  }
  void Evict(int h) {
    state_[static_cast<size_t>(h)] = kAbsent;
    used_ -= CopyBytes(h);
    loaded_.erase(std::find(loaded_.begin(), loaded_.end(), h));
    ++r_.evictions;
  }

  // AllocateDeviceCopy: room for g, evicting the resident copy used farthest
  // ahead. Returns when the room is there, or -1 when a prefetch gives up.
  double Allocate(int g, double now, bool demand) {
    for (;;) {
      if (used_ + CopyBytes(g) <= room_) {
        used_ += CopyBytes(g);
        return now;
      }
      int victim = -1;
      uint64_t best = 0;
      double next_ready = kInf;
      for (int h : loaded_) {
        if (h == g || h == pinned_ || state_[static_cast<size_t>(h)] != kLoaded) continue;
        if (!Resident(h, now)) {
          next_ready = std::min(next_ready, ready_[static_cast<size_t>(h)]);
          continue;
        }
        const uint64_t score = sched_.NextUse(h);
        if (victim < 0 || score > best) {
          victim = h;
          best = score;
        }
      }
      if (victim >= 0 && (demand || best > sched_.NextUse(g))) {
        Evict(victim);
        continue;
      }
      if (!demand) return -1;
      if (next_ready < kInf) {
        now = next_ready;
        continue;
      }                       // a load in flight becomes evictable
      used_ += CopyBytes(g);  // does not fit: the capacity report says so; go on over budget
      return now;
    }
  }

  void Track(int g) {
    if (std::find(loaded_.begin(), loaded_.end(), g) == loaded_.end()) loaded_.push_back(g);
  }

  // The prefetch thread: takes queued groups in order while it would have
  // started them by `until`.
  void RunPrefetcher(double until) {
    while (!queue_.empty()) {
      auto [h, enq] = queue_.front();
      const double start = std::max(prefetch_free_, enq);
      if (start > until) return;
      queue_.pop_front();
      if (state_[static_cast<size_t>(h)] != kAbsent) continue;
      if (Allocate(h, start, /*demand=*/false) < 0) continue;  // no room now: a fetch will load it
      state_[static_cast<size_t>(h)] = kLoaded;
      Track(h);
      ready_[static_cast<size_t>(h)] = prefetch_free_ = LoadChain(h, start);
    }
  }

  void Enqueue(const std::vector<int>& groups, double t) {
    for (int g : groups)
      if (state_[static_cast<size_t>(g)] == kAbsent &&
          std::none_of(queue_.begin(), queue_.end(), [&](const auto& q) { return q.first == g; }))
        queue_.emplace_back(g, t);
  }

  std::vector<int> Ahead() {
    const uint64_t window = cfg_.zero.prefetch_bucket_size * static_cast<uint64_t>(dp_);
    return sched_.Ahead(window, [&](int h) { return static_cast<uint64_t>(Shard(h) * dp_); });
  }

  // Fetch(g) at time t: returns when the group's copy is on the device.
  double Fetch(int g, double t) {
    ++r_.fetches;
    if (!fetched_) return t;
    RunPrefetcher(t);
    sched_.OnFetch(g);
    auto q = std::find_if(queue_.begin(), queue_.end(), [&](const auto& e) { return e.first == g; });
    const bool hit = state_[static_cast<size_t>(g)] != kAbsent || q != queue_.end();
    if (q != queue_.end()) queue_.erase(q);
    r_.prefetch_hits += hit;
    double ready;
    if (state_[static_cast<size_t>(g)] == kLoaded) {
      ready = std::max(t, ready_[static_cast<size_t>(g)]);
    } else {
      const double at = Allocate(g, t, /*demand=*/true);
      state_[static_cast<size_t>(g)] = kLoaded;
      Track(g);
      ready = ready_[static_cast<size_t>(g)] = LoadChain(g, at);
    }
    if (ready > t) {
      ++r_.stalls;
      r_.stall_s += ready - t;
    }
    pinned_ = g;
    Enqueue(Ahead(), ready);
    return ready;
  }

  // Grads(g): reduce across ranks, copy this rank's part to the host, add it
  // into the fp32 accumulator (and write that to NVMe when it lives there).
  double Grads(int g, double t, bool first, bool last) {
    if (l_.world_size > 1) {
      const double ring = Numel(g) * dp_ * (world_ - 1) / world_;
      t = Net(t, cfg_.zero.stage >= 2 ? ring : 2 * ring);
    }
    if (h_.gpu_optimizer) return t;
    const double n = OptNumel(g);
    if (c_.has_gpu) t = Pcie(t, n * dp_);
    const double gb = n * static_cast<double>(sb_.g_size);  // G's bytes
    if (h_.g == TierKind::kNvme && !first) t = Checksum(DiskRead(t, gb), gb);
    t = Cpu(t, n * (dp_ + 8) / c_.RankHostMem());  // cast or add, then the sum of squares
    if (h_.g == TierKind::kNvme) t = DiskWrite(Checksum(t, gb), gb);
    if (last) grads_[static_cast<size_t>(g)] = 1;
    return t;
  }

  // The layers' time for one use. Without a GPU strata-train also converts
  // each fetched copy to fp32 (tools/train/gpt.cpp) before its kernels run.
  double Compute(const GroupUse& u, double t) {
    double secs = u.flops / c_.LayerFlops(m_.hidden, u.head);
    if (u.fetch && !c_.has_gpu && m_.scheme == GroupScheme::kStrataTrain)
      secs += Numel(u.group) * (dp_ + 4) / c_.RankHostMem();
    return R(SimResource::kGpu).Book(t, secs);
  }

  double ForwardBackward() {
    const std::vector<GroupUse> uses = MicroBatchUses(m_);
    std::vector<int> trace;
    for (uint64_t mb = 0; mb < m_.grad_accum; ++mb)
      for (const GroupUse& u : uses)
        if (u.fetch) trace.push_back(u.group);
    for (int g : trace) sched_.OnFetch(g);  // the recorded first step
    sched_.OnStep();
    if (fetched_) Enqueue(Ahead(), 0);  // the previous Step ends by prefetching the first groups
    double t = 0;
    std::vector<std::pair<int, double>> speculate;  // group, when its gradients are complete
    const std::vector<double> stash = act_.StashBytes(uses);
    for (uint64_t mb = 0; mb < m_.grad_accum; ++mb) {
      const bool last = mb + 1 == m_.grad_accum;
      act_.BeginMicroBatch();
      for (size_t k = 0; k < uses.size(); ++k) {
        const GroupUse& u = uses[k];
        if (u.grads && backward_start_ < 0) backward_start_ = t;  // (prepare_step: before the step's first gradients)
        if (u.fetch) t = Fetch(u.group, t);
        if (u.grads) t = act_.Redeem(u.group, t, &r_);
        t = Compute(u, t);
        if (stash[k] > 0) act_.Stash(u.group, t, stash[k], &r_);
        pinned_ = -1;
        if (!u.grads) continue;
        t = Grads(u.group, t, mb == 0, last);
        if (last && Speculates(u.group)) speculate.emplace_back(u.group, t);
      }
    }
    RunPrefetcher(t);  // Step waits for loads in flight and drops the rest
    // The overlapped step's worker (UpdateWorker): from the moment a
    // group's gradients are complete it backs up the group's host-homed
    // state and updates it. Its run is streamed (StepPipeline::RunFeed): the
    // groups queued by the time it is free go through the step's pipeline
    // together. It is booked after backward's own work, into the gaps that
    // work leaves (split across them, as threads share the cores and the
    // disk): the trainer's path (its gradient copies and adds, the
    // prefetches) goes first, and a worker that falls behind delays the end
    // of the step, not backward.
    speculating_ = true;
    for (size_t i = 0; i < speculate.size();) {
      const double start = std::max(speculate[i].second, overlap_free_);
      std::vector<int> batch;
      for (; i < speculate.size() && (batch.empty() || speculate[i].second <= start); ++i)
        batch.push_back(speculate[i].first);
      overlap_free_ = Optimizer(batch, start);
    }
    speculating_ = false;
    return std::max(t, prefetch_free_);
  }

  // States the step moves through a slot (not addressable by the CPU in place).
  bool Staged(TierKind home) const {
    return home == TierKind::kNvme || (home == TierKind::kDevice && c_.has_gpu);
  }
  double Load(TierKind home, double t, double bytes) {
    return home == TierKind::kNvme ? DiskRead(t, bytes) : Pcie(t, bytes);
  }
  double Store(TierKind home, double t, double bytes) {
    return home == TierKind::kNvme ? DiskWrite(Checksum(t, bytes), bytes) : Pcie(t, bytes);
  }

  // RunOptimizer: the GPU's in-place update, or a schedule over step slots
  // (strata.step_io: "concurrent" here, "alternate" in OptimizerAlternate).
  double Optimizer(const std::vector<int>& order, double t) {
    const int n = static_cast<int>(order.size());
    if (h_.gpu_optimizer) {  // W, M, V, G and P all on the device: one pass over HBM per group
      // W, M, V read and written, G and P at 4 + 2 x dtype (fp32 Adam: 28 + 2 x dtype;
      // compact: P is read and written as the master's bf16 half, the same bytes).
      for (int g : order) {
        const double bytes = 2 * OptBytes(g, &StateBytes::Optimizer) + OptNumel(g) * (4 + 2 * dp_);
        t = Use(SimResource::kGpu, t, bytes / c_.device_mem_Bps);
      }
      return t;
    }
    struct Unmixed {  // for the length of this step
      bool& flag;
      ~Unmixed() { flag = false; }
    } unmixed{step_unmixed_ = cfg_.strata.step_io == "alternate" || behind_};
    if (behind_) return OptimizerBehind(order, t);
    const int k = static_cast<int>(std::clamp<uint64_t>(cfg_.zero.offload_optimizer.buffer_count, 3, 16));
    if (step_unmixed_) return OptimizerAlternate(order, t, k);
    std::vector<double> loads(static_cast<size_t>(n), -1), stores(static_cast<size_t>(n), 0);
    // Loads start when a job's slot is free, up to K-2 ahead.
    auto start_loads = [&](int i, double at) {
      loads[static_cast<size_t>(i)] = JobLoads(order[static_cast<size_t>(i)], at);
    };
    if (n > 0) start_loads(0, t);
    for (int i = 0; i < n; ++i) {
      const int g = order[static_cast<size_t>(i)];
      if (i + 2 - k >= 0) t = PShadowCopy(order[static_cast<size_t>(i + 2 - k)], std::max(t, stores[static_cast<size_t>(i + 2 - k)]));
      for (int a = i + 1; a <= std::min(i + k - 2, n - 1); ++a)
        if (loads[static_cast<size_t>(a)] < 0) start_loads(a, t);
      t = JobUpdate(g, JobVerify(g, std::max(t, loads[static_cast<size_t>(i)])));
      double done = t;
      ForEachStore(g, [&](TierKind home, double bytes) { done = std::max(done, Store(home, t, bytes)); });
      stores[static_cast<size_t>(i)] = done;
    }
    for (int i = std::max(n + 2 - k, 0); i < n; ++i)
      t = PShadowCopy(order[static_cast<size_t>(i)], std::max(t, stores[static_cast<size_t>(i)]));
    return t;
  }

  // Write-behind (StepPipeline::RunBehind): every job's loads at once, each
  // into a piece of its own, then each job verified and updated as its
  // loads land; the step returns there. Its writes are the next step's
  // (Run books them at its start).
  double OptimizerBehind(const std::vector<int>& order, double t) {
    std::vector<double> landed;
    for (int g : order)
      landed.push_back(static_cast<size_t>(g) < ahead_.size() ? ahead_[static_cast<size_t>(g)] : JobLoads(g, t));
    for (size_t i = 0; i < order.size(); ++i) t = JobUpdate(order[i], JobVerify(order[i], std::max(t, landed[i])));
    return t;
  }

  // The states a step job moves through its slot (W, M, V each its own stream).
  using StateBytesFn = uint64_t (StateBytes::*)(uint64_t) const;
  std::span<const StateBytesFn> OptStates() const {
    static constexpr StateBytesFn kWMV[] = {&StateBytes::W, &StateBytes::M, &StateBytes::V};
    return {kWMV, sb_.has_v ? 3u : 2u};
  }
  // Compact with P in place (host) but W staged: the step updates P's slice
  // in the slot, copied there before the job's reads are issued and back when
  // the job commits (engine/step/pipeline.cpp, p_shadow): a memcpy each way.
  bool PShadow() const { return sb_.compact && !Staged(h_.p) && Staged(h_.opt); }
  double PShadowCopy(int g, double t) {
    return PShadow() ? Cpu(t, 2 * PHomeNumel(g) * dp_ / c_.RankHostMem()) : t;
  }
  // Job g's reads from `at`; returns when the last lands.
  double JobLoads(int g, double at) {
    at = PShadowCopy(g, at);
    double done = at;
    if (Staged(h_.opt))
      for (auto s : OptStates()) done = std::max(done, Load(h_.opt, at, OptBytes(g, s)));
    if (Staged(h_.g) && grads_[static_cast<size_t>(g)])
      done = std::max(done, Load(h_.g, at, OptNumel(g) * static_cast<double>(sb_.g_size)));
    if (sb_.compact && Staged(h_.p)) done = std::max(done, Load(h_.p, at, PHomeNumel(g) * dp_));
    return done;
  }
  // The CPU's check of job g's NVMe reads against their checksums.
  double JobVerify(int g, double t) {
    if (h_.opt == TierKind::kNvme) t = Checksum(t, OptBytes(g, &StateBytes::Optimizer));
    if (sb_.compact && h_.p == TierKind::kNvme) t = Checksum(t, PHomeNumel(g) * dp_);
    if (h_.g == TierKind::kNvme && grads_[static_cast<size_t>(g)])
      t = Checksum(t, OptNumel(g) * static_cast<double>(sb_.g_size));
    return t;
  }
  double JobUpdate(int g, double t) {
    if (speculating_) t = HostCopy(t, spec_.host[static_cast<size_t>(g)]);  // the backup, then the update
    return Cpu(t, OptNumel(g) / (sb_.compact ? c_.RankCompactAdamEps() : c_.RankAdamEps()));
  }
  // Job g's outgoing bytes, fn(home, bytes): P, then W, M, V.
  template <typename Fn>
  void ForEachStore(int g, Fn&& fn) const {
    // fp32 P on NVMe beside W on NVMe or the host, or P and W both on the
    // host, is W's bytes: not stored (the engine's Layout::PIsW; copies are
    // read from W's block).
    const bool p_is_w = !sb_.compact && dp_ == 4 &&
                        ((h_.p == TierKind::kNvme && (h_.opt == TierKind::kNvme || h_.opt == TierKind::kHost)) ||
                         (h_.p == TierKind::kHost && h_.opt == TierKind::kHost));
    if (Staged(h_.p) && !p_is_w) fn(h_.p, (sb_.compact ? PHomeNumel(g) : OptNumel(g)) * dp_);
    if (Staged(h_.opt))
      for (auto s : OptStates()) fn(h_.opt, static_cast<double>(OptBytes(g, s)));
  }

  // strata.step_io "alternate" as StepPipeline::Run runs it (engine/step/pipeline.cpp):
  // batches of max(K/2, 1) jobs, the disk reading or writing, never both.
  // fp32 updates batch k beside batch k-1's writes; compact, beside batch
  // k+1's reads. Then the CPU checksums batch k's outgoing blocks, and batch
  // k's writes start once every read has landed; batch k+1's loads are
  // checked as they land (fp32) or beside the writes (compact). A batch costs
  // about max(update, write) + read (fp32), or max(read, update) + write
  // (compact).
  double OptimizerAlternate(const std::vector<int>& order, double t, int k) {
    const int n = static_cast<int>(order.size()), batch = std::max(k / 2, 1);
    auto group = [&](int i) { return order[static_cast<size_t>(i)]; };
    double landed = t;
    for (int i = 0; i < std::min(batch, n); ++i) landed = std::max(landed, JobLoads(group(i), t));
    t = landed;
    for (int i = 0; i < std::min(batch, n); ++i) t = JobVerify(group(i), t);
    double writes_done = t;
    for (int cur = 0; cur < n;) {
      const int cur_end = std::min(cur + batch, n), next = cur_end, next_end = std::min(next + batch, n);
      if (!sb_.compact)
        for (int i = cur; i < cur_end; ++i) t = JobUpdate(group(i), t);
      t = std::max(t, writes_done);  // the slots batch k+1 reads into are free
      for (int i = std::max(cur - batch, 0); i < cur; ++i) t = PShadowCopy(group(i), t);  // batch k-1 commits
      landed = t;
      for (int i = next; i < next_end; ++i) landed = std::max(landed, JobLoads(group(i), t));
      if (sb_.compact)
        for (int i = cur; i < cur_end; ++i) t = JobUpdate(group(i), t);
      for (int i = cur; i < cur_end; ++i)
        ForEachStore(group(i), [&](TierKind home, double bytes) {
          if (home == TierKind::kNvme) t = Checksum(t, bytes);
        });
      if (!sb_.compact)  // fp32 checks batch k+1's loads as they land
        for (int i = next; i < next_end; ++i) t = JobVerify(group(i), t);
      t = std::max(t, landed);
      writes_done = t;
      for (int i = cur; i < cur_end; ++i)
        ForEachStore(group(i), [&](TierKind home, double bytes) {
          writes_done = std::max(writes_done, home == TierKind::kNvme ? DiskWrite(t, bytes) : Pcie(t, bytes));
        });
      if (sb_.compact)  // compact checks them beside batch k's writes
        for (int i = next; i < next_end; ++i) t = JobVerify(group(i), t);
      if (next >= n)  // the drain: the last batch commits
        for (int i = cur; i < cur_end; ++i) t = PShadowCopy(group(i), std::max(t, writes_done));
      cur = next;
    }
    return std::max(t, writes_done);
  }

  const ModelSpec& m_;
  const Layout& l_;
  const ClusterSpec& c_;
  const Config& cfg_;
  const SimOptions o_;
  const Homes h_;
  const Speculation& spec_;
  const Finish finish_;
  int n_ = 0;
  double world_ = 1, dp_ = 2, cks_ = kInf, room_ = 0, used_ = 0;
  StateBytes sb_;
  bool fetched_ = false, step_unmixed_ = false, speculating_ = false;
  const bool behind_;  // the step writes behind (Capacity::writes_behind), without overlap
  double backward_start_ = -1;  // the step's first backward begins (ForwardBackward)
  double writes_end_ = 0;       // writing behind: the last step's writes have landed (Run)
  std::vector<double> ahead_;   // per group: its W, M, V read ahead during backward, landed
  Timeline res_[kNumSimResources];
  PrefetchSchedule sched_;
  std::vector<CopyState> state_;
  std::vector<double> ready_;
  std::vector<uint8_t> grads_;
  std::vector<int> loaded_;                   // groups that have had a copy (the eviction scan's candidates)
  std::deque<std::pair<int, double>> queue_;  // prefetch queue: group, time enqueued
  double prefetch_free_ = 0, overlap_free_ = 0;
  int pinned_ = -1;
  // The activation store: its transfers booked on this step's resources.
  ActivationSim act_{cfg_, m_,
                     {.copy = [this](double t, double b) { return c_.has_gpu ? Pcie(t, b) : HostCopy(t, b); },
                      .spill = [this](double t, double b) { return DiskWrite(Checksum(t, b), b); },
                      .read_back = [this](double t, double b) { return Checksum(DiskRead(t, b), b); }}};
  SimResult r_;
};

}  // namespace

const char* SimResourceName(SimResource r) {
  static const char* kNames[] = {"gpu", "pcie", "network", "disk", "cpu"};
  return kNames[static_cast<int>(r)];
}

SimResult Simulate(const ModelSpec& model, const Layout& layout, const Capacity& capacity,
                   const ClusterSpec& cluster, const Config& config, const SimOptions& options) {
  using Finish = StepSim::Finish;
  SimResult plain = StepSim(model, layout, capacity, cluster, config, options, Finish::kPlain).Run();
  plain.plain = TimesOf(plain);
  if (options.overlap_step && capacity.writes_behind) {  // (without overlap_step: no prepare_step, no read-ahead)
    SimOptions without = options;
    without.overlap_step = false;
    plain.plain = TimesOf(StepSim(model, layout, capacity, cluster, config, without, Finish::kPlain).Run());
  }
  plain.groups = static_cast<int>(layout.group_numel.size());
  if (!options.overlap_step || options.optimizer_only) return plain;

  // Speculation's room per group: from the capacity when it was sized for
  // the overlapped step, else sized here.
  Capacity sized;
  const Capacity* cap = &capacity;
  if (capacity.speculation.granted.size() != layout.group_numel.size()) {
    sized = capacity;
    sized.speculation = ComputeCapacity(model, layout, cluster, config, /*overlap_step=*/true).speculation;
    cap = &sized;
  }
  const SimResult commit = StepSim(model, layout, *cap, cluster, config, options, Finish::kCommit).Run();
  const SimResult replay = StepSim(model, layout, *cap, cluster, config, options, Finish::kReplay).Run();
  const double rr = std::clamp(options.replay_rate, 0.0, 1.0);
  SimResult r = MixSteps(commit, replay, plain, SpeculatedRate(config, cluster, *cap, rr), rr);
  r.speculation = config.strata.speculation;
  const Speculation& s = cap->speculation;
  r.groups = plain.groups;
  r.speculated_groups = s.Groups();
  r.speculated_fraction = s.Fraction();
  r.spec_host_bytes = s.host_bytes;
  r.spec_host_needed = s.host_needed;
  r.spec_disk_bytes = s.disk_bytes;
  r.spec_disk_needed = s.disk_needed;
  r.spec_groups_eligible = static_cast<int>(std::count(s.eligible.begin(), s.eligible.end(), 1));
  return r;
}

Result<SimResult> Simulate(const ModelSpec& model, const ClusterSpec& cluster, const Config& config,
                           const SimOptions& options) {
  STRATA_ASSIGN_OR_RETURN(Layout l, MakeLayout(model, static_cast<int>(cluster.world_size())));
  const Capacity cap = ComputeCapacity(model, l, cluster, config, options.overlap_step);
  return Simulate(model, l, cap, cluster, config, options);
}

}  // namespace strata::plan
