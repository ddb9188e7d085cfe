// The Gloo communicator: host buffers over Gloo's TCP transport, rendezvous
// through our store. Gloo reports failures by throwing; every entry point
// here catches and returns a Status, so nothing escapes the Communicator.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <poll.h>
#include <sys/eventfd.h>
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
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <set>
#include <cstring>
#include <exception>
#include <thread>
#include <type_traits>
#include <utility>

#include "base/fork_close.h"
#include "base/log.h"
#include "base/sizes.h"
#include "io/net/comm_backends.h"
#include "io/net/deadline.h"
#include "io/net/gloo_addresses.h"
#include "io/net/shm_channel.h"

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

// A transport's failure as the communicator says it: a wait past the
// timeout, or a communication failure (a peer that closed, a reset).
Status Described(bool timed_out, const std::string& what, Millis timeout, const char* transport) {
  if (timed_out)
    return TimeoutError("timed out after " + FormatSeconds(timeout) + " (" + transport + ": " + what + ")");
  return CommError(std::string("a peer failed or closed its connection (") + transport + ": " + what + ")");
}

// Gloo's message says "Timed out" when a wait ran past the timeout.
Status FromGloo(const std::exception& e, Millis timeout) {
  const std::string what = e.what();
  return Described(what.find("imed out") != std::string::npos, what, timeout, "gloo");
}

// A write to a socket whose peer died raises SIGPIPE, which would kill this
// rank silently instead of letting it report the collective. Ignore it unless
// the program chose a handler itself.
void IgnoreSigpipeUnlessHandled() {
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
}

// Connects to each peer's alive socket, kProbeBatch at a time (bounded file
// descriptors), each batch for at most `limit`; one line naming the peers
// lost (and why) and those that answered. A probe this rank could not even
// start (no socket: EMFILE, say) proves nothing about the peer: it is named
// as not probed, never as lost.
constexpr size_t kProbeBatch = 128;

