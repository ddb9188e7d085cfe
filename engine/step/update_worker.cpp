// UpdateWorker (update_worker.h): the overlapped step's thread.
#include "engine/step/update_worker.h"

#include "base/worker.h"

namespace strata {

UpdateWorker::UpdateWorker(std::function<Status(const Next& next, std::string* broken)> run,
                           std::function<void()> on_thread_start)
    : run_(std::move(run)), on_thread_start_(std::move(on_thread_start)) {}

UpdateWorker::~UpdateWorker() { Stop(); }

void UpdateWorker::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

int UpdateWorker::Take(bool wait) {
  std::unique_lock<std::mutex> lock(mu_);
  if (wait) cv_.wait(lock, [&] { return stop_ || closed_ || !queue_.empty(); });
  if (stop_ || abandoned_ || queue_.empty()) return -1;
  const int g = queue_.front();
  queue_.pop_front();
  return g;
}

void UpdateWorker::Run() {
  if (on_thread_start_) on_thread_start_();
  const Next next = [this](bool wait) { return Take(wait); };
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    busy_ = true;
    lock.unlock();
    std::string why;
    Status st = run_(next, &why);
    lock.lock();
    busy_ = false;
    if (!st.ok() && error_.ok()) error_ = st;
    if (!why.empty() && broken_.empty()) broken_ = std::move(why);
    cv_.notify_all();
  }
}

void UpdateWorker::Stop() {
  StopWorker(mu_, cv_, stop_, thread_);
  std::lock_guard<std::mutex> lock(mu_);
  queue_.clear();
}

void UpdateWorker::Enqueue(int g) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(g);
  }
  cv_.notify_all();
}

void UpdateWorker::Abandon() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.clear();
    abandoned_ = true;
  }
  cv_.notify_all();
}

Status UpdateWorker::WaitIdle(std::string* broken) {
  std::unique_lock<std::mutex> lock(mu_);
  closed_ = true;
  cv_.notify_all();
  cv_.wait(lock, [&] { return (queue_.empty() || !thread_.joinable()) && !busy_; });
  closed_ = false;
  abandoned_ = false;
  Status st = error_;
  error_ = Status::Ok();
  if (broken && broken->empty() && !broken_.empty()) *broken = broken_;
  broken_.clear();
  return st;
}

}  // namespace strata
