// UringRing: one io_uring, the thread that drives it and its queue of chunks.
// Internal to FileStorage.
#pragma once

#include <liburing.h>

#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "io/io_worker.h"

namespace strata {

class FileStorage;

class UringRing final : public IoWorker {
 public:
  UringRing(FileStorage* owner, int index, uint32_t queue_depth);
  ~UringRing() override;
  // *refused: io_uring itself is refused here (EPERM, ENOSYS: a sysctl or a
  // seccomp profile), as against a ring that could not be made.
  Status Init(bool register_files, bool register_buffers, bool* refused);
  void Start() override;
  void Stop() override;
  void Enqueue(const std::vector<IoChunk*>& chunks) override;
  Status SetFile(int slot, int fd) override;
  Status SetBuffer(int slot, void* p, uint64_t len) override;
  bool fixed_buffers() const override { return fixed_buffers_; }

 private:
  void Loop();
  void Wake();
  void ArmWake();
  void Prep(IoChunk* c);
  void Complete(IoChunk* c, int res);

  FileStorage* owner_;
  int index_;
  uint32_t queue_depth_;
  io_uring ring_{};
  bool ring_ok_ = false;
  bool fixed_files_ = false;
  bool fixed_buffers_ = false;
  int wake_fd_ = -1;
  uint64_t wake_buf_ = 0;
  std::thread thread_;
  uint32_t in_flight_ = 0;  // touched by the ring's thread only

  std::mutex mu_;  // guards pending_ and stop_
  std::deque<IoChunk*> pending_;
  bool stop_ = false;
};

}  // namespace strata
