// Speculation: overlap_step's updates made during backward, before the step
// knows the gradients' norm and finiteness, held so that the step can still
// take them (commit) or undo them (discard) exactly.
//
// A speculated group's update runs as the step would run it without
// clipping (the coefficient 1) and with the loss scale of the moment. Its
// new W, M, V (and P) are then:
//   - NVMe-homed: written to fresh extents and held unsettled (NvmeTier
//     copies on write): the old extents stay until commit publishes the new
//     ones, or discard drops them. Room: strata.speculation_disk_bytes,
//     reserved in the swap files beyond the state's own at build.
//   - CPU-addressable (host, or the device tier's host arena): updated in
//     place after their old values were copied into this component's arena
//     (strata.speculation_host_bytes, taken from the host budget at build);
//     discard copies them back. Commit costs nothing.
//   - P in fp32 format (a copy of W in the compute dtype): rewritten by the
//     update wherever it lives; a discard marks it p_stale (recomputed from
//     the restored W, bitwise what it was) and a replay rewrites it anyway.
// Groups whose W, M, V the GPU updates in place, or whose state other than
// fp32's P lands in place on a GPU, are not eligible: they update after
// backward; nor are groups stepped in units (Layout::units), which commit
// unit by unit. A group that does not fit what is left of either room is not
// speculated either (the step updates it after backward, as without
// overlap). Budgets are never exceeded: the arena is one allocation, and
// reservations count every byte a group can take before it is handed out.
//
// Thread: Reserve, Backup, Hold, Ready and Fail run on the overlap thread
// (UpdateWorker) while backward goes on; Commit, Discard and the queries on
// the caller's, after that thread is idle (UpdateWorker::WaitIdle orders
// them). No lock of its own.
#pragma once

#include <functional>
#include <vector>

#include "engine/layout/block_io.h"
#include "engine/layout/layout.h"
#include "engine/step/group_step.h"
#include "engine/step/shard_store.h"

namespace strata {

class Speculation {
 public:
  // What group g's speculation takes: host bytes of backups, swap bytes of
  // fresh extents, and whether it may speculate at all (`gpu_updates(g)`:
  // the GPU updates its W, M, V in place). `padded`: an NVMe block's size.
  struct Needs {
    bool eligible = false;
    uint64_t host = 0, disk = 0;
  };
  static Needs NeedsOf(const Layout& layout, int g, bool gpu_updates, const std::function<uint64_t(uint64_t)>& padded);
  // Totals over the groups that train (for "auto" and the build's reservation).
  static Needs TotalNeeds(const Layout& layout, const std::function<bool(int)>& gpu_updates,
                          const std::function<uint64_t(uint64_t)>& padded);

  Speculation(const Layout& layout, const std::vector<GroupBlocks>& blocks, BlockIo& io, HostTier& host,
              std::vector<GroupStep>& steps, std::function<bool(int)> gpu_updates,
              std::function<uint64_t(uint64_t)> padded)
      : layout_(layout),
        blocks_(blocks),
        io_(io),
        host_(host),
        steps_(steps),
        gpu_updates_(std::move(gpu_updates)),
        padded_(std::move(padded)) {}
  ~Speculation();  // discards what is held (its extents return to the swap)
  Speculation(const Speculation&) = delete;
  Speculation& operator=(const Speculation&) = delete;

  // At build: the arena (`host_bytes` from the host tier) and the swap room
  // (`disk_bytes`, already reserved in the swap files).
  Status Init(uint64_t host_bytes, uint64_t disk_bytes);
  uint64_t host_bytes() const { return arena_.bytes; }
  uint64_t disk_bytes() const { return disk_budget_; }
  // Room reserved in the swap files since Init (between steps: the worker idle).
  void AddDiskRoom(uint64_t bytes) { disk_budget_ += bytes; }
  // The host arena, after an Init without one (between steps).
  Status AddHostRoom(uint64_t bytes);

  // Overlap thread. Takes room for g's speculation; false (nothing taken)
  // when g is not eligible, already reserved this step, or does not fit.
  bool Reserve(int g);
  // The old contents of `bytes` at `home` (a CPU-addressable block of g),
  // copied into g's room before the update changes them.
  void Backup(int g, const void* home, uint64_t bytes);
  // One of g's stores, landed and not settled: published by Commit.
  void Hold(int g, BlockMove move);
  // g's update is done and held; `p_stale`: its P did not land (commit
  // marks it p_stale, as a failed P store does without speculation).
  void Ready(int g, bool p_stale);
  // g's update failed part-way: what it wrote is undone now (held stores
  // dropped, backups restored) and g is left to the step.
  void Fail(int g);

  // Caller's thread, the overlap thread idle.
  // The groups whose speculation is ready, in the order they became so.
  const std::vector<int>& ready() const { return ready_; }
  // Publishes every ready group's update: each is committed for this step.
  void Commit();
  // Undoes every ready group's update: held stores dropped, backups
  // restored; fp32 format: P marked p_stale (recomputed from W).
  void Discard();

 private:
  struct Backup_ {
    void* home;
    uint64_t offset;  // into the arena
    uint64_t bytes;
  };
  struct Record {
    bool reserved = false, ready = false, p_stale = false;
    uint64_t host = 0, disk = 0;  // reserved
    uint64_t host_at = 0;         // its room in the arena
    uint64_t host_used = 0;
    std::vector<Backup_> backups;
    std::vector<BlockMove> held;
  };
  void FailUnready();  // reserved and never ready (a run that stopped): undone
  void Undo(Record& r);
  // Not compact, P used and not on NVMe (where its store is held, not in
  // place): P may hold the undone update; it is rewritten from W.
  void MarkPStale(int g);
  void Release(Record& r);  // the room goes back (when nothing is reserved any more, the arena rewinds)

  const Layout& layout_;
  const std::vector<GroupBlocks>& blocks_;
  BlockIo& io_;
  HostTier& host_;
  std::vector<GroupStep>& steps_;
  const std::function<bool(int)> gpu_updates_;
  const std::function<uint64_t(uint64_t)> padded_;
  Allocation arena_;
  uint64_t arena_top_ = 0;  // bump: rewinds when every reservation is released
  uint64_t disk_budget_ = 0, disk_used_ = 0;
  int reserved_ = 0;
  std::vector<Record> records_;
  std::vector<int> ready_;
};

}  // namespace strata
