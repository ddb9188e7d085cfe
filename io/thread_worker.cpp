// ThreadWorker: pread and pwrite on a pool of threads.
#include "io/thread_worker.h"

#include <pthread.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "io/file_storage.h"

namespace strata {

ThreadWorker::ThreadWorker(FileStorage* owner, int index, int threads)
    : owner_(owner), index_(index), threads_(threads) {}

ThreadWorker::~ThreadWorker() { Stop(); }

void ThreadWorker::Start() {
  for (int t = 0; t < threads_; ++t)
    pool_.emplace_back([this, t] {
      const std::string name = "strata-io" + std::to_string(index_) + "." + std::to_string(t);
      pthread_setname_np(pthread_self(), name.c_str());
      Loop();
    });
}

void ThreadWorker::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : pool_) t.join();
  pool_.clear();
}

void ThreadWorker::Enqueue(const std::vector<IoChunk*>& chunks) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.insert(pending_.end(), chunks.begin(), chunks.end());
  }
  cv_.notify_all();
}

void ThreadWorker::Loop() {
  FaultPlan* faults = owner_->options().faults.get();
  for (;;) {
    IoChunk* c;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      if (pending_.empty()) return;  // stopping, and nothing left: another thread's chunk in hand finishes there
      c = pending_.front();
      pending_.pop_front();
    }
    for (;;) {
      const IoOp& op = c->op;
      c->seq = owner_->NextSeq();
      const ssize_t n = op.kind == IoOp::kRead ? ::pread(c->fd, op.buf, op.len, static_cast<off_t>(op.offset))
                                               : ::pwrite(c->fd, op.buf, op.len, static_cast<off_t>(op.offset));
      const int res = n < 0 ? -errno : static_cast<int>(n);  // n <= block_size <= 1 GiB
      Status st;
      if (SettleChunk(c, res, faults, *owner_, &st) == ChunkNext::kDone) {
        FinishChunk(c, std::move(st));  // may free `c`
        break;
      }
    }
  }
}

}  // namespace strata
