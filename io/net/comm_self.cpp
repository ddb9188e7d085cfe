// The one-rank communicator: every collective is a copy or nothing.
#include <cstring>

#include "io/net/comm_backends.h"

namespace strata::net {
namespace {

class SelfComm final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  const char* backend() const override { return "self"; }
  bool device_buffers() const override { return false; }

 protected:
  Status DoAllReduce(float*, size_t) override { return Status::Ok(); }
  Status DoReduceScatter(const float* in, float* out, size_t n) override {
    if (in != out) std::memmove(out, in, n * sizeof(float));
    return Status::Ok();
  }
  Status DoAllGather(const void* in, void* out, size_t bytes) override {
    if (in != out) std::memmove(out, in, bytes);
    return Status::Ok();
  }
  Status DoBroadcast(void*, size_t, int) override { return Status::Ok(); }
  Status DoBarrier() override { return Status::Ok(); }
  Status DoExchangeDescriptors(const void*, void*, size_t) override { return Status::Ok(); }
};

}  // namespace

std::unique_ptr<Communicator> MakeSelfComm() { return std::make_unique<SelfComm>(); }

}  // namespace strata::net
