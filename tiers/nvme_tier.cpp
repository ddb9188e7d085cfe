// NvmeTier: swap files, striping, checksums.
#include "tiers/nvme_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/file.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <cstring>

#include "base/align.h"
#include "base/check.h"
#include "base/log.h"
#include "base/sizes.h"
#include "io/direct_file.h"

namespace strata {

NvmeTier::NvmeTier(const NvmeTierOptions& options)
    : Tier(TierKind::kNvme, options.budget), options_(options) {}

NvmeTier::~NvmeTier() {
  // Swap is scratch: nothing in it outlives the tier (checkpoints do that).
  CloseAndRemove(files_, paths_);
  for (auto& [gen, old] : old_) CloseAndRemove(old.files, old.paths);
}

void NvmeTier::CloseAndRemove(const std::vector<FileId>& files, const std::vector<std::string>& paths) {
  for (FileId f : files) options_.storage->Close(f).IgnoreError();
  for (const auto& p : paths) ::unlink(p.c_str());
}

std::string NvmeTier::FilesOf(uint32_t gen) const {
  const std::vector<std::string>& paths = gen == gen_ ? paths_ : old_.at(gen).paths;
  std::string files = paths[0];
  for (size_t j = 1; j < paths.size(); ++j) files += ", " + paths[j];
  return files;
}

static Status CheckDir(const std::string& dir) {
  struct stat st {};
  if (dir.empty()) return InvalidError("nvme tier: an empty directory path");
  if (::stat(dir.c_str(), &st) != 0) return PosixError("nvme tier: stat directory", dir, errno);
  if (!S_ISDIR(st.st_mode)) return InvalidError("nvme tier: " + dir + " is not a directory");
  if (::access(dir.c_str(), W_OK) != 0) return PosixError("nvme tier: directory not writable:", dir, errno);
  // A swap folder in memory (tmpfs, ramfs: /tmp, /dev/shm in many
  // containers) takes RAM that no budget counts; in a cgroup with a memory
  // limit it counts against that, and the OOM killer ends the build silently.
  if (struct statfs fs{}; ::statfs(dir.c_str(), &fs) == 0 &&
                          (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC))
    WarnOnce("swap-in-ram:" + dir, "nvme tier: " + dir + " is on " + (fs.f_type == TMPFS_MAGIC ? "tmpfs" : "ramfs") +
                                ": its swap files are RAM, which strata.host_budget does not count (a cgroup's memory "
                                "limit does); give a folder on a disk" +
                                (fs.f_type == RAMFS_MAGIC ? " (ramfs reports no free space: the build is refused)" : ""));
  return Status::Ok();
}

Result<std::unique_ptr<NvmeTier>> NvmeTier::Create(const NvmeTierOptions& options) {
  if (!options.storage) return InvalidError("nvme tier: no storage given");
  if (options.dirs.empty()) return InvalidError("nvme tier: no directory given (nvme_paths)");
  if (options.budget == 0) return InvalidError("nvme tier: budget of 0 bytes");
  for (const auto& d : options.dirs) STRATA_RETURN_IF_ERROR(CheckDir(d));
  std::unique_ptr<NvmeTier> t(new NvmeTier(options));
  STRATA_RETURN_IF_ERROR(t->Open());
  return t;
}

Status NvmeTier::Open() {
  const uint64_t n = options_.dirs.size();
  per_file_capacity_ = AlignUp((options_.budget + options_.spare + n - 1) / n, kMiB);
  // A killed engine's files go first: their space is this engine's to take
  // (before, they counted against the free-space check). A process that
  // just died may still hold their locks a moment (OpenGeneration waits for
  // the one at its own name): what this pass could not take, the pass after
  // it removes, as before.
  RemoveStaleSwapFiles();
  STRATA_RETURN_IF_ERROR(OpenGeneration(0, &files_, &paths_));
  extents_ = std::make_unique<ExtentAllocator>(per_file_capacity_, align_);
  RemoveStaleSwapFiles();
  return Status::Ok();
}

// Whether `name` is one of this rank's swap files, of any stripe and
// generation: strata-swap.r<rank>.s<i>.bin or strata-swap.r<rank>.s<i>.g<gen>.bin.
static bool IsSwapFileOf(int rank, const std::string& name) {
  const std::string prefix = "strata-swap.r" + std::to_string(rank) + ".s";
  if (name.compare(0, prefix.size(), prefix) != 0 || name.size() < prefix.size() + 5) return false;
  if (name.compare(name.size() - 4, 4, ".bin") != 0) return false;
  const std::string mid = name.substr(prefix.size(), name.size() - 4 - prefix.size());  // "<i>" or "<i>.g<gen>"
  const size_t dot = mid.find(".g");
  auto digits = [](const std::string& s) {
    return !s.empty() && s.size() < 10 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  return dot == std::string::npos ? digits(mid) : digits(mid.substr(0, dot)) && digits(mid.substr(dot + 2));
}

// A killed engine leaves its swap files behind, generations after the
// first included (their names are not reused, so OpenGeneration never takes
// them over). Removes this rank's that no live engine holds: each engine
// flocks its swap files, so a lock taken without waiting proves the owner
// gone. A checkpoint that links one keeps its data (only this name goes).
void NvmeTier::RemoveStaleSwapFiles() {
  for (const std::string& dir : options_.dirs) {
    std::vector<std::string> stale;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string path = dir + "/" + e->d_name;
        if (IsSwapFileOf(options_.rank, e->d_name) && std::find(paths_.begin(), paths_.end(), path) == paths_.end())
          stale.push_back(path);
      }
      ::closedir(d);
    }
    for (const std::string& path : stale) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
      if (fd < 0) continue;
      struct stat held {}, named {};
      // Locked by us, and the name still on the file we locked: remove it.
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::fstat(fd, &held) == 0 && ::lstat(path.c_str(), &named) == 0 &&
          held.st_ino == named.st_ino && held.st_dev == named.st_dev && ::unlink(path.c_str()) == 0)
        STRATA_LOG_INFO("nvme tier: removed {}, a swap file left by an engine that is gone", path);
      ::close(fd);
    }
  }
}

