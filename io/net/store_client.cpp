// The rendezvous store's client: one TCP connection, blocking calls with a
// deadline (Boost.Asio async operations run on a private io_context for at
// most the call's time), and RendezvousStore, which puts server and client
// together for one rank.
#include <charconv>
#include <thread>
#include <utility>

#include "base/fork_close.h"
#include "io/net/asio.h"
#include "io/net/deadline.h"
#include "io/net/store.h"
#include "io/net/store_wire.h"

namespace strata::net {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

struct StoreClient::Conn {
  asio::io_context ioc;
  tcp::socket sock{ioc};
  int fd = -1;  // sock's once connected: kept from children of fork (base/fork_close.h)
  ~Conn() { Forget(); }
  void Forget() {
    if (fd >= 0) ForgetInForkChild(std::exchange(fd, -1));
  }

  // Runs queued operations until they finish (true) or `limit` passes
  // (false: the socket is closed and the aborted handlers drained).
  bool RunFor(Millis limit) {
    ioc.restart();
    ioc.run_for(limit);
    if (ioc.stopped()) return true;
    error_code ignored;
    Forget();
    sock.close(ignored);
    ioc.restart();
    ioc.run();
    return false;
  }
};

namespace {

constexpr Millis kWaitSlack{2000};  // network time on top of a server-side wait

bool IsLoopback(const std::string& addr) {
  error_code ec;
  auto a = asio::ip::make_address(addr, ec);
  return addr == "localhost" || (!ec && a.is_loopback());
}

// One connection attempt bounded by `limit`; the error, or none.
error_code TryConnect(StoreClient::Conn& c, const tcp::resolver::results_type& eps, Millis limit) {
  error_code result = asio::error::timed_out;
  asio::async_connect(c.sock, eps, [&](const error_code& ec, const tcp::endpoint&) { result = ec; });
  if (!c.RunFor(limit)) return asio::error::timed_out;
  if (!result) c.sock.set_option(tcp::no_delay(true), result);
  if (!result) KeepFromForkAndExec(c.fd = c.sock.native_handle());
  return result;
}

}  // namespace

StoreClient::StoreClient(std::string addr, int port, Millis op_timeout)
    : addr_(std::move(addr)),
      port_(port),
      name_(addr_ + ":" + std::to_string(port)),
      op_timeout_(op_timeout) {}

StoreClient::~StoreClient() = default;

Result<std::unique_ptr<StoreClient>> StoreClient::Connect(const std::string& addr, int port, Millis timeout) {
  std::unique_ptr<StoreClient> c(new StoreClient(addr, port, timeout));
  auto conn = std::make_unique<Conn>();
  auto deadline = std::chrono::steady_clock::now() + timeout;
  error_code ec;
  tcp::resolver resolver(conn->ioc);
  auto eps = resolver.resolve(addr, std::to_string(port), ec);
  if (ec) return CommError("store " + c->name_ + ": cannot resolve '" + addr + "': " + ec.message());
  for (;;) {
    auto left = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
    if (left <= Millis(0)) break;
    ec = TryConnect(*conn, eps, std::min(left, Millis(2000)));
    if (!ec) {
      c->conn_ = std::move(conn);
      return c;
    }
    error_code ignored;
    conn->Forget();
    conn->sock.close(ignored);  // a failed attempt leaves the socket open
    std::this_thread::sleep_for(std::min(left, Millis(100)));
  }
  // Unreachable is a communication failure (kComm), whatever the last
  // attempt said: nobody answered at this address and port within the timeout.
  return CommError("store " + c->name_ + " (rank 0's rendezvous, MASTER_ADDR:port): no answer within " +
                   FormatSeconds(timeout) + " (last error: " + ec.message() +
                   "); is rank 0 running there, and is that address reachable from this host?");
}

Result<Bytes> StoreClient::Call(const char* op, const std::string& key, const Bytes& request, Millis wait) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string what = "store " + name_ + ": " + op + " '" + key + "'";
  if (!conn_) {
    STRATA_ASSIGN_OR_RETURN(auto fresh, Connect(addr_, port_, op_timeout_));
    conn_ = std::move(fresh->conn_);
  }
  Conn& c = *conn_;
  error_code err;
  uint8_t header[4];
  Bytes body;
  asio::async_write(c.sock, asio::buffer(request), [&](const error_code& ec, size_t) {
    if (ec) return void(err = ec);
    asio::async_read(c.sock, asio::buffer(header), [&](const error_code& ec, size_t) {
      if (ec) return void(err = ec);
      uint32_t n = wire::DecodeLength(header);
      if (n > wire::kMaxFrame) return void(err = asio::error::message_size);
      body.resize(n);
      asio::async_read(c.sock, asio::buffer(body), [&](const error_code& ec, size_t) { err = ec; });
    });
  });
  Millis limit = wait > Millis(0) ? wait + kWaitSlack : op_timeout_;
  if (!c.RunFor(limit)) {
    conn_.reset();  // a late reply would desynchronize the stream: reconnect next time
    return TimeoutError(what + ": no reply within " + FormatSeconds(limit));
  }
  if (err) {
    conn_.reset();
    return CommError(what + ": connection to the store lost (" + err.message() + "); did rank 0 exit?");
  }
  auto resp = wire::DecodeResponse(body);
  if (!resp) {
    conn_.reset();
    return CommError(what + ": malformed reply");
  }
  std::string text(resp->payload.begin(), resp->payload.end());
  if (resp->status == wire::Reply::kTimeout)
    return TimeoutError(what + ": timed out after " + FormatSeconds(wait) + " waiting for " + text);
  if (resp->status == wire::Reply::kInvalid) return InvalidError(what + ": " + text);
  return std::move(resp->payload);
}

