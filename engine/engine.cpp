// Engine: creation, registration, build (layout, homes, staging, initial
// state), gradients and the step's arithmetic (norm, clipping, loss scale).
#include "engine/engine_impl.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

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

Engine::Impl::Impl(const Config& config, const EngineOptions& options) : config_(config), options_(options) {
  lay_.config = &config_;
}

Engine::Impl::~Impl() {
  reducer_.reset();
  worker_.reset();
  residency_.reset();  // its thread stops, its copies go back to the device tier
  pipeline_.reset();
  gpu_.reset();
  for (auto& blocks : blocks_)
    for (auto& b : blocks) io_->Free(b);
  // The trace, if any, is written a last time by ~StatsRecorder.
}

// Ranks: a given communicator, or one made from the launcher's variables.
Status Engine::Impl::InitRanks() {
  if (options_.comm) {
    comm_ = options_.comm;
  } else if (options_.world_size != 1) {
    STRATA_ASSIGN_OR_RETURN(net::RankInfo info, net::RankInfoFromEnv());
    if (options_.world_size > 1 && (info.world_size != options_.world_size || info.rank != options_.rank))
      return InvalidError("engine options say rank " + std::to_string(options_.rank) + " of " +
                          std::to_string(options_.world_size) + "; the environment (" + info.source + ") says rank " +
                          std::to_string(info.rank) + " of " + std::to_string(info.world_size));
    if (info.world_size > 1) {
      const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(config_.strata.timeout_s * 1000));
      STRATA_ASSIGN_OR_RETURN(store_, net::RendezvousStore::Open(info, timeout));
      net::CommOptions co;
      co.rank = info;
      co.backend = options_.force_no_gpu ? "gloo" : "auto";
      co.timeout_s = config_.strata.timeout_s;
      co.store = &store_->client();
      STRATA_ASSIGN_OR_RETURN(own_comm_, net::MakeCommunicator(co));
      comm_ = own_comm_.get();
    }
  } else if (options_.rank != 0) {
    return InvalidError("rank " + std::to_string(options_.rank) + " with world size 1");
  } else if (auto info = net::RankInfoFromEnv(); info.ok() && info->world_size > 1) {
    // Asked for by name (world_size 1), so not an error; but never silent.
    STRATA_LOG_WARN("this engine runs alone (world_size 1) although the environment ({}) says rank {} of {}; "
                    "world_size 0 joins the ranks",
                    info->source, info->rank, info->world_size);
  }
  if (comm_) {
    options_.rank = comm_->rank();
    options_.world_size = comm_->world_size();
  }
  if (options_.world_size < 1) options_.world_size = 1;
  lay_.multi = comm_ != nullptr && comm_->world_size() > 1;
  if (lay_.multi) {
    if (config_.zero.stage >= 1) {
      lay_.srank = options_.rank;
      lay_.sworld = options_.world_size;
    }
    lay_.p_sharded = config_.zero.stage == 3;
  }
  lay_.device_buffers = comm_ != nullptr && comm_->device_buffers();
  lay_.reduces = comm_ != nullptr && (lay_.multi || lay_.device_buffers);
  return Status::Ok();
}

