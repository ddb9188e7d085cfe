// ThreadWorker: threads that take chunks from one queue and move each with
// pread or pwrite: FileStorage's worker where io_uring is refused (a
// container's seccomp profile, kernel.io_uring_disabled) or not wanted
// (strata.io_backend "threads"). Each thread has one request in flight, so a
// worker of n threads keeps the disk n deep. Internal to FileStorage.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "io/io_worker.h"

namespace strata {

class FileStorage;

class ThreadWorker final : public IoWorker {
 public:
  ThreadWorker(FileStorage* owner, int index, int threads);
  ~ThreadWorker() override;
  void Start() override;
  void Stop() override;
  void Enqueue(const std::vector<IoChunk*>& chunks) override;
  Status SetFile(int, int) override { return Status::Ok(); }  // the chunk carries its descriptor
  Status SetBuffer(int, void*, uint64_t) override { return UnsupportedError("registered buffers are io_uring's"); }
  bool fixed_buffers() const override { return false; }

 private:
  void Loop();

  FileStorage* owner_;
  int index_;
  int threads_;
  std::vector<std::thread> pool_;

  std::mutex mu_;  // guards pending_ and stop_
  std::condition_variable cv_;
  std::deque<IoChunk*> pending_;
  bool stop_ = false;
};

}  // namespace strata