// Takes `fd`'s exclusive flock. A process that just died may hold it a
// moment longer (its io_uring, which references the file, is torn down
// asynchronously), so a held lock is retried for up to 3 s.
static bool LockWithGrace(int fd) {
  for (int tries = 0; tries < 300; ++tries) {
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return true;
    if (errno != EWOULDBLOCK) return false;
    ::usleep(10000);
  }
  return false;
}

static Status InUse(const std::string& path) {
  return InvalidError("nvme tier: " + path + " is in use by another Strata engine; give each engine its own "
                      "nvme_path or rank");
}

// Creates, locks and reserves one swap file per folder for generation `gen`.
// On error, what it opened is closed and removed.
Status NvmeTier::OpenGeneration(uint32_t gen, std::vector<FileId>* files, std::vector<std::string>* paths) {
  auto undo = [&](Status st) {
    CloseAndRemove(*files, *paths);
    files->clear();
    paths->clear();
    return st;
  };
  for (uint64_t i = 0; i < options_.dirs.size(); ++i) {
    const std::string& dir = options_.dirs[i];
    const std::string path = dir + "/strata-swap.r" + std::to_string(options_.rank) + ".s" + std::to_string(i) +
                             (gen ? ".g" + std::to_string(gen) : "") + ".bin";
    // A file left at this name by an engine that died may be a checkpoint's
    // data too (a snapshot links the swap file): never truncate it, take the
    // name off it. A live engine still holding it is refused below.
    const int stale = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (stale >= 0) {
      const bool ours = LockWithGrace(stale);
      ::close(stale);
      if (!ours) return undo(InUse(path));
      if (::unlink(path.c_str()) != 0 && errno != ENOENT) return undo(PosixError("unlink stale swap file", path, errno));
    }
    // (after the stale file at this name went: its space counts as free)
    auto free_or = FreeBytesAt(dir);
    if (!free_or.ok()) return undo(free_or.status().WithContext("nvme tier: the free space of " + dir));
    const uint64_t free = *free_or;
    if (free < per_file_capacity_) {
      return undo(NoSpaceError("nvme tier: " + dir + " has " + FormatBytes(free) + " (" + std::to_string(free) +
                               " bytes) free; its swap file needs " + FormatBytes(per_file_capacity_) + " (" +
                               std::to_string(per_file_capacity_) + " bytes)"));
    }
    // A new file, readable by this user alone (the model's weights and
    // moments), never through a name someone put there since the unlink
    // above (a symlink to another file: EEXIST, refused).
    auto f = options_.storage->Open(path, OpenMode::kCreateNew);
    if (!f.ok()) return undo(f.status());
    files->push_back(*f);
    const FileInfo& info = options_.storage->Info(*f);
    // One engine per swap file: a second one (same folder, same rank) is
    // refused instead of silently sharing the file.
    if (!LockWithGrace(info.fd)) return undo(InUse(path));
    paths->push_back(path);
    align_ = std::max<uint64_t>(align_, info.align);
    Status st = ReserveFileSpace(info.fd, path, per_file_capacity_);
    if (!st.ok()) return undo(st);
  }
  return Status::Ok();
}

