// The config's cross checks: contradictions inside the document (at parse
// time) and between the document, the model and the machine (at engine
// creation), each refused with a message that names the keys involved.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "base/cgroup.h"
#include "base/sizes.h"
#include "base/text.h"
#include "base/log.h"
#include "engine/config/config.h"
#include "engine/config/config_reader.h"
#include "io/file_storage.h"
#include "kernels/cpu/step_scalars.h"

namespace strata {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

uint64_t SaturatingMul(uint64_t a, uint64_t b) { return (b != 0 && a > kMax / b) ? kMax : a * b; }
uint64_t SaturatingAdd(uint64_t a, uint64_t b) { return a > kMax - b ? kMax : a + b; }

std::string LimitText(uint64_t bytes) { return bytes == kMax ? "unlimited" : FormatBytes(bytes); }

Status CheckNvmePath(const Config& c, OffloadDevice device, const std::string& nvme_path,
                     const std::string& section) {
  if (device != OffloadDevice::kNvme || !nvme_path.empty() || !c.strata.nvme_paths.empty())
    return Status::Ok();
  return ConfigError("zero_optimization." + section + ".nvme_path: required when zero_optimization." +
                     section + ".device is \"nvme\" (or list swap folders in strata.nvme_paths)");
}

// buffer_size counts elements (DeepSpeed's unit); a swap buffer holds one whole group.
Status CheckParamBuffer(const Config& c, const ConfigFacts& f) {
  const auto& p = c.zero.offload_param;
  if (p.device != OffloadDevice::kNvme || f.largest_group_numel == 0 || p.buffer_size >= f.largest_group_numel)
    return Status::Ok();
  return ConfigError("zero_optimization.offload_param.buffer_size: " + std::to_string(p.buffer_size) +
                     " elements is smaller than the largest parameter group (" +
                     std::to_string(f.largest_group_numel) + " elements); set it to at least " +
                     std::to_string(f.largest_group_numel));
}

// The device receives one whole gathered group of P at a time.
Status CheckDeviceBudget(const Config& c, const ConfigFacts& f) {
  const uint64_t need = SaturatingMul(f.largest_group_numel, DTypeSize(c.compute_dtype()));
  if (c.strata.device_budget == 0 || c.strata.device_budget >= need) return Status::Ok();
  return ConfigError("strata.device_budget: " + FormatBytes(c.strata.device_budget) +
                     " is too small for the largest parameter group: its " +
                     std::to_string(f.largest_group_numel) + " " + DTypeName(c.compute_dtype()) +
                     " parameters need " + FormatBytes(need) + " on the device");
}

// "this machine's RAM (X)", and which cgroup limits it to X where one does.
std::string RamText(const ConfigFacts& f) {
  return "this machine's RAM (" + FormatBytes(f.host_ram_bytes) +
         (f.ram_limit.empty() ? "" : ": the memory limit of the cgroup " + f.ram_limit) + ")";
}

// A budget in bytes is each rank's: `what` for one rank, or for each of the
// ranks sharing this host's memory, with the sum.
std::string EachRank(const std::string& what, uint64_t bytes, const ConfigFacts& f) {
  if (f.ranks_on_host <= 1) return what + ": " + FormatBytes(bytes);
  return what + ": " + FormatBytes(bytes) + " for each of the " + std::to_string(f.ranks_on_host) +
         " ranks on this host (" + FormatBytes(SaturatingMul(bytes, f.ranks_on_host)) + " in all)";
}

Status CheckHostBudget(const Config& c, const ConfigFacts& f) {
  const uint64_t budget = c.strata.host_budget;
  if (budget == 0) return Status::Ok();
  const uint64_t ranks = std::max<uint32_t>(f.ranks_on_host, 1);
  if (f.host_ram_bytes != 0 && SaturatingMul(budget, ranks) > f.host_ram_bytes)
    return ConfigError(EachRank("strata.host_budget", budget, f) + " is above " + RamText(f));
  const uint64_t need = MinHostBytes(c, f);
  if (budget < need)
    return ConfigError("strata.host_budget: " + FormatBytes(budget) +
                       " is too small for the largest parameter group: it needs at least " +
                       FormatBytes(need) + " of host memory (swap buffers, P, and fp32 W, M, V, G of a shard)");
  return Status::Ok();
}

// Pinned host memory counts against RLIMIT_MEMLOCK (mlock). Pinning only
// speeds up copies to a GPU: without one, pin_memory has no effect and no
// limit applies. With one, a limit too low for what would be pinned is a
// warning, never a refusal: what cannot be pinned stays unpinned (HostTier).
Status CheckMemlock(const Config& c, const ConfigFacts& f) {
  if (!c.any_pinned() || !f.has_gpu) return Status::Ok();
  const bool budgeted = c.strata.host_budget != 0;
  const uint64_t pinned = budgeted ? c.strata.host_budget : MinHostBytes(c, f);
  if (pinned <= f.memlock_limit_bytes) return Status::Ok();
  const std::string what = budgeted ? "strata.host_budget: " + FormatBytes(pinned)
                                    : "zero_optimization.offload_*.pin_memory: at least " + FormatBytes(pinned);
  WarnOnce("memlock", what + " of pinned memory (offload pin_memory is true) is above the memlock limit (" +
                          LimitText(f.memlock_limit_bytes) +
                          "); what cannot be pinned stays unpinned (slower copies to the GPU); raise the limit "
                          "(ulimit -l, /etc/security/limits.conf) to pin it all");
  return Status::Ok();
}

// Without a GPU the device tier is an arena in host memory.
Status CheckNoGpuArena(const Config& c, const ConfigFacts& f) {
  if (f.has_gpu || f.host_ram_bytes == 0 || c.strata.device_budget == 0) return Status::Ok();
  const uint64_t ranks = std::max<uint32_t>(f.ranks_on_host, 1);
  if (c.strata.host_budget == 0) {
    // "auto" takes what the arenas leave (AutoHostBudget): it must hold the
    // largest group, as a host budget in bytes must (CheckHostBudget).
    const uint64_t host = AutoHostBudget(f, c.strata.device_budget), need = MinHostBytes(c, f);
    if (host > 0 && host >= need) return Status::Ok();
    return ConfigError(EachRank("strata.device_budget", c.strata.device_budget, f) + " leaves " +
                       FormatBytes(host) + " of " + RamText(f) + " to an \"auto\" strata.host_budget" +
                       (ranks > 1 ? " (each rank's)" : "") +
                       (need > 0 ? ", too little for the largest parameter group: it needs " + FormatBytes(need)
                                 : ": nothing for the host tier") +
                       "; without a GPU the device tier lives in host memory: lower strata.device_budget");
  }
  const uint64_t total = SaturatingAdd(c.strata.device_budget, c.strata.host_budget);
  if (SaturatingMul(total, ranks) <= f.host_ram_bytes) return Status::Ok();
  return ConfigError(EachRank("strata.device_budget + strata.host_budget", total, f) + " is above " + RamText(f) +
                     "; without a GPU the device tier lives in host memory: lower strata.device_budget or "
                     "strata.host_budget");
}

}  // namespace

