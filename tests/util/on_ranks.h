// OnRanks: a test's ranks as threads of this process, each with a real Gloo
// communicator rendezvoused through one store on a free loopback port.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "io/net/comm.h"
#include "io/net/store.h"

namespace strata::testing {

// Runs body(rank, comm) on `world` threads and joins them; `timeout_s`
// bounds every collective and store wait; `shared_memory`: the ranks share
// a segment (CommOptions::shared_memory), else TCP over loopback.
inline void OnRanks(int world, const std::function<void(int, net::Communicator&)>& body, double timeout_s = 30,
                    bool shared_memory = true) {
  using namespace std::chrono_literals;
  auto server = net::StoreServer::Start("127.0.0.1", 0);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto client = net::StoreClient::Connect("127.0.0.1", (*server)->port(), 10s);
      ASSERT_TRUE(client.ok()) << client.status().ToString();
      net::CommOptions o;
      o.rank.rank = r;
      o.rank.world_size = world;
      o.backend = "gloo";
      o.timeout_s = timeout_s;
      o.store = client->get();
      o.shared_memory = shared_memory;
      auto c = net::MakeCommunicator(o);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      body(r, **c);
    });
  for (auto& t : threads) t.join();
}

}  // namespace strata::testing
