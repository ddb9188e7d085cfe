// The Gloo communicator: host buffers over Gloo's TCP transport, rendezvous
// through our store. Gloo reports failures by throwing; every entry point
// here catches and returns a Status, so nothing escapes the Communicator.
#include <arpa/inet.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <exception>

#include "io/net/comm_backends.h"
#include "io/net/deadline.h"

namespace strata::net {
namespace {

using Clock = std::chrono::steady_clock;

// gloo::rendezvous::Store over our StoreClient. Gloo wants exceptions; the
// Status behind the first one is kept so the caller can report it unchanged.
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(StoreClient& store, std::string prefix, Millis timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_.Set(prefix_ + key, Bytes(data.begin(), data.end())));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.Get(prefix_ + key, timeout_);
    Check(v.status());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    Check(store_.Wait(full, timeout.count() > 0 ? std::min(timeout, timeout_) : timeout_));
  }
  const Status& first_error() const { return error_; }

 private:
  void Check(const Status& s) {
    if (s.ok()) return;
    if (error_.ok()) error_ = s;
    throw gloo::IoException(s.ToString());
  }
  StoreClient& store_;
  std::string prefix_;
  Millis timeout_;
  Status error_;
};

// Gloo's message says "Timed out" when a wait ran past the timeout; anything
// else (a peer that closed, a reset) is a communication failure.
Status FromGloo(const std::exception& e, Millis timeout) {
  std::string what = e.what();
  if (what.find("imed out") != std::string::npos)
    return TimeoutError("timed out after " + FormatSeconds(timeout) + " (gloo: " + what + ")");
  return CommError("a peer failed or closed its connection (gloo: " + what + ")");
}

// A write to a socket whose peer died raises SIGPIPE, which would kill this
// rank silently instead of letting it report the collective. Ignore it unless
// the program chose a handler itself.
void IgnoreSigpipeUnlessHandled() {
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
}

// The local address this host uses to reach `master` (a UDP connect sends
// nothing; the kernel just picks the route).
Result<std::string> RouteAddress(const std::string& master, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  int rc = getaddrinfo(master.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) return CommError("gloo: cannot resolve MASTER_ADDR '" + master + "': " + gai_strerror(rc));
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in local{};
  socklen_t len = sizeof local;
  bool ok = fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
            getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  int err = errno;
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  if (!ok) return PosixError("gloo: find the local address routing to", master, err);
  char buf[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &local.sin_addr, buf, sizeof buf);
  return std::string(buf);
}

