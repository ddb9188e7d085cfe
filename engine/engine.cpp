// Engine: creation (ranks, tiers), registration, and the public face
// (Engine's calls routed to the composition). Build is build.cpp, grads
// grads.cpp, the step step.cpp, read/write_state state_access.cpp.
#include "engine/engine_impl.h"

#include <cstdlib>

#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>

#include "io/net/launch_env.h"

#include "base/align.h"
#include "base/cgroup.h"
#include "base/log.h"
#include "base/sizes.h"
#include "engine/layout/staging_plan.h"
#include "engine/step/step_checks.h"
#include "kernels/cpu/cast.h"
#include "kernels/cpu/norm.h"
#include "kernels/cpu/parallel.h"
#include "tiers/gpu.h"
#include "tiers/numa.h"

namespace strata {

// STRATA_STRICT_DEVICE=1: the strict host arena (DeviceTierOptions::strict).
// Any other value but unset, empty or 0 is refused by name at Init.
static Result<bool> StrictDeviceFromEnv() {
  const char* v = std::getenv("STRATA_STRICT_DEVICE");
  if (!v || !*v || std::string(v) == "0") return false;
  if (std::string(v) == "1") return true;
  return InvalidError(std::string("STRATA_STRICT_DEVICE='") + v + "': expected 1 (a strict host arena) or 0");
}

Engine::Impl::Impl(const Config& config, const EngineOptions& options) : config_(config), options_(options) {
  lay_.config = &config_;
}

Engine::Impl::~Impl() {
  if (pipeline_) (void)pipeline_->WaitBehind();  // the step's writes land (~StepPipeline logs a failure)
  if (pipeline_) pipeline_->DropReadAhead();  // its reads land before the slots and files go
  reducer_.reset();
  worker_.reset();
  spec_.reset();  // what it holds is undone while the blocks and their I/O still exist
  residency_.reset();  // its thread stops, its copies go back to the device tier
  acts_.reset();       // its thread stops, its arena and swap go back
  pipeline_.reset();
  gpu_.reset();
  for (auto& blocks : blocks_)
    for (auto& b : blocks) io_->Free(b);
  // The trace, if any, is written a last time by ~StatsRecorder.
}

Result<uint32_t> Engine::Impl::CountRanksOnHost(const std::string& memory_key) {
  if (!lay_.multi) return 1u;
  const int world = comm_->world_size();
  const uint64_t mine = XXH3_64bits(memory_key.data(), memory_key.size());
  std::vector<uint64_t> all(static_cast<size_t>(world));
  comm_->SetLabel("ranks on host");
  STRATA_RETURN_IF_ERROR(comm_->AllGather(&mine, all.data(), sizeof mine)
                             .WithContext("create: which ranks share this host's memory"));
  return static_cast<uint32_t>(std::count(all.begin(), all.end(), mine));
}

Status Engine::Impl::CountCpuSharers() {
  if (!lay_.multi) return Status::Ok();
  // The host (its boot id), and the process on it (pid and pid namespace:
  // containers' pid 1s differ).
  std::string boot, pidns;
  ReadFirstLine("/proc/sys/kernel/random/boot_id", &boot);
  struct stat ns {};
  if (::stat("/proc/self/ns/pid", &ns) == 0) pidns = std::to_string(ns.st_dev) + ":" + std::to_string(ns.st_ino);
  const std::string process = std::to_string(::getpid()) + "@" + pidns;
  // The CPUs: the NUMA node the process is about to be bound to, else its
  // affinity mask (ranks a launcher bound to CPUs of their own share none).
  const NumaChoice numa =
      ChooseNumaNode(config_.strata.numa_bind, placement_.device, placement_.gpu_node, NumaNodeCount());
  // The CPU limit: the cgroup that sets it (containers each with their own
  // --cpus share none), or none.
  std::string limit_dir;
  std::string limit_key = "none";
  if (CgroupCpuLimit(ProcSelfCgroup(), "/sys/fs/cgroup", &limit_dir) > 0) {
    struct stat st {};
    limit_key = ::stat(limit_dir.c_str(), &st) == 0 ? std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino)
                                                    : limit_dir;
  }
  struct Mine {
    uint64_t host, process, cpus, limit;
  } mine{XXH3_64bits(boot.data(), boot.size()), XXH3_64bits(process.data(), process.size()),
         numa.node >= 0 ? ~static_cast<uint64_t>(numa.node) : kernels::AffinityMaskKey(),
         XXH3_64bits(limit_key.data(), limit_key.size())};
  std::vector<Mine> all(static_cast<size_t>(comm_->world_size()));
  comm_->SetLabel("CPU sharers");
  STRATA_RETURN_IF_ERROR(comm_->AllGather(&mine, all.data(), sizeof mine)
                             .WithContext("create: which processes share this host's CPUs"));
  std::set<uint64_t> on_limit, on_cpus;
  for (const Mine& m : all) {
    if (m.host != mine.host) continue;
    if (m.limit == mine.limit) on_limit.insert(m.process);
    if (m.cpus == mine.cpus) on_cpus.insert(m.process);
  }
  cpu_mask_sharers_ = static_cast<int>(on_cpus.size());
  cpu_limit_sharers_ = static_cast<int>(on_limit.size());
  return Status::Ok();
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
      co.shared_memory = config_.strata.comm_shared_memory;
      co.store = &store_->client();
      co.device = options_.device;  // NCCL binds the GPU the engine is given (-1: the local rank's)
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
  lay_.SetRanks(comm_ != nullptr, options_.rank, options_.world_size, comm_ != nullptr && comm_->device_buffers());
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
  machine_ = ProbeMachineFacts();
  STRATA_ASSIGN_OR_RETURN(machine_.ranks_on_host, CountRanksOnHost(machine_.memory_key));
  if (options_.grad_accumulation_steps < 1)
    return InvalidError("grad_accumulation_steps must be at least 1");
  const std::string& opt = config_.optimizer.type;
  if (opt != "adam" && opt != "adamw" && opt != "lion" && opt != "adagrad")
    return ConfigError("optimizer.type: '" + opt + "' is not one of Adam, AdamW, Lion, Adagrad");
  lay_.dtype = config_.compute_dtype();
  lay_.compact = config_.strata.state_format == "compact";
  lay_.gdtype = config_.grad_dtype();
  stats_ = std::make_unique<StatsRecorder>(options_.rank, RankTracePath(config_.strata.trace_path));
  StorageOptions uo;
  uo.rings = config_.strata.io_rings;
  uo.backend = config_.strata.io_backend == "threads"    ? IoBackend::kThreads
               : config_.strata.io_backend == "io_uring" ? IoBackend::kUring
                                                         : IoBackend::kAuto;  // validated above
  uo.queue_depth = static_cast<uint32_t>(config_.aio.queue_depth);  // in 1..kMaxQueueDepth: validated above
  uo.block_size = config_.aio.block_size;
  uo.faults = options_.faults;
  STRATA_ASSIGN_OR_RETURN(storage_, FileStorage::Create(uo));
  placement_.rank = options_.rank;
  placement_.world_size = options_.world_size;
  STRATA_RETURN_IF_ERROR(PlaceOnGpu(options_.force_no_gpu, options_.device, &placement_));
  STRATA_RETURN_IF_ERROR(CountCpuSharers());
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
  // "auto": half of the memory this process may use (RAM, or its cgroup's
  // limit) for the host tier and, without a GPU, a quarter for the device
  // tier's arena, shared among the ranks that draw on the same memory.
  const uint64_t ranks_here = std::max<uint32_t>(machine_.ranks_on_host, 1);
  uint64_t device_budget = config_.strata.device_budget;
  if (device_budget == 0)
    device_budget = gpu ? gpu::DeviceMemoryBytes(device) / 10 * 9 : machine_.host_ram_bytes / 4 / ranks_here;
  uint64_t host_budget = config_.strata.host_budget;
  if (host_budget == 0) host_budget = AutoHostBudget(machine_, gpu ? 0 : config_.strata.device_budget);
  // The "auto" budgets that a limit or other ranks made smaller, said once a process.
  std::string autos;
  if (config_.strata.host_budget == 0) autos = "host_budget " + FormatBytes(host_budget);
  if (!gpu && config_.strata.device_budget == 0)
    autos += (autos.empty() ? "" : ", ") + std::string("device_budget ") + FormatBytes(device_budget);
  // (an "auto" host budget that the device arenas' budget in bytes shrank, too)
  const bool shrunk = config_.strata.host_budget == 0 && host_budget < AutoHostBudget(machine_, 0);
  if (!autos.empty() && (ranks_here > 1 || !machine_.ram_limit.empty() || shrunk)) {
    static std::once_flag said_shared;
    std::call_once(said_shared, [&] {
      STRATA_LOG_INFO("host memory: {}{}{}: \"auto\" budgets are {}{}", FormatBytes(machine_.host_ram_bytes),
                      machine_.ram_limit.empty() ? "" : " (the memory limit of the cgroup " + machine_.ram_limit + ")",
                      ranks_here > 1 ? ", shared by the " + std::to_string(ranks_here) + " ranks on this host" : "",
                      autos, shrunk ? " (what the device arenas of strata.device_budget leave)" : "");
    });
  }
  STRATA_ASSIGN_OR_RETURN(const bool strict, StrictDeviceFromEnv());
  if (strict && gpu)
    STRATA_LOG_WARN("STRATA_STRICT_DEVICE=1 is ignored: the device tier is a GPU (the strict host arena is for machines "
               "without one)");
  STRATA_ASSIGN_OR_RETURN(device_, DeviceTier::Create({.budget = device_budget, .device = device,
                                                       .force_host_arena = !gpu,
                                                       .pool = config_.strata.device_pool,
                                                       .strict = strict,  // (the tier ignores it on a GPU)
                                                       .faults = options_.faults}));
  static std::once_flag said_strict;  // once a process: tests make many engines
  if (device_->strict())
    std::call_once(said_strict, [] { STRATA_LOG_INFO("STRATA_STRICT_DEVICE=1: the device tier is a strict host arena (lagging copies, NaN-poisoned "
            "blocks, released copies evicted at once)"); });
  // Whether the CPU must copy into and out of the device tier: a GPU, or
  // the strict host arena standing in for one.
  lay_.device_on_gpu = device_->separate();
  // The process's CPUs bound to the GPU's node only now that nothing in
  // create can fail (a failed create left the whole process bound: the
  // trainer's threads, its data loader's), before the host tier's memory
  // is placed there. (Process-wide: threads started earlier are bound too.)
  PlaceOnNumaNode(config_.strata.numa_bind, &placement_);
  // The kernels' share of the CPUs they run on now.
  kernels::ShareCpuKernels(cpu_mask_sharers_, cpu_limit_sharers_);
  placement_.cpu_kernel_threads = kernels::CpuKernelThreads();
  placement_.cpu_sharers = cpu_mask_sharers_;
  // The host tier's memory is registered with io_uring (fixed buffers:
  // pinned, so faulted in at build, and counted against RLIMIT_MEMLOCK
  // without CAP_IPC_LOCK) only where the config puts state or activations
  // on NVMe, the I/O that moves through it every step. Elsewhere the ring
  // moves only checkpoints, which need no fixed buffers. (grad_home "nvme"
  // needs the optimizer on NVMe: ValidateConfig, above.)
  const bool nvme_io = config_.zero.offload_param.device == OffloadDevice::kNvme ||
                       config_.zero.offload_optimizer.device == OffloadDevice::kNvme ||
                       config_.strata.activation_nvme_bytes > 0;
  host_ = std::make_unique<HostTier>(HostTierOptions{.budget = host_budget,
                                                     .pin = gpu,
                                                     .numa_node = gpu ? placement_.gpu_node : -1,
                                                     .device = device,
                                                     .numa_bind = config_.strata.numa_bind != "off",
                                                     .storage = nvme_io ? storage_.get() : nullptr,
                                                     .faults = options_.faults});
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
// `init` take no memory (a model larger than RAM registers). When the memory
// cannot be had, the tensor just registered is dropped again (NOMEM names
// it): the call did nothing, and the name may be added again.
static Result<uint64_t> KeepInit(Engine::Impl& m, int group, const std::string& name, uint64_t off,
                                 uint64_t numel, const float* init) {
  try {
    if (static_cast<size_t>(group) >= m.init_.size()) m.init_.resize(static_cast<size_t>(group) + 1);
    auto& v = m.init_[static_cast<size_t>(group)];
    if (!init) return off;
    v.resize(off + numel, 0.0f);
    std::memcpy(v.data() + off, init, numel * sizeof(float));
    return off;
  } catch (const std::bad_alloc&) {
    m.lay_.part.DropLast(group);
    return NoMemError("add_param '" + name + "': its initial values, with the zeros of the group's tensors before it (" +
                      FormatBytes((off + numel) * sizeof(float)) +
                      "), cannot be kept until build; nothing was registered");
  }
}

Result<uint64_t> Engine::AddParam(int group, const std::string& name, uint64_t numel, const float* init) {
  STRATA_ASSIGN_OR_RETURN(uint64_t off, impl_->lay_.part.Add(group, name, numel));
  return KeepInit(*impl_, group, name, off, numel, init);
}

Status Engine::AddAlias(int group, const std::string& alias, const std::string& of) {
  return impl_->lay_.part.AddAlias(group, alias, of);
}

Result<uint64_t> Engine::AddShapedParam(int group, const std::string& name,
                                        const std::vector<uint64_t>& shape, const float* init) {
  STRATA_ASSIGN_OR_RETURN(uint64_t off, impl_->lay_.part.AddShaped(group, name, shape));
  return KeepInit(*impl_, group, name, off, impl_->lay_.part.group(group).tensors.back().numel, init);
}

Status Engine::Impl::CheckGroup(int group, const char* call) const {
  const Engine::Impl& m = *this;
  if (!m.built_) return StateError(std::string(call) + ": the engine is not built");
  if (group < 0 || group >= m.lay_.part.num_groups())
    return InvalidError(std::string(call) + ": group " + std::to_string(group) + " is not in 0.." +
                        std::to_string(m.lay_.part.num_groups() - 1));
  return Status::Ok();
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
    s.lent_reduced_bytes = reducer_->lent_reduced_bytes();
  }
  s.host = {host_->budget(), host_->used(), host_->peak()};
  if (nvme_) s.nvme = {nvme_->budget(), nvme_->used(), nvme_->peak()};
  if (acts_) {
    const ActivationStats a = acts_->stats();
    s.act_host_bytes = a.stashed_host_bytes;
    s.act_nvme_bytes = a.stashed_nvme_bytes;
    s.act_redeemed = a.redeemed;
    s.act_prefetch_hits = a.prefetch_hits;
    s.act_stalls = a.stalls;
    s.act_stall_s = a.stall_s;
    s.act_live_bytes = a.live_bytes;
  }
  return s;
}