std::string ProbePeers(const std::vector<std::string>& peers, int self, Millis limit) {
  struct Try {
    int rank, fd = -1;
    std::string addr, result;  // result empty: still waiting
    bool local_error = false;  // failed on this side: not evidence
  };
  std::vector<Try> tries;
  for (int k = 0; k < static_cast<int>(peers.size()); ++k)
    if (k != self && !peers[k].empty()) tries.push_back(Try{k, -1, peers[k], "", false});
  for (size_t b = 0; b < tries.size(); b += kProbeBatch) {
    const size_t e = std::min(tries.size(), b + kProbeBatch);
    for (size_t i = b; i < e; ++i) {
      Try& t = tries[i];
      const auto colon = t.addr.rfind(':');
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(std::atoi(t.addr.c_str() + colon + 1)));
      inet_pton(AF_INET, t.addr.substr(0, colon).c_str(), &a.sin_addr);
      t.fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (t.fd < 0) {
        t.result = std::strerror(errno);
        t.local_error = true;
      } else if (connect(t.fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
        t.result = "ok";
      } else if (errno != EINPROGRESS) {
        t.result = std::strerror(errno);
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      std::vector<pollfd> fds;
      std::vector<Try*> who;
      for (size_t i = b; i < e; ++i)
        if (tries[i].result.empty()) {
          fds.push_back({tries[i].fd, POLLOUT, 0});
          who.push_back(&tries[i]);
        }
      auto left = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
      if (fds.empty() || left <= Millis(0)) break;
      if (poll(fds.data(), fds.size(), static_cast<int>(left.count())) <= 0) continue;
      for (size_t i = 0; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(who[i]->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        who[i]->result = err == 0 ? "ok" : std::strerror(err);
      }
    }
    for (size_t i = b; i < e; ++i)
      if (tries[i].fd >= 0) close(tries[i].fd);
  }
  std::string lost, alive, unknown;
  int n_lost = 0, n_alive = 0;
  auto add = [](std::string& list, const std::string& item) { list += (list.empty() ? "" : ", ") + item; };
  for (const auto& t : tries) {
    const std::string where = "rank " + std::to_string(t.rank) + " at " + t.addr;
    if (t.result == "ok") {
      add(alive, std::to_string(t.rank));
      ++n_alive;
    } else if (t.local_error) {
      add(unknown, std::to_string(t.rank) + " (" + t.result + ")");
    } else if (t.result.empty()) {
      add(lost, where + " (no answer within " + FormatSeconds(limit) + ")");
      ++n_lost;
    } else if (t.result == std::strerror(ECONNREFUSED)) {
      add(lost, where + " (connection refused: its process is gone)");
      ++n_lost;
    } else {
      add(lost, where + " (" + t.result + ")");
      ++n_lost;
    }
  }
  std::string out = n_lost == 0 ? "no peer lost" : (n_lost == 1 ? "lost peer " : "lost peers ") + lost;
  out += n_alive == 0 ? "; no peer answers" : (n_alive == 1 ? "; answering: rank " : "; answering: ranks ") + alive;
  if (!unknown.empty()) out += "; not probed: rank " + unknown;
  return out;
}

// Each rank's alive socket and the thread that serves it. The socket only
// says "this process is alive": peers connect, the thread accepts and
// closes. When a collective has waited ProbeDelay() (half the timeout, or
// until 1.5 s before it, whichever is later) the thread probes every peer,
// while the other ranks still wait in the same collective: a peer that does
// not answer then is lost, one that answers lives (hung, or just slow); a
// probe after the failure instead might find peers that have exited because
// they failed too. Collectives that fail at once (a peer closed its
// connection) are probed after the failure (see GlooComm::Guard).
class Watchdog {
 public:
  ~Watchdog() {
    stop_ = true;
    if (thread_.joinable()) {
      const uint64_t one = 1;
      [[maybe_unused]] ssize_t n = write(wake_, &one, sizeof one);  // out of its poll now
      thread_.join();
    }
    if (wake_ >= 0) close(wake_);
    if (fd_ >= 0) {
      ForgetInForkChild(fd_);
      close(fd_);
    }
  }
  // Listens on `addr`; "addr:port", or "" when no socket could be made
  // (then nobody probes this rank, and it probes nobody ahead).
  std::string Open(const std::string& addr) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    socklen_t len = sizeof a;
    if (fd_ < 0 || inet_pton(AF_INET, addr.c_str(), &a.sin_addr) != 1 ||
        bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(fd_, 4096) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      if (fd_ >= 0) close(fd_);
      fd_ = -1;
      return "";
    }
    KeepFromForkAndExec(fd_);  // (a child's copy would answer "alive" for this rank after it died)
    return addr + ":" + std::to_string(ntohs(a.sin_port));
  }
  // Starts the thread once the peers are known.
  void Start(std::vector<std::string> peers, int self, Millis timeout) {
    if (fd_ < 0 || (wake_ = eventfd(0, EFD_CLOEXEC)) < 0) return;
    peers_ = std::move(peers);
    self_ = self;
    timeout_ = timeout;
    thread_ = std::thread([this] { Loop(); });
  }
  // A collective (one Guard call) begins / ends; lock-free.
  void Begin() {
    since_ms_.store(NowMs(), std::memory_order_relaxed);
    active_.store(++id_, std::memory_order_release);
  }
  void End() { active_.store(0, std::memory_order_release); }
  // What the probe ahead found during the collective that just failed, or "".
  std::string TakeResult() {
    std::lock_guard<std::mutex> lock(mu_);
    return result_id_ == id_ ? result_ : "";
  }
  static Millis ProbeDelay(Millis timeout) { return std::max(timeout / 2, timeout - Millis(1500)); }
  static Millis ProbeLimit(Millis timeout) {
    return std::clamp((timeout - ProbeDelay(timeout)) * 2 / 3, Millis(1), Millis(1000));
  }

 private:
  static int64_t NowMs() {
    return std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void Loop() {
    const Millis delay = ProbeDelay(timeout_);
    const int tick = static_cast<int>(std::clamp<int64_t>(delay.count() / 4, 1, 100));
    uint64_t probed = 0;
    while (!stop_) {
      pollfd p[2] = {{fd_, POLLIN, 0}, {wake_, POLLIN, 0}};
      if (poll(p, 2, tick) > 0 && (p[0].revents & POLLIN))
        for (int c; (c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) close(c);
      const uint64_t id = active_.load(std::memory_order_acquire);
      if (id == 0 || id == probed || NowMs() - since_ms_.load(std::memory_order_relaxed) < delay.count()) continue;
      probed = id;
      std::string found = ProbePeers(peers_, self_, ProbeLimit(timeout_)) + " (probed " +
                          FormatSeconds(delay) + " into the wait)";
      std::lock_guard<std::mutex> lock(mu_);
      result_ = std::move(found);
      result_id_ = id;
    }
  }

  int fd_ = -1;
  int wake_ = -1;  // eventfd: the destructor wakes the thread
  std::vector<std::string> peers_;
  int self_ = 0;
  Millis timeout_{0};
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> active_{0};  // the collective in progress (0: none)
  std::atomic<int64_t> since_ms_{0};
  uint64_t id_ = 0;  // the caller's count of collectives (one caller at a time)
  std::mutex mu_;
  std::string result_;  // guarded by mu_
  uint64_t result_id_ = 0;
};

void SumFloats(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<float*>(c);
  auto* x = static_cast<const float*>(a);
  auto* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

// Whether `fd` is a TCP socket whose local address is `local` (Gloo's: it
// binds every pair to the device's address), not another thread's socket
// made meanwhile (a socketpair, a client elsewhere).
bool GlooSocket(int fd, const std::string& local) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return false;
  char host[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET)
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&a)->sin_addr, host, sizeof host);
  else if (a.ss_family == AF_INET6)
    inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&a)->sin6_addr, host, sizeof host);
  else
    return false;
  int type = 0;
  socklen_t tlen = sizeof type;
  return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) == 0 && type == SOCK_STREAM && local == host;
}

