// FileStorage: the choice of workers, the batch bookkeeping, files and buffers tables.
#include "io/file_storage.h"

#include <sys/resource.h>
#include <unistd.h>

#include "base/fork_close.h"
#include "base/check.h"
#include "base/log.h"
#include "io/direct_file.h"
#include "io/thread_worker.h"
#include "io/uring_ring.h"

namespace strata {

void IoBatch::Fail(Status s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (status_.ok()) status_ = std::move(s);
}

void IoBatch::PartDone() {
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  {
    std::lock_guard<std::mutex> lock(mu_);  // pairs with the waiter's check
    cv_.notify_all();
  }
  OnAllDone();
}

Status IoBatch::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return remaining_.load(std::memory_order_acquire) == 0; });
  return status_;
}

// A ticket already finished with `s` (nothing to submit, or refused).
static IoTicket DoneTicket(Status s) {
  auto t = std::make_shared<IoBatch>(1);
  if (!s.ok()) t->Fail(std::move(s));
  t->PartDone();
  return t;
}

FileStorage::FileStorage(const StorageOptions& options) : options_(options) {}

const char* IoBackendName(IoBackend b) {
  switch (b) {
    case IoBackend::kAuto: return "auto";
    case IoBackend::kUring: return "io_uring";
    case IoBackend::kThreads: return "threads";
  }
  return "unknown";
}

Result<std::unique_ptr<FileStorage>> FileStorage::Create(const StorageOptions& options) {
  if (options.rings < 1 || options.rings > 64)
    return InvalidError("io rings " + std::to_string(options.rings) + " is not in 1..64");
  if (options.queue_depth < 1 || options.queue_depth > StorageOptions::kMaxQueueDepth)
    return InvalidError("io queue depth " + std::to_string(options.queue_depth) + " is not in 1.." +
                        std::to_string(StorageOptions::kMaxQueueDepth));
  if (options.block_size < 4096 || options.block_size > StorageOptions::kMaxBlockSize || options.block_size % 4096)
    return InvalidError("io block size " + std::to_string(options.block_size) +
                        " must be a multiple of 4096 between 4 KiB and 1 GiB");
  if (options.backend != IoBackend::kAuto && options.backend != IoBackend::kUring &&
      options.backend != IoBackend::kThreads)
    return InvalidError("io backend " + std::to_string(static_cast<int>(options.backend)) + " is not one of auto, "
                        "io_uring, threads");
  std::unique_ptr<FileStorage> s(new FileStorage(options));
  s->files_.reserve(IoWorker::kMaxFiles);  // Info() hands out references: never reallocate
  s->backend_ = options.backend == IoBackend::kThreads ? IoBackend::kThreads : IoBackend::kUring;
  for (int i = 0; i < options.rings && s->backend_ == IoBackend::kUring; ++i) {
    auto ring = std::make_unique<UringRing>(s.get(), i, options.queue_depth);
    bool refused = false;
    Status st = ring->Init(options.register_files, options.register_buffers, &refused);
    if (!st.ok() && refused) {
      const std::string why = std::string("io_uring is unavailable here (sysctl kernel.io_uring_disabled, a ") +
                              "container's seccomp profile: Docker's default since 25.0, containerd's since 2.0; or a " +
                              "kernel without io_uring)";
      if (options.backend == IoBackend::kUring)
        return st.WithContext(why + "; allow io_uring for this process, or use pread and pwrite on threads "
                                    "(strata.io_backend \"threads\" or \"auto\"; strata-iobench --backend threads)");
      WarnOnce("uring-refused", why + ": " + st.message() + "; Strata reads and writes its files with pread and "
                                "pwrite on threads instead (strata.io_backend \"auto\"): a thread per request in "
                                "flight, more CPU time on the NVMe tier");
      s->workers_.clear();
      s->backend_ = IoBackend::kThreads;
      break;
    }
    STRATA_RETURN_IF_ERROR(st);
    s->fixed_buffers_ok_ = s->fixed_buffers_ok_ && ring->fixed_buffers();
    s->workers_.push_back(std::move(ring));
  }
  if (s->backend_ == IoBackend::kThreads) {
    s->fixed_buffers_ok_ = false;
    const int threads = static_cast<int>(std::min<uint32_t>(options.queue_depth, StorageOptions::kMaxThreadsPerWorker));
    for (int i = 0; i < options.rings; ++i) s->workers_.push_back(std::make_unique<ThreadWorker>(s.get(), i, threads));
  }
  for (int i = IoWorker::kMaxBuffers - 1; i >= 0; --i) s->free_buffer_slots_.push_back(i);
  for (auto& w : s->workers_) w->Start();
  return s;
}

