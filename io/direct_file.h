// Opening files for direct I/O: O_DIRECT with the alignment statx reports
// (STATX_DIOALIGN, through the raw syscall since glibc hides the fields),
// else 4096; file systems without O_DIRECT (tmpfs) fall back to buffered I/O.
#pragma once

#include <string>

#include "base/status.h"
#include "io/storage.h"

namespace strata {

// Opens `path`; fills `info` (path, fd, align, direct). With `try_direct`
// false the file is opened buffered, as if O_DIRECT had been refused.
// Errors name the path.
Status OpenDirectFile(const std::string& path, OpenMode mode, FileInfo* info,
                      bool try_direct = true);

// Reserves [0, bytes) of `fd` on disk (fallocate), so that a full disk is
// found now. Errors name the path, the bytes wanted and the bytes free.
Status ReserveFileSpace(int fd, const std::string& path, uint64_t bytes);

// Free bytes on the file system holding `path` for an unprivileged writer
// (statvfs); IO naming the path and errno where statvfs fails (a file
// system without statfs), never a made-up 0 ("no space").
Result<uint64_t> FreeBytesAt(const std::string& path);

}  // namespace strata
