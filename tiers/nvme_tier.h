// NvmeTier: swap files under one or more directories (one per drive), space
// reserved up front with fallocate, blocks striped across the files, an
// extent allocator inside them, and an XXH3 checksum per block kept in
// memory and verified on every read. Writes are copy on write: a block's new
// contents go to a fresh extent, and the block moves there only once the
// write is done (its old extent is then released), so a failed write leaves
// the block's previous contents readable. Names are stable across runs:
// <dir>/strata-swap.r<rank>.s<stripe>.bin. Thread-safe.
#pragma once

#include <atomic>

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/align.h"
#include "io/storage.h"
#include "tiers/extent_allocator.h"
#include "tiers/tier.h"

namespace strata {

struct NvmeTierOptions {
  std::vector<std::string> dirs;  // one swap file per directory
  uint64_t budget = 0;            // bytes of swap in all, split over the dirs
  // Reserved beyond the budget for the fresh extents of writes in flight
  // (copy on write): at least the bytes of the blocks written at once.
  uint64_t spare = 0;
  // A rewrite that finds no free range of its size (the holes old versions
  // left are smaller, or apart) takes several (its bytes scattered over
  // them, read and written as one I/O), and the files grow only when the
  // free ranges together are too small: by the block's size, logged,
  // instead of failing NoSpace (NoSpace still when the disk cannot hold it).
  bool grow_for_holes = false;
  int rank = 0;
  bool checksums = true;
  Storage* storage = nullptr;     // REQUIRED, outlives the tier
};

// Where a block's bytes are in each swap file: one range, or (a rewrite
// that found no free range of its size) several, in order.
struct NvmeExtent {
  uint64_t offset = 0, len = 0;  // per file
};
using NvmeExtents = std::vector<NvmeExtent>;

// An I/O in flight on one block; finish it with NvmeTier::Finish.
struct NvmePending {
  IoTicket ticket;
  uint64_t id = 0;
  void* buf = nullptr;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
  uint64_t offset = 0;  // where the I/O goes (a write: its fresh extent's first range), for error messages
  NvmeExtents at;       // a write: its fresh extent
  uint32_t gen = 0;
  uint64_t version = 0;  // a read: the block's version (NvmeTier::Version) when it started
  bool is_read = false;
  bool waited = false;   // WaitIo ran: io_status holds the I/O's result
  bool settled = false;  // a write's extent was published or discarded
  bool in_place = false;  // a write to a block holding nothing yet: its own extent
  Status io_status;
};

class NvmeTier final : public Tier {
 public:
  // Creates the swap files and reserves the space; a full disk is an error
  // naming the directory, the bytes wanted and the bytes free.
  static Result<std::unique_ptr<NvmeTier>> Create(const NvmeTierOptions& options);
  ~NvmeTier() override;
  Result<Allocation> Allocate(uint64_t bytes) override;
  void Free(const Allocation& a) override;

  // Alignment that buffers handed to Start* must have; they must also be
  // at least BufferSize(bytes) long: a block's I/O reads or writes no byte
  // of the buffer beyond it (the padding up to it is written, not checked),
  // however many folders the block is striped over.
  uint64_t align() const { return align_; }
  uint64_t BufferSize(uint64_t bytes) const { return AlignUp(bytes, align_); }
  // What a block of `bytes` takes on disk (and is charged): `bytes` cut over
  // the folders' files, each stripe aligned. At least BufferSize(bytes).
  uint64_t PaddedSize(uint64_t bytes) const;
  // The padding rule itself. Before the files exist callers use the usual
  // direct-I/O alignment (4 KiB; a drive that needs more is found at
  // Allocate, as NoSpace naming the sizes) to size the reservation.
  static uint64_t PaddedSizeFor(uint64_t bytes, uint64_t dirs, uint64_t align = 4096) {
    return AlignUp((bytes + dirs - 1) / dirs, align) * dirs;
  }

  // Writes `bytes` of `src` as the block's new contents, to a fresh extent:
  // until the write is settled, reads get the previous contents, and a
  // failed write leaves them in place (a block never written stays
  // unreadable). NoSpace when no fresh extent is free.
  // `checksum`, when given, is BlockChecksum(src, bytes) computed by the
  // caller ahead of time (off the disk's critical path); else it is computed
  // here before the write is submitted.
  Result<NvmePending> StartWrite(const Allocation& a, const void* src, const uint64_t* checksum = nullptr);
  Result<NvmePending> StartRead(const Allocation& a, void* dst);
  // Waits for the I/O only: the disk is done with the buffer (a read's data
  // is in it, unverified). Finish must still follow.
  void WaitIo(NvmePending& p);
  // Waits (unless WaitIo did); for a read, verifies the checksum (CORRUPT
  // names file and offset); a write is settled: published when it
  // succeeded, discarded when not.
  Status Finish(NvmePending& p);
  // For writes that must land together (a group's W, M, V): WaitWrite waits
  // and returns the I/O's result without publishing anything; Settle then
  // publishes (the block now holds the new contents, its old extent is
  // released) or discards (the new extent is released, the block keeps its
  // old contents). Every write is settled exactly once, by Finish or Settle.
  Status WaitWrite(NvmePending& p);
  void Settle(NvmePending& p, bool publish);
  // The checksum StartWrite keeps for `bytes` of `src` (0 without checksums).
  uint64_t BlockChecksum(const void* src, uint64_t bytes) const;
  // Counts the block's published writes: a read that started at version v
  // holds the block's contents while Version is still v (0: unknown block).
  uint64_t Version(const Allocation& a);
  Status Write(const Allocation& a, const void* src);
  Status Read(const Allocation& a, void* dst);

