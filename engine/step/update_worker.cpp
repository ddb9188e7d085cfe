// UpdateWorker (update_worker.h): the overlapped step's thread.
#include "engine/step/update_worker.h"

#include "base/worker.h"

namespace strata {

UpdateWorker::UpdateWorker(std::function<Status(int g, std::string* broken)> update, std::function<void()> on_thread_start)
    : update_(std::move(update)), on_thread_start_(std::move(on_thread_start)) {}

UpdateWorker::~UpdateWorker() { Stop(); }

void UpdateWorker::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

void UpdateWorker::Run() {
  if (on_thread_start_) on_thread_start_();
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const int g = queue_.front();
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    std::string why;
    Status st = update_(g, &why);
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

Status UpdateWorker::WaitIdle(std::string* broken) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  Status st = error_;
  error_ = Status::Ok();
  if (broken && broken->empty() && !broken_.empty()) *broken = broken_;
  broken_.clear();
  return st;
}

}  // namespace strata
