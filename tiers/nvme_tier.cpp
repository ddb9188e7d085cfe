// NvmeTier: swap files, striping, checksums.
#include "tiers/nvme_tier.h"

#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "base/align.h"
#include "base/check.h"
#include "base/sizes.h"
#include "io/direct_file.h"

namespace strata {

NvmeTier::NvmeTier(const NvmeTierOptions& options)
    : Tier(TierKind::kNvme, options.budget), options_(options) {}

NvmeTier::~NvmeTier() {
  // Swap is scratch: nothing in it outlives the tier (checkpoints do that).
  for (FileId f : files_) options_.storage->Close(f).IgnoreError();
  for (const auto& p : paths_) ::unlink(p.c_str());
}

static Status CheckDir(const std::string& dir) {
  struct stat st {};
  if (dir.empty()) return InvalidError("nvme tier: an empty directory path");
  if (::stat(dir.c_str(), &st) != 0) return PosixError("nvme tier: stat directory", dir, errno);
  if (!S_ISDIR(st.st_mode)) return InvalidError("nvme tier: " + dir + " is not a directory");
  if (::access(dir.c_str(), W_OK) != 0) return PosixError("nvme tier: directory not writable:", dir, errno);
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
  // Alignment: what the files demand, at least 4 KiB.
  per_file_capacity_ = AlignUp((options_.budget + n - 1) / n, kMiB);
  for (uint64_t i = 0; i < n; ++i) {
    const std::string& dir = options_.dirs[i];
    const uint64_t free = FreeBytesAt(dir);
    if (free < per_file_capacity_) {
      return NoSpaceError("nvme tier: " + dir + " has " + FormatBytes(free) + " (" + std::to_string(free) +
                          " bytes) free; its swap file needs " + FormatBytes(per_file_capacity_) + " (" +
                          std::to_string(per_file_capacity_) + " bytes)");
    }
    const std::string path = dir + "/strata-swap.r" + std::to_string(options_.rank) + ".s" +
                             std::to_string(i) + ".bin";
    STRATA_ASSIGN_OR_RETURN(FileId f, options_.storage->Open(path, OpenMode::kCreate));
    files_.push_back(f);
    const FileInfo& info = options_.storage->Info(f);
    // One engine per swap file: a second one (same folder, same rank) is
    // refused instead of silently sharing the file.
    // A process that just died may hold the lock a moment longer: its
    // io_uring (which references the file) is torn down asynchronously.
    int locked = -1;
    for (int tries = 0; tries < 300 && (locked = ::flock(info.fd, LOCK_EX | LOCK_NB)) != 0 && errno == EWOULDBLOCK; ++tries)
      ::usleep(10000);
    if (locked != 0)
      return InvalidError("nvme tier: " + path + " is in use by another Strata engine (" + std::strerror(errno) +
                          "); give each engine its own nvme_path or rank");
    paths_.push_back(path);
    align_ = std::max<uint64_t>(align_, info.align);
    if (::ftruncate(info.fd, 0) != 0) return PosixError("ftruncate", path, errno);
    STRATA_RETURN_IF_ERROR(ReserveFileSpace(info.fd, path, per_file_capacity_));
  }
  extents_ = std::make_unique<ExtentAllocator>(per_file_capacity_, align_);
  return Status::Ok();
}

uint64_t NvmeTier::PaddedSize(uint64_t bytes) const {
  const uint64_t n = files_.size();
  return AlignUp((bytes + n - 1) / n, align_) * n;
}

Result<Allocation> NvmeTier::Allocate(uint64_t bytes) {
  if (bytes == 0) return InvalidError("nvme tier: allocation of 0 bytes");
  const uint64_t padded = PaddedSize(bytes);
  STRATA_RETURN_IF_ERROR(Charge(padded, Code::kNoSpace));
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t per_file = padded / files_.size();
  const uint64_t off = extents_->Allocate(per_file);
  if (off == UINT64_MAX) {
    Uncharge(padded);
    return NoSpaceError("nvme tier: no free extent of " + FormatBytes(per_file) + " per file in " +
                        paths_[0] + (paths_.size() > 1 ? " and the others" : "") + " (" +
                        FormatBytes(extents_->free_bytes()) + " free, largest " +
                        FormatBytes(extents_->largest_free()) + ")");
  }
  const uint64_t id = next_id_++;
  blocks_[id] = Block{off, per_file, bytes, 0, false};
  return Allocation{nullptr, id, bytes, padded};
}

void NvmeTier::Free(const Allocation& a) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(a.id);
    STRATA_CHECK_MSG(it != blocks_.end(), "nvme tier: freeing an unknown block");
    extents_->Free(it->second.offset, it->second.per_file);
    blocks_.erase(it);
  }
  Uncharge(a.charged);
}

