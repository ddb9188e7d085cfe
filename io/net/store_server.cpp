// The rendezvous store's server: Boost.Asio on one thread of its own. All
// state (keys, waiters, sessions) is touched only by that thread, so it needs
// no lock; Stop() joins the thread before touching anything.
#include <charconv>
#include <list>
#include <map>
#include <thread>
#include <utility>

#include "base/fork_close.h"
#include "base/log.h"
#include "io/net/asio.h"
#include "io/net/store.h"
#include "io/net/store_wire.h"

namespace strata::net {

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

class Session;

// A GET or WAIT that found a key missing: answered when the keys appear or
// when its timer fires, whichever comes first.
struct Waiter {
  std::shared_ptr<Session> session;
  wire::Request request;
  std::unique_ptr<asio::steady_timer> timer;
};

}  // namespace

struct StoreServer::Impl {
  asio::io_context ioc;
  tcp::acceptor acceptor{ioc};
  std::map<std::string, Bytes> keys;
  std::list<std::shared_ptr<Waiter>> waiters;
  std::vector<std::weak_ptr<Session>> sessions;
  std::thread thread;
  bool stopped = false;
  bool accept_failing = false;  // said once per run of failed accepts
  int port = 0;

  void Accept();
  void Handle(const std::shared_ptr<Session>& s, wire::Request req);
  bool Ready(const wire::Request& req) const;
  wire::Response Answer(const wire::Request& req);
  void WakeWaiters();
  std::vector<uint8_t> Missing(const wire::Request& req) const;
};

namespace {

// One client connection: read a frame, answer it (maybe later), repeat.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket sock, StoreServer::Impl* srv) : sock_(std::move(sock)), srv_(srv), fd_(sock_.native_handle()) {
    KeepFromForkAndExec(fd_);  // (asio sets no FD_CLOEXEC; a child's copy hides the close from the client)
  }
  ~Session() {
    if (fd_ >= 0) ForgetInForkChild(fd_);  // (the socket closes after)
  }
  void ReadHeader() {
    auto self = shared_from_this();
    asio::async_read(sock_, asio::buffer(header_), [self](boost::system::error_code ec, size_t) {
      if (ec) return;  // the client left; dropping `self` closes the socket
      uint32_t n = wire::DecodeLength(self->header_);
      if (n > wire::kMaxFrame) return;
      self->body_.resize(n);
      self->ReadBody();
    });
  }
  void Reply(const wire::Response& r) {
    auto frame = std::make_shared<std::vector<uint8_t>>(wire::EncodeResponse(r));
    auto self = shared_from_this();
    asio::async_write(sock_, asio::buffer(*frame), [self, frame](boost::system::error_code ec, size_t) {
      if (!ec) self->ReadHeader();
    });
  }
  void Close() {
    boost::system::error_code ignored;
    if (fd_ >= 0) ForgetInForkChild(std::exchange(fd_, -1));
    sock_.shutdown(tcp::socket::shutdown_both, ignored);
    sock_.close(ignored);
  }

 private:
  void ReadBody() {
    auto self = shared_from_this();
    asio::async_read(sock_, asio::buffer(body_), [self](boost::system::error_code ec, size_t) {
      if (ec) return;
      auto req = wire::DecodeRequest(self->body_);
      if (!req) return;  // malformed: drop the connection
      self->srv_->Handle(self, std::move(*req));
    });
  }

  tcp::socket sock_;
  StoreServer::Impl* srv_;
  int fd_;  // sock_'s, while open
  uint8_t header_[4] = {};
  std::vector<uint8_t> body_;
};

wire::Response Invalid(const std::string& msg) {
  return {wire::Reply::kInvalid, Bytes(msg.begin(), msg.end())};
}

}  // namespace

void StoreServer::Impl::Accept() {
  acceptor.async_accept([this](boost::system::error_code ec, tcp::socket sock) {
    if (ec) {
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;  // closed by Stop()
      // Out of descriptors (EMFILE, ENFILE), buffers, or a connection that
      // went before it was taken: the listener stays. Said, and accepted
      // again shortly (clients wait in the backlog meanwhile), never left
      // without an accept for the rest of the job.
      if (!std::exchange(accept_failing, true))
        STRATA_LOG_WARN("store server on port {}: accept failed ({}); trying again every 50 ms", port, ec.message());
      auto retry = std::make_shared<asio::steady_timer>(ioc, std::chrono::milliseconds(50));
      retry->async_wait([this, retry](boost::system::error_code) { Accept(); });
      return;
    }
    if (std::exchange(accept_failing, false)) STRATA_LOG_INFO("store server on port {}: accepting again", port);
    boost::system::error_code ignored;
    sock.set_option(tcp::no_delay(true), ignored);
    auto s = std::make_shared<Session>(std::move(sock), this);
    std::erase_if(sessions, [](const auto& w) { return w.expired(); });
    sessions.push_back(s);
    s->ReadHeader();
    Accept();
  });
}