// The public face: thin forwards.
Status Engine::Build() { return impl_->Build(); }
Result<void*> Engine::Fetch(int group) {
  STRATA_RETURN_IF_ERROR(impl_->CheckGroup(group, "fetch"));
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("fetch", /*pending_ok=*/true, /*in_pass=*/true));
  CallSpanScope span(*impl_->stats_, "fetch", group);
  return impl_->Fetch(group);
}
Status Engine::Release(int group) {
  STRATA_RETURN_IF_ERROR(impl_->CheckGroup(group, "release"));
  return impl_->Release(group);
}
Result<uint64_t> Engine::Stash(const void* src, uint64_t bytes) {
  if (!impl_->acts_) return StateError("stash: the engine is not built");
  CallSpanScope span(*impl_->stats_, "stash", -1);
  return impl_->acts_->Stash(src, bytes);
}

Status Engine::Redeem(uint64_t handle, void* dst, uint64_t bytes) {
  if (!impl_->acts_) return StateError("redeem: the engine is not built");
  CallSpanScope span(*impl_->stats_, "redeem", -1);
  return impl_->acts_->Redeem(handle, dst, bytes);
}

Status Engine::DropStash(uint64_t handle) {
  if (!impl_->acts_) return StateError("drop_stash: the engine is not built");
  return impl_->acts_->Drop(handle);
}

