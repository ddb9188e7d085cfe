// NvmeTier: swap files under one or more directories (one per drive), space
// reserved up front with fallocate, blocks striped across the files, an
// extent allocator inside them, and an XXH3 checksum per block kept in
// memory and verified on every read. Names are stable across runs:
// <dir>/strata-swap.r<rank>.s<stripe>.bin. Thread-safe.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/storage.h"
#include "tiers/extent_allocator.h"
#include "tiers/tier.h"

namespace strata {

struct NvmeTierOptions {
  std::vector<std::string> dirs;  // one swap file per directory
  uint64_t budget = 0;            // bytes of swap in all, split over the dirs
  int rank = 0;
  bool checksums = true;
  Storage* storage = nullptr;     // REQUIRED, outlives the tier
};

// An I/O in flight on one block; finish it with NvmeTier::Finish.
struct NvmePending {
  IoTicket ticket;
  uint64_t id = 0;
  void* buf = nullptr;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
  uint64_t offset = 0;  // where the block is, for error messages
  uint32_t gen = 0;
  bool is_read = false;
  bool waited = false;  // WaitIo ran: io_status holds the I/O's result
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
  // at least PaddedSize(bytes) long (the padding is written, not checked).
  uint64_t align() const { return align_; }
  uint64_t PaddedSize(uint64_t bytes) const;

  // Writes `bytes` of `src` as the block's new contents. Until Finish
  // succeeds the block holds no valid data; after a failed write, reads
  // refuse it (nothing half-applied is ever served).
  // `checksum`, when given, is BlockChecksum(src, bytes) computed by the
  // caller ahead of time (off the disk's critical path); else it is computed
  // here before the write is submitted.
  Result<NvmePending> StartWrite(const Allocation& a, const void* src, const uint64_t* checksum = nullptr);
  Result<NvmePending> StartRead(const Allocation& a, void* dst);
  // Waits for the I/O only: the disk is done with the buffer (a read's data
  // is in it, unverified). Finish must still follow.
  void WaitIo(NvmePending& p);
  // Waits (unless WaitIo did); for a read, verifies the checksum (CORRUPT
  // names file and offset).
  Status Finish(NvmePending& p);
  // The checksum StartWrite keeps for `bytes` of `src` (0 without checksums).
  uint64_t BlockChecksum(const void* src, uint64_t bytes) const;
  Status Write(const Allocation& a, const void* src);
  Status Read(const Allocation& a, void* dst);

  const std::vector<std::string>& paths() const { return paths_; }

  // Checkpoints without copying: makes `link_path` a hard link of the swap
  // file holding `blocks` (fsynced first) and moves the tier to a fresh swap
  // file, so the linked one is never written again: each block moves to the
  // new file when it is next written, and the old file leaves the swap folder
  // once it holds nothing live. Fills, per block, where it is in the linked
  // file and its checksum. Unsupported with several swap folders, without
  // checksums, for blocks not all in the current file (a snapshot since
  // they were last written) or across file systems; NoSpace when the new
  // file cannot be reserved. On any error nothing changed.
  // REQUIRES: no I/O in flight on `blocks`.
  struct SnapshotRef { uint64_t offset, bytes, checksum; };
  Status Snapshot(const std::string& link_path, const std::vector<Allocation>& blocks, std::vector<SnapshotRef>* out);

 private:
  struct Block { uint64_t offset, per_file, bytes, checksum; bool valid; uint32_t gen; };
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
  // Frees a block's extent in an old generation's file. REQUIRES: mu_ held
  void ReleaseOld(const Block& b);
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
  std::mutex mu_;  // guards extents_, blocks_, next_id_
  std::unique_ptr<ExtentAllocator> extents_;  // of the current files
  uint32_t gen_ = 0;                          // the current files' generation
  std::map<uint32_t, OldFiles> old_;          // earlier generations with live blocks
  std::unordered_map<uint64_t, Block> blocks_;
  uint64_t next_id_ = 1;
};

}  // namespace strata