Status NvmeTier::GrowSpare(uint64_t bytes) {
  if (bytes == 0) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  return GrowLocked(bytes);
}

Status NvmeTier::GrowLocked(uint64_t bytes) {
  const uint64_t n = options_.dirs.size();
  const uint64_t grown = AlignUp(per_file_capacity_ + (bytes + n - 1) / n, kMiB);
  for (size_t i = 0; i < files_.size(); ++i)
    STRATA_RETURN_IF_ERROR(ReserveFileSpace(options_.storage->Info(files_[i]).fd, paths_[i], grown)
                               .WithContext("nvme tier: growing the spare by " + FormatBytes(bytes)));
  extents_->Grow(grown);
  per_file_capacity_ = grown;
  return Status::Ok();
}

uint64_t NvmeTier::PaddedSize(uint64_t bytes) const {
  // One file per folder in every generation (files_ would need mu_).
  return PaddedSizeFor(bytes, options_.dirs.size(), align_);
}

Result<Allocation> NvmeTier::Allocate(uint64_t bytes) {
  if (bytes == 0) return InvalidError("nvme tier: allocation of 0 bytes");
  // Over the budget before rounding: a size near 2^64 would round to a small one.
  if (bytes > budget()) STRATA_RETURN_IF_ERROR(Charge(bytes, Code::kNoSpace));
  const uint64_t padded = PaddedSize(bytes);
  STRATA_RETURN_IF_ERROR(Charge(padded, Code::kNoSpace));
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t per_file = padded / options_.dirs.size();
  const uint64_t off = extents_->Allocate(per_file);
  if (off == UINT64_MAX) {
    Uncharge(padded);
    return NoSpaceError("nvme tier: no free extent of " + FormatBytes(per_file) + " per file in " +
                        paths_[0] + (paths_.size() > 1 ? " and the others" : "") + " (" +
                        FormatBytes(extents_->free_bytes()) + " free, largest " +
                        FormatBytes(extents_->largest_free()) + ")");
  }
  const uint64_t id = next_id_++;
  blocks_[id] = Block{{NvmeExtent{off, per_file}}, per_file, bytes, 0, false, gen_};
  return Allocation{nullptr, id, bytes, padded};
}

void NvmeTier::Free(const Allocation& a) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(a.id);
    STRATA_CHECK_MSG(it != blocks_.end(), "nvme tier: freeing an unknown block");
    const Block b = it->second;
    blocks_.erase(it);
    if (b.in_place_writes > 0) {  // its extent is still being written: Settle gives it back
      freed_in_flight_[a.id] = FreedInFlight{b.gen, b.at, a.charged, b.in_place_writes};
      return;
    }
    ReleaseExtent(b.gen, b.at);
  }
  Uncharge(a.charged);
}

// One op per stripe and range: stripe j of the buffer goes to file j at the
// extent, its bytes over the extent's ranges in order. Only the buffer's
// first BufferSize(b.bytes) bytes move: the stripes' padding beyond them
// (up to align * folders of it) stays on disk unread and unwritten, so a
// buffer of the block's aligned size is enough at any number of folders.
std::vector<IoOp> NvmeTier::Ops(const Block& b, void* buf, IoOp::Kind kind) const {
  const std::vector<FileId>& files = b.gen == gen_ ? files_ : old_.at(b.gen).files;
  const uint64_t span = BufferSize(b.bytes);
  std::vector<IoOp> ops;
  ops.reserve(files.size() * b.at.size());
  for (size_t j = 0; j < files.size(); ++j) {
    uint64_t at = j * b.per_file;  // the stripe's place in the buffer
    for (const NvmeExtent& e : b.at) {
      if (at >= span) return ops;
      const uint64_t len = std::min<uint64_t>(e.len, span - at);  // (both aligned)
      ops.push_back(IoOp{kind, files[j], e.offset, static_cast<char*>(buf) + at, len});
      at += e.len;
    }
  }
  return ops;
}

uint64_t NvmeTier::BlockChecksum(const void* src, uint64_t bytes) const {
  return options_.checksums ? XXH3_64bits(src, bytes) : 0;
}

