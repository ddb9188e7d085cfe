// UpdateWorker: the overlapped step's thread (overlap_step). Groups whose
// gradients are complete are queued; the thread runs `update(g)` for each,
// in order, one at a time, while the trainer's backward goes on.
//
// Invariants: one update runs at a time; WaitIdle returns only when the
// queue is empty and no update runs, with the first failure since the last
// WaitIdle (later updates still run: each group's update is all or nothing)
// and, when an update said the step cannot be finished, why (`broken`): the
// thread never writes the caller's state.
//
// Lock: mu_ guards queue_, busy_, stop_, error_, broken_. The thread is this
// component's own; it touches nothing but through `update`.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "base/status.h"

namespace strata {

class UpdateWorker {
 public:
  // `on_thread_start`: the thread's first call (the CUDA device).
  // `update(g, broken)`: group g's update; sets *broken (empty on entry)
  // when the step cannot be finished.
  UpdateWorker(std::function<Status(int g, std::string* broken)> update, std::function<void()> on_thread_start);
  ~UpdateWorker();  // Stop()
  UpdateWorker(const UpdateWorker&) = delete;
  UpdateWorker& operator=(const UpdateWorker&) = delete;

  void Start();
  void Stop();  // what is queued is dropped
  void Enqueue(int g);
  // *broken (when not null and empty) gets the first such reason since the last call.
  Status WaitIdle(std::string* broken = nullptr);

 private:
  void Run();

  const std::function<Status(int, std::string*)> update_;
  const std::function<void()> on_thread_start_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> queue_;
  bool busy_ = false, stop_ = false;
  Status error_;
  std::string broken_;
  std::thread thread_;
};

}  // namespace strata