bool StoreServer::Impl::Ready(const wire::Request& req) const {
  if (req.op != wire::Op::kGet && req.op != wire::Op::kWait) return true;
  for (const auto& k : req.keys)
    if (!keys.count(k)) return false;
  return true;
}

std::vector<uint8_t> StoreServer::Impl::Missing(const wire::Request& req) const {
  std::string out;
  for (const auto& k : req.keys)
    if (!keys.count(k)) out += (out.empty() ? "'" : ", '") + k + "'";
  return Bytes(out.begin(), out.end());
}

wire::Response StoreServer::Impl::Answer(const wire::Request& req) {
  const std::string& key = req.keys[0];
  switch (req.op) {
    case wire::Op::kSet:
      keys[key] = req.value;
      return {};
    case wire::Op::kGet:
      return {wire::Reply::kOk, keys[key]};
    case wire::Op::kWait:
      return {};
    case wire::Op::kAdd: {
      int64_t delta = 0, cur = 0;
      auto parse = [](const Bytes& b, int64_t* v) {
        auto* p = reinterpret_cast<const char*>(b.data());
        auto [end, ec] = std::from_chars(p, p + b.size(), *v);
        return ec == std::errc() && end == p + b.size();
      };
      if (!parse(req.value, &delta)) return Invalid("add: malformed delta");
      auto it = keys.find(key);
      if (it != keys.end() && !parse(it->second, &cur))
        return Invalid("add: the value of '" + key + "' is not an integer");
      std::string text = std::to_string(cur + delta);
      keys[key] = Bytes(text.begin(), text.end());
      return {wire::Reply::kOk, keys[key]};
    }
  }
  return Invalid("unknown op");
}

void StoreServer::Impl::Handle(const std::shared_ptr<Session>& s, wire::Request req) {
  if (Ready(req)) {
    bool changes = req.op == wire::Op::kSet || req.op == wire::Op::kAdd;
    s->Reply(Answer(req));
    if (changes) WakeWaiters();
    return;
  }
  auto w = std::make_shared<Waiter>(Waiter{s, std::move(req), std::make_unique<asio::steady_timer>(ioc)});
  waiters.push_back(w);
  w->timer->expires_after(std::chrono::milliseconds(w->request.wait_ms));
  w->timer->async_wait([this, w](boost::system::error_code ec) {
    if (ec) return;  // cancelled: answered already
    waiters.remove(w);
    w->session->Reply({wire::Reply::kTimeout, Missing(w->request)});
  });
}

void StoreServer::Impl::WakeWaiters() {
  for (auto it = waiters.begin(); it != waiters.end();) {
    auto w = *it;
    if (!Ready(w->request)) {
      ++it;
      continue;
    }
    it = waiters.erase(it);
    w->timer->cancel();
    w->session->Reply(Answer(w->request));
  }
}

StoreServer::StoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StoreServer::~StoreServer() { Stop(); }

Result<std::unique_ptr<StoreServer>> StoreServer::Start(const std::string& bind_addr, int port) {
  auto impl = std::make_unique<Impl>();
  std::string where = "store server " + bind_addr + ":" + std::to_string(port);
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(bind_addr, ec);
  if (ec) return InvalidError(where + ": bad address: " + ec.message());
  tcp::endpoint ep(addr, static_cast<uint16_t>(port));
  impl->acceptor.open(ep.protocol(), ec);
  if (!ec) impl->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(ep, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (!ec) impl->port = impl->acceptor.local_endpoint(ec).port();
  if (ec == asio::error::address_in_use)
    return CommError(where + ": cannot listen: port " + std::to_string(port) +
                     " is in use on this host (another job, or a rank of an earlier run still alive); give another "
                     "MASTER_PORT, or STRATA_STORE_PORT");
  if (ec) return CommError(where + ": cannot listen: " + ec.message());
  // Not in a child of fork, nor a program it runs: their copy of the
  // listener kept the port past Stop (the next job's store refused it).
  KeepFromForkAndExec(impl->acceptor.native_handle());
  impl->Accept();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->ioc.run(); });
  return std::unique_ptr<StoreServer>(new StoreServer(std::move(impl)));
}

int StoreServer::port() const { return impl_->port; }

void StoreServer::Stop() {
  if (impl_->stopped) return;
  impl_->stopped = true;
  impl_->ioc.stop();
  impl_->thread.join();
  // The thread is gone: closing from here races with nothing. Clients blocked
  // in a call see the connection close (kComm) at once.
  boost::system::error_code ignored;
  ForgetInForkChild(impl_->acceptor.native_handle());
  impl_->acceptor.close(ignored);
  for (auto& w : impl_->sessions)
    if (auto s = w.lock()) s->Close();
  impl_->waiters.clear();
}

}  // namespace strata::net