Result<NvmePending> NvmeTier::StartWrite(const Allocation& a, const void* src, const uint64_t* checksum) {
  if (!IsAligned(src, align_))
    return InvalidError("nvme tier: write buffer not aligned to " + std::to_string(align_) + " bytes");
  NvmePending p;
  std::vector<IoOp> ops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(a.id);
    if (it == blocks_.end()) return InvalidError("nvme tier: write to unknown block " + std::to_string(a.id));
    // Copy on write: the new contents go to a fresh extent of the current
    // file (which also moves a block out of a snapshotted one); the block
    // keeps its old extent, still readable, until the write is settled.
    Block fresh = it->second;
    // A block that holds nothing yet (never written, or its first write
    // failed) has nothing to protect: it is written where it is.
    p.in_place = !fresh.valid && fresh.gen == gen_;
    if (p.in_place) ++it->second.in_place_writes;
    if (!p.in_place) {
      // One free range of its size (best fit), else several (the holes the
      // old versions left are smaller, or apart), else (the free ranges
      // together are too small) the files grow.
      auto take = [&] {
        NvmeExtents at;
        for (const auto& [o, len] : extents_->AllocateScattered(fresh.per_file)) at.push_back({o, len});
        return at;
      };
      fresh.at = take();
      if (fresh.at.empty() && options_.grow_for_holes) {
        const uint64_t free = extents_->free_bytes();
        if (Status st = GrowLocked(fresh.per_file * options_.dirs.size()); !st.ok())
          return st.WithContext("nvme tier: a rewrite of block " + std::to_string(a.id) + " (" +
                                FormatBytes(fresh.per_file) + " a file) found too little free space (" +
                                FormatBytes(free) + ")");
        ++hole_growths_;
        STRATA_LOG_INFO("nvme tier: swap files grown to {} each: a rewrite of {} a file found {} free in all",
                        FormatBytes(per_file_capacity_), FormatBytes(fresh.per_file), FormatBytes(free));
        fresh.at = take();
      }
      if (fresh.at.empty())
        return NoSpaceError("nvme tier: no free extent of " + FormatBytes(fresh.per_file) + " in " + FilesOf(gen_) +
                            " for the new version of block " + std::to_string(a.id) + " (" +
                            FormatBytes(extents_->free_bytes()) + " free, largest " +
                            FormatBytes(extents_->largest_free()) + ")");
      if (fresh.at.size() > 1) ++scattered_;
    }
    fresh.gen = gen_;
    ++writes_unsettled_;
    p.offset = fresh.at.front().offset;
    p.at = fresh.at;
    p.gen = fresh.gen;
    p.bytes = fresh.bytes;
    ops = Ops(fresh, const_cast<void*>(src), IoOp::kWrite);  // under the lock: it reads gen_ and files_
  }
  p.id = a.id;
  p.buf = const_cast<void*>(src);
  p.is_read = false;
  p.ticket = options_.storage->Submit(ops);
  // The checksum once the disk has the write: it reads what the disk reads
  // (nothing changes src until Finish), beside the transfer rather than
  // before it. Nothing reads it before Settle publishes it.
  p.checksum = checksum ? *checksum : BlockChecksum(src, p.bytes);
  return p;
}

Result<NvmePending> NvmeTier::StartRead(const Allocation& a, void* dst) {
  if (!IsAligned(dst, align_))
    return InvalidError("nvme tier: read buffer not aligned to " + std::to_string(align_) + " bytes");
  Block b;
  std::vector<IoOp> ops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(a.id);
    if (it == blocks_.end()) return InvalidError("nvme tier: read of unknown block " + std::to_string(a.id));
    b = it->second;
    if (!b.valid)
      return StateError("nvme tier: block " + std::to_string(a.id) + " at offset " + std::to_string(b.at.front().offset) +
                        " of " + FilesOf(b.gen) + " holds no valid data (never written, or its last write failed)");
    ops = Ops(b, dst, IoOp::kRead);  // under the lock: it reads gen_ and files_
  }
  NvmePending p;
  p.id = a.id;
  p.buf = dst;
  p.bytes = b.bytes;
  p.offset = b.at.front().offset;
  p.gen = b.gen;
  p.version = b.version;
  p.checksum = b.checksum;
  p.is_read = true;
  p.ticket = options_.storage->Submit(ops);
  return p;
}