void SumFloats(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<float*>(c);
  auto* x = static_cast<const float*>(a);
  auto* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

class GlooComm final : public Communicator {
 public:
  GlooComm(std::shared_ptr<gloo::transport::Device> dev, std::shared_ptr<gloo::rendezvous::Context> ctx,
           Millis timeout)
      : dev_(std::move(dev)), ctx_(std::move(ctx)), timeout_(timeout) {}

  int rank() const override { return ctx_->rank; }
  int world_size() const override { return ctx_->size; }
  const char* backend() const override { return "gloo"; }
  bool device_buffers() const override { return false; }

  // The barrier that ends creation: after it no rank needs the store.
  Status FirstBarrier() {
    return Guard([&] { BarrierNow(0xffffffffu); });
  }

 protected:
  Status DoAllReduce(float* buf, size_t n) override {
    return Guard([&] {
      gloo::AllreduceOptions opts(ctx_);
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);  // same sum on every rank
      opts.setOutput(buf, n);
      opts.setReduceFunction(&SumFloats);
      opts.setTag(Tag());
      opts.setTimeout(timeout_);
      gloo::allreduce(opts);
    });
  }
  Status DoReduceScatter(const float* in, float* out, size_t n) override {
    return Guard([&] { RingReduceScatter(in, out, n); });
  }
  Status DoAllGather(const void* in, void* out, size_t bytes) override {
    return Guard([&] {
      auto* o = static_cast<uint8_t*>(out);
      gloo::AllgatherOptions opts(ctx_);
      // Gloo copies the input to out + rank*bytes; in place means no input.
      if (in != o + rank() * bytes) opts.setInput(static_cast<uint8_t*>(const_cast<void*>(in)), bytes);
      opts.setOutput(o, bytes * world_size());
      opts.setTag(Tag());
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
    });
  }
  Status DoBroadcast(void* buf, size_t bytes, int root) override {
    return Guard([&] {
      gloo::BroadcastOptions opts(ctx_);
      opts.setOutput(static_cast<uint8_t*>(buf), bytes);
      opts.setRoot(root);
      opts.setTag(Tag());
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    });
  }
  Status DoBarrier() override {
    return Guard([&] { BarrierNow(Tag()); });
  }
  // The descriptors travel under a tag of their own (the high bit set), so a
  // rank one collective ahead never has its data matched against them.
  Status DoExchangeDescriptors(const void* mine, void* all, size_t bytes) override {
    return Guard([&] {
      gloo::AllgatherOptions opts(ctx_);
      opts.setOutput(static_cast<uint8_t*>(all), bytes * world_size());
      (void)mine;  // in place: `mine` is all + rank*bytes
      opts.setTag(Tag() | 0x80000000u);
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
    });
  }

 private:
  uint32_t Tag() const { return static_cast<uint32_t>(current_seq()) & 0x7fffffffu; }

  void BarrierNow(uint32_t tag) {
    gloo::BarrierOptions opts(ctx_);
    opts.setTag(tag);
    opts.setTimeout(timeout_);
    gloo::barrier(opts);
  }

  template <typename Fn>
  Status Guard(Fn&& fn) {
    try {
      fn();
      return Status::Ok();
    } catch (const std::exception& e) {
      return FromGloo(e, timeout_);
    } catch (...) {
      return CommError("gloo threw an unknown exception");
    }
  }

  // Ring reduce-scatter over two halves of scratch_: at step s this rank
  // sends the partial sum of chunk (r-s-1) to the right and receives the
  // partial of chunk (r-s-2) from the left, adding its own contribution. After
  // world-1 steps it holds chunk r summed in the fixed order r+1, r+2, ..., r.
  void RingReduceScatter(const float* in, float* out, size_t n) {
    const int w = world_size(), r = rank();
    if (w == 1) {
      if (in != out) std::memmove(out, in, n * sizeof(float));
      return;
    }
    auto chunk = [&](int c) { return in + static_cast<size_t>((c % w + w) % w) * n; };
    scratch_.resize(2 * n);
    std::memcpy(scratch_.data(), chunk(r - 1), n * sizeof(float));
    auto buf = ctx_->createUnboundBuffer(scratch_.data(), 2 * n * sizeof(float));
    const auto deadline = Clock::now() + timeout_;
    const size_t bytes = n * sizeof(float);
    for (int s = 0; s < w - 1; ++s) {
      const size_t cur = s % 2, nxt = 1 - cur;
      const uint64_t slot = (uint64_t{0xA5} << 56) | (uint64_t{Tag()} << 24) | static_cast<uint64_t>(s);
      buf->send((r + 1) % w, slot, cur * bytes, bytes);
      buf->recv((r - 1 + w) % w, slot, nxt * bytes, bytes);
      WaitBefore(*buf, deadline, /*recv=*/true);
      WaitBefore(*buf, deadline, /*recv=*/false);
      float* dst = s == w - 2 ? out : scratch_.data() + nxt * n;
      const float* partial = scratch_.data() + nxt * n;
      const float* mine = chunk(r - s - 2);
      for (size_t i = 0; i < n; ++i) dst[i] = partial[i] + mine[i];
    }
  }

  void WaitBefore(gloo::transport::UnboundBuffer& buf, Clock::time_point deadline, bool recv) {
    auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    if (left <= Millis(0)) left = Millis(1);
    if (recv ? !buf.waitRecv(left) : !buf.waitSend(left)) throw gloo::IoException("wait aborted");
  }

  std::shared_ptr<gloo::transport::Device> dev_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  Millis timeout_;
  std::vector<float> scratch_;  // (2, n): reduce-scatter send/receive halves
};

}  // namespace

Result<std::unique_ptr<Communicator>> MakeGlooComm(const CommOptions& o) {
  const RankInfo& r = o.rank;
  const Millis timeout = SecondsToMillis(o.timeout_s);
  const std::string where =
      "gloo rendezvous on rank " + std::to_string(r.rank) + " of " + std::to_string(r.world_size);
  IgnoreSigpipeUnlessHandled();
  std::string local = o.local_addr;
  if (local.empty()) {
    STRATA_ASSIGN_OR_RETURN(local, RouteAddress(r.master_addr, r.master_port));
  }
  gloo::rendezvous::HashStore private_store;  // one rank, no store given
  std::unique_ptr<GlooStoreAdapter> adapter;
  if (o.store) adapter = std::make_unique<GlooStoreAdapter>(*o.store, o.prefix + "/gloo/", timeout);
  gloo::rendezvous::Store& store = adapter ? static_cast<gloo::rendezvous::Store&>(*adapter) : private_store;
  std::unique_ptr<GlooComm> comm;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = local;
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(r.rank, r.world_size);
    ctx->setTimeout(timeout);
    ctx->connectFullMesh(store, dev);
    comm = std::make_unique<GlooComm>(std::move(dev), std::move(ctx), timeout);
  } catch (const std::exception& e) {
    if (adapter && !adapter->first_error().ok()) return adapter->first_error().WithContext(where);
    return FromGloo(e, timeout).WithContext(where + " (listening on " + local + ")");
  }
  STRATA_RETURN_IF_ERROR(comm->FirstBarrier().WithContext(where + ": first barrier"));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace strata::net