Status Engine::Grads(int group, const void* grads, DType dtype) {
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("grads", false, /*in_pass=*/true));
  CallSpanScope span(*impl_->stats_, "grads", group);
  return impl_->Grads(group, grads, dtype);
}
// Calls that read G, the step's flags or run collectives of their own first
// wait for the background reductions (overlap_comm): one collective at a
// time, in the same order on every rank.
Status Engine::GradsPart(int group, uint64_t first, uint64_t count, const void* grads, DType dtype, bool lend) {
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable(lend ? "grads_part_lend" : "grads_part", false, /*in_pass=*/true));
  return impl_->GradsPart(group, first, count, grads, dtype, lend);
}

Status Engine::GradsEnd(int group) {
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("grads_end", false, /*in_pass=*/true));
  CallSpanScope span(*impl_->stats_, "grads", group);
  return impl_->GradsEnd(group);
}

Result<const void*> Engine::GradsView(int group) {
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("grads_view", false, /*in_pass=*/true));
  return impl_->GradsView(group);
}

Result<bool> Engine::LentInUse(int group) {
  STRATA_RETURN_IF_ERROR(impl_->CheckGroup(group, "grads_lent"));
  return impl_->LentInUse(group);
}

void Engine::EndLoans() {
  impl_->DrainComm().IgnoreError();  // (kept in step_.broken: the next step says it)
  impl_->SettleAllLent();
}

