// ActivationStore: a trainer's saved activations in the tiers. A trainer
// stashes a buffer during forward and redeems it in backward:
//   - Stash copies the buffer (device memory with a GPU, else host memory)
//     into host memory — an arena of strata.activation_host_bytes taken from
//     the host budget at build — and returns a handle. When the arena would
//     keep less free than the prefetch window, the buffer goes on to NVMe
//     instead: copied into the arena, then written by this component's
//     thread through the NVMe tier (io_uring, O_DIRECT, an XXH3 checksum per
//     block) to swap reserved for activations (strata.activation_nvme_bytes),
//     its arena room given back once the write is done.
//   - Redeem copies a stash back into the caller's buffer and frees it. A
//     stash on NVMe is read back by the thread ahead of its redeem: each
//     redeem queues reads of the stashes before it in stash order (backward
//     redeems in reverse) up to strata.activation_prefetch_bytes, so the next
//     redeem finds its data in the arena. A read whose checksum does not
//     match is CORRUPT, naming the stash; its data is never handed out.
//   - Drop frees a stash unread (a backward that did not run).
// Budgets are never exceeded: the arena is one host allocation, the swap is
// reserved at build, and a stash that fits neither is refused (NOMEM naming
// both). Activations never enter checkpoints.
//
// Thread: Stash, Redeem and Drop on the caller's thread (the engine's one
// driving thread); reads and writes on this component's thread. mu_ guards
// every field below it; the I/O runs without it.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/stats/stats.h"
#include "tiers/device_tier.h"
#include "tiers/extent_allocator.h"
#include "tiers/host_tier.h"
#include "tiers/nvme_tier.h"

namespace strata {

struct ActivationOptions {
  uint64_t host_bytes = 0;  // the arena (strata.activation_host_bytes)
  uint64_t nvme_bytes = 0;  // swap reserved for stashes (strata.activation_nvme_bytes); 0: none
  uint64_t window = 0;      // bytes read ahead of the redeems (strata.activation_prefetch_bytes)
};

// Cumulative figures.
struct ActivationStats {
  // Every stash's bytes (each is copied into the arena first) / those of
  // them sent on to NVMe (at once, or spilled later): nvme <= host.
  uint64_t stashed_host_bytes = 0, stashed_nvme_bytes = 0;
  uint64_t redeemed = 0;        // stashes redeemed
  uint64_t prefetch_hits = 0;   // NVMe stashes whose data was in the arena when redeemed
  uint64_t stalls = 0;          // redeems that waited for the disk
  double stall_s = 0;
  uint64_t live_bytes = 0;      // stashed and not yet redeemed or dropped
};

class ActivationStore {
 public:
  ActivationStore(ActivationOptions options, DeviceTier& device, HostTier& host, NvmeTier* nvme,
                  StatsRecorder& stats);
  ~ActivationStore();  // stops the thread (waits for its I/O), frees everything
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  // The arena, from the host tier (NOMEM naming the host budget); the thread.
  Status Init();

  Result<uint64_t> Stash(const void* src, uint64_t bytes);
  Status Redeem(uint64_t handle, void* dst, uint64_t bytes);
  Status Drop(uint64_t handle);
  // Waits until no write or read is in flight (tests; save, load and write_state).
  void WaitIdle();
  ActivationStats stats() const;

 private:
  enum class Where : uint8_t { kArena, kWriting, kDisk, kReading, kRead };
  struct Item {
    uint64_t bytes = 0;
    uint64_t seq = 0;      // stash order
    Where where = Where::kArena;
    uint64_t arena = ~uint64_t{0};  // offset in the arena (kArena, kWriting, kReading, kRead)
    Allocation disk;       // kWriting, kDisk, kReading, kRead
    Status io;             // a failed write or read, reported at redeem
    bool dropped = false;  // dropped while its I/O ran: freed by the thread
    // Its write to NVMe failed (it stays in the arena): never spilled again,
    // else a failing disk would have TakeArena spill it and wait forever.
    bool spill_failed = false;
  };
  struct Job {
    uint64_t handle;
    bool write;
  };

  // A stash's room in the arena: the bytes its NVMe I/O moves
  // (NvmeTier::BufferSize), page-aligned; no more at any number of folders.
  uint64_t ArenaBytes(uint64_t bytes) const;
  // What a stash takes of the activations' swap (NvmeTier::PaddedSize: the
  // stripes over the folders, each aligned), counted against nvme_bytes.
  uint64_t DiskBytes(uint64_t bytes) const;
  char* ArenaAt(uint64_t off) const { return static_cast<char*>(arena_.ptr) + off; }
  // REQUIRES: mu_. Room for `bytes` in the arena, waiting for writes to
  // finish when some are in flight; UINT64_MAX when there is none.
  uint64_t TakeArena(std::unique_lock<std::mutex>& lock, uint64_t bytes);
  void FreeItem(Item& it);  // REQUIRES: mu_
  // "" or, once a spill failed, the words saying so (for a refusal). REQUIRES: mu_
  std::string SpillFailure() const;
  // REQUIRES: mu_. A stash kept in the arena goes on to NVMe (its write is
  // queued, first or last); false when the swap has no room for it.
  bool Spill(uint64_t handle, bool first);
  void QueueReadsBefore(uint64_t seq);  // REQUIRES: mu_
  void Run();
  Status CopyIn(const void* src, void* dst, uint64_t bytes);   // caller's buffer -> arena
  Status CopyOut(const void* src, void* dst, uint64_t bytes);  // arena -> caller's buffer

  const ActivationOptions options_;
  DeviceTier& device_;
  HostTier& host_;
  NvmeTier* nvme_;
  StatsRecorder& stats_;
  Allocation arena_;
  std::unique_ptr<ExtentAllocator> extents_;
  std::thread thread_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Item> items_;
  std::deque<Job> jobs_;
  int in_flight_ = 0;  // jobs taken by the thread and not done
  uint64_t next_handle_ = 1, next_seq_ = 0;
  uint64_t nvme_used_ = 0;
  Status spill_error_;  // the last failed write of a stash to NVMe
  bool stop_ = false;
  ActivationStats st_;
};

}  // namespace strata
