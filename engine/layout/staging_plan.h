// The host staging pools Build allocates (engine/layout/staging.h), sized in
// one place so that the check at Build's start and the allocation agree, and
// that check.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/layout/layout.h"

namespace strata {

struct StagingSizes {
  uint64_t opt_offsets[kNumStates + 1] = {};  // of each state in a step slot; [kNumStates]: slot bytes
  int opt_slots = 0;                          // 0: every state is addressed in place
  // The step's pieces (StagingPool::SetPieces): where every group that
  // trains is stepped in units (Layout::SplitsIntoUnits), the step and its
  // read-ahead take a job's W, M, V (a unit's, or a small group's) in a
  // piece of a slot of its size, not a whole slot. piece_bytes: the largest
  // unit's (0: whole slots). The slots then number max(2, buffer_count
  // largest units' worth): what the calls that move whole groups between
  // steps need (a checkpoint's save overlaps two), and at least buffer_count
  // of the largest pieces.
  uint64_t piece_bytes = 0;
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

// The bytes of a piece that holds group g's unit u's W, M, V (each at a
// multiple of 4096, padded as the NVMe tier pads them: `padded`), or
// (`largest`) a whole unit's of zero_optimization.sub_group_size elements.
uint64_t StepPieceBytes(const Layout& m, const std::function<uint64_t(uint64_t)>& padded, int g, int u, bool largest);

// The pools' sizes for layout `m` (homes chosen); `padded` is the NVMe
// tier's padding of a block's bytes. The step's slots, G's staging and the
// reduction's buffers are sized by the groups that train; frozen groups
// count only in P's fetch staging and their own buffer.
StagingSizes PlanStaging(const Layout& m, const std::function<uint64_t(uint64_t)>& padded);

// Write-behind (StepPipeline::RunBehind) holds every unit's W, M, V in the
// step's slots at once: whether config allows it for layout `m`
// (strata.write_behind "always"; "auto" at one rank, and at several where
// the ranks can agree on a lost write before anything reads it:
// BehindLossAgreeable), and the pieces of `groups`, in the
// step's order (each at a multiple of 4096, as the slots place them; none
// where the step is not in pieces, Layout::opt_piece_bytes 0, or the state
// is compact). How many slots hold them: staging.h's BuffersForPieces.
bool WriteBehindAllowed(const Config& c, const Layout& m, bool p_copies_kept);
// Several ranks: nothing reads a write left behind between one step and the
// next's prepare_step or step, so a write lost behind a step is agreed by
// every rank at the next step (or save), and they all fail together, their
// communicator intact. G is off NVMe, and so is P, or P's copies are kept:
// `p_copies_kept`, stage 3's gathered copies that stay in the device tier
// (no GPU) from step to step, each refreshed by the step (Residency's
// keep_gathered). The forward's fetches then load no P from NVMe after a
// step whose copies all took its new P; a step whose copies did not waits
// for its writes, and the ranks agree on them, before it returns
// (Engine::Impl::ApplyStep).
bool BehindLossAgreeable(const Layout& m, bool p_copies_kept);
std::vector<uint64_t> BehindPieces(const Layout& m, const std::function<uint64_t(uint64_t)>& padded,
                                   const std::vector<int>& groups);

// At Build's start, with homes chosen and nothing allocated: CONFIG naming
// strata.host_budget, the least host memory Build needs and what for, when
// `host_budget` cannot hold the host-homed blocks and the staging pools.
// `taken`: what else build takes from the host budget by number (the
// activations' arena, a speculation room in bytes), named by `taken_what`.
Status CheckHostPlan(const Layout& m, uint64_t host_budget, uint64_t taken = 0, const std::string& taken_what = "");

}  // namespace strata
