// The host staging pools Build allocates (engine/layout/staging.h), sized in
// one place so that the check at Build's start and the allocation agree, and
// that check.
#pragma once

#include <cstdint>
#include <functional>

#include "engine/layout/layout.h"

namespace strata {

struct StagingSizes {
  uint64_t opt_offsets[kNumStates + 1] = {};  // of each state in a step slot; [kNumStates]: slot bytes
  int opt_slots = 0;                          // 0: every state is addressed in place
  // The step's pieces (StagingPool::SetPieces): where every group that
  // trains is stepped in units (Layout::SplitsIntoUnits), the step and its
  // read-ahead take a unit's W, M, V in a piece of a slot, not a whole slot:
  // of each state in a piece; [kNumStates]: piece bytes (0: whole slots).
  // The slots then number max(2, buffer_count / pieces a slot): what the
  // calls that move whole groups between steps need (a checkpoint's save
  // overlaps two), and at least buffer_count pieces.
  uint64_t piece_offsets[kNumStates + 1] = {};
  int param_slots = 0;
  uint64_t param_bytes = 0;
  int grad_slots = 0;
  uint64_t grad_bytes = 0;
  // A frozen group's P off the CPU's reach (NVMe, a GPU): one buffer of the
  // largest, for build, read_master, write_state and checkpoints.
  int frozen_slots = 0;
  uint64_t frozen_bytes = 0;
};

// Slots of the step's pipeline: offload_optimizer.buffer_count, at least 3
// (read ahead, update, write behind), at most 16.
int StepSlots(const Config& c);
// The groups whose writes the step has in flight at once with `slots`
// slots (StepPipeline): a batch, half the slots, under strata.step_io
// "alternate"; all but one of at least 3 under "concurrent".
int StepGroupsWriting(int slots, bool concurrent);

// The pools' sizes for layout `m` (homes chosen); `padded` is the NVMe
// tier's padding of a block's bytes. The step's slots, G's staging and the
// reduction's buffers are sized by the groups that train; frozen groups
// count only in P's fetch staging and their own buffer.
StagingSizes PlanStaging(const Layout& m, const std::function<uint64_t(uint64_t)>& padded);

// At Build's start, with homes chosen and nothing allocated: CONFIG naming
// strata.host_budget, the least host memory Build needs and what for, when
// `host_budget` cannot hold the host-homed blocks and the staging pools.
Status CheckHostPlan(const Layout& m, uint64_t host_budget);

}  // namespace strata
