// Build: the layout (partition, homes, frozen groups), the NVMe tier and
// the home blocks, the staging pools, the initial state, the components;
// a failed build leaves nothing behind.
#include "engine/engine_impl.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <new>
#include <set>

#include "io/direct_file.h"
#include "io/net/launch_env.h"

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"
#include "engine/layout/staging_plan.h"
#include "engine/step/step_checks.h"
#include "kernels/cpu/cast.h"
#include "kernels/cpu/norm.h"
#include "tiers/gpu.h"

namespace strata {

static TierKind HomeOf(OffloadDevice d) {
  return d == OffloadDevice::kNone ? TierKind::kDevice : d == OffloadDevice::kCpu ? TierKind::kHost : TierKind::kNvme;
}

// Fills a block through `fill(ptr)`: in place when addressable, else through
// a slot of `pool` (the step's slots, or a frozen group's buffer).
static Status FillBlock(Engine::Impl& m, const StateBlock& b, const std::function<Status(void*)>& fill,
                        StagingPool& pool) {
  if (m.io_->Direct(b)) return fill(m.io_->DirectPtr(b));
  void* buf = pool.Acquire();
  if (!buf) return InternalError("build: no staging slot for a block off the host");
  Status st = fill(buf);
  if (st.ok()) st = m.io_->Store(b, buf);
  pool.Release(buf);
  return st;
}

// The staging pools, as PlanStaging sizes them (CheckHostPlan checked the
// budget with the same sizes, less the NVMe tier's padding, which a refusal
// here names too).
static Status InitStaging(Engine::Impl& m) {
  const StagingSizes z = PlanStaging(m.lay_, [&](uint64_t bytes) { return m.io_->NvmeBuffer(bytes); });
  std::copy(std::begin(z.opt_offsets), std::end(z.opt_offsets), std::begin(m.lay_.opt_slot_offsets));
  m.lay_.opt_piece_bytes = z.piece_bytes;
  Status st = m.staging_.opt.Init(m.host_.get(), z.opt_slots, z.opt_offsets[kNumStates]);
  if (st.ok() && z.piece_bytes) m.staging_.opt.SetPieces();
  if (st.ok()) st = m.staging_.param.Init(m.host_.get(), z.param_slots, z.param_bytes);
  if (st.ok()) st = m.staging_.grad.Init(m.host_.get(), z.grad_slots, z.grad_bytes);
  if (st.ok()) st = m.staging_.frozen.Init(m.host_.get(), z.frozen_slots, z.frozen_bytes);
  return st.WithContext("build: staging (strata.host_budget " + FormatBytes(m.host_->budget()) + ")");
}

// A failed build leaves nothing behind (swap files and their locks, blocks,
// staging), so that build may be called again.
Status Engine::Impl::Build() {
  if (built_) return StateError("build: already built");
  // A C++ exception (an allocation failing: std::bad_alloc) is undone as a
  // failed Status is: the capi's guard would turn it into NOMEM, and the
  // half-built engine kept its swap files locked, its blocks charged.
  Status st;
  try {
    st = BuildOnce();
  } catch (const std::exception& e) {
    st = StatusOfException(e, "build: ");
  }
  if (!st.ok()) {
    UndoBuild();  // (the initial values stay: a build may be called again)
    return st;
  }
  // Written into the tiers: let them go only now that nothing can fail,
  // for a build that failed in its last steps (its threads, the ranks'
  // agreement on writing behind, write-behind's staging, the overlapped
  // step's room) is called again from them.
  init_.clear();
  init_.shrink_to_fit();
  return st;
}

void Engine::Impl::UndoBuild() {
  acts_.reset();  // its arena and swap go back before the tiers
  checkpointer_.reset();
  reducer_.reset();
  worker_.reset();
  // The overlapped step's room (StartOverlap, build's last step: a rank
  // whose peer failed there or at the last agreement had built it).
  spec_.reset();
  g_copies_.Clear();
  g_copy_.clear();
  spec_host_later_ = spec_disk_later_ = 0;
  step_.overlap = false;
  residency_.reset();
  p_home_.reset();
  for (auto& blocks : blocks_)
    for (auto& b : blocks)
      if (io_) io_->Free(b);
  pipeline_.reset();
  gpu_.reset();
  blocks_.clear();
  steps_.clear();
  shards_.reset();
  staging_.param.Clear();
  staging_.opt.Clear();
  staging_.grad.Clear();
  staging_.frozen.Clear();
  io_.reset();
  nvme_.reset();
  device_->Trim();  // the pool's blocks go back too: nothing is left held
  lay_.part.Reopen();   // not built: add_param works again (it said "already built")
}

Status Engine::Impl::BuildOnce() {
  STRATA_RETURN_IF_ERROR(lay_.part.Finalize(lay_.sworld));
  for (size_t g = static_cast<size_t>(lay_.part.num_groups()); g < lay_.frozen_groups.size(); ++g)
    if (lay_.frozen_groups[g])
      return StateError("build: group " + std::to_string(g) + " is frozen (freeze_group) but has no parameters "
                        "(groups are numbered 0.." + std::to_string(lay_.part.num_groups() - 1) + " without gaps)");
  lay_.frozen_groups.resize(static_cast<size_t>(lay_.part.num_groups()), 0);  // what is dropped was never frozen
  if (lay_.multi && !lay_.p_sharded && config_.zero.offload_param.device == OffloadDevice::kNvme)
    return ConfigError("zero_optimization.offload_param.device: nvme needs stage 3 (as in DeepSpeed); stage " +
                       std::to_string(config_.zero.stage) + " keeps every parameter on every rank");
  // Several ranks agree on the frozen groups first: the facts below count
  // only the groups that train, and a rank refused by them alone would
  // leave the others waiting in the broadcasts that follow.
  if (lay_.multi) STRATA_RETURN_IF_ERROR(AgreeOnFrozen());
  ConfigFacts facts = machine_;
  facts.largest_group_numel = lay_.part.largest_group_numel();
  // (All frozen: no W, M, V, G at all; 1, for 0 stands for "not known": ConfigFacts.)
  facts.largest_trainable_numel = std::max<uint64_t>(lay_.LargestTrainable(Layout::Size::kNumel), 1);
  facts.world_size = static_cast<uint32_t>(lay_.sworld);
  facts.has_gpu = device_->on_gpu();
  // (This machine's facts: RAM, cgroup, ranks on the host. Agreed, as below.)
  STRATA_RETURN_IF_ERROR(Agree(ValidateConfig(config_, facts), "build: the config's checks against each machine"));
  // Several ranks start from rank 0's initial values, as torch DDP does: a
  // rank whose model was initialized from another seed still trains the
  // same model. (A rank that registered other groups fails here, naming it.)
  // Only the values rank 0 was given move (a group's values past the end of
  // its vector are zeros): a model registered without values (larger than
  // RAM, written after build) takes no memory here on any rank. Before,
  // every rank grew every group to its whole fp32 size for the broadcast.
  init_.resize(std::max(init_.size(), static_cast<size_t>(lay_.part.num_groups())));
  if (lay_.multi)
    for (int g = 0; g < lay_.part.num_groups(); ++g) {
      std::vector<float>& w0 = init_[static_cast<size_t>(g)];
      const uint64_t numel = lay_.part.group(g).numel;
      uint64_t first[2] = {w0.size(), numel};  // rank 0's: how many values it has, and the group's size
      comm_->SetLabel("init count g" + std::to_string(g));
      STRATA_RETURN_IF_ERROR(comm_->Broadcast(first, sizeof first, 0)
                                 .WithContext("build: how many initial values rank 0 has of group " + std::to_string(g)));
      Status local;
      if (first[1] != numel)
        local = InvalidError("build: group " + std::to_string(g) + " holds " + std::to_string(numel) + " elements on rank " +
                             std::to_string(options_.rank) + " but " + std::to_string(first[1]) +
                             " on rank 0; every rank must register the same tensors");
      else if (first[0] > numel)
        local = InternalError("build: rank 0 has " + std::to_string(first[0]) + " initial values of group " +
                              std::to_string(g) + ", which holds " + std::to_string(numel));
      STRATA_RETURN_IF_ERROR(Agree(local, "build: group " + std::to_string(g) + "'s size"));
      const uint64_t given = first[0];
      w0.resize(given, 0.0f);
      if (given == 0) {
        w0.shrink_to_fit();  // (this rank's own values, if any, are not rank 0's)
        continue;
      }
      comm_->SetLabel("init g" + std::to_string(g));
      STRATA_RETURN_IF_ERROR(comm_->Broadcast(w0.data(), w0.size() * sizeof(float), 0)
                                 .WithContext("build: rank 0's initial values of group " + std::to_string(g)));
    }

  // Rank-local from here to the components (the machine's memory and disks,
  // the state allocated and written): the ranks agree on the outcome before
  // the next collective, so a rank that fails alone fails every rank at
  // once, each naming it (the others waited in that collective until
  // strata.timeout, then failed naming only it).
  STRATA_RETURN_IF_ERROR(Agree(BuildState(), "build: the state allocated and written"));
  STRATA_RETURN_IF_ERROR(StartComponents());
  // Several ranks: whether the step writes behind, on all or none (after
  // residency: whether P's copies stay). Before StartOverlap: "auto"
  // speculation asks WritesBehind.
  STRATA_RETURN_IF_ERROR(AgreeWriteBehind());
  // Rank-local again (write-behind's staging, the overlapped step's room),
  // and agreed: one rank failing here alone left the others' build OK, and
  // they trained into a collective their peer never entered.
  Status last = GrowStagingBehind();
  if (last.ok() && options_.overlap_step) last = StartOverlap();  // overlap.cpp
  STRATA_RETURN_IF_ERROR(Agree(last, "build: the step's staging and speculation room"));
  built_ = true;
  const TierKind opt_home = lay_.home[int(StateKind::kW)];
  STRATA_LOG_DEBUG("built {} groups ({} frozen), {} parameters; P on {}, W/M/V on {}, G on {}", lay_.part.num_groups(),
                   std::count(lay_.frozen_groups.begin(), lay_.frozen_groups.end(), 1), lay_.part.total_numel(), TierName(lay_.home[0]),
                   TierName(opt_home), TierName(lay_.home[int(StateKind::kG)]));
  return Status::Ok();
}

// Build's rank-local part: the homes, the host plan, the NVMe tier, every
// block in its home tier, the staging, the activation store and the
// initial state written. No collective: BuildOnce agrees on its outcome.
Status Engine::Impl::BuildState() {
  lay_.home[int(StateKind::kP)] = HomeOf(config_.zero.offload_param.device);
  const TierKind opt_home = HomeOf(config_.zero.offload_optimizer.device);
  lay_.home[int(StateKind::kW)] = lay_.home[int(StateKind::kM)] = lay_.home[int(StateKind::kV)] = opt_home;
  // G in host memory when strata.grad_home says so ("auto": when the host plan holds it).
  // What else build takes from the host budget by number: the activation
  // arena, and a speculation room given in bytes.
  lay_.home[int(StateKind::kG)] = TierKind::kHost;
  uint64_t taken = config_.strata.activation_host_bytes;
  if (options_.overlap_step && config_.strata.speculation_host_bytes != StrataConfig::kSpeculationAuto)
    taken += config_.strata.speculation_host_bytes;
  lay_.SetStepUnits();  // (the host plan's step pieces follow the units: staging_plan.h)
  const bool host_holds_g =
      host_->budget() > taken && CheckHostPlan(lay_, host_->budget() - taken).ok();
  lay_.home[int(StateKind::kG)] = GradHome(config_.strata.grad_home, opt_home, host_holds_g);
  lay_.SetStepUnits();
  if (config_.strata.grad_home == "auto" && opt_home == TierKind::kNvme && !host_holds_g)
    STRATA_LOG_INFO("build: G on NVMe beside W, M, V: strata.host_budget ({}) cannot hold it beside the staging "
                    "(strata.grad_home \"auto\")", FormatBytes(host_->budget()));
  // Before anything is allocated, with what build takes besides (before,
  // an arena that did not fit beside the plan was NOMEM at its allocation).
  std::string taken_what;
  if (config_.strata.activation_host_bytes) taken_what = "the activations' arena (strata.activation_host_bytes)";
  if (taken > config_.strata.activation_host_bytes)
    taken_what += std::string(taken_what.empty() ? "" : " and ") + "speculation room (strata.speculation_host_bytes)";
  STRATA_RETURN_IF_ERROR(CheckHostPlan(lay_, host_->budget(), taken, taken_what));
  const int ngroups = lay_.part.num_groups();
  auto used = [&](int s) { return lay_.StateUsed(s); };
  auto used_by = [&](int s, int g) { return lay_.StateUsedBy(s, g); };

  // The NVMe tier holds exactly the blocks homed there.
  std::vector<std::string> dirs = config_.OptimizerSwapPaths();
  for (const auto& d : config_.ParamSwapPaths())
    if (std::find(dirs.begin(), dirs.end(), d) == dirs.end()) dirs.push_back(d);
  // The step's units (layout.h): a group whose W, M, V are on NVMe is
  // stepped, and stored, in units of at most zero_optimization.sub_group_size
  // elements, each unit's blocks on their own.
  lay_.SetStepUnits();
  uint64_t nvme_bytes = 0, largest_frozen = 0, largest_g = 0, largest_p = 0;
  std::vector<uint64_t> stored;  // per step job (a group's unit), the NVMe blocks a step writes
  for (int g = 0; g < ngroups; ++g)
    for (int u = 0; u < lay_.Units(g); ++u) {
      uint64_t writes = 0;
      for (int s = 0; s < kNumStates; ++s) {
        // A frozen group keeps P alone. Each block (or part) takes its padded size, no more: small groups pack densely.
        if (!used(s) || lay_.home[s] != TierKind::kNvme || !used_by(s, g)) continue;
        const uint64_t padded = NvmeTier::PaddedSizeFor(lay_.PartBytes(s, g, u), dirs.size());
        nvme_bytes += padded;
        if (lay_.frozen(g)) largest_frozen = std::max(largest_frozen, padded);
        else if (s == int(StateKind::kG)) largest_g = std::max(largest_g, padded);
        else writes += padded;
        if (s == int(StateKind::kP) && !lay_.frozen(g)) largest_p = std::max(largest_p, padded);
      }
      stored.push_back(writes);
    }
  // Writes are copy on write: each block written at once needs a second
  // extent until it is settled. The step's jobs hold their slots until their
  // group's W, M, V are settled; the stores in flight at once are one batch's
  // under strata.step_io "alternate" (half the slots: batch k's writes start
  // once batch k-1's are settled), and all but one slot's under "concurrent":
  // the largest that many groups' blocks. Beside them: a G store from grads
  // (G on NVMe) and a P store from a recompute. A frozen group's P is written
  // only between steps (write_state, a load), alone. The allocator's holes (the
  // old extents a group leaves are its own sizes) are not reserved ahead: a
  // rewrite that finds none of its size grows the files by its size (logged;
  // NvmeTierOptions::grow_for_holes).
  std::sort(stored.begin(), stored.end(), std::greater<>());
  const int writing = StepGroupsWriting(StepSlots(config_), config_.strata.step_io == "concurrent");
  uint64_t in_flight = 0;
  for (size_t i = 0; i < std::min(static_cast<size_t>(std::max(writing, 0)), stored.size()); ++i) in_flight += stored[i];
  uint64_t cow_spare = in_flight + largest_g + largest_p + largest_frozen;
  // overlap_step's speculation keeps the old extents of NVMe-homed state
  // until the step commits (step/speculation.h): its room is reserved too.
  // It shares the step's own room for the writes in flight: the step's
  // pipeline writes only once the speculation is settled (committed or
  // discarded, Engine::Impl::Step), and while it is held nothing else is
  // written but what that room's G and P stores are for. So the files grow
  // only by what the room needs beyond `in_flight`.
  // "auto": all of it, at most what keeps the swap within 1.5x the state (or
  // `in_flight`, if more) and what the swap folders have free beyond the
  // state's own reservation (1% kept), whichever is least.
  if (options_.overlap_step && nvme_bytes > 0) {
    const uint64_t want = config_.strata.speculation_disk_bytes;
    uint64_t room = want;
    if (want == StrataConfig::kSpeculationAuto) {
      room = Speculation::TotalNeeds(lay_, [](int) { return false; },
                                     [&](uint64_t b) { return NvmeTier::PaddedSizeFor(b, dirs.size()); })
                 .disk;
      // (less the tier's 1 MiB beyond the state and a growth's rounding to whole MiB)
      const uint64_t others = cow_spare - in_flight + 3 * kMiB, half = nvme_bytes / 2;
      room = std::min(room, std::max(in_flight, half > others ? half - others : 0));
      uint64_t free_min = ~uint64_t{0};
      for (const auto& d : dirs) {  // (one that cannot be told: no room beyond the step's; the tier says why)
        auto f = FreeBytesAt(d);
        free_min = std::min(free_min, f.ok() ? *f : 0);
      }
      const uint64_t usable = free_min / 100 * 99 * dirs.size(), own = nvme_bytes + kMiB + cow_spare;
      room = std::min(room, usable > own ? in_flight + (usable - own) : in_flight);
    }
    if (config_.strata.speculation == "never") room = 0;
    // What is already reserved (the step's room) serves at once; "auto"
    // reserves the rest when its policy first speculates (a run clipped at
    // every step never does).
    const uint64_t shared = std::min(room, in_flight), beyond = room - shared;
    spec_disk_room_ = room;
    if (config_.strata.speculation == "auto" && want == StrataConfig::kSpeculationAuto) {
      spec_disk_later_ = beyond;
      spec_disk_room_ = shared;
    } else {
      cow_spare += beyond;
    }
  }
  // Swap for stashed activations (activations/activation_store.h), beside the state's.
  const uint64_t act_nvme = config_.strata.activation_nvme_bytes;
  if (act_nvme > 0 && dirs.empty()) dirs = config_.strata.nvme_paths;  // no state on NVMe: the activations' folders
  if (act_nvme > 0 && dirs.empty())
    return ConfigError("strata.activation_nvme_bytes (" + FormatBytes(act_nvme) + ") needs a swap folder: set "
                       "strata.nvme_paths (or offload an optimizer or parameter state to nvme with its nvme_path)");
  if (act_nvme > 0 && config_.strata.activation_host_bytes == 0)
    return ConfigError("strata.activation_nvme_bytes needs strata.activation_host_bytes too: every stash passes "
                       "through that host arena on its way to NVMe");
  nvme_bytes += act_nvme > 0 ? NvmeTier::PaddedSizeFor(act_nvme, dirs.size()) + kMiB : 0;
  if (nvme_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(nvme_, NvmeTier::Create({.dirs = dirs, .budget = nvme_bytes + kMiB, .spare = cow_spare, .grow_for_holes = true,
                                                     .rank = options_.rank, .checksums = config_.strata.checksums,
                                                     .storage = storage_.get()}));
  }
  io_ = std::make_unique<BlockIo>(device_.get(), host_.get(), nvme_.get(), stats_.get());
  shards_ = std::make_unique<ShardStore>(lay_, blocks_, *io_, staging_.opt, staging_.frozen);

  // Home blocks first: they are the model; staging comes out of what is left.
  steps_.assign(static_cast<size_t>(ngroups), GroupStep{});
  blocks_.assign(static_cast<size_t>(ngroups), {});
  for (int g = 0; g < ngroups; ++g)
    for (int s = 0; s < kNumStates; ++s) {
      if (!used_by(s, g)) continue;
      // A group in units keeps its NVMe blocks (W, M, V) in parts, one a unit.
      std::vector<uint64_t> parts;
      for (int u = 0; lay_.Units(g) > 1 && lay_.home[s] == TierKind::kNvme && u < lay_.Units(g); ++u)
        parts.push_back(lay_.PartBytes(s, g, u));
      auto b = parts.empty() ? io_->Allocate(lay_.home[s], lay_.StateBytes(s, g)) : io_->AllocateParts(parts);
      if (!b.ok())
        return b.status().WithContext(std::string("build: state ") + StateName(StateKind(s)) + " of group " +
                                      std::to_string(g) + " in its home tier");
      blocks_[static_cast<size_t>(g)][static_cast<size_t>(s)] = *b;
    }
  STRATA_RETURN_IF_ERROR(InitStaging(*this));
  acts_ = std::make_unique<ActivationStore>(ActivationOptions{.host_bytes = config_.strata.activation_host_bytes,
                                                              .nvme_bytes = act_nvme,
                                                              .window = config_.strata.activation_prefetch_bytes},
                                            *device_, *host_, nvme_.get(), *stats_);
  STRATA_RETURN_IF_ERROR(acts_->Init());
  gpu_ = std::make_unique<GpuUpdater>(lay_, blocks_, *device_, *stats_, *shards_, options_.gpu_optimizer_twin);
  gpu_->SetUp();  // its scratch from the device budget the home blocks left
  pipeline_ = std::make_unique<StepPipeline>(lay_, blocks_, *io_, staging_.opt, *stats_, *gpu_, *shards_, steps_);
  staging_.opt.SetReclaim([this] {
    if (pipeline_) pipeline_->DropReadAhead();
  });  // slots read ahead come back on demand
  io_->SetGate([this] { return pipeline_ ? pipeline_->Gate() : Status::Ok(); });  // NVMe moves wait for the step's writes left behind
  // The step's new P goes on into a cached device copy (host arena), so the
  // next forward does not read it back from NVMe; kept at the step's Drop.
  // A speculated group's (kHeld) is forgotten if the speculation is discarded
  // (DiscardSpeculation). Written on the run's thread (the overlap thread
  // during backward), read on the caller's once that thread is idle.
  p_refreshed_.assign(static_cast<size_t>(ngroups), PCopy::kOld);
  // A group stepped in units refreshes its copy a unit at a time: one unit
  // that the copy did not take (not resident then) leaves the copy to drop.
  pipeline_->OnPStored([this](int g, const void* p, bool held, uint64_t at, uint64_t bytes) {
    PCopy& f = p_refreshed_[static_cast<size_t>(g)];
    if (f == PCopy::kMissed) return;  // dropped at the step's end anyway
    const bool took = residency_ && residency_->Refresh(g, p, at, bytes);
    if (bytes != 0 && !took) f = PCopy::kMissed;
    else if (took) f = held ? PCopy::kHeld : PCopy::kCommitted;
  });

  // Initial state: W from the values given, M = V = G = 0, P = W in the compute dtype.
  // A large model takes a while (tens of GiB written): progress every 5 s.
  uint64_t state_total = 0, state_done = 0;
  for (int g = 0; g < ngroups; ++g)
    for (int s = 0; s < kNumStates; ++s)
      if (used_by(s, g)) state_total += lay_.StateBytes(s, g);
  const auto t_init = std::chrono::steady_clock::now();
  auto t_said = t_init;
  for (int g = 0; g < ngroups; ++g) {
    const auto now = std::chrono::steady_clock::now();
    if (now - t_said >= std::chrono::seconds(5)) {
      t_said = now;
      STRATA_LOG_INFO("build: initial state {} of {} written (group {} of {}, {:.0f} s)", FormatBytes(state_done),
                      FormatBytes(state_total), g, ngroups, std::chrono::duration<double>(now - t_init).count());
    }
    for (int s = 0; s < kNumStates; ++s)
      if (used_by(s, g)) state_done += lay_.StateBytes(s, g);
    const GroupLayout& L = lay_.part.group(g);
    const std::vector<float>& w0 = init_[static_cast<size_t>(g)];
    const uint64_t lo = static_cast<uint64_t>(lay_.srank) * L.shard_numel, real = L.RealInShard(lay_.srank);
    auto fill_w = [&](void* p) {  // this rank's shard of the initial values
      std::memset(p, 0, L.shard_numel * 4);
      std::memcpy(p, w0.data() + lo, std::min<uint64_t>(real, w0.size() > lo ? w0.size() - lo : 0) * 4);
      return Status::Ok();
    };
    auto fill_p = [&](void* p) {  // the whole group, or this rank's shard (stage 3)
      const uint64_t n = lay_.PHomeNumel(g);
      std::memset(p, 0, n * DTypeSize(lay_.dtype));
      const uint64_t from = lay_.p_sharded ? lo : 0, count = lay_.p_sharded ? real : L.numel;
      // Fails when the kernels cannot run (STRATA_CPU_ISA): P would stay zeros.
      const uint64_t have = std::min<uint64_t>(count, w0.size() > from ? w0.size() - from : 0);
      if (have == 0) return Status::Ok();
      return kernels::Cast(DType::kF32, w0.data() + from, lay_.dtype, p, have);
    };
    int zeroing = 0;  // the state `zero` fills
    auto zero = [&](void* p) {
      std::memset(p, 0, lay_.StateBytes(zeroing, g));
      return Status::Ok();
    };
    if (lay_.frozen(g)) {  // P alone, the values given in the compute dtype
      STRATA_RETURN_IF_ERROR(FillBlock(*this, blocks_[static_cast<size_t>(g)][int(StateKind::kP)], fill_p, staging_.frozen)
                                 .WithContext("build: P of frozen group " + std::to_string(g)));
      continue;
    }
    if (used_by(int(StateKind::kP), g))  // (P that is W's bytes has no block)
      STRATA_RETURN_IF_ERROR(FillBlock(*this, blocks_[static_cast<size_t>(g)][int(StateKind::kP)], fill_p, staging_.opt));
    if (lay_.compact) {  // W, M, V packed (and this rank's slice of P: the same bf16 bits)
      std::vector<float> w(L.shard_numel), zeros(L.shard_numel, 0.0f);
      STRATA_RETURN_IF_ERROR(fill_w(w.data()));
      STRATA_RETURN_IF_ERROR(shards_->WriteShardF32(g, w.data(), zeros.data(), used(int(StateKind::kV)) ? zeros.data() : nullptr));
    } else {
      STRATA_RETURN_IF_ERROR(FillBlock(*this, blocks_[static_cast<size_t>(g)][int(StateKind::kW)], fill_w, staging_.opt));
    }
    for (int s : {int(StateKind::kM), int(StateKind::kV), int(StateKind::kG)})
      if (used(s) && (!lay_.compact || s == int(StateKind::kG))) {
        zeroing = s;
        STRATA_RETURN_IF_ERROR(FillBlock(*this, blocks_[static_cast<size_t>(g)][static_cast<size_t>(s)], zero, staging_.opt));
      }
  }
  step_.group_steps.assign(static_cast<size_t>(ngroups), 0);
  step_.scaler.Init(config_.fp16);
  return Status::Ok();
}

}  // namespace strata
