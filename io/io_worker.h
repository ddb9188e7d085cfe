// IoWorker: what FileStorage hands its chunks to. Two kinds: UringRing (one
// io_uring and the thread that drives it) and ThreadWorker (threads calling
// pread and pwrite, where io_uring is refused). Internal to FileStorage.
//
// Both decide a completion the same way (SettleChunk): the FaultPlan's say,
// EINTR and EAGAIN retried, a short transfer continued from the aligned
// offset below what was done, anything else failing the batch with an error
// naming the file, offset, length and errno.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "io/fault.h"
#include "io/storage.h"

namespace strata {

// One request of at most block_size bytes; continued in place when short.
struct IoChunk {
  IoBatch* batch = nullptr;  // owns this chunk (ChunkBatch::chunks)
  IoOp op;
  int fd = -1;
  uint64_t align = 1;
  int buf_index = -1;  // registered buffer holding op.buf (and any short continuation), or -1
  uint64_t seq = 0;  // number of the operation last started for it
  int retries = 0;
};

// A batch of FileStorage: its chunks live in it, and it holds itself until
// the last one completes.
struct ChunkBatch final : IoBatch {
  explicit ChunkBatch(int64_t parts) : IoBatch(parts) {}
  std::vector<IoChunk> chunks;
  std::shared_ptr<IoBatch> self;

 protected:
  void OnAllDone() override {
    auto last = std::move(self);  // may free *this when `last` goes: touch nothing after
  }
};

// What became of a chunk whose operation returned `res` (bytes, or -errno).
enum class ChunkNext : uint8_t {
  kDone,   // finished (ok or failed): the caller calls FinishChunk
  kAgain,  // retried or continued: start its (updated) operation again
};
inline constexpr int kMaxChunkRetries = 1000;  // EINTR/EAGAIN in a row
// `faults` may be null; `storage` names the file in errors. On kDone, *st is the
// chunk's outcome.
ChunkNext SettleChunk(IoChunk* c, int res, FaultPlan* faults, const Storage& storage, Status* st);
// Records the outcome in the chunk's batch; may free the batch and `c`.
void FinishChunk(IoChunk* c, Status st);

class IoWorker {
 public:
  static constexpr unsigned kMaxFiles = 1024;
  static constexpr unsigned kMaxBuffers = 1024;

  virtual ~IoWorker() = default;
  virtual void Start() = 0;
  virtual void Stop() = 0;  // drains what is queued, then joins
  virtual void Enqueue(const std::vector<IoChunk*>& chunks) = 0;
  // Registered-table updates; -1 / nullptr clears the slot. A worker
  // without registered files takes every SetFile as done.
  virtual Status SetFile(int slot, int fd) = 0;
  virtual Status SetBuffer(int slot, void* p, uint64_t len) = 0;
  virtual bool fixed_buffers() const = 0;
};

}  // namespace strata
