// strata-train: trains a GPT-2-style model larger than the device budget
// through Strata's C API (its first embedding customer), on byte-level text.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "strata/strata.h"
#include "tools/train/checkpoints.h"
#include "tools/train/corpus.h"
#include "tools/train/gpt.h"
#include "tools/train/gpt_cuda.h"
#include "tools/train/presets.h"
#include "tools/train/report.h"
#include "tools/train/train_config.h"

namespace strata::train {
namespace {

struct Args {
  std::string preset = "small", data, nvme, config, trace, save, resume, state_format;
  std::string offload_activations;  // --offload-activations: "", host or nvme
  std::string device_budget, host_budget = "256MiB";  // device: see DefaultDeviceBudget
  int64_t steps = 100;
  int batch = 0, seq = 0, print_every = 10, save_every = 0, warmup = 10, keep_last = 0;
  double lr = 3e-3, min_lr_frac = 0.1, weight_decay = 0.0, clip = 1.0;
  uint64_t seed = 1337;
  bool resident = false, fp16 = false, weights_hash = false, log_losses = false, gpu = false;
  bool no_overlap_step = false;  // --no-overlap-step: every group updated after backward
  bool lr_given = false;         // --lr on the command line (else --config's lr, when it has one)
  bool host_budget_given = false;  // --host-budget on the command line (it wins over --config's)
};

// "strata-train", or "strata-train rank 1 of 2" with several ranks: every
// rank reports its own errors, naming itself.
std::string g_who = "strata-train";

int Fail(const std::string& msg) {
  std::fprintf(stderr, "%s: %s\n", g_who.c_str(), msg.c_str());
  return 1;
}

// SIGINT or SIGTERM: the run stops at the end of the step in flight (or
// before the first, once built), every rank at the same step (the request
// rides on the step's sum over ranks), saves a checkpoint there when --save
// is given, removes the swap folder it made and exits 128 + the signal. A
// second signal takes the default action at once (a swap folder made here
// is then left behind: the message says so).
volatile std::sig_atomic_t g_stop_signal = 0;
bool g_caught[2] = {false, false};  // SIGINT, SIGTERM: whether CatchStopSignals took them (set before any arrives)

void OnStopSignal(int sig) {
  g_stop_signal = sig;
  // The second signal, of either kind, takes the default action at once.
  struct sigaction dfl = {};
  dfl.sa_handler = SIG_DFL;
  if (g_caught[0]) ::sigaction(SIGINT, &dfl, nullptr);
  if (g_caught[1]) ::sigaction(SIGTERM, &dfl, nullptr);
  static const char kMsg[] =
      "\nstrata-train: stopping at the end of this step (a second signal stops at once, leaving the swap folder)\n";
  const ssize_t n = ::write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
  (void)n;
}

void CatchStopSignals() {
  struct sigaction sa = {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND | SA_RESTART;
  const int sigs[2] = {SIGINT, SIGTERM};
  for (int i = 0; i < 2; ++i) {
    struct sigaction was = {};
    // Ignored by whoever started the run (a shell's background job): it stays so.
    if (::sigaction(sigs[i], nullptr, &was) == 0 && was.sa_handler == SIG_IGN) continue;
    g_caught[i] = true;
    ::sigaction(sigs[i], &sa, nullptr);
  }
}

// Model FLOPs of one token's forward and backward (PaLM's count, as nanoGPT's
// MFU): 6 per parameter (2 forward, 4 backward; every parameter counts, the
// tied wte once, as the LM head it is the only matmul it takes part in) plus
// attention's q·kᵀ and att·v, 2·2·T·C a layer forward, times 3 with the
// backward: 12·L·T·C. The checkpointed blocks' second forward is not counted,
// so this is what the model needs, not what the GPU ran.
// The default device budget: 2 MiB, the figure that makes the small preset
// offload, or the compute copies (2 bytes a parameter, bf16 or f16) of two of the largest
// groups, a transformer block, when that is more: the engine refuses a budget
// below one group, and the second lets the next group be fetched ahead. In
// whole MiB, as a config string.
std::string DefaultDeviceBudget(const layers::GptConfig& cfg) {
  const uint64_t largest = std::max<uint64_t>(layers::BlockParamCount(cfg), layers::EmbedParamCount(cfg));
  const uint64_t mib = std::max<uint64_t>(2, (2 * 2 * largest + (1u << 20) - 1) >> 20);
  return std::to_string(mib) + "MiB";
}

double FlopsPerToken(const layers::GptConfig& cfg, uint64_t params, int seq) {
  return 6.0 * static_cast<double>(params) +
         12.0 * cfg.layers * static_cast<double>(seq) * static_cast<double>(cfg.channels);
}

double LrAt(const Args& a, int64_t step) {  // linear warm-up, cosine decay to min_lr_frac
  if (step < a.warmup) return a.lr * static_cast<double>(step + 1) / a.warmup;
  const double p = static_cast<double>(step - a.warmup) / static_cast<double>(std::max<int64_t>(1, a.steps - a.warmup));
  const double cosine = 0.5 * (1 + std::cos(M_PI * std::min(1.0, p)));
  return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * cosine);
}

// FNV-1a over every master weight. false (strata_last_error says why) where
// any call fails: a hash of what could not be read would compare equal.
bool WeightsHash(strata_engine_t* e, uint64_t* hash) {
  uint64_t h = 1469598103934665603ull;
  int groups = 0;
  if (strata_engine_num_groups(e, &groups) != STRATA_OK) return false;
  for (int g = 0; g < groups; ++g) {
    uint64_t n = 0;
    if (strata_engine_group_numel(e, g, &n) != STRATA_OK) return false;
    std::vector<float> w(n);
    if (strata_engine_read_master(e, g, w.data()) != STRATA_OK) return false;
    const auto* b = reinterpret_cast<const unsigned char*>(w.data());
    for (size_t i = 0; i < n * 4; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  *hash = h;
  return true;
}

// Where the state lives, for the banner: the folders the merged config
// sends the swap files to (--config may name its own), not a default.
std::string Placement(const Args& a, const TrainConfig& tc, int world) {
  if (tc.swap_folders.empty()) return a.resident ? "all resident" : "no state on NVMe";
  std::string s = "state on NVMe in ";
  for (size_t i = 0; i < tc.swap_folders.size(); ++i) s += (i ? ", " : "") + tc.swap_folders[i];
  if (world > 1 && !tc.own_swap.empty()) s += " (rank 0's; each rank makes its own)";
  return s;
}

// " (4 a rank on 2 ranks, ZeRO stage 3)" with several ranks, else "".
std::string RanksNote(int local_batch, int world, int stage) {
  if (world == 1) return "";
  return " (" + std::to_string(local_batch) + " a rank on " + std::to_string(world) + " ranks, ZeRO stage " +
         (stage >= 0 ? std::to_string(stage) : std::string("?")) + ")";
}

// --log-losses: "loss STEP MEAN grad_norm NORM", and with several ranks
// "ranks L0 L1 ..." (each rank's loss on its own slice), in full precision.
// What this host can give now: MemAvailable plus SwapFree (/proc/meminfo);
// 0 where it cannot be read (then only the host's memory is checked).
uint64_t HostAvailableBytes() {
  std::ifstream f("/proc/meminfo");
  std::string key, rest;
  uint64_t kib = 0, avail = 0, swap = 0;
  bool found = false;
  while (f >> key >> kib) {
    std::getline(f, rest);
    if (key == "MemAvailable:") avail = kib * 1024, found = true;
    else if (key == "SwapFree:") swap = kib * 1024;
  }
  return found ? avail + swap : 0;
}

// The model's own host buffers (its activations at --batch x --seq) against
// this host's memory and what it has free, agreed over the ranks (every rank
// calls it at the same point): a batch that cannot fit is refused by every
// rank, naming each rank short of memory, instead of a bad_alloc or the OOM
// killer once the engine is built. `when` says at which point.
bool CheckModelMemory(strata_engine_t* e, const Args& a, int local_batch, uint64_t bytes, int rank, int world,
                      const char* when, std::string* error) {
  uint64_t ram = 0;
  int local = 1;
  if (strata_host_memory(&ram, &local) != STRATA_OK) return *error = strata_last_error(), false;
  const uint64_t need = bytes * static_cast<uint64_t>(std::max(local, 1));
  const uint64_t free_now = HostAvailableBytes();
  const bool short_here = (ram != 0 && need > ram) || (free_now != 0 && need > free_now);
  // Per rank: its need where short (else 0), its memory, what it has free.
  std::vector<double> v(3 * static_cast<size_t>(world), 0.0);
  const size_t r = static_cast<size_t>(rank);
  v[3 * r] = short_here ? static_cast<double>(need) : 0.0;
  v[3 * r + 1] = static_cast<double>(ram);
  v[3 * r + 2] = static_cast<double>(free_now);
  if (strata_engine_sum_over_ranks(e, v.data(), v.size()) != STRATA_OK) return *error = strata_last_error(), false;
  std::string shortfalls;
  for (size_t k = 0; k < static_cast<size_t>(world); ++k) {
    if (v[3 * k] == 0) continue;
    shortfalls += std::string(shortfalls.empty() ? "" : "; ") + (world > 1 ? "rank " + std::to_string(k) + ": " : "") +
                  HumanBytes(static_cast<uint64_t>(v[3 * k])) + " needed, the host has " +
                  HumanBytes(static_cast<uint64_t>(v[3 * k + 1])) + " of memory and " +
                  HumanBytes(static_cast<uint64_t>(v[3 * k + 2])) + " free " + when +
                  " (MemAvailable + SwapFree)";
  }
  if (shortfalls.empty()) return true;
  *error = "--batch " + std::to_string(a.batch) + " x --seq " + std::to_string(a.seq) + ": the model's activations and "
           "buffers take " + HumanBytes(bytes) + " a rank (" + std::to_string(local_batch) + " sequences" +
           (local > 1 ? ", " + std::to_string(local) + " ranks on the host" : std::string()) + "), more than the host "
           "can give: " + shortfalls + ". Lower --batch or --seq" +
           (a.offload_activations.empty() ? ", or give --offload-activations (3 block inputs kept, not one a layer)"
                                          : std::string());
  return false;
}

void LogLoss(int64_t step, double loss, double grad_norm, const std::vector<double>& rank_losses) {
  std::printf("loss %lld %.9g grad_norm %.9g", static_cast<long long>(step), loss, grad_norm);
  if (rank_losses.size() > 1) {
    std::printf(" ranks");
    for (double l : rank_losses) std::printf(" %.9g", l);
  }
  std::printf("\n");
}

int Run(Args a) {
  const Preset* preset = FindPreset(a.preset);
  if (!preset) {
    std::string names;
    for (const auto& p : Presets()) names += std::string(names.empty() ? "" : ", ") + p.name;
    return Fail("--preset '" + a.preset + "' is not one of " + names);
  }
  const layers::GptConfig cfg = preset->cfg;
  if (a.batch == 0) a.batch = preset->batch;
  if (a.seq == 0) a.seq = preset->seq;
  if (a.seq > cfg.context) return Fail("--seq " + std::to_string(a.seq) + " is above the preset's context " + std::to_string(cfg.context));
  // Before the build (minutes on a large preset), not after it.
  if (!a.resume.empty() && !std::filesystem::is_directory(a.resume))
    return Fail("--resume " + a.resume + ": no such folder");

  // Data parallelism over the launcher's ranks (strata-launch, torchrun,
  // OpenMPI, Slurm): each rank trains on its slice of every global batch.
  int rank = 0, world = 1;
  if (strata_rank_from_env(&rank, &world) != STRATA_OK) return Fail(strata_last_error());
  if (world > 1) g_who = "strata-train rank " + std::to_string(rank) + " of " + std::to_string(world);
  const bool lead = rank == 0;  // the one rank that logs and writes reports
  if (a.batch % world != 0)
    return Fail("--batch " + std::to_string(a.batch) + " (the global batch) does not split evenly over " +
                std::to_string(world) + " ranks; give a multiple of " + std::to_string(world));
  const int local_batch = a.batch / world;
  // --gpu on several ranks: one process per GPU (the engine takes GPU
  // LOCAL_RANK and makes it current on this thread at create, so the layers'
  // CUDA work lands there too); gradients are reduced by NCCL on the device.

  std::string corpus, error;
  if (a.data.empty()) corpus = BuiltinCorpus(a.seed, 1 << 20);
  else if (!ReadCorpus(a.data, static_cast<size_t>(a.seq) + 1, &corpus, &error)) return Fail(error);

  if (a.gpu) {
    const std::string why = GpuUnavailableReason();
    if (!why.empty()) return Fail("--gpu: no usable GPU: " + why);
  }
  ConfigInputs ci;
  ci.lr = a.lr;
  ci.lr_given = a.lr_given;
  ci.weight_decay = a.weight_decay;
  ci.clip = a.clip;
  ci.fp16 = a.fp16;
  ci.resident = a.resident;
  ci.device_budget = a.device_budget.empty() ? DefaultDeviceBudget(cfg) : a.device_budget;
  ci.host_budget = a.host_budget;
  ci.nvme = a.nvme;
  ci.trace = a.trace;
  ci.state_format = a.state_format;
  ci.offload_activations = a.offload_activations;
  ci.activation_bytes = static_cast<uint64_t>(local_batch) * static_cast<uint64_t>(a.seq) *
                        static_cast<uint64_t>(cfg.channels) * sizeof(float);
  ci.activation_count = static_cast<uint64_t>(cfg.layers);
  ci.device_budget_given = !a.device_budget.empty();
  ci.host_budget_given = a.host_budget_given;
  ci.batch = a.batch;
  ci.local_batch = local_batch;
  ci.lead = lead;
  ci.config_path = a.config;
  TrainConfig tc;
  // A swap folder made here is removed at the end, whatever happens (the
  // engine, destroyed first, closes its files).
  struct Cleanup {
    const std::string& dir;
    ~Cleanup() { if (!dir.empty()) { std::error_code ec; std::filesystem::remove_all(dir, ec); } }
  } cleanup{tc.own_swap};
  if (!MakeTrainConfig(ci, &tc, &error)) return Fail(error);
  a.lr = tc.lr;  // the schedule's peak: --lr, else --config's
  for (const std::string& note : tc.notes)
    if (lead) std::printf("strata-train: %s\n", note.c_str());
  // strata.grad_reduce "sum": the engine adds the ranks' gradients, so each
  // hands 1/world of its local mean's; "mean" (the default) divides itself.
  const double grad_factor = tc.grad_sum ? 1.0 / world : 1.0;
  strata_engine_options_t eo = STRATA_ENGINE_OPTIONS_INIT;
  eo.rank = rank;
  eo.world_size = world;
  // The CPU layers need parameters and gradients in host memory; the GPU
  // layers take the engine's device pointers.
  eo.force_no_gpu = a.gpu ? 0 : 1;
  // The overlapped step: each group is updated while the backward of the
  // groups before it goes on (speculatively: a clipped or skipped step is
  // redone after backward, bitwise as without it).
  eo.overlap_step = a.no_overlap_step ? 0 : 1;
  strata_engine_t* e = nullptr;
  if (strata_engine_create(tc.json.c_str(), &eo, &e) != STRATA_OK) return Fail(strata_last_error());
  struct Destroy { strata_engine_t* e; ~Destroy() { strata_engine_destroy(e); } } destroy{e};
  int engine_rank = 0, engine_world = 0;  // never two ranks training copies of one another unnoticed
  if (strata_engine_rank(e, &engine_rank, &engine_world) != STRATA_OK) return Fail(strata_last_error());
  if (engine_rank != rank || engine_world != world)
    return Fail("the engine runs as rank " + std::to_string(engine_rank) + " of " + std::to_string(engine_world) +
                "; the launcher's variables say rank " + std::to_string(rank) + " of " + std::to_string(world));
  // Start-up takes a while on a large model (a 1.5B one: its initial values
  // drawn, then tens of GiB of state allocated and written): say what is
  // going on, and how long each part took, before the first step.
  const uint64_t nparams = layers::GptParamCount(cfg);
  const auto t_start = std::chrono::steady_clock::now();
  auto since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  if (lead) {
    std::printf("strata-train: start-up: drawing the initial values of %llu parameters (preset %s)\n",
                static_cast<unsigned long long>(nparams), preset->name);
    std::fflush(stdout);
  }
  if (!RegisterGpt(cfg, e, a.seed, &error)) return Fail(error);
  const double t_register = since(t_start);
  std::unique_ptr<GptModel> model;
  if (a.gpu) model = MakeGptCuda(cfg, local_batch, a.seq);
  else model = std::make_unique<Gpt>(cfg, local_batch, a.seq);
  if (!model) return Fail("--gpu: this build has no GPU model");
  GptModel& gpt = *model;
  if (!a.offload_activations.empty() && !gpt.OffloadActivations())
    return Fail("--offload-activations: this model cannot stash its activations");
  // The model's buffers, checked before the build (minutes on a large
  // preset) and again after it (the engine's state now taken), then
  // allocated: a batch too large fails here, naming it.
  const uint64_t model_bytes = gpt.HostBufferBytes();
  if (model_bytes != 0 &&
      !CheckModelMemory(e, a, local_batch, model_bytes, rank, world, "before the engine's build", &error))
    return Fail(error);
  const double t_model = since(t_start) - t_register;
  if (lead) {
    std::printf("strata-train: start-up: %.1f s drawing, %.1f s making the model; building the engine (every "
                "block allocated in its tier and its initial state written)\n",
                t_register, t_model);
    std::fflush(stdout);
  }
  const auto t_build0 = std::chrono::steady_clock::now();
  if (strata_engine_build(e) != STRATA_OK) return Fail(strata_last_error());
  if (model_bytes != 0 &&
      !CheckModelMemory(e, a, local_batch, model_bytes, rank, world, "after the engine's build", &error))
    return Fail(error);
  gpt.Allocate();
  if (lead) {
    std::printf("strata-train: start-up: built in %.1f s (%.1f s in all)\n", since(t_build0), since(t_start));
    std::fflush(stdout);
  }

  int64_t start = 0;
  if (!a.resume.empty()) {
    int64_t blob[2] = {0, 0};
    uint64_t len = sizeof blob;
    if (strata_checkpoint_load(e, a.resume.c_str(), nullptr, blob, &len) != STRATA_OK) return Fail(strata_last_error());
    if (len != sizeof blob || static_cast<uint64_t>(blob[1]) != a.seed)
      return Fail("--resume " + a.resume + ": the checkpoint is not from a strata-train run with this --seed");
    start = blob[0];
    if (start >= a.steps)
      return Fail("--resume " + a.resume + ": the checkpoint is at step " + std::to_string(start) + "; --steps " +
                  std::to_string(a.steps) + " leaves nothing to train (give more steps)");
    if (lead) std::printf("resumed from %s at step %lld\n", a.resume.c_str(), static_cast<long long>(start));
  }

  const uint64_t params = layers::GptParamCount(cfg);
  strata_dtype_t dt;
  strata_engine_compute_dtype(e, &dt);
  RunFigures fig;
  fig.params = params;
  // P in the compute dtype, W, M, V (fp32: 12 bytes; compact: about 5.25), G (fp32).
  fig.state_bytes = static_cast<uint64_t>(static_cast<double>(params) *
                                          ((dt == STRATA_DTYPE_F32 ? 4 : 2) + (tc.compact ? 5.25 : 12.0) + 4));
  if (lead)
    std::printf("strata-train: preset %s, %llu parameters, %s of state, batch %d x %d tokens%s, %lld steps, %s%s\n",
                preset->name, static_cast<unsigned long long>(params), HumanBytes(fig.state_bytes).c_str(), a.batch,
                a.seq, RanksNote(local_batch, world, tc.stage).c_str(), static_cast<long long>(a.steps),
                Placement(a, tc, world).c_str(), a.gpu ? ", layers on the GPU" : "");
  // Every rank says where it landed (its GPU, its NUMA binding): ranks differ.
  fig.placement = EnginePlacement(e);
  if (!fig.placement.empty()) std::printf("strata-train: %s\n", fig.placement.c_str());
  Progress progress(a.steps, a.print_every);
  double loss_scale = 1.0;
  if (strata_engine_loss_scale(e, &loss_scale) != STRATA_OK) return Fail(strata_last_error());
  std::vector<int32_t> inputs, targets;
  std::vector<double> rank_losses(static_cast<size_t>(world));
  // Each rank's loss in its place, and last whether any rank was asked to stop.
  std::vector<double> sums(static_cast<size_t>(world) + 1);
  // A stop asked for during start-up: every rank agrees before the first step.
  double stop_asked = g_stop_signal != 0 ? 1.0 : 0.0;
  if (strata_engine_sum_over_ranks(e, &stop_asked, 1) != STRATA_OK) return Fail(strata_last_error());
  int64_t stopped_at = stop_asked > 0 ? start : -1;  // the step the run stopped after (-1: none)
  double busy_cpu = 0, busy_disk = 0, wall = 0, compute_before = 0, compute_timed = 0, exposed = 0;
  const auto t_run = std::chrono::steady_clock::now();
  int64_t timed_steps = 0;
  for (int64_t s = start; s < a.steps && stopped_at < 0; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    SampleRankBatch(corpus, a.seed, s, a.batch, a.seq, rank, world, &inputs, &targets);
    double loss = 0;
    strata_step_options_t so = STRATA_STEP_OPTIONS_INIT;
    so.lr = LrAt(a, s);
    // The step's options before its first gradients: the overlapped updates
    // use them. Given after the forward, not before it: prepare_step waits
    // for the last step's writes left behind (strata.write_behind), which so
    // go on beside the forward, and reads the step's W, M, V ahead during
    // backward.
    gpt.before_backward = [&](std::string* why) {
      if (a.no_overlap_step || strata_engine_prepare_step(e, &so) == STRATA_OK) return true;
      *why = strata_last_error();
      return false;
    };
    if (!gpt.TrainStep(e, inputs.data(), targets.data(), loss_scale * grad_factor, &loss, &error)) return Fail(error);
    strata_step_result_t r = STRATA_STEP_RESULT_INIT;
    if (strata_engine_step(e, &so, &r) != STRATA_OK) return Fail(strata_last_error());
    loss_scale = r.loss_scale;
    // The logged loss: the mean of the ranks' local means, which (equal
    // slices) is the global batch's mean loss. One sum brings rank 0 every
    // rank's own loss too (each fills its place, the others are zeros).
    std::fill(sums.begin(), sums.end(), 0.0);
    sums[static_cast<size_t>(rank)] = loss;
    sums.back() = g_stop_signal != 0 ? 1.0 : 0.0;
    if (strata_engine_sum_over_ranks(e, sums.data(), sums.size()) != STRATA_OK) return Fail(strata_last_error());
    std::copy(sums.begin(), sums.end() - 1, rank_losses.begin());
    if (sums.back() > 0 && s + 1 < a.steps) stopped_at = s + 1;
    loss = 0;
    for (double l : rank_losses) loss += l;
    loss /= world;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    strata_stats_t st = STRATA_STATS_INIT;
    strata_engine_stats(e, &st);
    if (s > start) {  // the first step records the trace; the figures are for the steady state
      busy_cpu += (gpt.compute_seconds() - compute_before) + st.cpu_optimizer_s;
      compute_timed += gpt.compute_seconds() - compute_before;
      busy_disk += st.disk_busy_s;
      exposed += st.exposed_step_s;
      wall += secs;
      ++timed_steps;
    }
    compute_before = gpt.compute_seconds();
    if (lead && a.log_losses) LogLoss(s + 1, loss, r.grad_norm, rank_losses);
    if (s == start) fig.first_loss = loss;
    fig.last_loss = loss;
    const double tps = static_cast<double>(a.batch) * a.seq / secs;
    if (lead) progress.Step(s + 1, loss, tps, secs * static_cast<double>(a.steps - s - 1), so.lr, r.skipped != 0);
    // --save alone checkpoints after the last step (it saved nothing before);
    // with --save-every N, every N steps and after the last.
    const bool due = s + 1 == a.steps || stopped_at == s + 1 || (a.save_every > 0 && (s + 1) % a.save_every == 0);
    if (!a.save.empty() && due) {
      const int64_t blob[2] = {s + 1, static_cast<int64_t>(a.seed)};
      char tag[32];
      std::snprintf(tag, sizeof tag, "step%08lld", static_cast<long long>(s + 1));
      if (strata_checkpoint_save(e, a.save.c_str(), tag, blob, sizeof blob) != STRATA_OK) return Fail(strata_last_error());
      std::vector<std::string> gone;  // --keep-last: rank 0, once the new one is latest (ranks share the folder)
      if (lead && a.keep_last > 0 && !PruneCheckpoints(a.save, a.keep_last, &gone, &error)) return Fail(error);
      if (!gone.empty())
        std::printf("strata-train: --keep-last %d: removed %zu older checkpoint(s), the last %s\n", a.keep_last,
                    gone.size(), gone.back().c_str());
    }
  }
  if (stopped_at >= 0) {
    const int sig = g_stop_signal != 0 ? static_cast<int>(g_stop_signal) : SIGINT;  // (another rank's, else)
    if (lead) {
      progress.Done();
      const bool saved = !a.save.empty() && stopped_at > start;
      std::printf("strata-train: stopped by a signal after step %lld of %lld; %s\n", static_cast<long long>(stopped_at),
                  static_cast<long long>(a.steps),
                  saved ? ("checkpoint saved: go on with --resume " + a.save).c_str()
                        : a.save.empty() ? "nothing saved (no --save)" : "nothing new to save");
      std::fflush(stdout);
    }
    return 128 + sig;
  }
  uint64_t hash = 0;  // every rank: the shards are gathered
  if (a.weights_hash && !WeightsHash(e, &hash)) return Fail("--weights-hash: " + std::string(strata_last_error()));
  if (!lead) return 0;
  progress.Done();
  fig.steps = a.steps - start;
  fig.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_run).count();
  fig.tokens_per_s = timed_steps ? static_cast<double>(timed_steps) * a.batch * a.seq / wall : 0;
  fig.overlap_efficiency = wall > 0 ? std::max(busy_cpu, busy_disk) / wall : 0;
  fig.overlap_step = !a.no_overlap_step;
  fig.exposed_s = timed_steps ? exposed / static_cast<double>(timed_steps) : 0;
  if (a.gpu) {
    const double flops = FlopsPerToken(cfg, params, a.seq);
    fig.gpu = true;
    fig.tflops = flops * fig.tokens_per_s / 1e12;
    const double timed_tokens = static_cast<double>(timed_steps) * a.batch * a.seq;
    fig.kernel_tflops = compute_timed > 0 ? flops * timed_tokens / compute_timed / 1e12 : 0;
  }
  strata_stats_t st = STRATA_STATS_INIT;
  strata_engine_stats(e, &st);
  fig.placement = EnginePlacement(e);  // as of now: a memory binding that failed during the run says so
  PrintSummary(fig, st);
  if (a.weights_hash) std::printf("strata-train weights_hash=%016llx\n", static_cast<unsigned long long>(hash));
  // The GPU figures are appended only on the GPU: the CPU path's line stays as it was.
  char gpu_figures[96] = "";
  if (a.gpu)
    std::snprintf(gpu_figures, sizeof gpu_figures, " tflops=%.3f kernel_tflops=%.3f", fig.tflops,
                  fig.kernel_tflops);
  std::printf("strata-train first_loss=%.4f last_loss=%.4f state_to_device_budget=%.2f overlap_efficiency=%.2f tokens_per_s=%.0f%s\n",
              fig.first_loss, fig.last_loss,
              st.device.budget ? static_cast<double>(fig.state_bytes) / static_cast<double>(st.device.budget) : 0.0,
              fig.overlap_efficiency, fig.tokens_per_s, gpu_figures);
  return 0;
}

}  // namespace
}  // namespace strata::train

int main(int argc, char** argv) {
  strata::train::Args a;
  CLI::App app{"strata-train: train a GPT larger than the device budget through Strata's C API.\n"
               "Under strata-launch or torchrun it is data-parallel: each rank trains on its slice of every\n"
               "global batch at the config's ZeRO stage; rank 0 logs the mean loss over the ranks"};
  std::string names;
  for (const auto& p : strata::train::Presets()) names += std::string(names.empty() ? "" : ", ") + p.name;
  app.add_option("--preset", a.preset, "model: " + names)->capture_default_str();
  app.add_option("--steps", a.steps, "training steps")->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--batch", a.batch, "sequences per step over all ranks, split evenly among them (default: the preset's)")->check(CLI::Range(1, 1 << 16));
  app.add_option("--seq", a.seq, "tokens per sequence (default: the preset's)")->check(CLI::Range(1, 1 << 20));
  const CLI::Validator finite(
      [](std::string& v) {
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        return std::isfinite(x) && x >= 0 ? std::string() : "a finite number >= 0, not " + v;
      },
      "FINITE");
  CLI::Option* lr = app.add_option("--lr", a.lr,
                                    "peak learning rate (warm-up, then cosine decay); default: --config's "
                                    "optimizer.params.lr, else 3e-3")
                        ->check(finite);
  app.add_option("--warmup", a.warmup, "warm-up steps")->capture_default_str()->check(CLI::Range(1, 1 << 30));
  app.add_option("--seed", a.seed, "seed of the data, the initialization and the sampler")->capture_default_str();
  app.add_option("--data", a.data, "a text file (bytes are tokens); default: the built-in corpus");
  CLI::Option* device_budget = app.add_option("--device-budget", a.device_budget,
                 "device tier budget (default: 2 MiB, or two of the largest parameter group's compute copies "
                 "when that is more, so that every preset offloads and builds)");
  CLI::Option* host_budget = app.add_option("--host-budget", a.host_budget, "host tier budget")->capture_default_str();
  CLI::Option* nvme =
      app.add_option("--nvme", a.nvme, "swap folder (default: the config's nvme_path, else a fresh one under /var/tmp)");
  app.add_flag("--resident", a.resident, "keep every state resident (no offload, automatic budgets)")
      ->excludes(device_budget)
      ->excludes(host_budget)
      ->excludes(nvme);
  app.add_flag("--fp16", a.fp16, "fp16 with dynamic loss scaling instead of bf16");
  app.add_flag("--no-overlap-step", a.no_overlap_step,
               "update every group after backward instead of overlapping the update of each with the backward "
               "of the rest (the default; the same result, bitwise)");
  app.add_flag("--gpu", a.gpu,
               "run the layers on the GPU (CUDA, cuBLAS): parameters fetched to the device in the compute "
               "dtype (bf16; f16 with --fp16), gradients handed back as fp32 device pointers, TFLOPS in the "
               "summary; an error without a usable GPU. Default: the CPU layers, GPU or not");
  app.add_option("--config", a.config, "a ds_config.json merged over the built-in config");
  app.add_option("--offload-activations", a.offload_activations,
                 "each block's input (kept for its backward) goes to the engine's activation store after its "
                 "forward: host (host memory) or nvme (a small host arena, the rest on NVMe, read back ahead of "
                 "backward)")
      ->check(CLI::IsMember({"host", "nvme"}));
  app.add_option("--state-format", a.state_format,
                 "strata.state_format: fp32, or compact (about 5 bytes a parameter of optimizer state instead of 12)")
      ->check(CLI::IsMember({"fp32", "compact"}));
  app.add_option("--trace", a.trace, "write rank 0's Chrome trace (Perfetto) here");
  CLI::Option* save = app.add_option("--save", a.save, "checkpoint folder (alone: one checkpoint after the last step)");
  app.add_option("--save-every", a.save_every, "with --save: checkpoint every N steps too")
      ->check(CLI::Range(0, 1 << 30))
      ->needs(save);
  app.add_option("--keep-last", a.keep_last,
                 "with --save: keep only the newest N of this run's checkpoints (stepNNNNNNNN), removing older ones "
                 "after each save (never the one `latest` names); default: keep all")
      ->check(CLI::Range(1, 1 << 30))
      ->needs(save);
  app.add_option("--resume", a.resume, "resume from the latest checkpoint in this folder");
  app.add_option("--print-every", a.print_every, "log every N steps when not on a terminal")->capture_default_str();
  app.add_flag("--weights-hash", a.weights_hash, "print a hash of the final master weights");
  app.add_flag("--log-losses", a.log_losses,
               "print every step's loss and gradient norm in full precision (and each rank's loss)");
  CLI11_PARSE(app, argc, argv);
  a.lr_given = lr->count() > 0;
  a.host_budget_given = host_budget->count() > 0;
  strata::train::CatchStopSignals();
  return strata::train::Run(a);
}
