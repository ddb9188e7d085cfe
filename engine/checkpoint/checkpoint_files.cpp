// Checkpoint folders on disk: durable small files, tags, scans, leftovers.
#include "engine/checkpoint/checkpoint_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <tuple>

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"

namespace strata::ckpt {

void KillPoint(const char* name) {
  const char* at = std::getenv("STRATA_CHECKPOINT_KILL_AT");
  if (at && std::strcmp(at, name) == 0) {
    std::fprintf(stderr, "strata: STRATA_CHECKPOINT_KILL_AT=%s: aborting here\n", name);
    std::_Exit(86);
  }
}

Status FaultPoint(const char* name) {
  const char* at = std::getenv("STRATA_CHECKPOINT_FAIL_AT");
  if (at && std::strcmp(at, name) == 0)
    return IoError(std::string("STRATA_CHECKPOINT_FAIL_AT=") + name + ": an injected I/O error");
  return Status::Ok();
}

Status FsyncPath(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return PosixError("open for fsync", path, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return PosixError("fsync", path, err);
  return Status::Ok();
}

Status PreadFull(int fd, void* buf, uint64_t bytes, uint64_t off, const std::string& path) {
  for (uint64_t done = 0; done < bytes;) {
    const ssize_t n = ::pread(fd, static_cast<char*>(buf) + done, bytes - done, static_cast<off_t>(off + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PosixError("checkpoint load: pread", path, off + done, bytes - done, errno);
    if (n == 0) return CorruptError("checkpoint load: " + path + " ends early at offset " + std::to_string(off + done));
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status WriteSmallFile(const std::string& path, const void* data, uint64_t bytes) {
  // A file left at the name (a save that died) goes first; the new one is
  // created new, never written through a name someone put there since (a
  // symlink to another of the user's files, in a folder others may write).
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return PosixError("remove the old", path, errno);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);  // (less the umask)
  if (fd < 0) return PosixError("create", path, errno);
  const char* p = static_cast<const char*>(data);
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd, p + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      return PosixError("write", path, done, bytes - done, err);
    }
    done += static_cast<uint64_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return PosixError("fsync", path, err);
  }
  if (::close(fd) != 0) return PosixError("close", path, errno);
  return Status::Ok();
}

Status CreateDirsDurably(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<fs::path> made;  // deepest first
  std::error_code ec;
  fs::path top = fs::path(dir).lexically_normal();
  if (!top.has_filename()) top = top.parent_path();  // "ck/": "ck"
  for (fs::path p = top; !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    made.push_back(p);
    if (p == p.parent_path()) break;
  }
  fs::create_directories(dir, ec);
  if (ec) return IoError("cannot create " + dir + ": " + ec.message());
  for (const fs::path& p : made) {
    const fs::path parent = p.has_parent_path() ? p.parent_path() : fs::path(".");
    STRATA_RETURN_IF_ERROR(FsyncPath(parent.empty() ? "." : parent.string()));
  }
  return Status::Ok();
}

Status ReplaceFile(const std::string& folder, const std::string& name, const std::string& text) {
  const std::string tmp = folder + "/" + name + ".tmp", dst = folder + "/" + name;
  STRATA_RETURN_IF_ERROR(WriteSmallFile(tmp, text.data(), text.size()));
  if (::rename(tmp.c_str(), dst.c_str()) != 0) return PosixError("rename " + tmp + " to", dst, errno);
  return FsyncPath(folder);
}

Result<std::string> ReadSmallFile(const std::string& path, uint64_t limit) {
  // O_NONBLOCK: a FIFO in its place neither blocks the open nor is read (it is
  // not a regular file); the size is checked before anything is read, so a
  // file that is huge (or /dev/zero behind a link) costs no memory.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return NotFoundError("checkpoint: " + path + " does not exist");
    return PosixError("checkpoint: open", path, err);
  }
  struct stat st {};
  Status bad;
  if (::fstat(fd, &st) != 0)
    bad = PosixError("checkpoint: fstat", path, errno);
  else if (!S_ISREG(st.st_mode))
    bad = CorruptError("checkpoint: " + path + " is not a regular file");
  else if (static_cast<uint64_t>(st.st_size) > limit)
    bad = CorruptError("checkpoint: " + path + " is larger than " + FormatBytes(limit));
  std::string s;
  if (bad.ok()) {
    s.resize(static_cast<size_t>(st.st_size));
    bad = PreadFull(fd, s.data(), s.size(), 0, path);
    char extra;  // grown since the fstat: its size is not the one checked
    if (bad.ok() && ::pread(fd, &extra, 1, static_cast<off_t>(s.size())) > 0)
      bad = CorruptError("checkpoint: " + path + " changed while it was read");
  }
  ::close(fd);
  if (!bad.ok()) return bad;
  return s;
}

bool ValidTag(const std::string& t) {
  // "latest" and "latest.tmp" (ReplaceFile's temporary for it) are DIR's own files.
  if (t.empty() || t.size() > 200 || t == "latest" || t == "latest.tmp" || t[0] == '.') return false;
  for (char c : t)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') return false;
  return true;
}

std::string RankFile(int rank) {
  char b[32];
  std::snprintf(b, sizeof b, "rank%05d.bin", rank);
  return b;
}

Result<bool> Exists(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) return true;
  if (errno == ENOENT || errno == ENOTDIR) return false;
  return PosixError("checkpoint: lstat", path, errno);
}

Result<bool> IsDir(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return S_ISDIR(st.st_mode);
  if (errno == ENOENT || errno == ENOTDIR) return false;
  return PosixError("checkpoint: stat", path, errno);
}

Result<manifest::Manifest> ReadManifestAt(const std::string& folder) {
  const std::string path = folder + "/manifest.json";
  auto text = ReadSmallFile(path, 256 * kMiB);
  if (!text.ok() && text.status().code() == Code::kNotFound)
    return CorruptError("checkpoint: " + path + " is missing (the folder is not a whole checkpoint)");
  if (!text.ok()) return text.status();
  STRATA_ASSIGN_OR_RETURN(manifest::Manifest m, manifest::Parse(*text, path));
  if (!m.sealed)
    STRATA_LOG_WARN("checkpoint: {} carries no checksum of its own (written by an older Strata); its fields are "
                    "checked but a flipped bit in them cannot be detected", path);
  return m;
}

Result<std::vector<Found>> ScanCheckpoints(const std::string& dir) {
  std::vector<std::string> tags;
  DIR* d = ::opendir(dir.c_str());
  if (!d) {
    if (errno == ENOENT) return std::vector<Found>{};
    return PosixError("checkpoint: opendir", dir, errno);
  }
  struct Closer { DIR* d; ~Closer() { ::closedir(d); } } closer{d};
  for (;;) {
    errno = 0;
    const dirent* e = ::readdir(d);
    if (!e) {
      if (errno != 0) return PosixError("checkpoint: readdir", dir, errno);
      break;
    }
    if (!ValidTag(e->d_name)) continue;
    const std::string folder = dir + "/" + e->d_name;
    STRATA_ASSIGN_OR_RETURN(bool is_dir, IsDir(folder));
    if (!is_dir) continue;
    STRATA_ASSIGN_OR_RETURN(bool has_manifest, Exists(folder + "/manifest.json"));
    if (has_manifest) tags.emplace_back(e->d_name);
  }
  std::sort(tags.begin(), tags.end());
  std::vector<Found> found;
  for (auto& t : tags) found.push_back({t, ReadManifestAt(dir + "/" + t)});
  return found;
}

Result<std::string> LatestTag(const std::string& dir) {
  auto t = ReadSmallFile(dir + "/latest", 4096);
  if (!t.ok() && t.status().code() != Code::kNotFound && t.status().code() != Code::kCorrupt) return t.status();
  if (!t.ok()) return std::string();
  std::string tag = std::move(t).value();
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == ' ')) tag.pop_back();
  return ValidTag(tag) ? tag : "";
}