Status StoreClient::Set(const std::string& key, const Bytes& value) {
  wire::Request r{wire::Op::kSet, 0, {key}, value};
  return Call("set", key, wire::EncodeRequest(r), Millis(0)).status();
}

Result<Bytes> StoreClient::Get(const std::string& key, Millis timeout) {
  wire::Request r{wire::Op::kGet, static_cast<uint64_t>(timeout.count()), {key}, {}};
  return Call("get", key, wire::EncodeRequest(r), std::max(timeout, Millis(1)));
}

Result<int64_t> StoreClient::Add(const std::string& key, int64_t delta) {
  std::string d = std::to_string(delta);
  wire::Request r{wire::Op::kAdd, 0, {key}, Bytes(d.begin(), d.end())};
  STRATA_ASSIGN_OR_RETURN(Bytes v, Call("add", key, wire::EncodeRequest(r), Millis(0)));
  int64_t out = 0;
  auto* p = reinterpret_cast<const char*>(v.data());
  auto [end, ec] = std::from_chars(p, p + v.size(), out);
  if (ec != std::errc() || end != p + v.size())
    return CommError("store " + name_ + ": add '" + key + "': malformed reply");
  return out;
}

Status StoreClient::Wait(const std::vector<std::string>& keys, Millis timeout) {
  if (keys.empty()) return Status::Ok();
  wire::Request r{wire::Op::kWait, static_cast<uint64_t>(timeout.count()), keys, {}};
  std::string names;
  for (const auto& k : keys) names += (names.empty() ? "" : ",") + k;
  return Call("wait", names, wire::EncodeRequest(r), std::max(timeout, Millis(1))).status();
}

Result<std::unique_ptr<RendezvousStore>> RendezvousStore::Open(const RankInfo& info, Millis timeout) {
  auto s = std::make_unique<RendezvousStore>();
  if (info.rank == 0) {
    // A loopback master keeps the store off the network.
    std::string bind = IsLoopback(info.master_addr) ? "127.0.0.1" : "0.0.0.0";
    STRATA_ASSIGN_OR_RETURN(s->server_, StoreServer::Start(bind, info.store_port));
  }
  STRATA_ASSIGN_OR_RETURN(s->client_, StoreClient::Connect(info.master_addr, info.store_port, timeout));
  // Whose store this is: two jobs given the same MASTER_ADDR and port meet
  // at the first one's store (the second's rank 0 is refused the port,
  // named; its other ranks would join the first job's rendezvous and wait
  // out its timeout, or take its ranks' addresses). Rank 0 says its job and
  // world size; each other rank compares them with its own before it writes
  // anything there.
  const std::string mine = (info.job.empty() ? std::string("an unnamed job") : "job " + info.job) + " of " +
                           std::to_string(info.world_size) + " ranks";
  constexpr const char* kKey = "strata/job";
  if (info.rank == 0) {
    STRATA_RETURN_IF_ERROR(s->client_->Set(kKey, Bytes(mine.begin(), mine.end())));
  } else {
    STRATA_ASSIGN_OR_RETURN(Bytes theirs, s->client_->Get(kKey, timeout));
    if (std::string(theirs.begin(), theirs.end()) != mine)
      return CommError("the store at " + info.master_addr + ":" + std::to_string(info.store_port) + " is rank 0's of " +
                       std::string(theirs.begin(), theirs.end()) + "; this rank (" + std::to_string(info.rank) +
                       ") is of " + mine + ": two jobs were given the same MASTER_ADDR and MASTER_PORT (or "
                       "STRATA_STORE_PORT); give each its own");
  }
  return s;
}

}  // namespace strata::net
