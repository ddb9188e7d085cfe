// DeviceTier: GPU memory when a GPU is present; otherwise a host arena with
// the same budget and the same asynchronous copy interface (a copy thread
// per direction standing in for the copy-in and copy-out streams), so every
// test runs on a machine without a GPU. Thread-safe.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "tiers/gpu.h"
#include "tiers/tier.h"

namespace strata {

// Completion of one asynchronous copy. Wait() may be called once or more.
class CopyFence {
 public:
  virtual ~CopyFence() = default;
  virtual Status Wait() = 0;
  virtual bool Done() = 0;
};
using CopyTicket = std::shared_ptr<CopyFence>;

struct DeviceTierOptions {
  uint64_t budget = 0;
  int device = 0;
  bool force_host_arena = false;  // tests: behave as if there were no GPU
};

class DeviceTier final : public Tier {
 public:
  static Result<std::unique_ptr<DeviceTier>> Create(const DeviceTierOptions& options);
  ~DeviceTier() override;
  Result<Allocation> Allocate(uint64_t bytes) override;
  void Free(const Allocation& a) override;

  // Host -> device and device -> host, in order per direction. `host` should
  // be HostTier memory (pinned) for full speed.
  Result<CopyTicket> CopyIn(void* device_dst, const void* host_src, uint64_t bytes);
  Result<CopyTicket> CopyOut(void* host_dst, const void* device_src, uint64_t bytes);

  bool on_gpu() const { return on_gpu_; }

 private:
  class CopyQueue;  // one direction without a GPU
  explicit DeviceTier(const DeviceTierOptions& options);
  Result<CopyTicket> Copy(void* dst, const void* src, uint64_t bytes, bool to_device);

  DeviceTierOptions options_;
  bool on_gpu_ = false;
  gpu::Stream in_stream_ = nullptr, out_stream_ = nullptr;
  std::unique_ptr<CopyQueue> in_queue_, out_queue_;
  std::mutex mu_;  // guards sizes_
  std::map<void*, uint64_t> sizes_;
};

}  // namespace strata
