// Rendezvous store: rank 0 serves keys -> bytes over TCP (Boost.Asio) and
// every rank, rank 0 included, talks to it through a StoreClient. Used to
// exchange the NCCL unique id and to rendezvous Gloo; every call has a timeout.
//
//   RankInfo info = RankInfoFromEnv().value();
//   auto store = RendezvousStore::Open(info, std::chrono::seconds(30)).value();
//   store->client().Set("k", {1, 2});
//   auto v = store->client().Get("k", std::chrono::seconds(30));
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/status.h"
#include "io/net/launch_env.h"

namespace strata::net {

using Bytes = std::vector<uint8_t>;
using Millis = std::chrono::milliseconds;

// The server: an acceptor and all connections on one thread of its own.
// GET and WAIT block server-side until the keys exist or the client's
// deadline passes. Start() returns once it listens; the destructor stops it
// (closing every connection, so blocked clients see kComm).
class StoreServer {
 public:
  // Listens on `bind_addr:port`; port 0 picks a free one (see port()).
  static Result<std::unique_ptr<StoreServer>> Start(const std::string& bind_addr, int port);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const;
  // Stops serving now (idempotent; the destructor calls it).
  void Stop();

  struct Impl;

 private:
  explicit StoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One connection to the server. Thread-safe: calls are serialized by a mutex.
// Errors: the server gone or the connection broken -> kComm naming the store
// address, the operation and the key; a deadline passed -> kTimeout naming
// the key and the seconds. After a client-side timeout the connection is
// dropped and the next call reconnects.
class StoreClient {
 public:
  // Retries until `timeout` (rank 0 may not listen yet); kTimeout naming the
  // address when nobody answers.
  static Result<std::unique_ptr<StoreClient>> Connect(const std::string& addr, int port, Millis timeout);
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  // Sets (or replaces) `key`; wakes waiters. Bounded by the connect timeout.
  Status Set(const std::string& key, const Bytes& value);
  // Waits until `key` exists, then returns its value.
  Result<Bytes> Get(const std::string& key, Millis timeout);
  // Adds `delta` to the integer at `key` (absent = 0) and returns the new
  // value; the value is stored as decimal text. kInvalid if it is not an integer.
  Result<int64_t> Add(const std::string& key, int64_t delta);
  // Waits until every key exists.
  Status Wait(const std::vector<std::string>& keys, Millis timeout);

  const std::string& address() const { return name_; }  // "127.0.0.1:29500"

  struct Conn;

 private:
  StoreClient(std::string addr, int port, Millis op_timeout);
  Result<Bytes> Call(const char* op, const std::string& key, const Bytes& request, Millis wait);

  std::string addr_;
  int port_;
  std::string name_;
  Millis op_timeout_;           // bound on calls that do not wait for keys
  std::mutex mu_;               // serializes calls: one request in flight per connection
  std::unique_ptr<Conn> conn_;  // guarded by mu_; null after a broken call
};

// What one rank holds: rank 0 the server and a client, the others a client.
// Keep it alive until MakeCommunicator has returned (it ends with a barrier,
// so afterwards no rank needs the store for that communicator).
class RendezvousStore {
 public:
  // Rank 0 binds info.store_port on all interfaces (0.0.0.0); every rank
  // connects to info.master_addr:info.store_port within `timeout`.
  static Result<std::unique_ptr<RendezvousStore>> Open(const RankInfo& info, Millis timeout);
  StoreClient& client() { return *client_; }
  StoreServer* server() { return server_.get(); }  // null off rank 0

 private:
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<StoreClient> client_;
};

}  // namespace strata::net
