// Capacity accounting. Per rank, with Psi = parameters and N = ranks:
//   P  compute dtype (2 B): Psi, or Psi/N in stage 3            -> offload_param's tier
//   G  optimizer on the device: compute dtype, Psi (stages 0-1) or Psi/N (2-3), on the device;
//      optimizer offloaded: the fp32 accumulator of this rank's shard, beside W
//   W, M, V  fp32 (4 B each; V only for Adam): Psi, or Psi/N in stages 1-3 -> offload_optimizer's tier
// With bf16 and Adam on the device this is the ZeRO paper's (2 + 2 + 12) Psi
// divided per stage; offloaded, the ZeRO-Offload / ZeRO-Infinity accounting.
// strata.state_format "compact" keeps the master's bf16 half in P and stores
// W as its int8 corrections (1 B), M and V in 1.125 B each (StateBytes):
// offloaded to NVMe in stage 3 that is (2 + 4 + 5.25 - 2) Psi/N, not 18.
// The speculative overlapped step adds its backups (host) or the old extents
// it keeps until commit (NVMe) where the tier has room: Speculation.
#include "tools/plan/capacity.h"

#include <algorithm>
#include <numeric>

#include "base/align.h"
#include "base/sizes.h"
#include "engine/layout/layout.h"
#include "engine/layout/partition.h"
#include "engine/layout/staging.h"
#include "engine/layout/staging_plan.h"
#include "kernels/cpu/compact.h"
#include "tiers/device_tier.h"
#include "tiers/nvme_tier.h"

