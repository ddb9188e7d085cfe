// FileStorage: Storage on io_uring, or on threads calling pread and pwrite
// where io_uring is refused. Requests are cut into `block_size` chunks and
// spread over the workers: io_uring rings (one thread each, kept
// `queue_depth` deep, with registered files and sparse registered buffers),
// or thread pools (min(queue_depth, kMaxThreadsPerWorker) threads each, one
// request in flight per thread). Every completion's result is checked:
// short transfers continue from the aligned offset below what was done,
// EINTR and EAGAIN are retried, anything else fails the batch with an error
// naming the file, offset, length and errno.
#pragma once

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <map>
#include <vector>

#include "io/fault.h"
#include "io/storage.h"

namespace strata {

enum class IoBackend : uint8_t {
  kAuto,    // io_uring; pread and pwrite on threads, with one warning, where io_uring is refused
  kUring,   // io_uring, or fail
  kThreads, // pread and pwrite on threads
};
const char* IoBackendName(IoBackend b);

struct StorageOptions {
  // Limits of Create, shared with the config reader (aio.queue_depth,
  // aio.block_size) so that what the config accepts the storage accepts.
  static constexpr uint32_t kMaxQueueDepth = 4096;       // requests in flight per ring
  static constexpr uint64_t kMaxBlockSize = 1ull << 30;  // one request's buffer

  static constexpr int kMaxThreadsPerWorker = 4;

  IoBackend backend = IoBackend::kAuto;
  int rings = 1;                  // workers: io_uring rings (one thread each), or thread pools
  uint32_t queue_depth = 32;      // in-flight requests per ring
  uint64_t block_size = 1 << 20;  // largest single request
  bool register_buffers = true;
  bool register_files = true;
  bool direct = true;  // false: buffered I/O everywhere (as where O_DIRECT is refused)
  std::shared_ptr<FaultPlan> faults;  // tests only
};

class IoWorker;  // one worker: an io_uring ring, or a pool of threads

class FileStorage final : public Storage {
 public:
  // Sets up the workers and starts their threads. Errors name the io_uring
  // call; with kAuto, io_uring refused (EPERM, ENOSYS) is one warning naming
  // why, and the workers are threads.
  static Result<std::unique_ptr<FileStorage>> Create(const StorageOptions& options);
  ~FileStorage() override;

  Result<FileId> Open(const std::string& path, OpenMode mode) override;
  Status Close(FileId file) override;
  const FileInfo& Info(FileId file) const override;
  IoTicket Submit(std::span<const IoOp> ops) override;
  void RegisterBuffer(void* p, uint64_t len) override;
  void UnregisterBuffer(void* p) override;

  const StorageOptions& options() const { return options_; }
  // The backend chosen: kUring or kThreads (never kAuto).
  IoBackend backend() const { return backend_; }
  // Operations submitted so far (SQEs, retries included).
  uint64_t ops_submitted() const { return next_seq_.load(); }

  // Used by the workers.
  struct BufferSlot { uint64_t len; int index; };
  int FixedBufferIndex(const void* p, uint64_t len) const;
  uint64_t NextSeq() { return next_seq_.fetch_add(1); }

 private:
  explicit FileStorage(const StorageOptions& options);
  Status ValidateOp(const IoOp& op) const;

  StorageOptions options_;
  IoBackend backend_ = IoBackend::kUring;
  std::vector<std::unique_ptr<IoWorker>> workers_;
  std::atomic<uint64_t> next_seq_{0};
  std::atomic<uint64_t> next_ring_{0};

  mutable std::shared_mutex files_mu_;  // guards files_ (the table, not the I/O)
  std::vector<FileInfo> files_;         // index = FileId; fd -1 = closed slot

  mutable std::shared_mutex buffers_mu_;  // guards buffers_ and free_buffer_slots_
  std::map<uintptr_t, BufferSlot> buffers_;  // start address -> slot
  std::vector<int> free_buffer_slots_;
  bool fixed_buffers_ok_ = true;
};

}  // namespace strata
