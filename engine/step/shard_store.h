// ShardStore: where this rank's shard of a group's state is for the CPU, in
// either strata.state_format, for every path that is not the step's
// pipeline (build, read_state, write_state, checkpoints) and for the
// pipeline's compact arrays.
//
// "compact" (bf16 compute only): W's block holds the master's int8
// corrections, M's and V's their codes then their scales, and P's block
// (this rank's slice of it, at PSliceOffset) is the master's bf16 half: P is
// part of the optimizer state. "fp32": W, M, V are fp32 arrays and P a copy.
//
// Touches: the layout and the home blocks (read), the blocks' I/O, and two
// staging pools it borrows slots from (the step's, and the frozen groups'
// buffer). No lock and no thread: callers run between steps, or (the
// pipeline) own the group they ask about.
#pragma once

#include <array>
#include <vector>

#include "engine/layout/layout.h"
#include "engine/layout/staging.h"
#include "kernels/cpu/compact.h"

namespace strata {

// A shard's P (compact), W, M, V blocks where the CPU addresses them: in
// place, or in one staging slot held until destruction.
struct ShardBlocks {
  void* at[kNumStates] = {};
  void* slot = nullptr;
  StagingPool* pool = nullptr;
  ShardBlocks() = default;
  ShardBlocks(const ShardBlocks&) = delete;
  ShardBlocks& operator=(const ShardBlocks&) = delete;
  ~ShardBlocks();
};

// A shard's W, M, V in one format, for conversions: fp32 (f: W, M, V; V
// null for Lion) or compact (cs).
struct FormatView {
  bool compact = false;
  float* f[3] = {};
  kernels::CompactState cs{};
  // Array k of saved state s (0 W, 1 M, 2 V; manifest::SavedArrays' order)
  // at element `at` (a multiple of kCompactBlock for the scales); null for
  // a state not kept.
  char* Array(int s, int k, uint64_t at) const;
  FormatView Shift(uint64_t at) const;  // every array from element `at` on
};
// n elements of `from` into `to`: packs fp32 into compact, or unpacks.
Status ConvertView(const FormatView& from, const FormatView& to, uint64_t n);

using GroupBlocks = std::array<StateBlock, kNumStates>;

class ShardStore {
 public:
  // `blocks`: per group, its blocks in their homes (the vector outlives the store).
  ShardStore(const Layout& layout, const std::vector<GroupBlocks>& blocks, BlockIo& io, StagingPool& opt_staging,
             StagingPool& frozen_staging)
      : layout_(layout), blocks_(blocks), io_(io), opt_staging_(opt_staging), frozen_staging_(frozen_staging) {}

  // The compact arrays of group g's shard, from where its P, W, M, V blocks
  // are in memory (v null for Lion).
  kernels::CompactState CompactAt(int g, void* p, void* w, void* m, void* v) const;
  // This rank's shard of group g's W, M, V as fp32, whatever the format (n =
  // shard_numel floats each; v null when the optimizer keeps none).
  Status ReadShardF32(int g, float* w, float* m, float* v);
  // The reverse: packs (compact) or copies them into their homes; with
  // compact, P's slice too (with several ranks in stages 1-2 the caller
  // gathers the other slices).
  Status WriteShardF32(int g, const float* w, const float* m, const float* v);
  // Where group g's blocks are for the CPU: in place, or in a slot (read
  // from their homes when `load`; a P holding the whole group always is).
  Status LocateShard(int g, bool load, ShardBlocks* sb);
  // A frozen group's P where the CPU addresses it: in place, or in the
  // frozen groups' buffer (read from its home when `load`). sb->at[kP] holds
  // PHomeNumel(g) elements of the compute dtype; StoreShard writes it back.
  Status LocateFrozenP(int g, bool load, ShardBlocks* sb);
  // Writes the slot-staged blocks of `sb` back to their homes.
  Status StoreShard(int g, const ShardBlocks& sb);
  // What a checkpoint saves of state s (kW, kM, kV) of group g, as up to two
  // pieces in memory, from where the blocks are (`at`, by StateKind): fp32
  // the block; compact W the bf16 half (P's slice) then the corrections; a
  // frozen group's (s = kP) its slice of P (FrozenSavedBytes).
  struct Piece {
    const void* ptr;
    uint64_t bytes;
  };
  int SavedPieces(int g, int s, void* const at[kNumStates], Piece out[2]) const;
  FormatView ShardView(int g, const ShardBlocks& sb) const;  // the engine's format

 private:
  const Layout& layout_;
  const std::vector<GroupBlocks>& blocks_;
  BlockIo& io_;
  StagingPool& opt_staging_;
  StagingPool& frozen_staging_;
};

}  // namespace strata