Status config_internal::CheckConfigConsistency(const Config& c) {
  if (c.bf16 && c.fp16.enabled)
    return ConfigError("bf16.enabled and fp16.enabled: both true; enable at most one");
  const auto& z = c.zero;
  STRATA_RETURN_IF_ERROR(CheckNvmePath(c, z.offload_param.device, z.offload_param.nvme_path, "offload_param"));
  if (c.strata.grad_home == "nvme" && z.offload_optimizer.device != OffloadDevice::kNvme)
    return ConfigError("strata.grad_home: \"nvme\" needs zero_optimization.offload_optimizer.device \"nvme\" "
                       "(G lives beside W, M, V; with them on the host or the device it is host memory)");
  STRATA_RETURN_IF_ERROR(
      CheckNvmePath(c, z.offload_optimizer.device, z.offload_optimizer.nvme_path, "offload_optimizer"));
  if (z.stage < 0 || z.stage > 3)
    return ConfigError("zero_optimization.stage: " + std::to_string(z.stage) + " is not one of 0, 1, 2, 3");
  if (z.offload_param.buffer_count == 0 || z.offload_optimizer.buffer_count == 0)
    return ConfigError("zero_optimization.offload_*.buffer_count: 0 is out of range; allowed: at least 1");
  if (c.aio.block_size == 0 || c.aio.block_size % 4096 != 0)
    return ConfigError("aio.block_size: " + std::to_string(c.aio.block_size) +
                       " is not a multiple of 4096 (O_DIRECT alignment)");
  const std::string& nf = c.strata.nonfinite;
  if (nf != "skip" && nf != "error" && nf != "apply")
    return ConfigError("strata.nonfinite: \"" + nf + "\" is not one of skip, error, apply");
  if (!c.optimizer.bias_correction)
    return ConfigError("optimizer.params.bias_correction: false is not supported (the update always corrects the "
                       "moments' bias); allowed: true");
  const std::string& mu = c.optimizer.moment_update;
  if (mu != "mul_add" && mu != "lerp")
    return ConfigError("optimizer.params.moment_update: \"" + mu + "\" is not one of mul_add, lerp");
  if (mu != "mul_add" && c.optimizer.type != "adam" && c.optimizer.type != "adamw")
    return ConfigError("optimizer.params.moment_update: \"" + mu + "\" is Adam's and AdamW's; " + c.optimizer.type +
                       " has no first moment of that form; allowed: mul_add (or leave it out)");
  const std::string& gr = c.strata.grad_reduce;
  if (gr != "mean" && gr != "sum")
    return ConfigError("strata.grad_reduce: \"" + gr + "\" is not one of mean, sum");
  if (c.grad_accum_dtype != "fp32" && c.grad_accum_dtype != "bf16")
    return ConfigError("data_types.grad_accum_dtype: \"" + c.grad_accum_dtype + "\" is not one of fp32, bf16");
  const std::string& nb = c.strata.numa_bind;
  if (nb != "auto" && nb != "off")
    return ConfigError("strata.numa_bind: \"" + nb + "\" is not one of auto, off");
  const std::string& ib = c.strata.io_backend;
  if (ib != "auto" && ib != "io_uring" && ib != "threads")
    return ConfigError("strata.io_backend: \"" + ib + "\" is not one of auto, io_uring, threads");
  const std::string& sf = c.strata.state_format;
  if (sf != "fp32" && sf != "compact")
    return ConfigError("strata.state_format: \"" + sf + "\" is not one of fp32, compact");
  const std::string& go = c.strata.gpu_optimizer;
  if (go != "auto" && go != "off")
    return ConfigError("strata.gpu_optimizer: \"" + go + "\" is not one of auto, off");
  if (sf == "compact" && c.optimizer.type == "adagrad")
    return ConfigError("strata.state_format: \"compact\" has no Adagrad kernel (optimizer.type is adagrad); allowed "
                       "with adam, adamw and lion, or use \"fp32\"");
  if (sf == "compact" && !c.bf16)
    return ConfigError(std::string("strata.state_format: \"compact\" needs bf16.enabled true (the compute dtype is ") +
                       DTypeName(c.compute_dtype()) + "): the parameters are the master's bf16 half, so P has no "
                       "storage of its own; use \"fp32\" with fp32 or fp16 compute");
  if (CompactEpsMakesNaN(c, c.optimizer.eps))
    return ConfigError("optimizer.params.eps: " + ShortDouble(c.optimizer.eps) + " (0 as a float) with strata.state_format \"compact\": an element whose moments "
                       "round to 0 in their block would update by 0/0 (NaN); give eps > 0, or use \"fp32\"");
  if (Status st = OptimizerScalarsRefused(c.optimizer); !st.ok())
    return ConfigError("optimizer.params: " + st.message());
  if (c.aio.block_size > StorageOptions::kMaxBlockSize)
    return ConfigError("aio.block_size: " + std::to_string(c.aio.block_size) + " is out of range; allowed: from 4096 to " +
                       std::to_string(StorageOptions::kMaxBlockSize));
  if (c.aio.queue_depth < 1 || c.aio.queue_depth > StorageOptions::kMaxQueueDepth)
    return ConfigError("aio.queue_depth: " + std::to_string(c.aio.queue_depth) + " is out of range; allowed: from 1 to " +
                       std::to_string(StorageOptions::kMaxQueueDepth));
  return Status::Ok();
}

