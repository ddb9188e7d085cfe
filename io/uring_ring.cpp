// UringRing: prepares SQEs, reaps CQEs and decides, for each completion,
// whether the chunk is done, continues (short), is retried (EINTR, EAGAIN)
// or fails its batch.
#include "io/uring_ring.h"

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/fork_close.h"
#include "base/align.h"
#include "base/check.h"
#include "base/log.h"
#include "io/file_storage.h"

namespace strata {

UringRing::UringRing(FileStorage* owner, int index, uint32_t queue_depth)
    : owner_(owner), index_(index), queue_depth_(queue_depth) {}

UringRing::~UringRing() {
  Stop();
  if (ring_ok_) {
    ForgetInForkChild(ring_.ring_fd);
    io_uring_queue_exit(&ring_);
  }
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

static Status UringError(const char* call, int neg_errno) {
  return Status(Code::kIo, std::string(call) + ": " + std::strerror(-neg_errno) + " (errno " +
                               std::to_string(-neg_errno) + ")");
}

Status UringRing::Init(bool register_files, bool register_buffers, bool* refused) {
  int rc = io_uring_queue_init(queue_depth_ + 2, &ring_, 0);  // +1 for the wake read
  *refused = rc == -EPERM || rc == -ENOSYS;  // the kernel or a container refuses io_uring itself
  if (*refused) return UringError("io_uring_queue_init", rc);  // FileStorage::Create says what then
  if (rc == -ENOMEM)  // the ring's memory is locked memory on kernels before 5.12
    return UringError("io_uring_queue_init", rc)
        .WithContext("a ring of " + std::to_string(queue_depth_ + 2) + " entries: its memory counts against " +
                     "RLIMIT_MEMLOCK (ulimit -l) on older kernels; raise it, or lower aio.queue_depth or "
                     "strata.io_rings");
  if (rc < 0) return UringError("io_uring_queue_init", rc);  // any other (EMFILE, EINVAL, ENFILE)
  ring_ok_ = true;
  // Not in a child of fork: a child's mappings would keep the ring, and the
  // files registered in it (their locks, a deleted swap file's space), past
  // our close. (The child cannot use the engine anyway.)
  if (int d = io_uring_ring_dontfork(&ring_); d < 0) return UringError("io_uring_ring_dontfork", d);
  CloseInForkChild(ring_.ring_fd);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (wake_fd_ < 0) return PosixError("eventfd", "io ring " + std::to_string(index_), errno);
  if (register_files) {
    rc = io_uring_register_files_sparse(&ring_, kMaxFiles);
    fixed_files_ = rc == 0;
    if (rc < 0) WarnOnce("uring-files", std::string("io_uring cannot register files (") +
                                            std::strerror(-rc) + "); using plain descriptors");
  }
  if (register_buffers) {
    rc = io_uring_register_buffers_sparse(&ring_, kMaxBuffers);
    fixed_buffers_ = rc == 0;
    if (rc < 0) WarnOnce("uring-buffers", std::string("io_uring cannot register buffers (") +
                                              std::strerror(-rc) + "); using plain buffers");
  }
  return Status::Ok();
}

void UringRing::Start() {
  thread_ = std::thread([this] {
    const std::string name = "strata-io" + std::to_string(index_);
    pthread_setname_np(pthread_self(), name.c_str());
    Loop();
  });
}

void UringRing::Stop() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  Wake();
  thread_.join();
}

void UringRing::Enqueue(const std::vector<IoChunk*>& chunks) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.insert(pending_.end(), chunks.begin(), chunks.end());
  }
  Wake();
}

// Wakes the thread if it sleeps in io_uring_submit_and_wait; the counter only
// needs to become non-zero, so EAGAIN (overflow) is harmless.
void UringRing::Wake() {
  const uint64_t one = 1;
  while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

Status UringRing::SetFile(int slot, int fd) {
  if (!fixed_files_) return Status::Ok();
  int rc = io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &fd, 1);
  if (rc < 0) return UringError("io_uring_register_files_update", rc);
  return Status::Ok();
}

Status UringRing::SetBuffer(int slot, void* p, uint64_t len) {
  if (!fixed_buffers_) return UnsupportedError("registered buffers unavailable");
  iovec iov{p, static_cast<size_t>(len)};
  __u64 tag = 0;
  int rc = io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(slot), &iov, &tag, 1);
  if (rc < 0) return UringError("io_uring_register_buffers_update_tag", rc);
  return Status::Ok();
}

void UringRing::ArmWake() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  STRATA_CHECK_MSG(sqe != nullptr, "io ring has no free SQE for its wake-up read");
  io_uring_prep_read(sqe, wake_fd_, &wake_buf_, sizeof wake_buf_, 0);
  io_uring_sqe_set_data(sqe, &wake_buf_);
}

void UringRing::Prep(IoChunk* c) {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  STRATA_CHECK_MSG(sqe != nullptr, "io ring full beyond its queue depth");
  const IoOp& op = c->op;
  const int fd = fixed_files_ ? op.file : c->fd;
  const int buf_index = fixed_buffers_ ? c->buf_index : -1;
  const auto len = static_cast<unsigned>(op.len);
  if (op.kind == IoOp::kRead) {
    if (buf_index >= 0) io_uring_prep_read_fixed(sqe, fd, op.buf, len, op.offset, buf_index);
    else io_uring_prep_read(sqe, fd, op.buf, len, op.offset);
  } else {
    if (buf_index >= 0) io_uring_prep_write_fixed(sqe, fd, op.buf, len, op.offset, buf_index);
    else io_uring_prep_write(sqe, fd, op.buf, len, op.offset);
  }
  if (fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
  c->seq = owner_->NextSeq();
  io_uring_sqe_set_data(sqe, c);
  ++in_flight_;
}

void UringRing::Complete(IoChunk* c, int res) {
  Status st;
  if (SettleChunk(c, res, owner_->options().faults.get(), *owner_, &st) == ChunkNext::kDone)
    return FinishChunk(c, std::move(st));
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_front(c);
}

void UringRing::Loop() {
  ArmWake();
  std::vector<IoChunk*> batch;
  batch.reserve(queue_depth_);
  for (;;) {
    batch.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_ && pending_.empty() && in_flight_ == 0) break;
      while (in_flight_ + batch.size() < queue_depth_ && !pending_.empty()) {
        batch.push_back(pending_.front());
        pending_.pop_front();
      }
    }
    for (IoChunk* c : batch) Prep(c);
    int rc = io_uring_submit_and_wait(&ring_, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY)
      STRATA_LOG_ERROR("io ring {}: io_uring_submit_and_wait: {}", index_, std::strerror(-rc));
    io_uring_cqe* cqe;
    unsigned head, seen = 0;
    bool rearm = false;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      void* data = io_uring_cqe_get_data(cqe);
      if (data == &wake_buf_) { rearm = true; continue; }
      --in_flight_;
      Complete(static_cast<IoChunk*>(data), cqe->res);
    }
    io_uring_cq_advance(&ring_, seen);
    if (rearm) ArmWake();
  }
}

}  // namespace strata
