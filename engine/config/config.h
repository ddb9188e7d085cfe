// The engine's configuration: one JSON document in DeepSpeed's dialect (an
// existing ds_config.json works unchanged, with DeepSpeed's defaults) plus
// Strata's own keys under "strata". Parsing refuses bad keys and values up
// front; ValidateConfig refuses what needs facts known at engine creation.
//
// Example:
//   STRATA_ASSIGN_OR_RETURN(Config cfg, LoadConfigFile("ds_config.json"));
//   ConfigFacts facts = ProbeMachineFacts();
//   facts.largest_group_numel = registry.LargestGroupNumel();
//   facts.has_gpu = DeviceCount() > 0;
//   STRATA_RETURN_IF_ERROR(ValidateConfig(cfg, facts));
//
// Thread safety: all functions are pure (apart from logging) and may be called
// from any thread. Errors have code kConfig and name the full key path, e.g.
// "zero_optimization.offload_optimizer.devce: unknown key; did you mean 'device'?".
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"

namespace strata {

enum class OffloadDevice : uint8_t { kNone, kCpu, kNvme };
const char* OffloadDeviceName(OffloadDevice d);  // "none", "cpu", "nvme"

// zero_optimization.offload_param
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;  // "" = unset
  bool pin_memory = false;
  uint64_t buffer_count = 5;
  uint64_t buffer_size = 100'000'000;  // ELEMENTS per swap buffer (DeepSpeed's unit)
  uint64_t max_in_cpu = 1'000'000'000;  // elements kept in host memory when device is nvme
  bool operator==(const OffloadParamConfig&) const = default;
};

// zero_optimization.offload_optimizer
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  bool pin_memory = false;
  uint64_t buffer_count = 4;
  bool pipeline_read = false;
  bool pipeline_write = false;
  double ratio = 1.0;  // fraction of optimizer work done on the CPU, in [0, 1]
  bool operator==(const OffloadOptimizerConfig&) const = default;
};

// zero_optimization. The stage3_* keys and their bare names are both read.
struct ZeroConfig {
  int stage = 0;  // 0..3
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
  uint64_t prefetch_bucket_size = 50'000'000;       // elements
  uint64_t max_live_parameters = 1'000'000'000;     // elements
  uint64_t max_reuse_distance = 1'000'000'000;      // elements
  uint64_t param_persistence_threshold = 100'000;   // elements
  // The step's unit (Layout::units), elements. Strata's default is 4 Mi
  // (DeepSpeed's 1e9): units of 16 MiB a state keep the swap's copy-on-write
  // room small; a value given is used as given.
  uint64_t sub_group_size = uint64_t{4} << 20;
  // Several ranks: a group's gradients are reduced in collectives of at most
  // this many elements (reduce_bucket_size); with overlap_comm a grads call
  // returns once its gradients are copied, and the reduction runs on a
  // communication thread beside the trainer's backward (a config file leaves
  // it on at stage 3, off below, as DeepSpeed does). contiguous_gradients:
  // accepted; the gradients are always copied into one buffer.
  uint64_t reduce_bucket_size = 500'000'000;        // elements
  bool overlap_comm = false;
  bool contiguous_gradients = true;
  bool operator==(const ZeroConfig&) const = default;
};

// aio: the NVMe swap I/O.
struct AioConfig {
  uint64_t block_size = 1'048'576;  // bytes; a multiple of 4096 (O_DIRECT)
  uint64_t queue_depth = 8;
  uint64_t thread_count = 1;  // "intra_op_parallelism" or the older "thread_count"
  bool single_submit = false;
  bool overlap_events = true;
  bool operator==(const AioConfig&) const = default;
};

// fp16: loss_scale 0 means dynamic loss scaling.
// The largest fp16 loss scale: a float's largest power of two (torch's
// GradScaler grows its scale only while it stays a finite float).
inline constexpr double kMaxLossScale = 0x1p127;

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0;
  int initial_scale_power = 16;
  uint64_t loss_scale_window = 1000;
  int hysteresis = 2;
  double min_loss_scale = 1;
  bool operator==(const Fp16Config&) const = default;
};

// optimizer: {"type": ..., "params": {...}}. Defaults depend on the type
// (those of DeepSpeed's CPU optimizers); with no "optimizer" key, AdamW.
struct OptimizerConfig {
  std::string type = "adamw";  // lower-cased: "adam", "adamw", "lion", "adagrad"
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  bool adam_w_mode = true;  // decoupled weight decay; DeepSpeed's "Adam" defaults to it too
  bool bias_correction = true;
  // Adam/AdamW's first-moment arithmetic (kernels::MomentUpdate): "mul_add",
  // torch 1.x's exp_avg.mul_(b1).add_(g, alpha=1-b1), or "lerp", torch >= 2.0's
  // exp_avg.lerp_(g, 1-b1); each bitwise its torch. An option, not state.
  std::string moment_update = "mul_add";
  bool operator==(const OptimizerConfig&) const = default;
};

