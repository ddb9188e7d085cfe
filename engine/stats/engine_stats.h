// The engine's figures (EngineStats): tiers, moves, fetches, the last
// step's busy times. StatsRecorder (stats.h) keeps them; engine.h returns them.
#pragma once

#include <cstdint>

namespace strata {

// Per-tier and per-step figures.
struct TierStats {
  uint64_t budget = 0, used = 0, peak = 0;
};
struct EngineStats {
  TierStats device, host, nvme;
  // Bytes moved between tiers, cumulative.
  uint64_t nvme_to_host = 0, host_to_nvme = 0, host_to_device = 0, device_to_host = 0;
  uint64_t fetches = 0, prefetch_hits = 0;  // fetches after the trace exists
  uint64_t fetch_stalls = 0;
  double fetch_stall_s = 0;
  // Busy seconds of each resource in the last step, and its wall time.
  double disk_busy_s = 0, copy_busy_s = 0, cpu_optimizer_s = 0, step_wall_s = 0;
  double prefetch_hit_rate() const { return fetches ? double(prefetch_hits) / double(fetches) : 0; }
  double overlap_efficiency = 0;  // largest busy time / wall time, last step
  uint64_t steps = 0, skipped_steps = 0;
  // The device tier's pool: bytes of free blocks kept (within device.used),
  // cudaMalloc calls so far, and allocations served from the cache.
  uint64_t device_cached = 0, device_raw_allocs = 0, device_pool_hits = 0;
  // Stage 3 with overlap_comm: groups gathered ahead on the communication
  // thread (the fetch that followed found them gathered), and those the
  // ranks let the fetch gather instead (a shard not loaded on some rank).
  uint64_t gathers_ahead = 0, gathers_ahead_declined = 0;
  // Stage 3 with several ranks: all-gathers of a group's parameters for its
  // fetches, cumulative (in the fetch or ahead of it). Once per group and
  // step in forward, and again in backward unless the device budget holds
  // every group gathered (residency.h, keep_gathered).
  uint64_t p_gathers = 0;
  // A step that updated after backward: bytes of NVMe-homed W, M, V read
  // during backward into free step slots (StepPipeline::ReadAhead) that the
  // step then used, cumulative.
  uint64_t step_read_ahead_bytes = 0;
  // Steps that returned before their W, M, V writes to NVMe were done
  // (strata.write_behind), cumulative; not one that waited for them before
  // it returned (Engine::Impl::ApplyStep).
  uint64_t write_behind_steps = 0;
  // Several ranks: the gradients' reductions (each group's) and the gathers
  // of P (stage 3's for a fetch, in it or ahead of it; stages 1-2's after
  // the update and where P is recomputed from W), the GradReducer's
  // collectives, cumulative, on whichever thread ran them (strata.h says
  // what is not counted): their wall seconds, the CPU seconds of that
  // thread within them (the rest waited for other ranks, or for Gloo's own
  // threads over TCP), the bytes this rank put into reductions (fp32,
  // packed: the group padded to the ranks' shards, one shard at stage 0)
  // and the bytes of P it gathered (whole groups). Not at one rank.
  double comm_s = 0, comm_cpu_s = 0;
  uint64_t reduced_bytes = 0, gathered_bytes = 0;
  // Seconds during which the engine waited for the writes a step left
  // behind (strata.write_behind: StepPipeline::WaitBehind, from prepare_step,
  // step, an NVMe read's gate on any thread, checkpoints, state access),
  // cumulative; threads waiting at once count once.
  double behind_wait_s = 0;
  // Of reduced_bytes, those reduce-scattered from lent gradient parts where
  // they lay (GradReducer::LendsParts), without packing.
  uint64_t lent_reduced_bytes = 0;
  // overlap_step: steps whose early updates were speculative (held until
  // the norm was known), and of those the ones committed, replayed (clipping
  // applied, or the options changed: redone after backward) and discarded
  // (a skipped step: fp16 overflow, strata.nonfinite); groups updated before
  // the end of backward (speculated or committed early); and the last
  // step's exposed time: from the return of its last grads call to the
  // return of step (0 when it had no grads call).
  uint64_t speculated_steps = 0, committed_steps = 0, replayed_steps = 0, discarded_steps = 0;
  uint64_t early_updates = 0;
  // Steps whose early updates would have been speculative and that did not
  // speculate (strata.speculation: the policy expected a discard, or
  // "never"); they updated after backward.
  uint64_t unspeculated_steps = 0;
  // Stashed activations (activations/activation_store.h), cumulative: bytes
  // stashed into the host arena and, of those, sent on to NVMe; stashes redeemed; redeems of
  // NVMe stashes read ahead in time (hits) or waited for (stalls, seconds),
  // and the bytes stashed and not yet redeemed or dropped.
  uint64_t act_host_bytes = 0, act_nvme_bytes = 0, act_redeemed = 0, act_prefetch_hits = 0, act_stalls = 0;
  double act_stall_s = 0;
  uint64_t act_live_bytes = 0;
  double exposed_step_s = 0;
};

}  // namespace strata