std::string Engine::WhyNoGradParts(int group, DType dtype) const {
  if (Status st = impl_->CheckGroup(group, "grads_part"); !st.ok()) return st.message();
  return impl_->PartsRefused(group, dtype);
}

Result<StepResult> Engine::Step(const StepOptions& options) {
  Status drained = impl_->DrainComm().WithContext("step");
  Result<StepResult> r = drained.ok() ? impl_->Step(options) : Result<StepResult>(std::move(drained));
  // Lent gradients are the caller's again once step returns: what a step
  // that did not finish (or did not start) still needs is copied into G.
  impl_->SettleAllLent();
  return r;
}
Status Engine::DiscardGrads() {
  Status drained = impl_->DrainComm().WithContext("discard_grads");
  Status st = drained.ok() ? impl_->DiscardGrads() : std::move(drained);
  impl_->SettleAllLent();  // lent parts are the caller's again, as after Step
  return st;
}
Result<double> Engine::GradNorm() {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("grad_norm"));
  return impl_->GradNorm();
}
Status Engine::PrepareStep(const StepOptions& options) {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("prepare_step"));
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("prepare_step", false, /*in_pass=*/true));
  return impl_->PrepareStep(options);
}
// Save, load and write_state check the engine's state in CheckBetweenSteps.
Status Engine::SaveCheckpoint(const std::string& dir, const std::string& tag, const void* blob, uint64_t blob_bytes) {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("save"));
  return impl_->SaveCheckpoint(dir, tag, blob, blob_bytes);
}
Status Engine::LoadCheckpoint(const std::string& dir, const std::string& tag, std::vector<uint8_t>* blob) {
  impl_->DrainComm().IgnoreError();  // a lost background reduction is what a load recovers from
  Status st = impl_->LoadCheckpoint(dir, tag, blob);
  impl_->SettleAllLent();  // (a load that changed nothing keeps the step's gradients: in G now)
  return st;
}
Status Engine::ReadMaster(int group, float* out) {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("read_master"));
  if (impl_->ReadGathers(group)) STRATA_RETURN_IF_ERROR(impl_->AgreeBehind("read_master"));
  // A frozen group's P (gathered too) is nothing a step writes.
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("read_master", false, /*in_pass=*/impl_->FrozenGroup(group)));
  return impl_->ReadMaster(group, out);
}
// The state an OptimizerState names: W, M, V follow P in StateKind.
static StateKind KindOf(Engine::OptimizerState which) { return static_cast<StateKind>(static_cast<int>(which) + 1); }
Status Engine::ReadState(int group, OptimizerState which, float* out) {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("read_state"));
  const StateKind kind = KindOf(which);
  if (impl_->ReadGathers(group, kind)) STRATA_RETURN_IF_ERROR(impl_->AgreeBehind("read_state"));
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("read_state", false));
  return impl_->ReadState(group, kind, out);
}
Status Engine::WriteState(int group, OptimizerState which, const float* in) {
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("write_state"));
  return impl_->WriteState(group, KindOf(which), in);
}
// A step count a caller may set: the next step counts one more.
static Status CheckStepCount(const std::string& what, int64_t steps) {
  if (steps < 0) return InvalidError(what + ": " + std::to_string(steps) + " is negative");
  if (steps == INT64_MAX) return InvalidError(what + ": " + std::to_string(steps) + " leaves no count for the next step");
  return Status::Ok();
}