uint64_t AutoHostBudget(const ConfigFacts& f, uint64_t device_budget) {
  const uint64_t ranks = std::max<uint32_t>(f.ranks_on_host, 1);
  uint64_t host = f.host_ram_bytes / 2;
  if (!f.has_gpu && device_budget > 0) {
    const uint64_t arenas = SaturatingMul(device_budget, ranks);
    host = arenas >= f.host_ram_bytes ? 0 : std::min(host, f.host_ram_bytes - arenas);
  }
  return host / ranks;
}

uint64_t MinHostBytes(const Config& c, const ConfigFacts& f) {
  const uint64_t numel = f.largest_group_numel;  // P: frozen groups keep theirs too
  const uint64_t trained = f.largest_trainable_numel ? f.largest_trainable_numel : numel;  // W, M, V, G
  const uint64_t p_size = DTypeSize(c.compute_dtype());
  const uint64_t world = std::max<uint32_t>(f.world_size, 1);
  const uint64_t shard = c.zero.stage >= 1 ? (trained + world - 1) / world : trained;
  // P's home holds this rank's shard at stage 3 (the whole group's copy is the device tier's).
  const uint64_t p_home = c.zero.stage == 3 ? (numel + world - 1) / world : numel;
  uint64_t need = 0;
  const auto& p = c.zero.offload_param;
  // What the engine allocates: with a GPU, NVMe-homed P passes through up to
  // four pinned buffers of a group (without one the disk reads straight into
  // the device tier's host arena); host-homed P is one group at least.
  const auto od = c.zero.offload_optimizer.device;
  const bool compact = c.strata.state_format == "compact";
  if (p.device == OffloadDevice::kNvme && f.has_gpu)
    need = SaturatingMul(SaturatingMul(std::min<uint64_t>(p.buffer_count, 4), numel), p_size);
  else if (p.device == OffloadDevice::kCpu &&
           !(c.compute_dtype() == DType::kF32 && !compact && od == OffloadDevice::kCpu))  // (else P may be W's bytes)
    need = SaturatingMul(p_home, p_size);
  // The optimizer: host-homed W, M, V, G are a shard. NVMe-homed W, M, V
  // stream through step slots of a shard, at least three (read ahead,
  // update, write behind), or two where fp32 state is stepped in units;
  // G is a shard more, homed on the host or staged beside them. A lower
  // bound (Build's CheckHostPlan has the exact sizes): it must never refuse
  // a budget the engine would fit in. Bytes an element: fp32 W, M, V 4 each
  // (V: Adam's only), compact at least 1 each; G its dtype's.
  const std::string& type = c.optimizer.type;
  const uint64_t states = (type == "adam" || type == "adamw") ? 3 : 2;
  const uint64_t wmv = states * (compact ? 1 : 4), g = DTypeSize(c.grad_dtype());
  if (od == OffloadDevice::kNvme)
    need = SaturatingAdd(need, SaturatingMul(shard, (compact ? 3 : 2) * wmv + g));
  else if (od == OffloadDevice::kCpu)
    need = SaturatingAdd(need, SaturatingMul(shard, wmv + g));
  return need;
}