bool Older(const manifest::Manifest& a, const manifest::Manifest& b) {
  return std::tie(a.save_seq, a.step) < std::tie(b.save_seq, b.step);
}

Status FindNewest(const std::string& dir, const std::string& who, std::string* tag, manifest::Manifest* m) {
  auto in = [&](Status st) { return st.WithContext(who); };
  auto latest_or = LatestTag(dir);
  if (!latest_or.ok()) return in(latest_or.status());
  const std::string latest = *latest_or;
  auto found_or = ScanCheckpoints(dir);
  if (!found_or.ok()) return in(found_or.status());
  std::vector<Found> found = std::move(found_or).value();
  if (!latest.empty()) {
    auto is_dir = IsDir(dir + "/" + latest);
    if (!is_dir.ok()) return in(is_dir.status());
    auto has_manifest = *is_dir ? Exists(dir + "/" + latest + "/manifest.json") : Result<bool>(true);
    if (!has_manifest.ok()) return in(has_manifest.status());
    if (!*has_manifest)
      return CorruptError(who + ": " + dir + "/" + latest + "/manifest.json (the checkpoint " + dir +
                          "/latest names) is missing");
  }
  if (found.empty()) {
    auto has_latest = Exists(dir + "/latest");
    if (!has_latest.ok()) return in(has_latest.status());
    if (*has_latest)
      return CorruptError(who + ": " + dir + "/latest names '" + latest + "', but " + dir +
                          " holds no checkpoint folder");
    return NotFoundError(who + ": " + dir + " holds no checkpoint (no latest, no tag folder)");
  }
  const Found* best = nullptr;
  for (const Found& f : found) {
    if (!f.manifest.ok())  // it might be the newest: taking an older one would be a silent step back
      return f.manifest.status().WithContext(who + ": cannot tell which checkpoint in " + dir +
                                             " is the newest; name a tag or remove the damaged one");
    if (!best || Older(best->manifest.value(), f.manifest.value()) ||
        (!Older(f.manifest.value(), best->manifest.value()) && f.tag == latest))
      best = &f;
  }
  if (best->tag != latest && latest.empty())
    STRATA_LOG_WARN("{}: {}/latest is missing or damaged; taking '{}', the newest by save order", who, dir, best->tag);
  else if (best->tag != latest)
    STRATA_LOG_WARN("{}: {}/latest names '{}', but '{}' was saved after it (a save was interrupted "
                    "before it updated latest); taking '{}'", who, dir, latest, best->tag, best->tag);
  *tag = best->tag;
  *m = best->manifest.value();
  return Status::Ok();
}

PartialLock::~PartialLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

Status PartialLock::Lock(const std::string& folder) {
  fd_ = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) return PosixError("checkpoint save: open", folder, errno);
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) return PosixError("checkpoint save: flock", folder, errno);
  return Status::Ok();
}

int RemoveAbandonedPartials(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.size() > 9 && n[0] == '.' && n.compare(n.size() - 8, 8, ".partial") == 0) names.push_back(n);
    }
    ::closedir(d);
  }
  int removed = 0;
  for (const std::string& n : names) {
    const std::string path = dir + "/" + n;
    // A live save holds its folder's flock; a killed one's died with it.
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);
      continue;
    }
    std::error_code ec;
    std::filesystem::remove_all(path, ec);  // only links and the partial's own files: no complete checkpoint
    ::close(fd);
    if (ec) STRATA_LOG_WARN("checkpoint save: cannot remove the abandoned {}: {}", path, ec.message());
    else ++removed;
  }
  return removed;
}

}  // namespace strata::ckpt