// The sockets among this process's descriptors.
std::set<int> SocketFds() {
  std::set<int> out;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return out;
  char link[300], target[64];
  for (dirent* e; (e = readdir(d)) != nullptr;) {
    if (e->d_name[0] == '.') continue;
    std::snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
    const ssize_t n = readlink(link, target, sizeof target - 1);
    if (n > 7 && std::strncmp(target, "socket:", 7) == 0) out.insert(std::atoi(e->d_name));
  }
  closedir(d);
  return out;
}

class GlooComm final : public Communicator {
 public:
  GlooComm(std::shared_ptr<gloo::transport::Device> dev, std::shared_ptr<gloo::rendezvous::Context> ctx,
           Millis timeout, std::unique_ptr<Watchdog> watchdog, std::vector<std::string> peers,
           std::unique_ptr<ShmChannel> shm, std::vector<std::pair<int, ino_t>> gloo_sockets)
      : gloo_sockets_(std::move(gloo_sockets)),
        dev_(std::move(dev)),
        ctx_(std::move(ctx)),
        timeout_(timeout),
        watchdog_(std::move(watchdog)),
        peers_(std::move(peers)),
        shm_(std::move(shm)) {
    watchdog_->Start(peers_, ctx_->rank, timeout_);
  }
  ~GlooComm() override {
    // (Closed by ctx_ and dev_, after.) Only the numbers that still name
    // the socket registered: a pair closes its own on an error, and the
    // number may be another's registered file since.
    for (const auto& [fd, ino] : gloo_sockets_) {
      struct stat st {};
      if (fstat(fd, &st) == 0 && st.st_ino == ino) ForgetInForkChild(fd);
    }
  }