// strata: Strata's own keys.
struct StrataConfig {
  uint64_t device_budget = 0;  // bytes; 0 = "auto" (all of the device, resolved by the engine)
  uint64_t host_budget = 0;    // bytes; 0 = "auto" (resolved by the engine)
  std::vector<std::string> nvme_paths;  // swap folders, striped; empty = offload_*.nvme_path
  std::string trace_path;               // "" = no trace
  bool checksums = true;                // checksum swap blocks, verify on read
  double timeout_s = 300;               // collectives and store waits
  bool comm_shared_memory = true;       // Gloo, every rank on this host: bulk collectives through /dev/shm
  int io_rings = 1;                     // I/O workers: io_uring rings, or thread pools
  // How files are read and written: "auto" (io_uring; pread and pwrite on
  // threads, with one warning, where io_uring is refused), "io_uring" (or
  // fail), "threads".
  std::string io_backend = "auto";
  // The optimizer step's disk schedule over NVMe-homed state:
  //   "alternate"  the disk reads or writes, never both at once: shard i+1 is
  //                read after shard i-1's writes finish and before shard i's
  //                start; the CPU update of shard i overlaps shard i-1's writes.
  //                Many SSDs (and this project's test machines) move less in a
  //                mixed stream than in its two halves one after the other.
  //   "concurrent" shard i+1 is read while shard i-1 is written, for devices
  //                that gain bandwidth from mixing.
  std::string step_io = "alternate";
  // Write-behind (StepPipeline::RunBehind): a step that updates after
  // backward returns once every unit is updated, its W, M, V writes to NVMe
  // going on in the background until the next call that needs them (a
  // fetch from NVMe, prepare_step, step, a checkpoint, state access). One
  // rank, W, M, V on NVMe in units, staging pieces for every unit. A write
  // that fails then breaks the engine (a checkpoint load recovers) instead
  // of leaving the step pending. "auto": at one rank; "always": with several
  // ranks too (a lost write then fails every rank's next step at once, and
  // their communicator with it: restart them from a checkpoint); "never".
  std::string write_behind = "auto";
  // What a step does when a gradient is NaN or infinite (fp32 and bf16
  // compute; with fp16 it is a loss-scale overflow and always skipped):
  //   "skip"   nothing is updated, StepResult.skipped is true, steps_applied
  //            stays, and a warning names the first non-finite group;
  //   "error"  nothing is updated and the step returns INVALID naming it;
  //   "apply"  the update runs with them (NaN reaches W, M, V for good).
  std::string nonfinite = "skip";
  // How gradients from several ranks and several grads calls of a step
  // combine (torch DDP's semantics by default):
  //   "mean"  the sum over ranks and accumulation calls is divided by
  //           world_size x grad_accumulation_steps; each rank hands the
  //           gradient of its own mean loss, and the step sees the mean over
  //           the global batch. The reported norm and gradient_clipping use
  //           the averaged gradient.
  //   "sum"   gradients are summed over ranks and calls, unscaled.
  std::string grad_reduce = "mean";
  // How W, M, V are stored, on every tier and in checkpoints:
  //   "fp32"     12 bytes a parameter (Adam; 8 for Lion), bitwise the fp32
  //              arithmetic of kernels/cpu/adam.h;
  //   "compact"  about 5.25 bytes (kernels/cpu/compact.h): the master as its
  //              bf16 half plus an int8 correction (within 2^-15.9 of fp32),
  //              M and V as block-scaled 8-bit codes. With bf16 compute the
  //              bf16 half is P itself, so P needs no storage of its own.
  //              Adam, AdamW and Lion; Adagrad is refused.
  std::string state_format = "fp32";
  // The device tier keeps freed blocks for the next allocation of their size
  // (no cudaFree on the hot path; cached bytes count against device_budget).
  // false frees at once: for measuring what the pool saves.
  bool device_pool = true;
  // Where the step updates W, M, V homed on a GPU device tier
  // (offload_optimizer.device "none"):
  //   "auto"  on the GPU, in place, by the CUDA twins of the CPU kernels
  //           (bitwise the same result), when a twin exists for the
  //           optimizer and format (compact: when P is homed on the
  //           device too, as its bf16 half is the master's) and the device
  //           budget holds the gradient scratch; else on the CPU;
  //   "off"   always on the CPU (copied to host staging and back), e.g. to
  //           measure one against the other.
  std::string gpu_optimizer = "auto";
  // Binding to the NUMA node nearest the process's GPU (engine/placement.h):
  //   "auto"  with a GPU whose node is known on a machine of several nodes,
  //           the process's CPUs (every thread) and the host tier's memory
  //           are bound to that node; otherwise nothing is bound but the
  //           host tier's memory, to the node it starts on;
  //   "off"   nothing is bound: the OS places threads and pages.
  std::string numa_bind = "auto";
  // overlap_step's speculation (engine/step/speculation.h): updates made
  // during backward before the step knows the norm are held until it does.
  //   speculation_host_bytes: host memory (from host_budget) for the old
  //     values of host-homed W, M, V (compact: and P's slice) that a discard
  //     restores. "auto": what every host-homed group needs, at most what
  //     the host budget has left after build.
  //   speculation_disk_bytes: swap reserved beyond the state's own so that
  //     NVMe-homed W, M, V (and P) keep their old extents until the commit.
  //     "auto": the NVMe-homed optimizer state's padded bytes (every group).
  // Groups that do not fit are updated after backward; 0 speculates none
  // of that tier's groups. kSpeculationAuto is "auto".
  // speculation: whether a step speculates at all (step/speculation_policy.h).
  //   "auto"   from the recent steps: not after a clipped or skipped step,
  //            nor before the first step, nor when more than one of the
  //            last 4 was (a run clipped at every step never pays for it);
  //   "always" every step whose early updates would be speculative;
  //   "never"  none: such steps update after backward.
  std::string speculation = "auto";
  // Where G, the step's summed fp32 gradients, lives when W, M, V are on
  // NVMe (with them on the host or device it is host memory, and "nvme" is
  // refused). Layout's GradHome decides:
  //   "auto"  host memory when G's bytes are at most a quarter of the host
  //           budget and the host plan holds them, else NVMe: a ZeRO-3 step
  //           then reads and writes W, M, V alone (DeepSpeed keeps its
  //           gradients in host memory too);
  //   "host"  host memory (the host plan must hold it);
  //   "nvme"  NVMe: backward writes each group's G, the step reads it back.
  std::string grad_home = "auto";
  // Activations stashed by the trainer (engine/activations/activation_store.h):
  //   activation_host_bytes: a host arena (from host_budget) they are kept
  //     in, and that NVMe stashes pass through; 0: no activation store.
  //   activation_nvme_bytes: swap reserved for stashes that do not fit the
  //     arena; 0: none (a full arena refuses the stash).
  //   activation_prefetch_bytes: read ahead of backward's redeems, and the
  //     arena kept free for the NVMe stashes' way through it.
  uint64_t activation_host_bytes = 0;
  uint64_t activation_nvme_bytes = 0;
  uint64_t activation_prefetch_bytes = 64ull << 20;
  static constexpr uint64_t kSpeculationAuto = ~uint64_t{0};
  uint64_t speculation_host_bytes = kSpeculationAuto;
  uint64_t speculation_disk_bytes = kSpeculationAuto;
  bool operator==(const StrataConfig&) const = default;
};