namespace strata::plan {

namespace {

constexpr double kDeviceUsable = 0.9;  // the engine's default device budget: 90% of the GPU
constexpr double kHostUsable = 0.9;    // leave a tenth of host memory to the OS and the trainer

TierKind HomeOf(OffloadDevice d) {
  return d == OffloadDevice::kNone  ? TierKind::kDevice
         : d == OffloadDevice::kCpu ? TierKind::kHost
                                    : TierKind::kNvme;
}

constexpr uint64_t kNvmeBlock = 4096;
uint64_t NvmePadded(uint64_t bytes) { return (bytes + kNvmeBlock - 1) / kNvmeBlock * kNvmeBlock; }

// Sums saturate: an estimate past 2^64 (an activation set of a long context)
// stays "too much" instead of wrapping to a small number that fits.
uint64_t SatAdd(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

void Add(Capacity& c, PlanState s, TierKind t, uint64_t bytes) {
  uint64_t& cell = c.bytes[static_cast<size_t>(s)][static_cast<size_t>(t)];
  cell = SatAdd(cell, bytes);
}

}  // namespace

const char* PlanStateName(PlanState s) {
  static const char* kNames[] = {"P", "G", "W", "M", "V", "act", "work", "staging", "spec"};
  return kNames[static_cast<int>(s)];
}

const char* PlanStateDescription(PlanState s) {
  static const char* kText[] = {
      "parameters, compute dtype (compact: the master's bf16 half)",
      "gradients (compute dtype on the device; fp32 accumulator when offloaded)",
      "master weights (fp32; compact: int8 corrections to P's bf16)",
      "first moment (fp32, or compact's 8-bit codes)",
      "second moment (fp32, or compact's 8-bit codes)",
      "activations (one micro-batch; the activation store's arena and swap)",
      "device working buffers (gathered and prefetched groups, one group's gradient)",
      "pinned host staging buffers (swap and step slots)",
      "speculation until commit (host: W, M, V backups; nvme: their old extents)",
  };
  return kText[static_cast<int>(s)];
}

Result<Layout> MakeLayout(const ModelSpec& model, int world_size) {
  Partition part;
  for (size_t g = 0; g < model.groups.size(); ++g)
    STRATA_RETURN_IF_ERROR(
        part.Add(static_cast<int>(g), model.groups[g].name, model.groups[g].numel).status());
  STRATA_RETURN_IF_ERROR(part.Finalize(world_size));
  Layout l;
  l.world_size = world_size;
  for (int g = 0; g < part.num_groups(); ++g) {
    const GroupLayout& gl = part.group(g);
    l.full_numel += gl.numel;
    l.shard_numel += gl.shard_numel;
    l.group_numel.push_back(gl.numel);
    l.group_shard.push_back(gl.shard_numel);
  }
  l.largest_group = part.largest_group_numel();
  l.largest_shard = part.largest_shard_numel();
  return l;
}

int Speculation::Groups() const {
  int n = 0;
  for (uint8_t g : granted) n += g;
  return n;
}

double Speculation::Fraction() const {
  const uint64_t needed = host_needed + disk_needed;
  return needed ? static_cast<double>(host_granted + disk_granted) / static_cast<double>(needed) : 0.0;
}

uint64_t Capacity::Used(TierKind t) const {
  uint64_t n = 0;
  for (const auto& row : bytes) n = SatAdd(n, row[static_cast<size_t>(t)]);
  return n;
}

uint64_t Capacity::ModelStates(TierKind t) const {
  uint64_t n = 0;
  for (int s = 0; s <= static_cast<int>(PlanState::kV); ++s)
    n = SatAdd(n, bytes[static_cast<size_t>(s)][static_cast<size_t>(t)]);
  return n;
}

std::vector<std::string> Capacity::Problems() const {
  std::vector<std::string> out;
  for (int t = 0; t < kNumTiers; ++t)
    if (!Fits(TierKind(t)))
      out.push_back(std::string(TierName(TierKind(t))) + ": " + FormatBytes(Used(TierKind(t))) +
                    " needed per rank, " + FormatBytes(capacity[static_cast<size_t>(t)]) + " available");
  return out;
}

Homes HomesOf(const Config& config, const ClusterSpec& cluster, bool g_on_host) {
  Homes h;
  h.p = HomeOf(config.zero.offload_param.device);
  h.opt = HomeOf(config.zero.offload_optimizer.device);
  h.gpu_optimizer = h.opt == TierKind::kDevice && cluster.has_gpu;
  // The engine keeps the fp32 accumulator in host memory, or beside W, M, V
  // on NVMe (strata.grad_home), when the step runs on the CPU.
  h.g = h.gpu_optimizer ? TierKind::kDevice : strata::GradHome(config.strata.grad_home, h.opt, g_on_host);
  return h;
}

uint64_t HostBudgetOf(const ClusterSpec& cluster, const Config& config) {
  uint64_t host = static_cast<uint64_t>(static_cast<double>(cluster.host_bytes) * kHostUsable) /
                  std::max<uint64_t>(cluster.gpus_per_node, 1);
  if (config.strata.host_budget) host = std::min(host, config.strata.host_budget);
  return host;
}

uint64_t StateBytes::W(uint64_t n) const { return compact ? n : 4 * n; }
uint64_t StateBytes::M(uint64_t n) const {
  return compact ? n + sizeof(float) * kernels::CompactScaleCount(n) : 4 * n;
}
uint64_t StateBytes::V(uint64_t n) const { return has_v ? M(n) : 0; }

StateBytes StateBytesOf(const Config& config) {
  const std::string& o = config.optimizer.type;
  return {.compact = config.strata.state_format == "compact", .has_v = o == "adam" || o == "adamw",
          .g_size = DTypeSize(config.grad_dtype())};
}

namespace {

constexpr uint64_t kBackupAlign = 64;  // engine/step/speculation.cpp: each backup in the arena

// What group g's speculation needs, as Speculation::NeedsOf
// (engine/step/speculation.cpp) counts it: for each state the step writes
// (P, W, M, V), NVMe-homed: a fresh extent (padded as the NVMe tier pads,
// striped over strata.nvme_paths); CPU-addressable (host, or a GPU-less
// machine's device arena): a backup (fp32's P, a copy of W, is recomputed
// instead; compact's P, the master's half, is backed up as this rank's 2-byte
// slice); in place on a GPU: nothing could undo it, so g does not speculate.
// Returns false when g cannot speculate.
// P that is W's bytes (the engine's Layout::PIsW): fp32 compute, not
// compact, P on NVMe with W, M, V on NVMe or the host, or both on the host,
// and P's home the size of W's (stage 3, or P whole where W is): no block of
// its own, never written by the step.
bool PIsW(const Config& config, const Homes& h, const StateBytes& sb, const Layout& l) {
  const int stage = config.zero.stage;
  const bool homes = (h.p == TierKind::kNvme && (h.opt == TierKind::kNvme || h.opt == TierKind::kHost)) ||
                     (h.p == TierKind::kHost && h.opt == TierKind::kHost);
  return DTypeSize(config.compute_dtype()) == 4 && !sb.compact && homes &&
         (stage >= 3 || stage == 0 || l.world_size == 1);
}

bool NeedOf(const Layout& l, int g, const Homes& h, const StateBytes& sb, const ClusterSpec& cluster,
            const Config& config, uint64_t* host, uint64_t* disk) {
  *host = *disk = 0;
  if (h.gpu_optimizer) return false;  // the GPU updates W, M, V in place
  const uint64_t dirs = std::max<uint64_t>(1, config.strata.nvme_paths.size());
  const uint64_t dp = DTypeSize(config.compute_dtype());
  const size_t gi = static_cast<size_t>(g);
  const uint64_t opt = config.zero.stage >= 1 ? l.group_shard[gi] : l.group_numel[gi];
  // Stepped in units (the engine's Layout::SplitsIntoUnits, on a machine
  // without a GPU): a shard of W, M, V on NVMe larger than sub_group_size
  // does not speculate.
  const uint64_t unit = std::max<uint64_t>(2048, config.zero.sub_group_size / 2048 * 2048);
  if (!cluster.has_gpu && !sb.compact && h.opt == TierKind::kNvme && h.g != TierKind::kNvme &&
      (PIsW(config, h, sb, l) || h.p != TierKind::kNvme) && opt > unit)
    return false;
  const uint64_t p_home = config.zero.stage >= 3 ? l.group_shard[gi] : l.group_numel[gi];
  struct Written {
    TierKind home;
    uint64_t bytes;
    bool p;
  };
  const Written states[] = {{h.p, p_home * dp, true},
                            {h.opt, sb.W(opt), false},
                            {h.opt, sb.M(opt), false},
                            {h.opt, sb.V(opt), false}};
  const bool p_is_w = PIsW(config, h, sb, l);
  for (const Written& w : states) {
    if (w.bytes == 0) continue;  // Lion has no V
    if (w.p && p_is_w) continue;  // not written: W is P
    const bool copy = w.p && !sb.compact;
    if (w.home == TierKind::kNvme) {
      *disk += NvmeTier::PaddedSizeFor(w.bytes, dirs);
    } else if (w.home == TierKind::kHost || !cluster.has_gpu) {
      if (copy) continue;
      *host += AlignUp(w.p ? l.group_shard[gi] * 2 : w.bytes, kBackupAlign);
    } else if (!copy) {
      *host = *disk = 0;
      return false;
    }
  }
  return true;
}

// Capacity::speculation for a capacity sized without it, as the engine's
// build and StartOverlap (engine/overlap.cpp) size it: the host arena is
// strata.speculation_host_bytes ("auto": what every group needs, at most what
// the host tier has left), the swap's reservation strata.speculation_disk_bytes
// ("auto": what every group needs); both count in the tiers' totals. Groups
// are granted in the order their gradients complete (the last group first,
// for every GroupScheme) while their needs fit in what is left of the two.
void AddSpeculation(Capacity& c, const Layout& l, const ClusterSpec& cluster, const Config& config) {
  const Homes h = HomesOf(config, cluster, c.g_on_host);
  const StateBytes sb = StateBytesOf(config);
  Speculation& s = c.speculation;
  const size_t n = l.group_numel.size();
  s.host.assign(n, 0);
  s.disk.assign(n, 0);
  s.eligible.assign(n, 0);
  s.granted.assign(n, 0);
  for (size_t g = 0; g < n; ++g) {
    s.eligible[g] = NeedOf(l, static_cast<int>(g), h, sb, cluster, config, &s.host[g], &s.disk[g]);
    s.host_needed += s.host[g];
    s.disk_needed += s.disk[g];
  }
  const uint64_t used = c.Used(TierKind::kHost), cap = c.capacity[static_cast<size_t>(TierKind::kHost)];
  const uint64_t host_left = cap > used ? cap - used : 0;
  const uint64_t want_host = config.strata.speculation_host_bytes,
                 want_disk = config.strata.speculation_disk_bytes;
  s.host_bytes = want_host == StrataConfig::kSpeculationAuto ? std::min(s.host_needed, host_left) : want_host;
  // The engine reserves swap room only where state lives on NVMe.
  const bool nvme = h.p == TierKind::kNvme || h.opt == TierKind::kNvme;
  // "auto": what every group needs. (The engine's build caps it to keep the
  // swap within 1.5x the state and shares it with the step's writes in
  // flight, neither modelled here: the plan's swap is an upper bound.)
  s.disk_bytes = !nvme ? 0 : want_disk == StrataConfig::kSpeculationAuto ? s.disk_needed : want_disk;
  uint64_t host_room = s.host_bytes, disk_room = s.disk_bytes;
  for (size_t i = n; i-- > 0;) {
    if (!s.eligible[i] || s.host[i] > host_room || s.disk[i] > disk_room) continue;
    s.granted[i] = 1;
    host_room -= s.host[i];
    disk_room -= s.disk[i];
    s.host_granted += s.host[i];
    s.disk_granted += s.disk[i];
  }
  Add(c, PlanState::kSpeculation, TierKind::kHost, s.host_bytes);
  Add(c, PlanState::kSpeculation, TierKind::kNvme, s.disk_bytes);
}

}  // namespace

namespace {
// The engine's Layout of rank 0 for this plan (engine.cpp and build.cpp set
// it so): the ranks (a communicator where there are several; NCCL's with
// GPUs), the groups partitioned as the engine does, the homes.
void EngineLayoutOf(const ModelSpec& model, const Layout& l, const ClusterSpec& cluster, const Config& config,
                    const Homes& h, ::strata::Layout* el) {
  el->config = &config;
  const bool comm = l.world_size > 1;
  el->SetRanks(comm, 0, l.world_size, comm && cluster.has_gpu);
  el->device_on_gpu = cluster.has_gpu;
  el->dtype = config.compute_dtype();
  el->gdtype = config.grad_dtype();
  el->compact = config.strata.state_format == "compact";
  el->home[int(StateKind::kP)] = h.p;
  // G as the engine's build homes it: with the GPU's optimizer (opt_home
  // on the device) that is host memory, not the device the plan counts G's
  // bytes on (the device's copy is the trainer's).
  el->home[int(StateKind::kG)] = h.gpu_optimizer ? strata::GradHome(config.strata.grad_home, h.opt, true) : h.g;
  for (StateKind s : {StateKind::kW, StateKind::kM, StateKind::kV}) el->home[int(s)] = h.opt;
  for (size_t g = 0; g < model.groups.size(); ++g)
    (void)el->part.Add(static_cast<int>(g), model.groups[g].name, model.groups[g].numel);  // (MakeLayout took them)
  (void)el->part.Finalize(el->sworld);
  el->frozen_groups.assign(static_cast<size_t>(el->part.num_groups()), 0);
  el->SetStepUnits();
}

Capacity CapacityWith(const ModelSpec& model, const Layout& l, const ClusterSpec& cluster, const Config& config,
                      bool overlap_step, bool g_on_host) {
  Capacity c;
  const int stage = config.zero.stage;
  const uint64_t dp = DTypeSize(config.compute_dtype());
  const StateBytes sb = StateBytesOf(config);
  const Homes h = HomesOf(config, cluster, g_on_host);
  c.g_on_host = h.g == TierKind::kHost;
  const uint64_t opt_numel = stage >= 1 ? l.shard_numel : l.full_numel;
  // W, M, V per group (compact's block scales round up per group's shard).
  const std::vector<uint64_t>& opt_groups = stage >= 1 ? l.group_shard : l.group_numel;
  auto sum = [&](uint64_t (StateBytes::*bytes)(uint64_t) const) {
    uint64_t n = 0;
    for (uint64_t g : opt_groups) n += (sb.*bytes)(g);
    return n;
  };

  if (!PIsW(config, h, sb, l)) Add(c, PlanState::kP, h.p, (stage >= 3 ? l.shard_numel : l.full_numel) * dp);
  if (h.gpu_optimizer)
    Add(c, PlanState::kG, TierKind::kDevice, (stage >= 2 ? l.shard_numel : l.full_numel) * dp);
  else
    Add(c, PlanState::kG, h.g, sb.G(opt_numel));
  Add(c, PlanState::kW, h.opt, sum(&StateBytes::W));
  Add(c, PlanState::kM, h.opt, sum(&StateBytes::M));
  Add(c, PlanState::kV, h.opt, sum(&StateBytes::V));
  // The trainer's own device memory, outside strata.device_budget: its
  // activations and the gradient of one group (on the GPU). Without a GPU
  // the CPU layers keep both in host RAM beside strata.host_budget, where
  // they are not counted here.
  uint64_t trainer = cluster.has_gpu ? ActivationBytes(model) : 0;
  // The activation store (strata.activation_host_bytes, activation_nvme_bytes):
  // what the trainer stashes there leaves the device, and the store takes its
  // arena from the host budget and its swap on NVMe, as the engine reserves
  // them at build (what does not fit them stays on the device).
  const uint64_t store_host = config.strata.activation_host_bytes, store_nvme = config.strata.activation_nvme_bytes;
  if (store_host > 0 && cluster.has_gpu)
    trainer -= std::min({trainer, StashableActivationBytes(model), store_host + store_nvme});
  Add(c, PlanState::kActivations, TierKind::kDevice, trainer);
  Add(c, PlanState::kActivations, TierKind::kHost, store_host);
  if (store_host > 0 && store_nvme > 0) Add(c, PlanState::kActivations, TierKind::kNvme, NvmePadded(store_nvme));
  if (cluster.has_gpu) Add(c, PlanState::kWork, TierKind::kDevice, l.largest_group * dp);
  const uint64_t activations = cluster.has_gpu ? SatAdd(trainer, l.largest_group * dp) : 0;

  // The engine's device working buffers: the group in use plus the prefetch
  // window when P is fetched. Prefetching never passes the budget (it stops
  // when only nearer-used copies could go), so the window counts only where
  // the budget leaves room for it; the group in use always counts.
  const bool fetched = h.p != TierKind::kDevice || (stage >= 3 && l.world_size > 1);
  if (fetched) {
    const uint64_t window =
        std::max(l.largest_group, std::min(config.zero.prefetch_bucket_size, l.full_numel));
    const uint64_t want = (l.largest_group + window) * dp;
    const uint64_t budget = config.strata.device_budget;
    const uint64_t state = c.Used(TierKind::kDevice) - activations;  // the engine's device state so far
    const uint64_t room = budget > state ? budget - state : 0;
    Add(c, PlanState::kWork, TierKind::kDevice,
        budget ? std::max(std::min(want, room), l.largest_group * dp) : want);
  }

  // Pinned staging, as the engine's build sizes it (PlanStaging, on the
  // engine's own Layout of rank 0): the step's slots; P's staging (NVMe to
  // the GPU); G's, and the reduction's buffers with several ranks; each
  // buffer in whole pages, as the host tier charges them.
  ::strata::Layout el;
  EngineLayoutOf(model, l, cluster, config, h, &el);
  const StagingSizes z = PlanStaging(el, NvmePadded);
  el.opt_piece_bytes = z.piece_bytes;  // (as the engine's build sets it)
  const uint64_t step_slot = AlignUp(z.opt_offsets[kNumStates], 4096);
  const uint64_t step_slots = static_cast<uint64_t>(z.opt_slots);
  Add(c, PlanState::kStaging, TierKind::kHost, step_slots * step_slot);
  Add(c, PlanState::kStaging, TierKind::kHost, static_cast<uint64_t>(z.param_slots) * AlignUp(z.param_bytes, 4096));
  Add(c, PlanState::kStaging, TierKind::kHost, static_cast<uint64_t>(z.grad_slots) * AlignUp(z.grad_bytes, 4096));
  const uint64_t ranks = cluster.gpus_per_node;
  uint64_t device = cluster.has_gpu
                        ? static_cast<uint64_t>(static_cast<double>(cluster.device_bytes) * kDeviceUsable)
                        : cluster.device_bytes;
  const uint64_t host = HostBudgetOf(cluster, config);
  if (config.strata.device_budget) device = std::min(device, config.strata.device_budget > UINT64_MAX - activations
                                                               ? UINT64_MAX
                                                               : config.strata.device_budget + activations);
  c.capacity = {device, host, cluster.nvme_bytes() / ranks};
  // Write-behind's step staging (the engine's GrowStagingBehind): more
  // slots, until every unit's W, M, V fits them at once, where the host
  // budget has that much left after everything else; none under
  // speculation "always" with the overlapped step (its room comes first).
  // The step writes behind where the slots, grown or not, hold them.
  // Several ranks with P on NVMe: "auto" writes behind where stage 3's
  // gathered copies stay from step to step (the engine's keep_gathered, no
  // GPU): every group's copy within the device budget, each as the device
  // tier's pool charges it (the engine's AgreeKeepGathered).
  uint64_t copies = 0;
  for (int g = 0; g < el.num_groups(); ++g) copies += DeviceTier::MostCharged(el.PBytes(g));
  const bool p_kept = !cluster.has_gpu && el.p_sharded && copies <= device;
  if (!h.gpu_optimizer && step_slots > 0 && WriteBehindAllowed(config, el, p_kept)) {
    std::vector<int> groups(model.groups.size());
    std::iota(groups.begin(), groups.end(), 0);  // (the plan freezes none)
    const std::vector<uint64_t> pieces = BehindPieces(el, NvmePadded, groups);
    const int64_t slots = pieces.empty() ? -1 : BuffersForPieces(pieces, step_slot);
    const int64_t extra = slots - static_cast<int64_t>(step_slots);
    c.writes_behind = slots >= 0 && extra <= 0;
    const uint64_t used = c.Used(TierKind::kHost), cost = extra > 0 ? static_cast<uint64_t>(extra) * step_slot : 0;
    if (slots >= 0 && cost > 0 && used <= host && cost <= host - used &&
        !(overlap_step && config.strata.speculation == "always")) {
      Add(c, PlanState::kStaging, TierKind::kHost, cost);
      c.write_behind_slots = static_cast<int>(extra);
      c.writes_behind = true;
    }
  }
  if (overlap_step) AddSpeculation(c, l, cluster, config);
  return c;
}
}  // namespace

Capacity ComputeCapacity(const ModelSpec& model, const Layout& l, const ClusterSpec& cluster,
                         const Config& config, bool overlap_step) {
  // strata.grad_home "auto" as the engine's build decides it: G in host
  // memory when the host tier holds it there, else on NVMe.
  Capacity c = CapacityWith(model, l, cluster, config, overlap_step, true);
  if (config.strata.grad_home == "auto" && c.Used(TierKind::kHost) > c.capacity[static_cast<size_t>(TierKind::kHost)])
    c = CapacityWith(model, l, cluster, config, overlap_step, false);
  return c;
}

Result<Capacity> ComputeCapacity(const ModelSpec& model, const ClusterSpec& cluster, const Config& config,
                                 bool overlap_step) {
  STRATA_ASSIGN_OR_RETURN(Layout l, MakeLayout(model, static_cast<int>(cluster.world_size())));
  return ComputeCapacity(model, l, cluster, config, overlap_step);
}

}  // namespace strata::plan