FileStorage::~FileStorage() {
  for (auto& w : workers_) w->Stop();
  workers_.clear();
  for (auto& f : files_)
    if (f.fd >= 0) {
      ForgetInForkChild(f.fd);
      ::close(f.fd);
    }
}

Result<FileId> FileStorage::Open(const std::string& path, OpenMode mode) {
  FileInfo info;
  STRATA_RETURN_IF_ERROR(OpenDirectFile(path, mode, &info, options_.direct));
  std::unique_lock<std::shared_mutex> lock(files_mu_);
  FileId id = -1;
  for (size_t i = 0; i < files_.size(); ++i)
    if (files_[i].fd < 0) { id = static_cast<FileId>(i); break; }
  if (id < 0) {
    if (files_.size() >= IoWorker::kMaxFiles) {
      ::close(info.fd);
      return InvalidError("open " + path + ": more than " + std::to_string(IoWorker::kMaxFiles) +
                          " files open in one storage");
    }
    id = static_cast<FileId>(files_.size());
    files_.push_back({});
  }
  for (size_t k = 0; k < workers_.size(); ++k) {
    Status st = workers_[k]->SetFile(id, info.fd);
    if (!st.ok()) {
      // The rings that took it let go of it again: a registered file holds
      // the open file (its lock, an unlinked file's space) past close.
      for (size_t j = 0; j < k; ++j)
        if (Status undo = workers_[j]->SetFile(id, -1); !undo.ok())
          STRATA_LOG_WARN("register {}: ring {} keeps the file until its slot is reused: {}", path, j, undo.ToString());
      ::close(info.fd);
      return st.WithContext("register " + path);
    }
  }
  files_[id] = info;
  CloseInForkChild(info.fd);  // (a child's copy would hold the swap file's lock and space past our close)
  return id;
}

Status FileStorage::Close(FileId file) {
  std::unique_lock<std::shared_mutex> lock(files_mu_);
  if (file < 0 || static_cast<size_t>(file) >= files_.size() || files_[file].fd < 0)
    return InvalidError("close: file id " + std::to_string(file) + " is not open");
  const std::string path = files_[file].path;
  // The fd closes anyway; a ring that could not let go of it holds the open
  // file (its lock, an unlinked file's space) until the slot is reused.
  for (size_t k = 0; k < workers_.size(); ++k)
    if (Status st = workers_[k]->SetFile(file, -1); !st.ok())
      STRATA_LOG_WARN("close {}: ring {} keeps the file until its slot is reused: {}", path, k, st.ToString());
  ForgetInForkChild(files_[file].fd);
  const int rc = ::close(files_[file].fd);
  files_[file] = FileInfo{};
  if (rc != 0) return PosixError("close", path, errno);
  return Status::Ok();
}

const FileInfo& FileStorage::Info(FileId file) const {
  std::shared_lock<std::shared_mutex> lock(files_mu_);
  STRATA_CHECK_MSG(file >= 0 && static_cast<size_t>(file) < files_.size(), "unknown file id");
  return files_[file];
}

Status FileStorage::ValidateOp(const IoOp& op) const {
  std::shared_lock<std::shared_mutex> lock(files_mu_);
  if (op.file < 0 || static_cast<size_t>(op.file) >= files_.size() || files_[op.file].fd < 0)
    return InvalidError("I/O on file id " + std::to_string(op.file) + ", which is not open");
  const FileInfo& f = files_[op.file];
  if (op.buf == nullptr && op.len > 0) return InvalidError("I/O on " + f.path + " with a null buffer");
  const uint64_t a = f.align;
  if (f.direct && (op.offset % a || op.len % a || reinterpret_cast<uintptr_t>(op.buf) % a)) {
    return InvalidError(std::string(op.kind == IoOp::kRead ? "read" : "write") + " " + f.path +
                        " offset " + std::to_string(op.offset) + " length " + std::to_string(op.len) +
                        ": offset, length and buffer must be aligned to " + std::to_string(a) +
                        " bytes for O_DIRECT");
  }
  return Status::Ok();
}