struct Config {
  ZeroConfig zero;
  AioConfig aio;
  bool bf16 = false;  // bf16.enabled (or "bfloat16")
  Fp16Config fp16;
  double gradient_clipping = 0;  // 0 = off
  // data_types.grad_accum_dtype: how G (the step's summed gradients) is
  // stored: "fp32" (DeepSpeed's default), or "bf16" (2 bytes a parameter:
  // each grads call adds in fp32 and rounds the sum to nearest even; a single
  // call of bf16 gradients is stored exactly). "fp16" is refused.
  std::string grad_accum_dtype = "fp32";
  OptimizerConfig optimizer;
  StrataConfig strata;
  // Diagnostics of the parse, not configuration (ignored by operator==):
  std::vector<std::string> notes;     // trainer keys seen ("train_batch_size", ...)
  std::vector<std::string> warnings;  // DeepSpeed keys Strata does not implement

  // The dtype of P (parameters as the model computes with them): f16 when
  // fp16.enabled, bf16 when bf16.enabled, f32 when neither (as in DeepSpeed).
  DType compute_dtype() const;
  DType grad_dtype() const;  // of G: kF32 or kBF16 (data_types.grad_accum_dtype)
  // Swap folders for parameters / optimizer state: strata.nvme_paths when
  // given, else the section's nvme_path; empty when that tier is not nvme.
  std::vector<std::string> ParamSwapPaths() const;
  std::vector<std::string> OptimizerSwapPaths() const;
  bool any_pinned() const;  // pin_memory on an offload that is in use

  bool operator==(const Config& o) const;
};

