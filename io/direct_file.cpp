// O_DIRECT opening, alignment discovery and space reservation.
#include "io/direct_file.h"

#include <fcntl.h>
#include <linux/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>

#include "base/log.h"
#include "base/sizes.h"

namespace strata {

// The direct-I/O alignment of an open file: max(memory, offset) alignment
// from statx, or 4096 when the kernel or file system doesn't say.
static uint64_t DirectIoAlignment(int fd) {
  struct statx stx {};
  const long rc = syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx);
  if (rc == 0 && (stx.stx_mask & STATX_DIOALIGN) && stx.stx_dio_offset_align > 0) {
    return std::max<uint64_t>(stx.stx_dio_mem_align, stx.stx_dio_offset_align);
  }
  return 4096;
}

static int OpenFlags(OpenMode mode) {
  switch (mode) {
    case OpenMode::kReadOnly: return O_RDONLY | O_CLOEXEC;
    case OpenMode::kReadWrite: return O_RDWR | O_CLOEXEC;
    case OpenMode::kCreate: return O_RDWR | O_CREAT | O_CLOEXEC;
    case OpenMode::kCreateNew: return O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  }
  return O_RDWR | O_CLOEXEC;
}

Status OpenDirectFile(const std::string& path, OpenMode mode, FileInfo* info, bool try_direct) {
  const int flags = OpenFlags(mode);
  const mode_t perms = mode == OpenMode::kCreateNew ? 0600 : 0666;  // (less the umask)
  bool direct = try_direct;
  int fd = -1;
  if (mode == OpenMode::kCreateNew) {
    // Created first, O_DIRECT set after: an open with O_CREAT and O_DIRECT
    // makes the file before it finds the file system without O_DIRECT
    // (EINVAL), and O_EXCL would refuse the retry.
    fd = ::open(path.c_str(), flags, perms);
    if (fd < 0) return PosixError("open", path, errno);
    if (direct && ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_DIRECT) != 0) {
      if (errno != EINVAL) {
        const int err = errno;
        ::close(fd);
        ::unlink(path.c_str());
        return PosixError("fcntl O_DIRECT", path, err);
      }
      direct = false;
    }
  } else {
    fd = direct ? ::open(path.c_str(), flags | O_DIRECT, perms) : -1;
    if (!direct || (fd < 0 && errno == EINVAL)) {  // the file system has no O_DIRECT
      fd = ::open(path.c_str(), flags, perms);
      direct = false;
    }
    if (fd < 0) return PosixError("open", path, errno);
  }
  // Never at 0, 1 or 2: where the process started with them closed (a
  // supervisor's `cmd <&- >&- 2>&-`), a file opened there took stderr's
  // number, and every log line went into it (a swap file: the state
  // corrupt).
  if (fd <= 2) {
    const int moved = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
    const int err = errno;
    ::close(fd);
    if (moved < 0) {
      if (mode == OpenMode::kCreateNew) ::unlink(path.c_str());
      return PosixError("fcntl F_DUPFD_CLOEXEC", path, err);
    }
    fd = moved;
  }
  if (try_direct && !direct)
    WarnOnce("no-odirect:" + path.substr(0, path.rfind('/')),
             "the file system holding " + path + " does not support O_DIRECT (tmpfs?); using buffered I/O there");
  info->path = path;
  info->fd = fd;
  info->direct = direct;
  info->align = direct ? DirectIoAlignment(fd) : 1;
  return Status::Ok();
}

Result<uint64_t> FreeBytesAt(const std::string& path) {
  struct statvfs vfs {};
  if (::statvfs(path.c_str(), &vfs) != 0) return PosixError("statvfs", path, errno);
  return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

// Past RLIMIT_FSIZE the kernel sends SIGXFSZ, which kills by default; we
// want the EFBIG result instead, so ignore the signal unless someone handles it.
static void IgnoreSigxfszOnce() {
  static const bool done = [] {
    struct sigaction old {};
    if (::sigaction(SIGXFSZ, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) ::signal(SIGXFSZ, SIG_IGN);
    return true;
  }();
  (void)done;
}

Status ReserveFileSpace(int fd, const std::string& path, uint64_t bytes) {
  if (bytes == 0) return Status::Ok();
  IgnoreSigxfszOnce();
  const std::string dir = path.substr(0, path.rfind('/'));
  // The free space as it was: a fallocate that fails part-way has taken
  // some (the message said "0 B free" of a disk that had most of it).
  Result<uint64_t> free_before = FreeBytesAt(dir);
  int rc;
  do {
    rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (rc == EINTR);
  if (rc == 0) return Status::Ok();
  if (rc == ENOSPC || rc == EFBIG || rc == EDQUOT) {
    return NoSpaceError("reserving " + FormatBytes(bytes) + " (" + std::to_string(bytes) +
                        " bytes) for " + path + " failed: " + std::strerror(rc) + "; " +
                        (free_before.ok() ? FormatBytes(*free_before) : free_before.status().message()) +
                        " free in " + dir + " before it" +
                        (rc == EFBIG ? " (the file size limit, RLIMIT_FSIZE, may be lower)" : ""));
  }
  return PosixError("fallocate", path, 0, bytes, rc);
}

}  // namespace strata
