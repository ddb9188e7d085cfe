// StopWorker: the end of a thread whose loop waits on `cv` until `stop` (or
// work) and returns on `stop`. Sets `stop` under `mu`, wakes every waiter,
// joins, and sets `stop` back so that the thread may be started again.
// Nothing when the thread does not run.
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>

namespace strata {

inline void StopWorker(std::mutex& mu, std::condition_variable& cv, bool& stop, std::thread& thread) {
  if (!thread.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_all();
  thread.join();
  std::lock_guard<std::mutex> lock(mu);
  stop = false;
}

}  // namespace strata
