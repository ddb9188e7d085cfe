// strata-export's copy loop: for each group, each rank's W shard (a frozen
// group's P shard) in rank order, read in chunks, hashed, and the chunk's
// real elements written (as f32 or bf16) where their tensor lies in the
// safetensors data section.
#include "tools/export/export.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "base/sizes.h"
#include "kernels/cpu/cast.h"
#include "kernels/cpu/compact.h"
#include "tools/export/safetensors.h"

namespace strata::exporter {

namespace {

std::string Hex(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

Status PreadFull(int fd, const std::string& path, void* buf, uint64_t bytes, uint64_t off) {
  char* p = static_cast<char*>(buf);
  for (uint64_t done = 0; done < bytes;) {
    const ssize_t n = ::pread(fd, p + done, bytes - done, static_cast<off_t>(off + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PosixError("pread", path, off + done, bytes - done, errno);
    if (n == 0) return CorruptError(path + " is truncated: nothing to read at offset " + std::to_string(off + done));
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status PwriteFull(int fd, const std::string& path, const void* buf, uint64_t bytes, uint64_t off) {
  const char* p = static_cast<const char*>(buf);
  for (uint64_t done = 0; done < bytes;) {
    const ssize_t n = ::pwrite(fd, p + done, bytes - done, static_cast<off_t>(off + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return PosixError("pwrite", path, off + done, bytes - done, n < 0 ? errno : EIO);
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

// The open output and the rank files, closed (and the output removed unless
// committed) on every path out.
class Files {
 public:
  explicit Files(std::string tmp) : tmp_(std::move(tmp)) {}
  ~Files() {
    for (auto& [path, fd] : in_) ::close(fd);
    if (out_ >= 0) ::close(out_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  Status OpenOut() {
    out_ = ::open(tmp_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);  // read back for aliases
    return out_ < 0 ? PosixError("create", tmp_, errno) : Status::Ok();
  }
  Result<int> In(const std::string& path) {
    auto it = in_.find(path);
    if (it != in_.end()) return it->second;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return PosixError("open", path, errno);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    in_[path] = fd;
    return fd;
  }
  int out() const { return out_; }
  const std::string& tmp() const { return tmp_; }
  Status Commit(const std::string& dst) {
    if (::fsync(out_) != 0) return PosixError("fsync", tmp_, errno);
    if (::close(out_) != 0) return PosixError("close", tmp_, errno);
    out_ = -1;
    if (::rename(tmp_.c_str(), dst.c_str()) != 0) return PosixError("rename " + tmp_ + " to", dst, errno);
    committed_ = true;
    std::string dir = std::filesystem::path(dst).parent_path().string();
    const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_CLOEXEC);
    if (dfd >= 0) {  // the rename made durable; a failure here leaves a whole file, so it only warns
      if (::fsync(dfd) != 0) std::fprintf(stderr, "strata-export: warning: fsync %s failed\n", dir.c_str());
      ::close(dfd);
    }
    return Status::Ok();
  }

 private:
  std::string tmp_;
  std::map<std::string, int> in_;
  int out_ = -1;
  bool committed_ = false;
};

struct Buffers {
  std::unique_ptr<float, void (*)(void*)> read{nullptr, std::free};
  std::vector<uint16_t> bf16;
  uint64_t bytes = 0;
};

// One chunk of group elements [a, b) at `src`: each tensor's part of it to the output.
Status WriteChunk(const GroupRef& g, const std::vector<SafetensorsEntry>& entries, size_t first_entry, uint64_t data_base,
                  uint64_t a, uint64_t b, const float* src, Files& files, Buffers& bufs) {
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    const TensorRef& tr = g.tensors[t];
    const uint64_t lo = std::max(a, tr.offset), hi = std::min(b, tr.offset + tr.numel);
    if (lo >= hi) continue;
    const SafetensorsEntry& e = entries[first_entry + t];
    const uint64_t dst = data_base + e.begin + (lo - tr.offset) * DTypeSize(e.dtype);
    const float* from = src + (lo - a);
    const uint64_t n = hi - lo;
    if (e.dtype == DType::kF32) {
      STRATA_RETURN_IF_ERROR(PwriteFull(files.out(), files.tmp(), from, n * 4, dst));
    } else {
      for (uint64_t i = 0; i < n; ++i) bufs.bf16[i] = F32ToBF16(from[i]);
      STRATA_RETURN_IF_ERROR(PwriteFull(files.out(), files.tmp(), bufs.bf16.data(), n * 2, dst));
    }
  }
  return Status::Ok();
}

// Reads shard r's W block of group g chunk by chunk into bufs.read, hashing
// it, calling `chunk(done, n)` on each (may be null), then checks the hash.
Status ReadHashed(const GroupRef& g, size_t gi, uint64_t r, Files& files, Buffers& bufs,
                  const std::function<Status(uint64_t, uint64_t)>& chunk) {
  const ShardRef& s = g.shards[r];
  STRATA_ASSIGN_OR_RETURN(int fd, files.In(s.path));
  XXH3_state_t* hs = XXH3_createState();
  XXH3_64bits_reset(hs);
  Status st;
  for (uint64_t done = 0; st.ok() && done < s.bytes;) {
    const uint64_t n = std::min(bufs.bytes, s.bytes - done);
    st = PreadFull(fd, s.path, bufs.read.get(), n, s.offset + done);
    if (!st.ok()) break;
    XXH3_64bits_update(hs, bufs.read.get(), n);
    if (chunk) st = chunk(done, n);
    ::posix_fadvise(fd, static_cast<off_t>(s.offset + done), static_cast<off_t>(n), POSIX_FADV_DONTNEED);
    done += n;
  }
  const uint64_t h = XXH3_64bits_digest(hs);
  XXH3_freeState(hs);
  if (st.ok() && Hex(h) != s.xxh3)
    st = CorruptError("checksum mismatch in " + s.path + ": the " + (g.frozen ? "P" : "W") + " block of group " +
                      std::to_string(gi) + " at offset " +
                      std::to_string(s.offset) + " (" + std::to_string(s.bytes) + " bytes)");
  return st;
}

// Rank r's W shard of group g: read chunk by chunk, hashed, its real elements written.
Status CopyShard(const GroupRef& g, size_t gi, uint64_t r, const std::vector<SafetensorsEntry>& entries,
                 size_t first_entry, uint64_t data_base, Files& files, Buffers& bufs) {
  return ReadHashed(g, gi, r, files, bufs, [&](uint64_t done, uint64_t n) {
    const uint64_t a = r * g.shard_numel + done / 4;
    return WriteChunk(g, entries, first_entry, data_base, a, a + n / 4, bufs.read.get(), files, bufs);
  });
}

// A frozen group's P shard (its parameters in the compute dtype `dt`): read
// chunk by chunk, hashed, widened to f32 (exact), its real elements written.
Status CopyFrozenShard(const GroupRef& g, size_t gi, uint64_t r, DType dt, const std::vector<SafetensorsEntry>& entries,
                       size_t first_entry, uint64_t data_base, Files& files, Buffers& bufs) {
  const uint64_t es = DTypeSize(dt);
  std::vector<float> wide(dt == DType::kF32 ? 0 : bufs.bytes / es);
  return ReadHashed(g, gi, r, files, bufs, [&](uint64_t done, uint64_t n) -> Status {
    const uint64_t a = r * g.shard_numel + done / es, count = n / es;
    const float* src = bufs.read.get();
    if (dt != DType::kF32) {
      STRATA_RETURN_IF_ERROR(kernels::Cast(dt, bufs.read.get(), DType::kF32, wide.data(), count));
      src = wide.data();
    }
    return WriteChunk(g, entries, first_entry, data_base, a, a + count, src, files, bufs);
  });
}

// The same for a compact W block: checked whole against its checksum
// first, then rebuilt a chunk at a time from its bf16 halves and corrections.
Status CopyCompactShard(const GroupRef& g, size_t gi, uint64_t r, const std::vector<SafetensorsEntry>& entries,
                        size_t first_entry, uint64_t data_base, Files& files, Buffers& bufs) {
  STRATA_RETURN_IF_ERROR(ReadHashed(g, gi, r, files, bufs, nullptr));
  const ShardRef& s = g.shards[r];
  STRATA_ASSIGN_OR_RETURN(int fd, files.In(s.path));
  const uint64_t n = g.shard_numel;
  const uint64_t chunk = bufs.bytes / 4 / kernels::kCompactBlock * kernels::kCompactBlock;  // the rebuilt floats fill the buffer
  std::vector<uint16_t> hi(chunk);
  std::vector<int8_t> lo(chunk), m_code(chunk, 0);
  std::vector<float> m_scale(kernels::CompactScaleCount(chunk), 0.0f), m(chunk);
  for (uint64_t e = 0; e < n; e += chunk) {  // the moments are zeros here: only W is rebuilt
    const uint64_t c = std::min(chunk, n - e);
    STRATA_RETURN_IF_ERROR(PreadFull(fd, s.path, hi.data(), c * 2, s.offset + e * 2));
    STRATA_RETURN_IF_ERROR(PreadFull(fd, s.path, lo.data(), c, s.offset + 2 * n + e));
    const kernels::CompactState cs{hi.data(), lo.data(), m_code.data(), m_scale.data(), nullptr, nullptr};
    STRATA_RETURN_IF_ERROR(kernels::CompactUnpack(c, cs, bufs.read.get(), m.data(), nullptr));
    const uint64_t a = r * g.shard_numel + e;
    STRATA_RETURN_IF_ERROR(WriteChunk(g, entries, first_entry, data_base, a, a + c, bufs.read.get(), files, bufs));
  }
  return Status::Ok();
}

}  // namespace

Result<ExportSummary> ExportSafetensors(const CheckpointPlan& plan, const std::string& out_path, const ExportOptions& options) {
  if (options.dtype != DType::kF32 && options.dtype != DType::kBF16)
    return InvalidError("strata-export: --dtype must be f32 or bf16");
  ExportSummary sum;
  std::vector<SafetensorsEntry> entries;
  std::vector<size_t> first_entry;  // per group
  for (const GroupRef& g : plan.groups) {
    first_entry.push_back(entries.size());
    for (const TensorRef& t : g.tensors) {
      uint64_t n = 1;
      for (uint64_t d : t.shape) n *= d;
      if (n != t.numel)  // the plan's promise; a mismatch would misplace every later tensor
        return InternalError("strata-export: tensor '" + t.name + "' has " + std::to_string(t.numel) +
                             " elements but a shape of " + std::to_string(n));
      entries.push_back({t.name, options.dtype, t.shape, 0, 0});
      sum.elements += t.numel;
    }
  }
  // A tied weight's other names: entries of their own after every group's
  // (safetensors shares no data between names), filled from the first's.
  std::vector<std::pair<size_t, size_t>> alias_of;  // (alias entry, its tensor's entry)
  for (size_t g = 0; g < plan.groups.size(); ++g)
    for (size_t t = 0; t < plan.groups[g].tensors.size(); ++t)
      for (const std::string& a : plan.groups[g].tensors[t].aliases) {
        alias_of.push_back({entries.size(), first_entry[g] + t});
        entries.push_back({a, options.dtype, plan.groups[g].tensors[t].shape, 0, 0});
      }
  sum.tensors = entries.size();
  const uint64_t data_bytes = LayOutEntries(entries);
  const std::string prefix = SafetensorsPrefix(
      entries, {{"format", "pt"}, {"producer", "strata"}, {"step", std::to_string(plan.step)}, {"checkpoint", plan.tag}});
  sum.file_bytes = prefix.size() + data_bytes;

  Buffers bufs;
  bufs.bytes = std::max<uint64_t>(4096, options.buffer_bytes / 4096 * 4096);
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bufs.bytes) != 0) return NoMemError("strata-export: no memory for a read buffer");
  bufs.read.reset(static_cast<float*>(p));
  if (options.dtype == DType::kBF16) bufs.bf16.resize(bufs.bytes / 2);  // a chunk of 16-bit P: bytes / 2 elements

  Files files(out_path + ".partial");
  STRATA_RETURN_IF_ERROR(files.OpenOut());
  // Space checked up front: a full disk is found before the copy, not in its
  // middle. (Not fallocate: buffered writes into its unwritten extents ran at
  // half the speed here.)
  struct statvfs vfs {};
  if (::fstatvfs(files.out(), &vfs) == 0 && static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize < sum.file_bytes)
    return NoSpaceError("strata-export: " + files.tmp() + " needs " + FormatBytes(sum.file_bytes) + "; its file system has " +
                        FormatBytes(static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize) + " free");
  STRATA_RETURN_IF_ERROR(PwriteFull(files.out(), files.tmp(), prefix.data(), prefix.size(), 0));
  for (size_t g = 0; g < plan.groups.size(); ++g)
    for (uint64_t r = 0; r < plan.groups[g].shards.size(); ++r) {
      if (plan.groups[g].frozen)
        STRATA_RETURN_IF_ERROR(CopyFrozenShard(plan.groups[g], g, r, plan.p_dtype, entries, first_entry[g],
                                               prefix.size(), files, bufs));
      else
        STRATA_RETURN_IF_ERROR((plan.compact ? CopyCompactShard : CopyShard)(plan.groups[g], g, r, entries,
                                                                             first_entry[g], prefix.size(), files, bufs));
      sum.read_bytes += plan.groups[g].shards[r].bytes;
    }
  for (const auto& [a, t] : alias_of) {  // copied from the file as written, a buffer at a time
    const SafetensorsEntry &from = entries[t], &to = entries[a];
    for (uint64_t done = 0; done < from.end - from.begin;) {
      const uint64_t n = std::min<uint64_t>(bufs.bytes, from.end - from.begin - done);
      STRATA_RETURN_IF_ERROR(PreadFull(files.out(), files.tmp(), bufs.read.get(), n, prefix.size() + from.begin + done));
      STRATA_RETURN_IF_ERROR(PwriteFull(files.out(), files.tmp(), bufs.read.get(), n, prefix.size() + to.begin + done));
      done += n;
    }
  }
  STRATA_RETURN_IF_ERROR(files.Commit(out_path));
  return sum;
}

}  // namespace strata::exporter
