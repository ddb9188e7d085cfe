// BlockIo: moves one state block between its home tier and host memory,
// asynchronously: NVMe reads and writes through the NvmeTier (checksummed),
// device copies through the DeviceTier's streams (or copy threads). Blocks
// whose home the CPU can address (host, or the device tier's host arena)
// need no move at all: Direct() says so and DirectPtr() gives the memory.
#pragma once

#include <functional>
#include <vector>

#include "engine/stats/stats.h"
#include "tiers/device_tier.h"
#include "tiers/host_tier.h"
#include "tiers/nvme_tier.h"

namespace strata {

enum class StateKind : int { kP = 0, kW = 1, kM = 2, kV = 3, kG = 4 };
inline constexpr int kNumStates = 5;
const char* StateName(StateKind s);

// One (group, shard, state) block in its home tier. An NVMe block of a group
// stepped in units (Layout::units) is stored in parts, one per unit, each
// its own NVMe block (copy on write, checksummed, settled on its own); the
// whole block's alloc then holds the parts' charge in all and no address,
// and every move of the whole block moves all its parts.
struct StateBlock {
  TierKind home = TierKind::kHost;
  Allocation alloc;
  uint64_t bytes = 0;  // of the shard, padding included
  std::vector<StateBlock> parts;  // in order, back to back: unit u at part u
  // Part u, or the block itself when it has no parts.
  const StateBlock& Part(int u) const { return parts.empty() ? *this : parts[static_cast<size_t>(u)]; }
};

// An asynchronous move in flight (or nothing).
struct BlockMove {
  // kParts: a block in parts, one move a part (in `parts`).
  enum Kind : uint8_t { kNone, kNvme, kCopy, kParts } kind = kNone;
  NvmePending nvme;
  std::vector<BlockMove> parts;
  CopyTicket copy;
  double start = 0;
  uint64_t bytes = 0;
  const char* name = "";
  bool io_done = false;  // WaitIo ran (its disk span is recorded)
};

class BlockIo {
 public:
  BlockIo(DeviceTier* device, HostTier* host, NvmeTier* nvme, StatsRecorder* stats)
      : device_(device), host_(host), nvme_(nvme), stats_(stats) {}

  Result<StateBlock> Allocate(TierKind home, uint64_t bytes);
  // An NVMe block in parts of these sizes (StateBlock::parts); nothing is
  // left allocated on error.
  Result<StateBlock> AllocateParts(const std::vector<uint64_t>& part_bytes);
  void Free(StateBlock& b);
  bool Direct(const StateBlock& b) const { return DirectAt(b.home, device_->separate()); }
  // Whether a block homed in `home` is CPU-addressable in place: the host
  // tier, or the device tier when it is a plain host arena (no GPU, not
  // strict). `device_separate`: DeviceTier::separate().
  static bool DirectAt(TierKind home, bool device_separate) {
    return home == TierKind::kHost || (home == TierKind::kDevice && !device_separate);
  }
  void* DirectPtr(const StateBlock& b) const { return b.alloc.ptr; }

  // home -> dst (host memory, NVMe-aligned, at least NvmeBuffer(b.bytes) bytes).
  Result<BlockMove> StartLoad(const StateBlock& b, void* dst);
  // An NVMe block's version (NvmeTier::Version): a load started at version v
  // (BlockMove::nvme.version) holds its contents while this is still v.
  // (In parts: the sum of the parts' versions, which any publication raises.)
  uint64_t Version(const StateBlock& b) const {
    if (b.home != TierKind::kNvme || !nvme_) return 0;
    if (b.parts.empty()) return nvme_->Version(b.alloc);
    uint64_t v = 0;
    for (const StateBlock& p : b.parts) v += nvme_->Version(p.alloc);
    return v;
  }
  // src -> home. `checksum`: StoreChecksum(b, src), computed earlier (NVMe).
  Result<BlockMove> StartStore(const StateBlock& b, const void* src, const uint64_t* checksum = nullptr);
  // What StartStore would checksum for `src` (NVMe-homed blocks; else 0):
  // callers compute it while the disk is busy with something else. (A block
  // in parts: 0, and StartStore checksums each part itself.)
  uint64_t StoreChecksum(const StateBlock& b, const void* src) const;
  // Waits for an NVMe move's I/O only (a load's data is in place, not yet
  // verified); Finish must still follow. Other moves: nothing.
  void WaitIo(BlockMove& m);
  Status Finish(BlockMove& m);
  // A store whose publication waits for its siblings' (a group's W, M, V
  // land together): WaitStore returns the move's result without publishing
  // an NVMe write (copy on write: the block still holds its old contents);
  // SettleStore then publishes it or discards it. Other moves land in place
  // and settle as they finish.
  Status WaitStore(BlockMove& m);
  void SettleStore(BlockMove& m, bool publish);
  Status Load(const StateBlock& b, void* dst);
  // A block in parts (a group stepped in units) is stored one part at a
  // time, each published as it is written: a failure at part k leaves parts
  // before k new and the rest old. *parts_stored (where given) says how many
  // were published: 0 on a failure means nothing changed.
  Status Store(const StateBlock& b, const void* src, size_t* parts_stored = nullptr);

  // An NVMe block of `bytes`: what it takes on disk (NvmeTier::PaddedSize),
  // and what a buffer it is loaded into or stored from must hold
  // (NvmeTier::BufferSize; no more at any number of swap folders).
  uint64_t NvmePadded(uint64_t bytes) const { return nvme_ ? nvme_->PaddedSize(bytes) : bytes; }
  uint64_t NvmeBuffer(uint64_t bytes) const { return nvme_ ? nvme_->BufferSize(bytes) : bytes; }

  // Called before every move of an NVMe-homed block starts (a load or a
  // store, a block in parts once): the step's writes left behind
  // (StepPipeline::Gate) finish first, so that no read finds a block's old
  // contents and no write races theirs. An error fails the move with it.
  // Set once, before use.
  void SetGate(std::function<Status()> gate) { gate_ = std::move(gate); }

 private:
  std::function<Status()> gate_;
  // host -> home (to_home) or home -> host.
  Result<BlockMove> Start(const StateBlock& b, void* host, bool to_home, const uint64_t* checksum);

  DeviceTier* device_;
  HostTier* host_;
  NvmeTier* nvme_;
  StatsRecorder* stats_;
};

}  // namespace strata