IoTicket FileStorage::Submit(std::span<const IoOp> ops) {
  int64_t parts = 0;
  for (const IoOp& op : ops) {
    Status st = ValidateOp(op);
    if (!st.ok()) return DoneTicket(std::move(st));
    parts += static_cast<int64_t>((op.len + options_.block_size - 1) / options_.block_size);
  }
  if (parts == 0) return DoneTicket(Status::Ok());
  // The batch owns all its chunks; it keeps itself alive
  // until its last chunk completes, whether or not the caller keeps the ticket.
  auto ticket = std::make_shared<ChunkBatch>(parts);
  ticket->chunks.resize(static_cast<size_t>(parts));
  ticket->self = ticket;
  size_t next = 0;
  std::vector<std::vector<IoChunk*>> per_ring(workers_.size());
  uint64_t ring = next_ring_.fetch_add(static_cast<uint64_t>(parts));  // chunks go round the rings
  for (const IoOp& op : ops) {
    const FileInfo& f = Info(op.file);
    // Once per op, not per chunk: every chunk lies in the op's buffer.
    const int buf_index = fixed_buffers_ok_ ? FixedBufferIndex(op.buf, op.len) : -1;
    for (uint64_t done = 0; done < op.len; done += options_.block_size) {
      IoChunk* c = &ticket->chunks[next++];
      c->batch = ticket.get();
      c->op = op;
      c->op.offset = op.offset + done;
      c->op.buf = static_cast<char*>(op.buf) + done;
      c->op.len = std::min<uint64_t>(options_.block_size, op.len - done);
      c->fd = f.fd;
      c->align = f.direct ? f.align : 1;
      c->buf_index = buf_index;
      per_ring[ring++ % workers_.size()].push_back(c);
    }
  }
  for (size_t i = 0; i < workers_.size(); ++i)
    if (!per_ring[i].empty()) workers_[i]->Enqueue(per_ring[i]);
  return ticket;
}

int FileStorage::FixedBufferIndex(const void* p, uint64_t len) const {
  std::shared_lock<std::shared_mutex> lock(buffers_mu_);
  const auto addr = reinterpret_cast<uintptr_t>(p);
  auto it = buffers_.upper_bound(addr);
  if (it == buffers_.begin()) return -1;
  --it;
  if (addr + len > it->first + it->second.len) return -1;
  return it->second.index;
}

void FileStorage::RegisterBuffer(void* p, uint64_t len) {
  if (!fixed_buffers_ok_ || len == 0 || len > (1ull << 30)) return;  // kernel limit: 1 GiB
  std::unique_lock<std::shared_mutex> lock(buffers_mu_);
  if (free_buffer_slots_.empty()) return;
  const int slot = free_buffer_slots_.back();
  for (auto& r : workers_) {
    Status st = r->SetBuffer(slot, p, len);
    if (!st.ok()) {
      // ENOMEM, as a rule: the pages count against RLIMIT_MEMLOCK unless
      // the process has CAP_IPC_LOCK.
      rlimit lim{};
      const std::string limit =
          getrlimit(RLIMIT_MEMLOCK, &lim) != 0 ? "unknown"
          : lim.rlim_cur == RLIM_INFINITY      ? "unlimited"
                                               : std::to_string(lim.rlim_cur >> 10) + " KiB";
      WarnOnce("register-buffer", "could not register an I/O buffer of " + std::to_string(len >> 20) +
                                      " MiB with io_uring (" + st.message() +
                                      "); its I/O goes on with unregistered buffers. Registered buffers are pinned "
                                      "memory: this process may lock " + limit +
                                      " (ulimit -l); raise that limit, or give it CAP_IPC_LOCK, to register them");
      for (auto& r2 : workers_) r2->SetBuffer(slot, nullptr, 0).IgnoreError();
      return;
    }
  }
  free_buffer_slots_.pop_back();
  buffers_[reinterpret_cast<uintptr_t>(p)] = BufferSlot{len, slot};
}

void FileStorage::UnregisterBuffer(void* p) {
  std::unique_lock<std::shared_mutex> lock(buffers_mu_);
  auto it = buffers_.find(reinterpret_cast<uintptr_t>(p));
  if (it == buffers_.end()) return;
  for (auto& r : workers_) r->SetBuffer(it->second.index, nullptr, 0).IgnoreError();
  free_buffer_slots_.push_back(it->second.index);
  buffers_.erase(it);
}

}  // namespace strata