Status ValidateConfig(const Config& config, const ConfigFacts& facts) {
  STRATA_RETURN_IF_ERROR(config_internal::CheckConfigConsistency(config));
  STRATA_RETURN_IF_ERROR(CheckParamBuffer(config, facts));
  STRATA_RETURN_IF_ERROR(CheckDeviceBudget(config, facts));
  STRATA_RETURN_IF_ERROR(CheckHostBudget(config, facts));
  STRATA_RETURN_IF_ERROR(CheckMemlock(config, facts));
  return CheckNoGpuArena(config, facts);
}

namespace {

// A limit file's value: bytes, or 0 for none ("max"; v1's "unlimited" is
// PAGE_COUNTER_MAX pages, above 2^62) or for a value that is not a number.
uint64_t LimitValue(const std::string& text) {
  if (text.empty() || text == "max") return 0;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0' || v >= (1ull << 62)) return 0;
  return v;
}

}  // namespace

CgroupLimit CgroupMemoryLimit(std::string_view proc_self_cgroup, const std::string& fs_root) {
  CgroupLimit best;
  ForEachCgroupDir(proc_self_cgroup, fs_root, "memory", [&](const std::string& dir, bool v2) {
    std::string text;
    if (!ReadFirstLine(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"), &text)) return;
    const uint64_t v = LimitValue(text);
    if (v != 0 && (best.bytes == 0 || v < best.bytes)) best = {v, dir};
  });
  return best;
}

// The kernels' own refusal of the config's hyperparameters at step 1 (where
// lr / (1 - beta1^step) is largest): a value whose float the update cannot
// take (beyond float's range, an eps that is 0 as a float) is refused at
// create, not at the first step.
Status OptimizerScalarsRefused(const OptimizerConfig& o) {
  if (o.type == "lion") {
    kernels::LionOptions l;
    l.lr = o.lr, l.beta1 = o.beta1, l.beta2 = o.beta2, l.weight_decay = o.weight_decay;
    return kernels::ValidateLionOptions(l);
  }
  if (o.type == "adagrad") {
    kernels::AdagradOptions a;
    a.lr = o.lr, a.eps = o.eps, a.weight_decay = o.weight_decay;
    return kernels::ValidateAdagradOptions(a);
  }
  kernels::AdamOptions a;
  a.lr = o.lr, a.beta1 = o.beta1, a.beta2 = o.beta2, a.eps = o.eps, a.weight_decay = o.weight_decay;
  a.mode = o.type == "adamw" || o.adam_w_mode ? kernels::AdamMode::kAdamW : kernels::AdamMode::kAdam;
  return kernels::ValidateAdamOptions(a);
}

bool CompactEpsMakesNaN(const Config& config, double eps) {
  return config.strata.state_format == "compact" && config.optimizer.type != "lion" && eps <= kZeroAsFloat;
}

ConfigFacts ProbeMachineFacts() {
  ConfigFacts facts;
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page_size > 0)
    facts.host_ram_bytes = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  const CgroupLimit cgroup = CgroupMemoryLimit(ProcSelfCgroup(), "/sys/fs/cgroup");
  std::string boot;
  ReadFirstLine("/proc/sys/kernel/random/boot_id", &boot);
  facts.memory_key = boot;
  if (cgroup.bytes != 0 && (facts.host_ram_bytes == 0 || cgroup.bytes < facts.host_ram_bytes)) {
    facts.host_ram_bytes = cgroup.bytes;
    facts.ram_limit = cgroup.dir;
    // The cgroup itself (a container sees its own at the mount's root, at
    // the same path as every other container's).
    struct stat st {};
    if (::stat(cgroup.dir.c_str(), &st) == 0)
      facts.memory_key += "|" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
    else
      facts.memory_key += "|" + cgroup.dir;
  }
  struct rlimit limit {};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY)
    facts.memlock_limit_bytes = static_cast<uint64_t>(limit.rlim_cur);
  return facts;
}

}  // namespace strata
