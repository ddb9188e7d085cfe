// UpdateWorker: the overlapped step's thread (overlap_step). Groups whose
// gradients are complete are queued; the thread hands them, in order, to
// one streamed run (`run(next, broken)`: StepPipeline::RunFeed), which
// takes each as it comes while the trainer's backward goes on, and ends
// when WaitIdle closes the stream (the step) and the queue is empty.
//
// Invariants: one run at a time; WaitIdle returns only when the queue is
// empty and no run is going, with the first failure since the last WaitIdle
// (a run that fails ends; what is queued after it goes to a new run) and,
// when a run said the step cannot be finished, why (`broken`): the thread
// never writes the caller's state.
//
// Lock: mu_ guards queue_, busy_, closed_, abandoned_, stop_, error_, broken_. The
// thread is this component's own; it touches nothing but through `run`.
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
  // `next(wait)`: the next queued group, or -1 (wait: blocks until one is
  // queued or the stream is closed, then -1 when it is over; else: none now).
  using Next = std::function<int(bool wait)>;
  // `on_thread_start`: the thread's first call (the CUDA device).
  // `run(next, broken)`: the updates of the groups `next` gives; sets
  // *broken (empty on entry) when the step cannot be finished.
  UpdateWorker(std::function<Status(const Next& next, std::string* broken)> run, std::function<void()> on_thread_start);
  ~UpdateWorker();  // Stop()
  UpdateWorker(const UpdateWorker&) = delete;
  UpdateWorker& operator=(const UpdateWorker&) = delete;

  void Start();
  void Stop();  // what is queued is dropped
  void Enqueue(int g);  // any thread
  // Drops what is queued and ends the stream at once: the run finishes what
  // it has started and takes no more (until WaitIdle returns).
  void Abandon();
  // Closes the stream and waits for the thread to be idle; the next Enqueue
  // opens a new one. *broken (when not null and empty) gets the first such
  // reason since the last call.
  Status WaitIdle(std::string* broken = nullptr);

 private:
  void Run();
  int Take(bool wait);

  const std::function<Status(const Next&, std::string*)> run_;
  const std::function<void()> on_thread_start_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> queue_;
  bool busy_ = false, closed_ = false, abandoned_ = false, stop_ = false;
  Status error_;
  std::string broken_;
  std::thread thread_;
};

}  // namespace strata
