// GpuUpdater: the optimizer on the GPU for state homed on the device — the
// choice (made once, at build, from gpu_update.h's plain decisions), the
// device scratch it reserves there (from the device budget, never past it),
// the kernels' stream, and one group's update in place: G copied in, the
// CUDA twin of the CPU kernel, P written on the device or copied home.
//
// Touches: the layout and home blocks (read), the device tier (its scratch,
// copies), the stats, and the shard store's compact arrays. No lock: the
// scratch is used by one update at a time (the step's pipeline runs one
// group at a time, on one thread: the overlap thread's or the step's after
// it is idle), and each update ends synchronized.
#pragma once

#include <vector>

#include "engine/layout/layout.h"
#include "engine/stats/stats.h"
#include "engine/step/gpu_update.h"
#include "engine/step/shard_store.h"
#include "tiers/device_tier.h"
#include "tiers/gpu.h"

namespace strata {

// How far a group's update on the GPU got (Update).
enum class GpuUpdateOutcome : uint8_t {
  kUntouched,  // failed before the kernel: W, M, V are as they were
  kPartial,    // failed from the kernel's launch on: W, M, V may be neither old nor new
  kUpdated,    // W, M, V are new (P may still have failed to reach its home)
};

class GpuUpdater {
 public:
  // `twin` (tests): the CPU kernels stand in for CUDA's on a host-arena device tier.
  GpuUpdater(const Layout& layout, const std::vector<GroupBlocks>& blocks, DeviceTier& device, StatsRecorder& stats,
             const ShardStore& shards, bool twin)
      : layout_(layout), blocks_(blocks), device_(device), stats_(stats), shards_(shards), twin_(twin) {}
  ~GpuUpdater() { TearDown(); }
  GpuUpdater(const GpuUpdater&) = delete;
  GpuUpdater& operator=(const GpuUpdater&) = delete;

  // At build, once the home blocks are allocated: decides (strata.gpu_optimizer,
  // a GPU, a CUDA twin, the budget) and reserves the scratch; logs once when
  // the CPU updates device state.
  void SetUp();
  void TearDown();
  bool UpdatesOnGpu(int g) const;  // this group's W, M, V are updated on the GPU, in place
  // One group's update on the GPU: `at` holds W, M, V (and P when homed on
  // the device) as device pointers, G and any other P as host memory. Returns
  // after the stream's synchronization, with *outcome saying what changed.
  Status Update(int g, float* const at[kNumStates], const StepKernelOptions& ko, GpuUpdateOutcome* outcome);

 private:
  Status UpdateCompact(int g, float* const at[kNumStates], const StepKernelOptions& ko, GpuUpdateOutcome* outcome);

  const Layout& layout_;
  const std::vector<GroupBlocks>& blocks_;
  DeviceTier& device_;
  StatsRecorder& stats_;
  const ShardStore& shards_;
  const bool twin_;
  bool on_ = false;
  Allocation scratch_;  // device: one shard's G, then (P homed elsewhere, bf16/fp16) its new P
  GpuScratchPlan plan_;
  gpu::Stream stream_ = nullptr;  // the kernels' stream
};

}  // namespace strata