// One op per stripe: stripe j of the buffer goes to file j at the extent.
std::vector<IoOp> NvmeTier::Ops(const Block& b, void* buf, IoOp::Kind kind) const {
  std::vector<IoOp> ops;
  ops.reserve(files_.size());
  for (size_t j = 0; j < files_.size(); ++j)
    ops.push_back(IoOp{kind, files_[j], b.offset, static_cast<char*>(buf) + j * b.per_file, b.per_file});
  return ops;
}

Result<NvmePending> NvmeTier::StartWrite(const Allocation& a, const void* src) {
  if (!IsAligned(src, align_))
    return InvalidError("nvme tier: write buffer not aligned to " + std::to_string(align_) + " bytes");
  Block b;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(a.id);
    if (it == blocks_.end()) return InvalidError("nvme tier: write to unknown block " + std::to_string(a.id));
    it->second.valid = false;  // in flux until Finish
    b = it->second;
  }
  NvmePending p;
  p.id = a.id;
  p.buf = const_cast<void*>(src);
  p.bytes = b.bytes;
  p.checksum = options_.checksums ? XXH3_64bits(src, b.bytes) : 0;
  p.is_read = false;
  auto ops = Ops(b, p.buf, IoOp::kWrite);
  p.ticket = options_.storage->Submit(ops);
  return p;
}

Result<NvmePending> NvmeTier::StartRead(const Allocation& a, void* dst) {
  if (!IsAligned(dst, align_))
    return InvalidError("nvme tier: read buffer not aligned to " + std::to_string(align_) + " bytes");
  Block b;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(a.id);
    if (it == blocks_.end()) return InvalidError("nvme tier: read of unknown block " + std::to_string(a.id));
    b = it->second;
  }
  if (!b.valid)
    return StateError("nvme tier: block " + std::to_string(a.id) + " at offset " + std::to_string(b.offset) +
                      " of " + paths_[0] + " holds no valid data (never written, or its last write failed)");
  NvmePending p;
  p.id = a.id;
  p.buf = dst;
  p.bytes = b.bytes;
  p.checksum = b.checksum;
  p.is_read = true;
  auto ops = Ops(b, dst, IoOp::kRead);
  p.ticket = options_.storage->Submit(ops);
  return p;
}

Status NvmeTier::Finish(NvmePending& p) {
  Status st = p.ticket->Wait();
  uint64_t offset;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(p.id);
    if (it == blocks_.end()) return InternalError("nvme tier: block freed with I/O in flight");
    Block& b = it->second;
    offset = b.offset;
    if (!st.ok()) return st;
    if (!p.is_read) {
      b.checksum = p.checksum;
      b.valid = true;
      return Status::Ok();
    }
  }
  if (!options_.checksums) return Status::Ok();
  const uint64_t got = XXH3_64bits(p.buf, p.bytes);  // outside the lock: reads run in parallel
  if (got == p.checksum) return Status::Ok();
  // Find the stripe that differs, to name its file.
  char want[17], have[17];
  std::snprintf(want, sizeof want, "%016llx", static_cast<unsigned long long>(p.checksum));
  std::snprintf(have, sizeof have, "%016llx", static_cast<unsigned long long>(got));
  std::string files = paths_[0];
  for (size_t j = 1; j < paths_.size(); ++j) files += ", " + paths_[j];
  return CorruptError("nvme tier: checksum mismatch reading block " + std::to_string(p.id) + " (" +
                      std::to_string(p.bytes) + " bytes) at offset " + std::to_string(offset) + " of " +
                      files + ": expected " + want + ", got " + have);
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