  int rank() const override { return ctx_->rank; }
  int world_size() const override { return ctx_->size; }
  const char* backend() const override { return "gloo"; }
  bool device_buffers() const override { return false; }
  bool shared_memory() const override { return shm_ != nullptr; }
  bool reads_pieces() const override { return shm_ != nullptr; }

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
  // Through shared memory when every rank is on this host (after the
  // descriptors: they keep the ranks' rounds in step). Guard says a
  // failure there as it says Gloo's: a timeout, or a peer gone (COMM).
  Status DoReduceScatter(const float* in, float* out, size_t n) override {
    if (shm_) return Guard([&] { return shm_->ReduceScatter(in, out, n, Clock::now() + timeout_); });
    return Guard([&] { RingReduceScatter(in, out, n); });
  }
  Status DoReduceScatterPieces(const FloatPieces& in, uint64_t stride, uint64_t first, float* out,
                               size_t n) override {
    if (!shm_) return Communicator::DoReduceScatterPieces(in, stride, first, out, n);
    return Guard([&] { return shm_->ReduceScatter(in, stride, first, out, n, Clock::now() + timeout_); });
  }
  Status DoAllGather(const void* in, void* out, size_t bytes) override {
    if (shm_) return Guard([&] { return shm_->AllGather(in, out, bytes, Clock::now() + timeout_); });
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
  // Through shared memory too, where the ranks share it: every collective
  // exchanges one descriptor of a fixed size, so the rounds stay in step
  // whatever the collectives are (a mismatch is found here, before any
  // data moves, and breaks the communicator).
  Status DoExchangeDescriptors(const void* mine, void* all, size_t bytes) override {
    if (shm_) return Guard([&] { return shm_->AllGather(mine, all, bytes, Clock::now() + timeout_); });
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

  // A failure says which peers are lost (see Watchdog), once: the
  // communicator is broken after its first failure. `fn` is Gloo's (it
  // throws) or shared memory's (it returns a Status).
  template <typename Fn>
  Status Guard(Fn&& fn) {
    Status s;
    watchdog_->Begin();
    if constexpr (std::is_same_v<decltype(fn()), Status>) {
      if (Status st = fn(); !st.ok()) s = Described(st.code() == Code::kTimeout, st.message(), timeout_, "shared memory");
    } else {
      try {
        fn();
      } catch (const std::exception& e) {
        s = FromGloo(e, timeout_);
      } catch (...) {
        s = CommError("gloo threw an unknown exception");
      }
    }
    watchdog_->End();
    if (s.ok()) return s;
    if (probed_ || peers_.empty()) return s;
    probed_ = true;
    std::string found = watchdog_->TakeResult();
    if (found.empty()) {
      // A peer that closed its connection may be the first of several dying
      // at once (a host lost): let the others' deaths land before asking.
      if (s.code() == Code::kComm) std::this_thread::sleep_for(kSettle);
      found = ProbePeers(peers_, rank(), Watchdog::ProbeLimit(timeout_)) + " (probed after the failure)";
    }
    return Status(s.code(), s.message() + "; " + found);
  }
  static constexpr Millis kSettle{200};

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

  // Gloo's sockets (and their inodes), closed in children of fork (base/fork_close.h).
  std::vector<std::pair<int, ino_t>> gloo_sockets_;
  std::shared_ptr<gloo::transport::Device> dev_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  Millis timeout_;
  std::unique_ptr<Watchdog> watchdog_;  // this rank's alive socket and its thread
  std::vector<std::string> peers_;      // every rank's alive socket, "addr:port" ("" unknown)
  bool probed_ = false;
  std::vector<float> scratch_;  // (2, n): reduce-scatter send/receive halves
  std::unique_ptr<ShmChannel> shm_;  // every rank on this host (CommOptions::shared_memory)
};

// Every rank on this host (the same HostKey): rank 0 makes the segment and
// says its name, slot size and host in the store (no name when it could
// not); the others open it; each says whether it could, and all use it only
// if all could (else every rank keeps TCP, with an info line naming why).
// Rank 0 removes the name once all have opened.
Result<std::unique_ptr<ShmChannel>> ShareMemory(const CommOptions& o, Millis timeout) {
  const RankInfo& r = o.rank;
  if (!o.shared_memory || !o.store || r.world_size < 2) return std::unique_ptr<ShmChannel>();
  const std::string key = o.prefix + "/shm/";
  std::unique_ptr<ShmChannel> ch;
  Status why;
  if (r.rank == 0) {
    // The slots shrink (down to 256 KiB) where /dev/shm cannot hold them
    // (a container's 64 MiB, say): more rounds, still no TCP.
    std::string said;
    for (uint64_t slot = o.shm_slot_bytes; !ch && slot >= (uint64_t{256} << 10); slot /= 2) {
      std::string name;
      auto c = ShmChannel::Create(r.world_size, slot, &name);
      if (c.ok()) {
        ch = std::move(*c);
        said = name + "\n" + std::to_string(slot) + "\n" + HostKey();
      } else if (why.ok()) {
        why = c.status();
      }
    }
    STRATA_RETURN_IF_ERROR(o.store->Set(key + "name", Bytes(said.begin(), said.end())));
  } else {
    STRATA_ASSIGN_OR_RETURN(auto v, o.store->Get(key + "name", timeout));
    const std::string said(v.begin(), v.end());
    const size_t a = said.find('\n'), b = a == std::string::npos ? a : said.find('\n', a + 1);
    if (b == std::string::npos) {
      why = CommError("rank 0 could not make the segment");
    } else if (said.substr(b + 1) != HostKey()) {
      why = CommError("rank 0 is on another host (" + said.substr(b + 1) + ", this rank " + HostKey() + ")");
    } else {
      auto c = ShmChannel::Open(said.substr(0, a), r.rank, r.world_size, std::stoull(said.substr(a + 1, b - a - 1)));
      if (c.ok()) ch = std::move(*c);
      else why = c.status();
    }
  }
  const std::string mine = ch ? "1" : "0";
  STRATA_RETURN_IF_ERROR(o.store->Set(key + "ok/" + std::to_string(r.rank), Bytes(mine.begin(), mine.end())));
  int missing = -1;
  for (int k = 0; k < r.world_size; ++k) {
    STRATA_ASSIGN_OR_RETURN(auto v, o.store->Get(key + "ok/" + std::to_string(k), timeout));
    if (v.size() != 1 || v[0] != '1') {
      missing = k;
      break;
    }
  }
  if (missing >= 0 || !ch) {
    STRATA_LOG_INFO("gloo rank {} of {}: collectives over TCP, not shared memory ({})", r.rank, r.world_size,
                    !why.ok() ? why.message() : "rank " + std::to_string(missing) + " could not open it");
    return std::unique_ptr<ShmChannel>();
  }
  if (r.rank == 0) {
    ch->Unlink();
    STRATA_LOG_INFO("gloo: the {} ranks share this host: all-gathers and reduce-scatters through shared memory "
                    "({} in /dev/shm)", r.world_size, FormatBytes(ch->segment_bytes()));
  }
  return ch;
}

}  // namespace

Result<std::unique_ptr<Communicator>> MakeGlooComm(const CommOptions& o) {
  const RankInfo& r = o.rank;
  const Millis timeout = SecondsToMillis(o.timeout_s);
  const std::string where =
      "gloo rendezvous on rank " + std::to_string(r.rank) + " of " + std::to_string(r.world_size);
  IgnoreSigpipeUnlessHandled();
  std::string local = o.local_addr, why = "CommOptions::local_addr";
  if (local.empty()) {
    STRATA_ASSIGN_OR_RETURN(local, ListenAddress(r, &why));
  }
  STRATA_LOG_DEBUG("gloo rank {} of {} listens on {} ({}); store {}:{}", r.rank, r.world_size, local, why,
                   r.master_addr, r.store_port);
  auto watchdog = std::make_unique<Watchdog>();
  const std::string alive_at = r.world_size > 1 && o.store ? watchdog->Open(local) : "";
  if (o.store && r.world_size > 1) {
    STRATA_RETURN_IF_ERROR(o.store->Set(o.prefix + "/alive/" + std::to_string(r.rank),
                                        Bytes(alive_at.begin(), alive_at.end()))
                               .WithContext(where));
    const std::string host = HostKey() + "\n" + local;
    STRATA_RETURN_IF_ERROR(o.store->Set(o.prefix + "/host/" + std::to_string(r.rank), Bytes(host.begin(), host.end()))
                               .WithContext(where));
    STRATA_RETURN_IF_ERROR(CheckReachable(o, local, why, timeout).WithContext(where));
  }
  gloo::rendezvous::HashStore private_store;  // one rank, no store given
  std::unique_ptr<GlooStoreAdapter> adapter;
  if (o.store) adapter = std::make_unique<GlooStoreAdapter>(*o.store, o.prefix + "/gloo/", timeout);
  gloo::rendezvous::Store& store = adapter ? static_cast<gloo::rendezvous::Store&>(*adapter) : private_store;
  std::unique_ptr<GlooComm> comm;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = local;
    // Gloo's sockets to the peers, which Gloo makes without FD_CLOEXEC:
    // kept from children of fork and the programs they run (a child's
    // copy of a dead rank's connections hid its death from the others,
    // who waited out the whole timeout). Those made during the connect
    // (the engine makes no others meanwhile: create is one thread's).
    const std::set<int> before = SocketFds();
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(r.rank, r.world_size);
    ctx->setTimeout(timeout);
    ctx->connectFullMesh(store, dev);
    std::vector<std::pair<int, ino_t>> gloo_sockets;
    for (const int fd : SocketFds()) {
      struct stat st {};
      if (!before.count(fd) && GlooSocket(fd, local) && fstat(fd, &st) == 0) gloo_sockets.emplace_back(fd, st.st_ino);
    }
    std::vector<std::string> peers;
    for (int k = 0; o.store && r.world_size > 1 && k < r.world_size; ++k) {
      auto v = o.store->Get(o.prefix + "/alive/" + std::to_string(k), timeout);
      if (!v.ok()) return v.status().WithContext(where);
      peers.emplace_back(v->begin(), v->end());
    }
    auto shm = ShareMemory(o, timeout);
    if (!shm.ok()) return shm.status().WithContext(where + ": sharing memory");
    for (const auto& [fd, ino] : gloo_sockets) KeepFromForkAndExec(fd);  // (forgotten by the comm, which closes them)
    comm = std::make_unique<GlooComm>(std::move(dev), std::move(ctx), timeout, std::move(watchdog), std::move(peers),
                                      std::move(*shm), std::move(gloo_sockets));
  } catch (const std::exception& e) {
    if (adapter && !adapter->first_error().ok()) return adapter->first_error().WithContext(where);
    return FromGloo(e, timeout).WithContext(where + " (listening on " + local + ", from " + why + ")");
  }
  STRATA_RETURN_IF_ERROR(comm->FirstBarrier().WithContext(where + ": first barrier"));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace strata::net