void NvmeTier::WaitIo(NvmePending& p) {
  if (p.waited) return;
  p.io_status = p.ticket->Wait();
  p.waited = true;
}

Status NvmeTier::WaitWrite(NvmePending& p) {
  WaitIo(p);
  return p.io_status;
}

void NvmeTier::Settle(NvmePending& p, bool publish) {
  if (p.is_read || p.settled) return;
  p.settled = true;
  std::lock_guard<std::mutex> lock(mu_);
  --writes_unsettled_;
  auto it = blocks_.find(p.id);
  if (p.in_place) {  // the block's own extent: released only if the block was freed meanwhile
    if (it != blocks_.end()) {
      --it->second.in_place_writes;
      if (publish) {
        it->second.checksum = p.checksum;
        it->second.valid = true;
        ++it->second.version;
      }
      return;
    }
    auto f = freed_in_flight_.find(p.id);
    if (f != freed_in_flight_.end() && --f->second.writes == 0) {
      ReleaseExtent(f->second.gen, f->second.at);
      Uncharge(f->second.charged);
      freed_in_flight_.erase(f);
    }
    return;
  }
  if (!publish || it == blocks_.end()) {  // discarded, or the block was freed meanwhile
    ReleaseExtent(p.gen, p.at);
    return;
  }
  Block& b = it->second;
  ReleaseExtent(b.gen, b.at);  // the old version: nothing reads it any more
  b.at = std::move(p.at);
  b.gen = p.gen;
  b.checksum = p.checksum;
  b.valid = true;
  ++b.version;
}

uint64_t NvmeTier::Version(const Allocation& a) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(a.id);
  return it == blocks_.end() ? 0 : it->second.version;
}

Status NvmeTier::Finish(NvmePending& p) {
  WaitIo(p);
  if (!p.is_read) {  // the block holds the new contents only once the write is done
    Settle(p, p.io_status.ok());
    return p.io_status;
  }
  if (!p.io_status.ok() || !options_.checksums) return p.io_status;
  const uint64_t got = XXH3_64bits(p.buf, p.bytes);  // no lock: reads verify in parallel
  if (got == p.checksum) return Status::Ok();
  char want[17], have[17];
  std::snprintf(want, sizeof want, "%016llx", static_cast<unsigned long long>(p.checksum));
  std::snprintf(have, sizeof have, "%016llx", static_cast<unsigned long long>(got));
  std::lock_guard<std::mutex> lock(mu_);
  return CorruptError("nvme tier: checksum mismatch reading block " + std::to_string(p.id) + " (" +
                      std::to_string(p.bytes) + " bytes) at offset " + std::to_string(p.offset) + " of " +
                      FilesOf(p.gen) + ": expected " + want + ", got " + have);
}

void NvmeTier::ReleaseExtent(uint32_t gen, const NvmeExtents& at) {
  if (gen == gen_) {
    for (const NvmeExtent& e : at) extents_->Free(e.offset, e.len);
    return;
  }
  OldFiles& o = old_.at(gen);
  // Not the snapshot's (a P or G block): nobody reads it from this file
  // again. (New versions always go to the current file.)
  const bool kept = o.kept.count(at.front().offset) > 0;
  for (const NvmeExtent& e : at) {
    o.extents->Free(e.offset, e.len);
    if (!kept) Punch(options_.storage->Info(o.files[0]).fd, o.paths[0], e.offset, e.len);
  }
  --o.live;
  RetireIfEmpty(gen);
}

void NvmeTier::RetireIfEmpty(uint32_t gen) {
  auto it = old_.find(gen);
  if (it == old_.end() || it->second.live > 0) return;
  CloseAndRemove(it->second.files, it->second.paths);
  old_.erase(it);
}