// Step counts are set between steps: mid-step, groups already updated early
// (overlap_step) counted the old count, and the reducer's and the
// overlap's threads read it.
static Status CheckBetweenSteps(const std::vector<GroupStep>& steps, const std::string& what) {
  for (const auto& gs : steps)
    if (gs.grad_calls > 0 || gs.parts.open)
      return StateError(what + ": gradients of this step are pending; set it between steps");
  return Status::Ok();
}

Status Engine::SetStepsApplied(int64_t steps) {
  STRATA_RETURN_IF_ERROR(CheckStepCount("set_steps", steps));
  // Before build there are no groups' counts to set, and build starts every
  // count at 0: a count set then would be lost to the groups, not to
  // get_steps.
  if (!impl_->built_) return StateError("set_steps: the engine is not built");
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("set_steps"));
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("set_steps", false, /*in_pass=*/true));
  STRATA_RETURN_IF_ERROR(CheckBetweenSteps(impl_->steps_, "set_steps"));
  impl_->step_.applied = steps;
  for (int g = 0; g < static_cast<int>(impl_->step_.group_steps.size()); ++g)
    if (!impl_->lay_.frozen(g)) impl_->step_.group_steps[static_cast<size_t>(g)] = steps;
  return Status::Ok();
}
Result<int64_t> Engine::GroupSteps(int group) const {
  STRATA_RETURN_IF_ERROR(impl_->CheckGroup(group, "group_steps"));
  if (impl_->lay_.frozen(group)) return int64_t{0};  // never updated
  return impl_->StepsOf(group);
}
Status Engine::SetGroupSteps(int group, int64_t steps) {
  const std::string what = "set_group_steps: group " + std::to_string(group);
  STRATA_RETURN_IF_ERROR(impl_->CheckGroup(group, "set_group_steps"));
  STRATA_RETURN_IF_ERROR(CheckStepCount(what, steps));
  if (impl_->lay_.frozen(group)) return InvalidError(what + " is frozen (freeze_group): it is never updated");
  if (!impl_->skips_gradless())
    return InvalidError(what + ": every group counts the engine's steps (set_steps) unless the engine skips groups "
                        "without gradients (skip_groups_without_grads)");
  STRATA_RETURN_IF_ERROR(impl_->DrainComm().WithContext("set_group_steps"));
  STRATA_RETURN_IF_ERROR(impl_->CheckUsable("set_group_steps", false, /*in_pass=*/true));
  STRATA_RETURN_IF_ERROR(CheckBetweenSteps(impl_->steps_, what));
  impl_->step_.group_steps[static_cast<size_t>(group)] = steps;
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
double Engine::loss_scale() const { return impl_->step_.scaler.scale(); }
int64_t Engine::steps_applied() const { return impl_->step_.applied; }
uint64_t Engine::group_numel(int group) const {
  return group >= 0 && group < impl_->lay_.part.num_groups() ? impl_->lay_.part.group(group).numel : 0;
}
DType Engine::compute_dtype() const { return impl_->lay_.dtype; }
const Config& Engine::config() const { return impl_->config_; }

}  // namespace strata