// With several ranks each writes its own trace: "run/trace.json" becomes
// "run/trace.rank1.json" (one file, overwritten by every rank, otherwise).
std::string Engine::Impl::RankTracePath(const std::string& path) const {
  if (path.empty() || !lay_.multi) return path;
  const std::string tag = ".rank" + std::to_string(options_.rank);
  const size_t slash = path.rfind('/');
  const size_t dot = path.rfind('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash) || dot == slash + 1)
    return path + tag;
  return path.substr(0, dot) + tag + path.substr(dot);
}

Status Engine::Impl::Init() {
  // A Config built in code is held to the parser's rules (aio.queue_depth, ...)
  // before anything is created from it; machine and model facts come at Build.
  STRATA_RETURN_IF_ERROR(ValidateConfig(config_, ConfigFacts{}));
  STRATA_RETURN_IF_ERROR(CheckCpuIsaVariable());
  STRATA_RETURN_IF_ERROR(InitRanks());
  if (options_.grad_accumulation_steps < 1)
    return InvalidError("grad_accumulation_steps must be at least 1");
  const std::string& opt = config_.optimizer.type;
  if (opt != "adam" && opt != "adamw" && opt != "lion" && opt != "adagrad")
    return ConfigError("optimizer.type: '" + opt + "' is not one of Adam, AdamW, Lion, Adagrad");
  lay_.dtype = config_.compute_dtype();
  lay_.compact = config_.strata.state_format == "compact";
  lay_.gdtype = config_.grad_dtype();
  stats_ = std::make_unique<StatsRecorder>(options_.rank, RankTracePath(config_.strata.trace_path));
  UringOptions uo;
  uo.rings = config_.strata.io_rings;
  uo.queue_depth = static_cast<uint32_t>(config_.aio.queue_depth);  // in 1..kMaxQueueDepth: validated above
  uo.block_size = config_.aio.block_size;
  uo.faults = options_.faults;
  STRATA_ASSIGN_OR_RETURN(storage_, UringStorage::Create(uo));
  placement_.rank = options_.rank;
  placement_.world_size = options_.world_size;
  STRATA_RETURN_IF_ERROR(PlaceOnGpu(options_.force_no_gpu, options_.device, &placement_));
  const bool gpu = placement_.device >= 0;
  const int device = gpu ? placement_.device : 0;
  // With a GPU device tier the gradients, and fetched parameters, are
  // device pointers: several ranks reduce them with NCCL, on the device.
  // Gloo moves host buffers only; staging every gradient and every stage-3
  // gather through pinned host memory would hide a misconfigured cluster
  // behind a slow one, so it is refused, naming the way out.
  if (gpu && lay_.multi && !comm_->device_buffers())
    return UnsupportedError(std::string("several ranks with a GPU device tier need NCCL (device buffers); the ") +
                            "communicator is " + comm_->backend() + " (NCCL in this build: " +
                            (net::NcclAvailable() ? "yes" : "no") + "); pass force_no_gpu to train the ranks on the "
                            "CPU with Gloo");
  if (comm_ && comm_->device_buffers() && !gpu)
    return UnsupportedError(std::string("the communicator (") + comm_->backend() + ") moves device buffers, but " +
                            (options_.force_no_gpu ? "force_no_gpu is set" : "no GPU is usable") +
                            ": the device tier is host memory; use a Gloo communicator");
  // Threads first (the tiers' threads start bound), then the host tier's
  // memory on the GPU's node.
  PlaceOnNumaNode(config_.strata.numa_bind, &placement_);
  const ConfigFacts facts = ProbeMachineFacts();
  uint64_t device_budget = config_.strata.device_budget;
  if (device_budget == 0) device_budget = gpu ? gpu::DeviceMemoryBytes(device) / 10 * 9 : facts.host_ram_bytes / 4;
  uint64_t host_budget = config_.strata.host_budget;
  if (host_budget == 0) host_budget = facts.host_ram_bytes / 2;
  STRATA_ASSIGN_OR_RETURN(device_, DeviceTier::Create({.budget = device_budget, .device = device,
                                                       .force_host_arena = !gpu,
                                                       .pool = config_.strata.device_pool}));
  lay_.device_on_gpu = device_->on_gpu();
  host_ = std::make_unique<HostTier>(HostTierOptions{.budget = host_budget,
                                                     .pin = gpu,
                                                     .numa_node = gpu ? placement_.gpu_node : -1,
                                                     .device = device,
                                                     .numa_bind = config_.strata.numa_bind != "off",
                                                     .storage = storage_.get()});
  placement_.memory_node = host_->numa_node();
  placement_.pinned = gpu;
  return Status::Ok();
}

Result<std::unique_ptr<Engine>> Engine::Create(const Config& config, const EngineOptions& options) {
  auto impl = std::make_unique<Impl>(config, options);
  STRATA_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

// Keeps a registered tensor's initial values until Build. A group's values
// past the end of its vector are zeros, so tensors registered without
// `init` take no memory (a model larger than RAM registers).
static uint64_t KeepInit(Engine::Impl& m, int group, uint64_t off, uint64_t numel, const float* init) {
  if (static_cast<size_t>(group) >= m.init_.size()) m.init_.resize(static_cast<size_t>(group) + 1);
  auto& v = m.init_[static_cast<size_t>(group)];
  if (!init) return off;
  v.resize(off + numel, 0.0f);
  std::memcpy(v.data() + off, init, numel * sizeof(float));
  return off;
}

Result<uint64_t> Engine::AddParam(int group, const std::string& name, uint64_t numel, const float* init) {
  STRATA_ASSIGN_OR_RETURN(uint64_t off, impl_->lay_.part.Add(group, name, numel));
  return KeepInit(*impl_, group, off, numel, init);
}

Status Engine::AddAlias(int group, const std::string& alias, const std::string& of) {
  return impl_->lay_.part.AddAlias(group, alias, of);
}

Result<uint64_t> Engine::AddShapedParam(int group, const std::string& name,
                                        const std::vector<uint64_t>& shape, const float* init) {
  STRATA_ASSIGN_OR_RETURN(uint64_t off, impl_->lay_.part.AddShaped(group, name, shape));
  return KeepInit(*impl_, group, off, impl_->lay_.part.group(group).tensors.back().numel, init);
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
  const StagingSizes z = PlanStaging(m.lay_, [&](uint64_t bytes) { return m.io_->NvmePadded(bytes); });
  std::copy(std::begin(z.opt_offsets), std::end(z.opt_offsets), std::begin(m.lay_.opt_slot_offsets));
  Status st = m.opt_staging_.Init(m.host_.get(), z.opt_slots, z.opt_offsets[kNumStates]);
  if (st.ok()) st = m.param_staging_.Init(m.host_.get(), z.param_slots, z.param_bytes);
  if (st.ok()) st = m.grad_staging_.Init(m.host_.get(), z.grad_slots, z.grad_bytes);
  if (st.ok()) st = m.frozen_staging_.Init(m.host_.get(), z.frozen_slots, z.frozen_bytes);
  return st.WithContext("build: staging (strata.host_budget " + FormatBytes(m.host_->budget()) + ")");
}

// A failed build leaves nothing behind (swap files and their locks, blocks,
// staging), so that build may be called again.
Status Engine::Impl::Build() {
  if (built_) return StateError("build: already built");
  Status st = BuildOnce();
  if (!st.ok()) UndoBuild();
  return st;
}

void Engine::Impl::UndoBuild() {
  reducer_.reset();
  worker_.reset();
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
  param_staging_.Clear();
  opt_staging_.Clear();
  grad_staging_.Clear();
  frozen_staging_.Clear();
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
  ConfigFacts facts = ProbeMachineFacts();
  facts.largest_group_numel = lay_.part.largest_group_numel();
  facts.world_size = static_cast<uint32_t>(lay_.sworld);
  facts.has_gpu = device_->on_gpu();
  STRATA_RETURN_IF_ERROR(ValidateConfig(config_, facts));
  // Several ranks start from rank 0's initial values, as torch DDP does: a
  // rank whose model was initialized from another seed still trains the
  // same model. (A rank that registered other groups fails here, naming it.)
  if (lay_.multi)
    for (int g = 0; g < lay_.part.num_groups(); ++g) {
      std::vector<float>& w0 = init_[static_cast<size_t>(g)];
      w0.resize(lay_.part.group(g).numel, 0.0f);  // zeros registered without values, on every rank alike
      comm_->SetLabel("init g" + std::to_string(g));
      STRATA_RETURN_IF_ERROR(comm_->Broadcast(w0.data(), w0.size() * sizeof(float), 0)
                                 .WithContext("build: rank 0's initial values of group " + std::to_string(g)));
    }
  if (lay_.multi) STRATA_RETURN_IF_ERROR(AgreeOnFrozen());

  lay_.home[int(StateKind::kP)] = HomeOf(config_.zero.offload_param.device);
  const TierKind opt_home = HomeOf(config_.zero.offload_optimizer.device);
  lay_.home[int(StateKind::kW)] = lay_.home[int(StateKind::kM)] = lay_.home[int(StateKind::kV)] = opt_home;
  lay_.home[int(StateKind::kG)] = opt_home == TierKind::kNvme ? TierKind::kNvme : TierKind::kHost;
  STRATA_RETURN_IF_ERROR(CheckHostPlan(lay_, host_->budget()));  // before anything is allocated
  const int ngroups = lay_.part.num_groups();
  auto used = [&](int s) { return lay_.StateUsed(s); };
  auto used_by = [&](int s, int g) { return lay_.StateUsedBy(s, g); };

  // The NVMe tier holds exactly the blocks homed there.
  std::vector<std::string> dirs = config_.OptimizerSwapPaths();
  for (const auto& d : config_.ParamSwapPaths())
    if (std::find(dirs.begin(), dirs.end(), d) == dirs.end()) dirs.push_back(d);
  uint64_t nvme_bytes = 0, largest_stored = 0, largest_frozen = 0;
  for (int s = 0; s < kNumStates; ++s) {
    if (!used(s) || lay_.home[s] != TierKind::kNvme) continue;
    uint64_t largest = 0;
    for (int g = 0; g < ngroups; ++g) {
      if (!used_by(s, g)) continue;  // a frozen group keeps P alone
      // Each block takes its padded size, no more: small groups pack densely.
      const uint64_t padded = NvmeTier::PaddedSizeFor(lay_.StateBytes(s, g), dirs.size());
      nvme_bytes += padded;
      if (lay_.frozen(g)) largest_frozen = std::max(largest_frozen, padded);
      else largest = std::max(largest, padded);
    }
    largest_stored += largest;
  }
  // Writes are copy on write: each block written at once needs a second
  // extent until it is settled — a slot's blocks per step job, plus a G
  // store from grads and a P store from a recompute beside them. A frozen
  // group's P is written only between steps (write_state, a load), alone.
  const uint64_t cow_spare = static_cast<uint64_t>(StepSlots(config_) + 2) * largest_stored + largest_frozen;
  if (nvme_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(nvme_, NvmeTier::Create({.dirs = dirs, .budget = nvme_bytes + kMiB, .spare = cow_spare,
                                                     .rank = options_.rank, .checksums = config_.strata.checksums,
                                                     .storage = storage_.get()}));
  }
  io_ = std::make_unique<BlockIo>(device_.get(), host_.get(), nvme_.get(), stats_.get());
  shards_ = std::make_unique<ShardStore>(lay_, blocks_, *io_, opt_staging_, frozen_staging_);

  // Home blocks first: they are the model; staging comes out of what is left.
  steps_.assign(static_cast<size_t>(ngroups), GroupStep{});
  blocks_.assign(static_cast<size_t>(ngroups), {});
  for (int g = 0; g < ngroups; ++g)
    for (int s = 0; s < kNumStates; ++s) {
      if (!used_by(s, g)) continue;
      auto b = io_->Allocate(lay_.home[s], lay_.StateBytes(s, g));
      if (!b.ok())
        return b.status().WithContext(std::string("build: state ") + StateName(StateKind(s)) + " of group " +
                                      std::to_string(g) + " in its home tier");
      blocks_[static_cast<size_t>(g)][static_cast<size_t>(s)] = *b;
    }
  STRATA_RETURN_IF_ERROR(InitStaging(*this));
  gpu_ = std::make_unique<GpuUpdater>(lay_, blocks_, *device_, *stats_, *shards_, options_.gpu_optimizer_twin);
  gpu_->SetUp();  // its scratch from the device budget the home blocks left
  pipeline_ = std::make_unique<StepPipeline>(lay_, blocks_, *io_, opt_staging_, *stats_, *gpu_, *shards_, steps_);

  // Initial state: W from the values given, M = V = G = 0, P = W in the compute dtype.
  for (int g = 0; g < ngroups; ++g) {
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
      STRATA_RETURN_IF_ERROR(FillBlock(*this, blocks_[static_cast<size_t>(g)][int(StateKind::kP)], fill_p, frozen_staging_)
                                 .WithContext("build: P of frozen group " + std::to_string(g)));
      continue;
    }
    STRATA_RETURN_IF_ERROR(FillBlock(*this, blocks_[static_cast<size_t>(g)][int(StateKind::kP)], fill_p, opt_staging_));
    if (lay_.compact) {  // W, M, V packed (and this rank's slice of P: the same bf16 bits)
      std::vector<float> w(L.shard_numel), zeros(L.shard_numel, 0.0f);
      STRATA_RETURN_IF_ERROR(fill_w(w.data()));
      STRATA_RETURN_IF_ERROR(shards_->WriteShardF32(g, w.data(), zeros.data(), used(int(StateKind::kV)) ? zeros.data() : nullptr));
    } else {
      STRATA_RETURN_IF_ERROR(FillBlock(*this, blocks_[static_cast<size_t>(g)][int(StateKind::kW)], fill_w, opt_staging_));
    }
    for (int s : {int(StateKind::kM), int(StateKind::kV), int(StateKind::kG)})
      if (used(s) && (!lay_.compact || s == int(StateKind::kG))) {
        zeroing = s;
        STRATA_RETURN_IF_ERROR(FillBlock(*this, blocks_[static_cast<size_t>(g)][static_cast<size_t>(s)], zero, opt_staging_));
      }
  }
  init_.clear();
  init_.shrink_to_fit();
  group_steps_.assign(static_cast<size_t>(ngroups), 0);
  scaler_.Init(config_.fp16);
  STRATA_RETURN_IF_ERROR(StartComponents());
  if (options_.overlap_step) {
    overlap_ = config_.gradient_clipping == 0 && !config_.fp16.enabled && !lay_.multi && !lay_.reduces;
    if (overlap_) {
      // Its own update count with skip_groups_without_grads (bias correction), else the engine's.
      worker_ = std::make_unique<UpdateWorker>(
          [this](int g) { return pipeline_->Run({g}, 1.0 / GradMeanDivisor(), prepared_opts_, StepsOf(g) + 1, &broken_); },
          [this] { UseDeviceOnThisThread(); });
      worker_->Start();
    }
    else WarnOnce("overlap-off", "overlap_step needs gradient_clipping 0, no fp16 and one rank without a communicator (the update depends "
                                 "on every gradient; collectives keep one order); stepping after backward instead");
  }
  built_ = true;
  STRATA_LOG_DEBUG("built {} groups ({} frozen), {} parameters; P on {}, W/M/V on {}, G on {}", ngroups,
                   std::count(lay_.frozen_groups.begin(), lay_.frozen_groups.end(), 1), lay_.part.total_numel(), TierName(lay_.home[0]),
                   TierName(opt_home), TierName(lay_.home[int(StateKind::kG)]));
  return Status::Ok();
}

static Status CheckGroup(const Engine::Impl& m, int group, const char* call) {
  if (!m.built_) return StateError(std::string(call) + ": the engine is not built");
  if (group < 0 || group >= m.lay_.part.num_groups())
    return InvalidError(std::string(call) + ": group " + std::to_string(group) + " is not in 0.." +
                        std::to_string(m.lay_.part.num_groups() - 1));
  return Status::Ok();
}

Status Engine::Impl::Grads(int group, const void* grads, DType dtype) {
  STRATA_RETURN_IF_ERROR(CheckGroup(*this, group, "grads"));
  if (!grads) return InvalidError("grads: null gradient pointer for group " + std::to_string(group));
  if (lay_.frozen(group))
    return InvalidError("grads: group " + std::to_string(group) +
                        " is frozen (freeze_group): it keeps its parameters alone and takes no gradients");
  GroupStep& gs = steps_[static_cast<size_t>(group)];
  // The overlapped step updated this group once its gradients were complete:
  // one more would land in a G the update already read (or is reading).
  if (overlap_ && gs.updated)
    return StateError("grads: group " + std::to_string(group) + " already had its " +
                      std::to_string(options_.grad_accumulation_steps) +
                      " grads call(s) of this step and was updated (overlap_step); call step first");
  if (lay_.reduces) {
    STRATA_RETURN_IF_ERROR(DrainComm(/*wait=*/false));  // an earlier background failure: now
    return reducer_->Grads(group, grads, dtype);
  }
  const GroupLayout& L = lay_.part.group(group);
  const uint64_t lo = static_cast<uint64_t>(lay_.srank) * L.shard_numel;  // one shard here: lay_.srank is 0
  const uint64_t real = L.RealInShard(lay_.srank);
  const char* src = static_cast<const char*>(grads) + lo * DTypeSize(dtype);
  void* src_buf = nullptr;
  if (device_->on_gpu()) {  // bring the gradients to the host first
    src_buf = grad_staging_.Acquire();
    auto t = device_->CopyOut(src_buf, src, real * DTypeSize(dtype));
    Status st = t.ok() ? (*t)->Wait() : t.status();
    if (!st.ok()) { grad_staging_.Release(src_buf); return st.WithContext("grads: group " + std::to_string(group)); }
    stats_->AddMoved(TierKind::kDevice, TierKind::kHost, real * DTypeSize(dtype));
    src = static_cast<const char*>(src_buf);
  }
  Status st = AccumulateG(group, src, dtype, real);
  if (src_buf) grad_staging_.Release(src_buf);
  if (!st.ok()) return st.WithContext("grads: group " + std::to_string(group));
  // An update before the step needs no norm: none with clipping asked for.
  if (overlap_ && prepared_ && prepared_opts_.max_grad_norm <= 0 &&
      gs.grad_calls == options_.grad_accumulation_steps && OverlapMayUpdate(config_, gs)) {
    gs.updated = true;
    worker_->Enqueue(group);
  }
  return Status::Ok();
}

// Adds `count` elements of `src` (host memory, `dtype`) to this rank's shard
// of the group's G — the step's first call overwrites, the padding stays
// zero — and records the shard's sum of squares for the global norm.
Status Engine::Impl::AccumulateG(int group, const void* src, DType dtype, uint64_t count) {
  GroupStep& gs = steps_[static_cast<size_t>(group)];
  const uint64_t n = lay_.part.group(group).shard_numel, gsize = DTypeSize(lay_.gdtype);
  const StateBlock& gb = blocks_[static_cast<size_t>(group)][int(StateKind::kG)];
  const bool direct = io_->Direct(gb);
  void* G = direct ? io_->DirectPtr(gb) : grad_staging_.Acquire();
  Status st;
  if (gs.grad_calls > 0 && !direct) st = io_->Load(gb, G);
  if (gs.grad_calls == 0 && dtype == lay_.gdtype) {  // stored as handed in
    std::memcpy(G, src, count * gsize);
  } else if (gs.grad_calls == 0 && lay_.gdtype == DType::kF32) {
    st = kernels::Cast(dtype, src, DType::kF32, G, count);
  } else if (st.ok()) {  // a tile at a time: widen, add in fp32, store in G's dtype (nearest even)
    constexpr uint64_t kTile = 4096;
    float wide[kTile], sum[kTile];
    for (uint64_t at = 0; st.ok() && at < count; at += kTile) {
      const uint64_t k = std::min(kTile, count - at);
      const float* x = wide;
      if (dtype == DType::kF32) x = static_cast<const float*>(src) + at;
      else st = kernels::Cast(dtype, static_cast<const char*>(src) + at * DTypeSize(dtype), DType::kF32, wide, k);
      char* g = static_cast<char*>(G) + at * gsize;
      if (!st.ok()) break;
      if (lay_.gdtype == DType::kF32) {
        float* gf = reinterpret_cast<float*>(g);
        if (gs.grad_calls == 0) std::memcpy(gf, x, k * 4);
        else for (uint64_t i = 0; i < k; ++i) gf[i] += x[i];
        continue;
      }
      if (gs.grad_calls == 0) {
        st = kernels::Cast(DType::kF32, x, lay_.gdtype, g, k);
        continue;
      }
      st = kernels::Cast(lay_.gdtype, g, DType::kF32, sum, k);
      for (uint64_t i = 0; st.ok() && i < k; ++i) sum[i] += x[i];
      if (st.ok()) st = kernels::Cast(DType::kF32, sum, lay_.gdtype, g, k);
    }
  }
  if (st.ok() && gs.grad_calls == 0) std::memset(static_cast<char*>(G) + count * gsize, 0, (n - count) * gsize);
  kernels::SquaresSum sq;
  if (st.ok()) st = kernels::SumSquares(lay_.gdtype, G, n, &sq);
  if (st.ok() && !direct) st = io_->Store(gb, G);
  if (!direct) grad_staging_.Release(G);
  if (!st.ok()) return st;
  gs.sum_squares = sq.sum_squares;
  gs.finite = sq.all_finite;
  ++gs.grad_calls;
  return Status::Ok();
}

Status Engine::Impl::PrepareStep(const StepOptions& so) {
  STRATA_RETURN_IF_ERROR(CheckStepOptions(so, "prepare_step"));
  if (!built_) return StateError("prepare_step: the engine is not built");
  for (const auto& gs : steps_)
    if (gs.grad_calls > 0) return StateError("prepare_step: gradients of this step have already arrived");
  prepared_ = true;
  prepared_opts_ = so;
  return Status::Ok();
}

static bool SameOptions(const StepOptions& a, const StepOptions& b) {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
         a.weight_decay == b.weight_decay && a.max_grad_norm == b.max_grad_norm;
}

Status Engine::Impl::CheckUsable(const char* call, bool pending_ok) const {
  if (!broken_.empty())
    return StateError(std::string(call) + ": the engine is broken: " + broken_ +
                      "; load the last checkpoint to go on");
  if (pending_ && !pending_ok)
    return StateError(std::string(call) + ": a failed step is pending; call step again with the same options to "
                      "finish it, or load a checkpoint");
  return Status::Ok();
}

void Engine::Impl::AbandonStep() {
  pending_.reset();
  broken_.clear();
  prepared_ = false;
  for (auto& gs : steps_) {
    gs.grad_calls = 0;
    gs.updated = gs.committed = gs.p_stale = false;
  }
}

Status Engine::Impl::RepairStaleP() {
  Status st;
  void* buf = nullptr;
  for (int g = 0; st.ok() && g < lay_.part.num_groups(); ++g) {
    GroupStep& gs = steps_[static_cast<size_t>(g)];
    if (!gs.p_stale) continue;
    if (!buf) buf = opt_staging_.Acquire();
    st = RecomputePGroup(g, buf, buf ? opt_staging_.bytes() : 0);
    if (st.ok()) gs.p_stale = false;
  }
  opt_staging_.Release(buf);
  return st.WithContext("step: rewriting P from the committed master weights");
}

Status Engine::Impl::GlobalSquares(double* sum_out, bool* finite_out) {
  double sum = 0;
  bool finite = true;
  for (const auto& gs : steps_) {
    if (gs.grad_calls == 0) continue;
    sum += gs.sum_squares;
    finite = finite && gs.finite;
  }
  if (lay_.multi && lay_.sworld > 1) {  // each rank holds a shard of G
    std::vector<double> sums(static_cast<size_t>(lay_.sworld));
    sums[static_cast<size_t>(lay_.srank)] = sum;  // the label: the caller's
    STRATA_RETURN_IF_ERROR(comm_->AllGather(&sums[static_cast<size_t>(lay_.srank)], sums.data(), sizeof(double))
                               .WithContext("gradient norm"));
    sum = 0;
    for (double x : sums) sum += x;
    finite = std::isfinite(sum);
  }
  *sum_out = sum;
  *finite_out = finite;
  return Status::Ok();
}

Result<double> Engine::Impl::GradNorm() {
  if (!built_) return StateError("grad_norm: the engine is not built");
  STRATA_RETURN_IF_ERROR(CheckUsable("grad_norm"));
  double sum = 0;
  bool finite = true;
  if (lay_.multi) comm_->SetLabel("grad_norm s" + std::to_string(step_count_ + 1));
  STRATA_RETURN_IF_ERROR(GlobalSquares(&sum, &finite).WithContext("grad_norm"));
  if (!finite) return INFINITY;
  return std::sqrt(sum) / scaler_.scale() / GradMeanDivisor();
}

// The global norm of this step's gradients (the ranks' shards summed in
// rank order) and the factor the update applies to them: clipping over the
// loss scale. r->skipped when the step is held back (fp16 overflow,
// strata.nonfinite), with *held saying why when that is an error. A resumed
// step gets the same figures again: G and the loss scale are as they were.
Status Engine::Impl::ScaleGradients(const StepOptions& so, StepResult* r, double* grad_scale, Status* held) {
  double sum = 0;
  bool finite = true;
  // The label: Step's, naming the step and its options.
  STRATA_RETURN_IF_ERROR(GlobalSquares(&sum, &finite).WithContext("step"));
  // strata.grad_reduce "mean": G holds the sum over the ranks and the
  // step's grads calls; the step, its norm and its clipping see the mean.
  const double mean = GradMeanDivisor();
  const double scale = scaler_.scale();
  r->grad_norm = std::sqrt(sum) / scale / mean;
  std::function<Status()> wait_overlap;
  if (worker_) wait_overlap = [this] { return worker_->WaitIdle(); };
  if (HoldBackNonfinite(config_, steps_, finite, wait_overlap, held)) {
    r->skipped = true;
    r->grad_norm = INFINITY;
    return Status::Ok();
  }
  // torch's clip_grad_norm_ (and DeepSpeed's): scaled by max/(norm + 1e-6)
  // whenever that is below 1.
  const double clip = so.max_grad_norm >= 0 ? so.max_grad_norm : config_.gradient_clipping;
  const double c = clip / (r->grad_norm + 1e-6);
  const double coef = (clip > 0 && c < 1.0) ? c : 1.0;
  *grad_scale = coef / (scale * mean);
  return Status::Ok();
}

// Updates every group not yet committed in this step, rewrites P where only
// its store failed, and (stages 1-2, several ranks) gathers P — after every
// rank has learnt that every rank's update is done. Frozen groups never
// change; with skip_groups_without_grads neither do groups without
// gradients, and the others are updated in cohorts of one update count
// (their bias correction).
Status Engine::Impl::ApplyStep(const StepOptions& so, double grad_scale) {
  Status st = worker_ ? worker_->WaitIdle() : Status::Ok();
  std::map<int64_t, std::vector<int>> cohorts;  // by update count: one pipeline each
  for (int g = 0; g < lay_.part.num_groups(); ++g) {
    const GroupStep& gs = steps_[static_cast<size_t>(g)];
    if (lay_.frozen(g) || gs.committed || (skips_gradless() && gs.grad_calls == 0)) continue;
    cohorts[StepsOf(g)].push_back(g);
  }
  for (const auto& [steps, groups] : cohorts)
    if (st.ok()) st = pipeline_->Run(groups, grad_scale, so, steps + 1, &broken_);
  if (st.ok()) st = RepairStaleP();
  if (!broken_.empty())
    st = StateError("step: cannot be finished: " + broken_ + "; load the last checkpoint to go on (" +
                    st.message() + ")");
  st = Agree(st, "step");  // none gathers alone
  for (int g = 0; st.ok() && lay_.p_gathered_after_step() && g < lay_.part.num_groups(); ++g)
    if (!lay_.frozen(g)) st = reducer_->Gather(g, io_->DirectPtr(blocks_[static_cast<size_t>(g)][int(StateKind::kP)]));
  return st;
}

Result<StepResult> Engine::Impl::Step(const StepOptions& so) {
  STRATA_RETURN_IF_ERROR(CheckStepOptions(so, "step"));
  if (!built_) return StateError("step: the engine is not built");
  STRATA_RETURN_IF_ERROR(CheckUsable("step"));
  residency_->DropAheadPins();
  for (int g = 0; g < lay_.part.num_groups(); ++g)
    if (residency_->pins(g) > 0)
      return StateError("step: group " + std::to_string(g) + " is fetched and not released");
  if (pending_ && !SameOptions(*pending_, so))
    return InvalidError("step: a failed step is pending; finish it with the options it was called with (or load a "
                        "checkpoint); nothing was changed");
  residency_->WaitIdle();
  if (!pending_ && overlap_ && prepared_ && !SameOptions(prepared_opts_, so))
    return InvalidError("step: options differ from those given to prepare_step, which the overlapped "
                        "updates already used");
  if (lay_.multi) {
    // Ranks agree on the step and its options before anything changes: the
    // label rides on the step's first collective, the norm's all-gather
    // (stages 1-3), or on a barrier where there is none (stage 0).
    char hash[24];
    std::snprintf(hash, sizeof hash, "%08llx",
                  static_cast<unsigned long long>(XXH3_64bits(&so, sizeof so) & 0xffffffffu));
    comm_->SetLabel("step " + std::to_string(step_count_ + 1) + " opts " + hash);
    if (lay_.sworld == 1) STRATA_RETURN_IF_ERROR(comm_->Barrier().WithContext("step: agreeing with the other ranks"));
  }
  stats_->StepBegin();
  StepResult r;
  double grad_scale = 1;
  Status held;
  if (Status st = ScaleGradients(so, &r, &grad_scale, &held); !st.ok()) {
    stats_->StepEnd(false);
    return st;
  }
  Status st = held;
  if (r.skipped) {
    scaler_.Update(true);
  } else {
    st = ApplyStep(so, grad_scale);
    if (st.ok()) {
      ++step_count_;
      for (int g = 0; skips_gradless() && g < lay_.part.num_groups(); ++g)  // the groups this step updated
        if (!lay_.frozen(g) && steps_[static_cast<size_t>(g)].grad_calls > 0) ++group_steps_[static_cast<size_t>(g)];
      scaler_.Update(false);
    }
  }
  r.loss_scale = scaler_.scale();
  prepared_ = false;
  if (st.ok() || r.skipped) {
    AbandonStep();  // the step is done (or held back): nothing pending, every group fresh for the next
  } else if (broken_.empty()) {
    pending_ = so;
    for (auto& gs : steps_) gs.updated = false;
  }
  DropDeviceCopies(/*keep_frozen=*/true);  // P changed (for the committed groups, at least); frozen P never does
  const std::vector<int> ahead = residency_->OnStep();
  stats_->StepEnd(r.skipped);
  if (!st.ok()) {
    if (!broken_.empty() || r.skipped) return st;
    return st.WithContext("step " + std::to_string(step_count_ + 1) + " is not finished (" +
                          std::to_string(CountCommitted()) + " of " + std::to_string(lay_.part.num_groups()) +
                          " groups updated); call step again with the same options to finish it");
  }
  residency_->Prefetch(ahead);
  return r;
}

int Engine::Impl::CountCommitted() const {
  int n = 0;
  for (const auto& gs : steps_) n += gs.committed;
  return n;
}

// The refusal of an optimizer state that a frozen group does not keep.
static Status FrozenKeepsNo(const char* call, int group, StateKind kind) {
  return InvalidError(std::string(call) + ": group " + std::to_string(group) + " is frozen (freeze_group): it keeps " +
                      "its parameters alone (read as the master weights), no optimizer state " +
                      (kind == StateKind::kM ? "exp_avg" : kind == StateKind::kV ? "exp_avg_sq" : StateName(kind)));
}

Status Engine::Impl::ReadState(int group, StateKind kind, float* out) {
  STRATA_RETURN_IF_ERROR(CheckGroup(*this, group, "read_state"));
  if (!out) return InvalidError("read_state: null output for group " + std::to_string(group));
  if (lay_.frozen(group)) {
    if (kind != StateKind::kW) return FrozenKeepsNo("read_state", group, kind);
    return ReadFrozen(group, out).WithContext("read_state: frozen group " + std::to_string(group));
  }
  const StateBlock& w = blocks_[static_cast<size_t>(group)][static_cast<size_t>(kind)];
  if (!w.alloc.charged)
    return InvalidError(std::string("read_state: the ") + config_.optimizer.type + " optimizer keeps no state " +
                        StateName(kind));
  const GroupLayout& L = lay_.part.group(group);
  const uint64_t n = L.numel;
  // This rank's shard, into `all` at its place (or straight out, with one shard).
  std::vector<float> all;
  float* mine = out;
  if (lay_.sworld > 1) {
    all.resize(L.padded);
    mine = all.data() + static_cast<uint64_t>(lay_.srank) * L.shard_numel;
  }
  const uint64_t take = lay_.sworld > 1 ? L.shard_numel : n;
  Status st;
  if (lay_.compact) {  // the three unpacked together (M's codes depend on V's)
    std::vector<float> f(3 * L.shard_numel);
    float* wmv[3] = {f.data(), f.data() + L.shard_numel, f.data() + 2 * L.shard_numel};
    const bool has_v = blocks_[static_cast<size_t>(group)][int(StateKind::kV)].alloc.charged != 0;
    st = shards_->ReadShardF32(group, wmv[0], wmv[1], has_v ? wmv[2] : nullptr);
    if (st.ok()) std::memcpy(mine, wmv[static_cast<int>(kind) - 1], take * 4);
  } else if (io_->Direct(w)) {
    std::memcpy(mine, io_->DirectPtr(w), take * 4);
  } else {
    void* buf = opt_staging_.Acquire();
    st = io_->Load(w, buf);
    if (st.ok()) std::memcpy(mine, buf, take * 4);
    opt_staging_.Release(buf);
  }
  if (st.ok() && lay_.sworld > 1) {
    comm_->SetLabel(std::string("read ") + StateName(kind) + " of g" + std::to_string(group));
    st = comm_->AllGather(mine, all.data(), L.shard_numel * 4);
    if (st.ok()) std::memcpy(out, all.data(), n * 4);
  }
  return st.WithContext("read_state: group " + std::to_string(group));
}

Status Engine::Impl::WriteState(int group, StateKind kind, const float* in) {
  STRATA_RETURN_IF_ERROR(CheckGroup(*this, group, "write_state"));
  if (!in) return InvalidError("write_state: null input for group " + std::to_string(group));
  if (lay_.frozen(group) && kind != StateKind::kW) return FrozenKeepsNo("write_state", group, kind);
  STRATA_RETURN_IF_ERROR(CheckBetweenSteps("write_state"));
  if (lay_.frozen(group)) return WriteFrozen(group, in).WithContext("write_state: frozen group " + std::to_string(group));
  const StateBlock& b = blocks_[static_cast<size_t>(group)][static_cast<size_t>(kind)];
  if (!b.alloc.charged)
    return InvalidError(std::string("write_state: the ") + config_.optimizer.type + " optimizer keeps no state " +
                        StateName(kind));
  const GroupLayout& L = lay_.part.group(group);
  const uint64_t lo = static_cast<uint64_t>(lay_.srank) * L.shard_numel, real = L.RealInShard(lay_.srank);
  if (lay_.compact) {  // unpack all three, replace one, pack all three (M's codes depend on V's)
    std::vector<float> f(3 * L.shard_numel);
    float* wmv[3] = {f.data(), f.data() + L.shard_numel, f.data() + 2 * L.shard_numel};
    const bool has_v = blocks_[static_cast<size_t>(group)][int(StateKind::kV)].alloc.charged != 0;
    float* v = has_v ? wmv[2] : nullptr;
    Status st = shards_->ReadShardF32(group, wmv[0], wmv[1], v);
    if (st.ok()) {
      float* dst = wmv[static_cast<int>(kind) - 1];
      std::memset(dst, 0, L.shard_numel * 4);
      std::memcpy(dst, in + lo, real * 4);
      st = shards_->WriteShardF32(group, wmv[0], wmv[1], v);
    }
    if (st.ok() && kind == StateKind::kW && lay_.p_gathered_after_step()) st = RecomputePGroup(group, nullptr, 0);
    DropDeviceCopies();
    return st.WithContext("write_state: group " + std::to_string(group));
  }
  void* slot = opt_staging_.Acquire();
  float* dst = io_->Direct(b) ? static_cast<float*>(io_->DirectPtr(b)) : static_cast<float*>(slot);
  Status st = dst ? Status::Ok() : InternalError("write_state: no staging slot for a staged block");
  if (st.ok()) {
    std::memset(dst, 0, L.shard_numel * 4);
    std::memcpy(dst, in + lo, real * 4);
    if (!io_->Direct(b)) st = io_->Store(b, dst);
  }
  if (st.ok() && kind == StateKind::kW) st = RecomputePGroup(group, slot, slot ? opt_staging_.bytes() : 0);
  opt_staging_.Release(slot);
  DropDeviceCopies();
  return st.WithContext("write_state: group " + std::to_string(group));
}

EngineStats Engine::Impl::Stats() const {
  EngineStats s = stats_->Snapshot();
  s.device = {device_->budget(), device_->used(), device_->peak()};
  const DevicePoolStats pool = device_->pool_stats();
  s.device_cached = pool.cached;
  s.device_raw_allocs = pool.raw_allocs;
  s.device_pool_hits = pool.hits;
  if (reducer_) {
    s.gathers_ahead = reducer_->gathers_ahead();
    s.gathers_ahead_declined = reducer_->gathers_ahead_declined();
  }
  s.host = {host_->budget(), host_->used(), host_->peak()};
  if (nvme_) s.nvme = {nvme_->budget(), nvme_->used(), nvme_->peak()};
  return s;
}

// The public face: thin forwards.
Status Engine::Build() { return impl_->Build(); }
Result<void*> Engine::Fetch(int group) {
  STRATA_RETURN_IF_ERROR(CheckGroup(*impl_, group, "fetch"));
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("fetch"));
  CallSpanScope span(*impl_->stats_, "fetch", group);
  return impl_->Fetch(group);
}
Status Engine::Release(int group) {
  STRATA_RETURN_IF_ERROR(CheckGroup(*impl_, group, "release"));
  return impl_->Release(group);
}
Status Engine::Grads(int group, const void* grads, DType dtype) {
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("grads", false));
  CallSpanScope span(*impl_->stats_, "grads", group);
  return impl_->Grads(group, grads, dtype);
}
// Calls that read G, the step's flags or run collectives of their own first
// wait for the background reductions (overlap_comm): one collective at a
// time, in the same order on every rank.
Result<StepResult> Engine::Step(const StepOptions& options) {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("step"));
  return impl_->Step(options);
}
Result<double> Engine::GradNorm() {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("grad_norm"));
  return impl_->GradNorm();
}
Status Engine::PrepareStep(const StepOptions& options) {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("prepare_step"));
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("prepare_step", false));
  return impl_->PrepareStep(options);
}
// Save, load and write_state check the engine's state in CheckBetweenSteps.
Status Engine::SaveCheckpoint(const std::string& dir, const std::string& tag, const void* blob, uint64_t blob_bytes) {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("save"));
  return impl_->SaveCheckpoint(dir, tag, blob, blob_bytes);
}
Status Engine::LoadCheckpoint(const std::string& dir, const std::string& tag, std::vector<uint8_t>* blob) {
  impl_->DrainComm().IgnoreError();  // a lost background reduction is what a load recovers from
  return impl_->LoadCheckpoint(dir, tag, blob);
}
Status Engine::ReadMaster(int group, float* out) {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("read_master"));
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("read_master", false));
  return impl_->ReadMaster(group, out);
}
Status Engine::ReadState(int group, OptimizerState which, float* out) {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("read_state"));
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("read_state", false));
  return impl_->ReadState(group, static_cast<StateKind>(static_cast<int>(which) + 1), out);
}
Status Engine::WriteState(int group, OptimizerState which, const float* in) {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("write_state"));
  return impl_->WriteState(group, static_cast<StateKind>(static_cast<int>(which) + 1), in);
}
Status Engine::SetStepsApplied(int64_t steps) {
  if (steps < 0) return InvalidError("set_steps: " + std::to_string(steps) + " is negative");
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("set_steps"));
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("set_steps", false));
  impl_->step_count_ = steps;
  for (int g = 0; g < static_cast<int>(impl_->group_steps_.size()); ++g)
    if (!impl_->lay_.frozen(g)) impl_->group_steps_[static_cast<size_t>(g)] = steps;
  return Status::Ok();
}
Result<int64_t> Engine::GroupSteps(int group) const {
  STRATA_RETURN_IF_ERROR(CheckGroup(*impl_, group, "group_steps"));
  if (impl_->lay_.frozen(group)) return int64_t{0};  // never updated
  return impl_->StepsOf(group);
}
Status Engine::SetGroupSteps(int group, int64_t steps) {
  const std::string what = "set_group_steps: group " + std::to_string(group);
  STRATA_RETURN_IF_ERROR(CheckGroup(*impl_, group, "set_group_steps"));
  if (steps < 0) return InvalidError(what + ": " + std::to_string(steps) + " is negative");
  if (impl_->lay_.frozen(group)) return InvalidError(what + " is frozen (freeze_group): it is never updated");
  if (!impl_->skips_gradless())
    return InvalidError(what + ": every group counts the engine's steps (set_steps) unless the engine skips groups "
                        "without gradients (skip_groups_without_grads)");
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("set_group_steps"));
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("set_group_steps", false));
  for (const auto& gs : impl_->steps_)
    if (gs.grad_calls > 0) return StateError(what + ": gradients of this step are pending; set it between steps");
  impl_->group_steps_[static_cast<size_t>(group)] = steps;
  return Status::Ok();
}
EngineStats Engine::stats() const { return impl_->Stats(); }
Placement Engine::placement() const {
  Placement p = impl_->placement_;
  p.memory_node = impl_->host_->numa_node();
  return p;
}
Result<uint64_t> Engine::BeginSpan(const char* name) { return impl_->stats_->BeginUserSpan(name); }
Status Engine::EndSpan(uint64_t token) { return impl_->stats_->EndUserSpan(token); }
Status Engine::WriteTrace() {
  if (!impl_->stats_->tracing())
    return ConfigError("write_trace: strata.trace_path is not set: nothing is traced");
  return impl_->stats_->WriteTrace();
}
int Engine::num_groups() const { return impl_->lay_.part.num_groups(); }
double Engine::loss_scale() const { return impl_->scaler_.scale(); }
int64_t Engine::steps_applied() const { return impl_->step_count_; }
uint64_t Engine::group_numel(int group) const {
  return group >= 0 && group < impl_->lay_.part.num_groups() ? impl_->lay_.part.group(group).numel : 0;
}
DType Engine::compute_dtype() const { return impl_->lay_.dtype; }
const Config& Engine::config() const { return impl_->config_; }

}  // namespace strata