Status NvmeTier::Snapshot(const std::string& link_path, const std::vector<Allocation>& blocks,
                          std::vector<SnapshotRef>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (files_.size() != 1) return UnsupportedError("nvme tier: snapshots need a single swap folder");
  if (!options_.checksums) return UnsupportedError("nvme tier: snapshots need checksums");
  if (writes_unsettled_ > 0) return InternalError("nvme tier: snapshot with writes in flight");
  std::vector<SnapshotRef> refs;
  for (const Allocation& a : blocks) {
    auto it = blocks_.find(a.id);
    if (it == blocks_.end()) return InvalidError("nvme tier: snapshot of unknown block " + std::to_string(a.id));
    const Block& b = it->second;
    if (!b.valid || b.gen != gen_)
      return UnsupportedError("nvme tier: block " + std::to_string(a.id) + " is not in the current swap file");
    if (b.at.size() != 1)  // a checkpoint's manifest places a block at one offset
      return UnsupportedError("nvme tier: block " + std::to_string(a.id) + " is scattered over " +
                              std::to_string(b.at.size()) + " ranges of the swap file");
    refs.push_back({b.at.front().offset, b.bytes, b.checksum});
  }
  const std::string& path = paths_[0];
  const int fd = options_.storage->Info(files_[0]).fd;
  // A link needs one file system: elsewhere (the usual checkpoint disk) the
  // caller copies, and no next swap file is reserved first only to go.
  struct stat swap_st{}, dir_st{};
  const std::string link_dir = std::filesystem::path(link_path).parent_path().string();
  // (folder against folder: on overlayfs a file and a folder may report different devices)
  if (::stat(options_.dirs[0].c_str(), &swap_st) == 0 && ::stat(link_dir.c_str(), &dir_st) == 0 &&
      swap_st.st_dev != dir_st.st_dev)
    return UnsupportedError("nvme tier: " + link_dir + " is on another file system than " + path);
  if (::fsync(fd) != 0) return PosixError("fsync", path, errno);  // the data and its extents, durable
  // The swap file deleted under the engine (another process cleaning the
  // folder): it is still open, so training goes on, but it has no name to
  // link: the caller copies (every save failed before).
  if (struct stat st{}; ::fstat(fd, &st) == 0 && st.st_nlink == 0) {
    WarnOnce("swap-deleted", "nvme tier: the swap file " + path + " was deleted while in use (by another process?); "
                             "training goes on from the open file, checkpoints copy the state instead of linking it");
    return UnsupportedError("nvme tier: the swap file " + path + " was deleted while in use");
  }
  std::vector<FileId> next_files;
  std::vector<std::string> next_paths;
  // The next swap file takes a whole reservation beside the linked one: no
  // room for it is no reason to fail a save that a copy can make.
  // Nor is a next file that cannot be made (the folder full, or removed).
  if (Status st = OpenGeneration(gen_ + 1, &next_files, &next_paths); !st.ok())
    return UnsupportedError("nvme tier: no next swap file to link beside: " + st.message());
  if (::link(path.c_str(), link_path.c_str()) != 0) {
    const int err = errno;
    CloseAndRemove(next_files, next_paths);
    if (err == EXDEV || err == EPERM || err == EOPNOTSUPP || err == ENOENT)
      return UnsupportedError("nvme tier: cannot link " + path + " to " + link_path + ": " + std::strerror(err));
    return PosixError("link " + path + " to", link_path, err);
  }
  // From now on this file is never written (a block moves to the new file
  // when next written) and the checkpoint reads only its blocks: the free
  // ranges hold nothing anyone reads. Punched out, the checkpoint holds the
  // state, not the swap file's reservation.
  for (const auto& [off, len] : extents_->free_ranges()) Punch(fd, path, off, len);
  OldFiles old;
  old.files = std::move(files_);
  old.paths = std::move(paths_);
  old.extents = std::move(extents_);
  for (const SnapshotRef& r : refs) old.kept.insert(r.offset);
  for (const auto& [id, b] : blocks_) old.live += b.gen == gen_;
  old_[gen_] = std::move(old);
  files_ = std::move(next_files);
  paths_ = std::move(next_paths);
  extents_ = std::make_unique<ExtentAllocator>(per_file_capacity_, align_);
  RetireIfEmpty(gen_);
  ++gen_;
  *out = std::move(refs);
  return Status::Ok();
}

void NvmeTier::Punch(int fd, const std::string& path, uint64_t offset, uint64_t len) {
  if (len == 0) return;
  // Only disk space: a file system without hole punching keeps the bytes.
  if (::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                  static_cast<off_t>(len)) != 0)
    STRATA_LOG_DEBUG("nvme tier: cannot punch [{}, +{}) of {}: {}", offset, len, path, std::strerror(errno));
}

Status NvmeTier::Write(const Allocation& a, const void* src) {
  STRATA_ASSIGN_OR_RETURN(NvmePending p, StartWrite(a, src));
  return Finish(p);
}

Status NvmeTier::Read(const Allocation& a, void* dst) {
  STRATA_ASSIGN_OR_RETURN(NvmePending p, StartRead(a, dst));
  return Finish(p);
}

}  // namespace strata
