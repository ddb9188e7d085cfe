// Communicators in one process: the self backend, the factory's refusals,
// and Gloo across threads over loopback (collectives, a peer that leaves,
// the broken latch). The multi-process runs are in comm_worker.cpp.
#include "io/net/comm.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>

using namespace strata;
using namespace strata::net;
using namespace std::chrono_literals;

namespace {

TEST(SelfComm, CopiesAndNothingElse) {
  CommOptions o;
  o.backend = "self";
  auto c = MakeCommunicator(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Communicator& comm = **c;
  EXPECT_STREQ(comm.backend(), "self");
  EXPECT_FALSE(comm.device_buffers());
  float buf[3] = {1, 2, 3}, out[3] = {};
  ASSERT_TRUE(comm.AllReduce(buf, 3).ok());
  EXPECT_EQ(buf[2], 3);
  ASSERT_TRUE(comm.ReduceScatter(buf, out, 3).ok());
  EXPECT_EQ(out[1], 2);
  ASSERT_TRUE(comm.AllGather(buf, out, sizeof buf).ok());
  EXPECT_EQ(out[0], 1);
  ASSERT_TRUE(comm.Broadcast(buf, sizeof buf, 0).ok());
  ASSERT_TRUE(comm.Barrier().ok());
  Status bad = comm.Broadcast(buf, sizeof buf, 1);
  EXPECT_EQ(bad.code(), Code::kInvalid);
  EXPECT_NE(bad.message().find("self broadcast #6 (12 bytes from rank 1) on rank 0 of 1"), std::string::npos)
      << bad.ToString();
  EXPECT_EQ(comm.collectives_issued(), 6u);
}

TEST(MakeCommunicator, RefusesWhatCannotWork) {
  CommOptions o;
  o.backend = "mpi";
  auto c = MakeCommunicator(o);
  EXPECT_EQ(c.status().code(), Code::kInvalid);
  EXPECT_NE(c.status().message().find("'mpi'"), std::string::npos);
  o.backend = "self";
  o.rank.world_size = 2;
  EXPECT_EQ(MakeCommunicator(o).status().code(), Code::kInvalid);
  o.backend = "gloo";
  EXPECT_NE(MakeCommunicator(o).status().message().find("needs a rendezvous store"), std::string::npos);
  o.rank.world_size = 1;
  o.backend = "auto";
  auto a = MakeCommunicator(o);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_STREQ((*a)->backend(), NcclAvailable() ? "nccl" : "self");
  if (!NcclAvailable()) {
    o.backend = "nccl";
    EXPECT_EQ(MakeCommunicator(o).status().code(), Code::kUnsupported);
  }
}

TEST(GlooComm, OneRankWithoutAStore) {
  CommOptions o;
  o.backend = "gloo";
  o.timeout_s = 5;
  auto c = MakeCommunicator(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  float in[4] = {1, 2, 3, 4}, out[4] = {};
  ASSERT_TRUE((*c)->ReduceScatter(in, out, 4).ok());
  EXPECT_EQ(out[3], 4);
  ASSERT_TRUE((*c)->AllReduce(in, 4).ok());
  EXPECT_EQ(in[0], 1);
}

// Runs `body(rank, comm)` on `world` threads, each with a Gloo communicator
// rendezvoused through one store on a free port.
void OnThreads(int world, double timeout_s, const std::function<void(int, Communicator&)>& body) {
  auto server = StoreServer::Start("127.0.0.1", 0).value();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto client = StoreClient::Connect("127.0.0.1", server->port(), 5s).value();
      CommOptions o;
      o.rank.rank = r;
      o.rank.world_size = world;
      o.backend = "gloo";
      o.timeout_s = timeout_s;
      o.store = client.get();
      auto c = MakeCommunicator(o);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      body(r, **c);
    });
  for (auto& t : threads) t.join();
}

TEST(GlooComm, ReduceScatterMatchesAScalarSum) {
  const int world = 3;
  const size_t per = 1001;
  OnThreads(world, 10, [&](int r, Communicator& c) {
    std::vector<float> in(per * world), out(per);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>((i * 31 + r * 7) % 97);
    ASSERT_TRUE(c.ReduceScatter(in.data(), out.data(), per).ok());
    for (size_t j = 0; j < per; ++j) {
      size_t g = r * per + j;
      float want = 0;
      for (int k = 0; k < world; ++k) want += static_cast<float>((g * 31 + k * 7) % 97);
      ASSERT_EQ(out[j], want) << "rank " << r << " element " << g;
    }
  });
}

TEST(GlooComm, APeerThatLeavesBreaksTheCommunicator) {
  OnThreads(2, 2, [&](int r, Communicator& c) {
    float x = 1;
    ASSERT_TRUE(c.AllReduce(&x, 1).ok());
    if (r == 1) return;  // rank 1 leaves: its communicator is destroyed
    auto t0 = std::chrono::steady_clock::now();
    Status s = c.AllReduce(&x, 1);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
    ASSERT_FALSE(s.ok());
    EXPECT_TRUE(s.code() == Code::kComm || s.code() == Code::kTimeout) << s.ToString();
    EXPECT_NE(s.message().find("gloo all_reduce #2 (1 floats) on rank 0 of 2"), std::string::npos)
        << s.ToString();
    Status again = c.Barrier();
    EXPECT_EQ(again.code(), Code::kComm);
    EXPECT_NE(again.message().find("barrier #3"), std::string::npos) << again.ToString();
    EXPECT_NE(again.message().find("failed earlier"), std::string::npos) << again.ToString();
  });
}

}  // namespace