// Parses a JSON document. Unknown keys, bad types, bad values and
// contradictions that need no machine facts are errors (code kConfig);
// trainer keys go to `notes`, unimplemented DeepSpeed keys to `warnings`,
// each logged once per process.
Result<Config> ParseConfig(std::string_view json_text);
// Reads and parses a file; errors name the path.
Result<Config> LoadConfigFile(const std::string& path);

// Facts known only when the engine is created. Zero means unknown and skips
// the checks that need it.
struct ConfigFacts {
  uint64_t largest_group_numel = 0;  // elements of the largest parameter group
  // Of the largest group that trains (not frozen: frozen groups keep P
  // alone, no W, M, V or G). Left 0: largest_group_numel stands for it.
  uint64_t largest_trainable_numel = 0;
  uint32_t world_size = 1;           // ranks sharing each group (stage >= 1 shards state)
  // The memory this process may use: physical RAM, or less where a cgroup's
  // memory limit (a container's, a job's) says so; `ram_limit` then names
  // that cgroup ("" for physical RAM).
  uint64_t host_ram_bytes = 0;
  std::string ram_limit;
  // What tells the ranks that share host_ram_bytes apart from the others:
  // the kernel's boot id and the limiting cgroup (ranks with the same key
  // draw on the same memory).
  std::string memory_key;
  // Ranks of this job with this process's memory_key, this one included
  // (the engine counts them at create). The "auto" budgets are shared among
  // them, and budgets in bytes are each rank's: all of them must fit.
  uint32_t ranks_on_host = 1;
  uint64_t memlock_limit_bytes = std::numeric_limits<uint64_t>::max();  // max = unlimited
  bool has_gpu = false;  // without one the device tier is a host arena
};

// The host budget that "auto" resolves to (the engine's, and the checks'
// below): half of host_ram_bytes, shared among the ranks_on_host. Without a
// GPU and with a device budget given in bytes (`device_budget`, 0 for
// "auto"), the device tier's arena is host memory too: "auto" then takes at
// most what the ranks' arenas leave of RAM, so that both budgets fit in it
// (0 where the arenas alone take it all: refused by the checks).
uint64_t AutoHostBudget(const ConfigFacts& f, uint64_t device_budget);

// Refuses contradictions between the config and the machine or the model:
// an nvme offload without a path, a param swap buffer smaller than the largest
// group, a host budget above RAM or (when pinned) the memlock limit, and a
// device or host budget too small for the largest group. Also re-checks what
// ParseConfig checks, so that a Config built in code is held to the same rules.
Status ValidateConfig(const Config& config, const ConfigFacts& facts);

// Whether Adam's `eps` makes compact state update by 0/0: an element whose
// moments round to 0 in its block has its m zeroed too, and eps 0 as the
// kernels' float (at most 2^-150) gives 0/0, NaN in the master for good
// (fp32 keeps the tiny m and v apart). The config's check and the step
// option's both ask this.
bool CompactEpsMakesNaN(const Config& config, double eps);
// The update's refusal (kernels/cpu/step_scalars.h) of the optimizer's
// hyperparameters at step 1: beyond float's range, an eps that is 0 as a
// float. OK where it takes them.
Status OptimizerScalarsRefused(const OptimizerConfig& optimizer);

// Least host memory the engine needs for the largest group: the pinned param
// swap buffers (nvme), one gathered group of P (cpu) and one shard's fp32
// W, M, V, G when the optimizer is offloaded. A lower bound, not a plan.
uint64_t MinHostBytes(const Config& config, const ConfigFacts& facts);

// Host RAM (sysconf, at most the cgroup memory limit: CgroupMemoryLimit on
// /proc/self/cgroup and /sys/fs/cgroup), the memory key and the memlock
// limit (getrlimit). Leaves largest_group_numel, world_size, ranks_on_host
// and has_gpu for the engine to fill in.
ConfigFacts ProbeMachineFacts();

// The tightest memory limit of the cgroups this process is in, walking up
// from its own: `proc_self_cgroup` is /proc/self/cgroup's text and `fs_root`
// where the hierarchies are mounted (/sys/fs/cgroup). Both cgroup v2
// (memory.max, "max" unlimited) and v1 (memory/memory.limit_in_bytes; a
// value of 2^62 or more is unlimited). A cgroup directory that does not
// exist is skipped (a container sees its own cgroup at the mount's root).
// bytes 0: no limit; else `dir` is the directory that sets it.
struct CgroupLimit {
  uint64_t bytes = 0;
  std::string dir;
};
CgroupLimit CgroupMemoryLimit(std::string_view proc_self_cgroup, const std::string& fs_root);

// The fully resolved config as JSON (DeepSpeed's key names, stage3_* spelling,
// budgets in bytes or "auto"), for logs and checkpoints. ParseConfig of the
// result gives back an equal Config.
std::string ConfigToJson(const Config& config);

}  // namespace strata
