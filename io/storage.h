// The storage seam: the one interface through which Strata reads and writes
// files. The real implementation is FileStorage (io_uring, O_DIRECT); tests
// give it a FaultPlan to inject the faults a real disk won't produce on demand.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "base/status.h"

namespace strata {

using FileId = int32_t;

struct FileInfo {
  std::string path;
  uint64_t align = 4096;  // offset, length and buffer alignment required
  bool direct = true;     // false: the file system refused O_DIRECT (tmpfs)
  int fd = -1;
};

enum class OpenMode {
  kReadWrite,
  kCreate,     // create or open, read-write (mode 0666 less the umask)
  kReadOnly,
  kCreateNew,  // create, read-write, mode 0600: refused where the name exists, a symlink included (private files)
};

struct IoOp {
  enum Kind : uint8_t { kRead, kWrite };
  Kind kind = kRead;
  FileId file = -1;
  uint64_t offset = 0;
  void* buf = nullptr;
  uint64_t len = 0;
};

// Completion state of one submitted batch. Thread-safe.
class IoBatch {
 public:
  explicit IoBatch(int64_t parts) : remaining_(parts) {}
  virtual ~IoBatch() = default;
  // Records a failure; the first one wins.
  void Fail(Status s);
  // One part finished (successfully or not).
  void PartDone();
  Status Wait();

 protected:
  // Runs once, the last thing the last PartDone does (it may free the batch).
  virtual void OnAllDone() {}

 private:
  std::atomic<int64_t> remaining_;
  std::mutex mu_;  // guards status_ and the wake-up
  std::condition_variable cv_;
  Status status_;
};
using IoTicket = std::shared_ptr<IoBatch>;

class Storage {
 public:
  virtual ~Storage() = default;
  // Opens `path` for direct I/O (buffered, with one warning, where the file
  // system refuses O_DIRECT). Errors name the path and errno.
  virtual Result<FileId> Open(const std::string& path, OpenMode mode) = 0;
  // REQUIRES: no I/O on `file` in flight.
  virtual Status Close(FileId file) = 0;
  virtual const FileInfo& Info(FileId file) const = 0;
  // Starts every op of `ops` (which the callee copies); buffers must stay
  // valid until the ticket is done. Invalid ops (misaligned for a direct
  // file, unknown file) fail the ticket before anything is submitted.
  virtual IoTicket Submit(std::span<const IoOp> ops) = 0;
  // Makes [p, p+len) a registered (fixed) buffer for faster I/O. Failure to
  // register is not an error: I/O on the range works either way.
  virtual void RegisterBuffer(void* p, uint64_t len) = 0;
  virtual void UnregisterBuffer(void* p) = 0;

  // Submit and wait.
  Status Run(std::span<const IoOp> ops) { return Submit(ops)->Wait(); }
};

}  // namespace strata