  const std::vector<std::string>& paths() const { return paths_; }

  // Reserves `bytes` more of spare (split over the files, as at Create):
  // the swap files grow by fallocate and their new ends are free extents.
  // NoSpace naming the folder when the disk cannot hold them; the tier's
  // extents are then unchanged (a file may keep some of the space).
  Status GrowSpare(uint64_t bytes);
  // Times a rewrite grew the files (grow_for_holes), and the bytes added.
  uint64_t hole_growths() const { return hole_growths_.load(); }
  // Rewrites that found no free range of their size and took several.
  uint64_t scattered_writes() {
    std::lock_guard<std::mutex> lock(mu_);
    return scattered_;
  }

  // Checkpoints without copying: makes `link_path` a hard link of the swap
  // file holding `blocks` (fsynced first) and moves the tier to a fresh swap
  // file, so the linked one is never written again: each block moves to the
  // new file when it is next written, and the old file leaves the swap folder
  // once it holds nothing live. Fills, per block, where it is in the linked
  // file and its checksum. Unsupported with several swap folders, without
  // checksums, for blocks not all in the current file (a snapshot since
  // they were last written), across file systems, or without room to
  // reserve the next file (the caller copies instead). On any error
  // nothing changed.
  // REQUIRES: no I/O in flight on `blocks`.
  struct SnapshotRef { uint64_t offset, bytes, checksum; };
  Status Snapshot(const std::string& link_path, const std::vector<Allocation>& blocks, std::vector<SnapshotRef>* out);

 private:
  struct Block {
    NvmeExtents at;  // never empty; their lengths sum to per_file
    uint64_t per_file, bytes, checksum;
    bool valid;
    uint32_t gen;
    uint64_t version = 0;
    uint32_t in_place_writes = 0;  // writes to its own extent started and not settled
  };
  // A block freed while writes to its own extent were in flight: the extent
  // (and its charge) go back when the last of them settles, not before,
  // so that no other block's data lands where such a write still goes.
  struct FreedInFlight {
    uint32_t gen;
    NvmeExtents at;
    uint64_t charged;
    uint32_t writes;
  };
  std::unordered_map<uint64_t, FreedInFlight> freed_in_flight_;  // by block id (mu_)
  // A swap file replaced by a snapshot, still holding blocks not yet rewritten.
  struct OldFiles {
    std::vector<FileId> files;
    std::vector<std::string> paths;
    std::unique_ptr<ExtentAllocator> extents;
    uint64_t live = 0;
    std::set<uint64_t> kept;  // offsets of the blocks its snapshot references
  };
  // Frees the disk space of [offset, offset+len) of a snapshotted file.
  void Punch(int fd, const std::string& path, uint64_t offset, uint64_t len);
  Status OpenGeneration(uint32_t gen, std::vector<FileId>* files, std::vector<std::string>* paths);
  void RetireIfEmpty(uint32_t gen);  // REQUIRES: mu_ held
  Status GrowLocked(uint64_t bytes);   // GrowSpare's work. REQUIRES: mu_ held
  // Frees a block's extent of generation `gen` (the current one, or an old
  // one's, which may retire its files). REQUIRES: mu_ held
  void ReleaseExtent(uint32_t gen, const NvmeExtents& at);
  uint64_t scattered_ = 0;  // rewrites that took several ranges (mu_)
  // Closes the files and unlinks the paths (a checkpoint's link keeps the data).
  void CloseAndRemove(const std::vector<FileId>& files, const std::vector<std::string>& paths);
  std::string FilesOf(uint32_t gen) const;  // "a, b": generation gen's paths. REQUIRES: mu_ held
  explicit NvmeTier(const NvmeTierOptions& options);
  Status Open();
  void RemoveStaleSwapFiles();
  std::vector<IoOp> Ops(const Block& b, void* buf, IoOp::Kind kind) const;

  NvmeTierOptions options_;
  std::vector<std::string> paths_;
  std::vector<FileId> files_;
  uint64_t align_ = 4096;
  uint64_t per_file_capacity_ = 0;
  std::mutex mu_;  // guards extents_, old_, gen_, files_, blocks_, next_id_, writes_unsettled_
  std::unique_ptr<ExtentAllocator> extents_;  // of the current files
  uint32_t gen_ = 0;                          // the current files' generation
  std::map<uint32_t, OldFiles> old_;          // earlier generations with live blocks
  std::unordered_map<uint64_t, Block> blocks_;
  uint64_t next_id_ = 1;
  int writes_unsettled_ = 0;  // fresh extents not yet published or discarded
  std::atomic<uint64_t> hole_growths_{0};
};

}  // namespace strata
