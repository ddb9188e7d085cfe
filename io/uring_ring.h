// UringRing: one io_uring, the thread that drives it and its queue of chunks.
// Internal to UringStorage.
#pragma once

#include <liburing.h>

#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "io/storage.h"

namespace strata {

class UringStorage;

// One request of at most block_size bytes; continued in place when short.
struct IoChunk {
  IoBatch* batch = nullptr;  // owns this chunk (UringBatch::chunks)
  IoOp op;
  int fd = -1;
  uint64_t align = 1;
  int buf_index = -1;  // registered buffer holding op.buf (and any short continuation), or -1
  uint64_t seq = 0;  // number of the SQE last submitted for it
  int retries = 0;
};

// A batch of UringStorage: its chunks live in it, and it holds itself until
// the last one completes.
struct UringBatch final : IoBatch {
  explicit UringBatch(int64_t parts) : IoBatch(parts) {}
  std::vector<IoChunk> chunks;
  std::shared_ptr<IoBatch> self;

 protected:
  void OnAllDone() override {
    auto last = std::move(self);  // may free *this when `last` goes: touch nothing after
  }
};

class UringRing {
 public:
  static constexpr unsigned kMaxFiles = 1024;
  static constexpr unsigned kMaxBuffers = 1024;
  static constexpr int kMaxRetries = 1000;  // EINTR/EAGAIN in a row

  UringRing(UringStorage* owner, int index, uint32_t queue_depth);
  ~UringRing();
  Status Init(bool register_files, bool register_buffers);
  void Start();
  void Stop();  // drains what is queued, then joins
  void Enqueue(const std::vector<IoChunk*>& chunks);
  // Registered-table updates; -1 / nullptr clears the slot.
  Status SetFile(int slot, int fd);
  Status SetBuffer(int slot, void* p, uint64_t len);
  bool fixed_buffers() const { return fixed_buffers_; }

 private:
  void Loop();
  void Wake();
  void ArmWake();
  void Prep(IoChunk* c);
  void Complete(IoChunk* c, int res);
  void Finish(IoChunk* c, Status st);

  UringStorage* owner_;
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
