// Communicators in one process: the self backend, the factory's refusals,
// and Gloo across threads over loopback (collectives, a peer that leaves,
// the broken latch). The multi-process runs are in comm_worker.cpp.
#include "io/net/comm.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include "base/fork_close.h"
#include <atomic>
#include <filesystem>
#include <unistd.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstring>
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
void OnThreads(int world, double timeout_s, const std::function<void(int, Communicator&)>& body,
               bool shared_memory = true) {
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
      o.shared_memory = shared_memory;
      auto c = MakeCommunicator(o);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      body(r, **c);
    });
  for (auto& t : threads) t.join();
}

// A child of fork (a data loader's worker, a program run with system())
// keeps none of the ranks' sockets: Gloo's connections, its listener, the
// watchdog's, the store's. (Its copies hid a dead rank from the others,
// who waited out the whole timeout, and kept a stopped store's port.)
TEST(GlooComm, AChildOfForkKeepsNoneOfTheRanksSockets) {
  std::atomic<int> made{0};
  int sockets_in_child = -1;
  OnThreads(2, 20, [&](int rank, Communicator& comm) {
    ++made;
    while (made < 2) std::this_thread::yield();
    if (rank == 0) {
      const pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        int n = 0;
        for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
          std::error_code ec;
          const auto target = std::filesystem::read_symlink(e.path(), ec).string();
          if (!ec && target.rfind("socket:", 0) == 0) ++n;
        }
        ::_exit(n);
      }
      int status = 0;
      ASSERT_EQ(::waitpid(pid, &status, 0), pid);
      ASSERT_TRUE(WIFEXITED(status));
      sockets_in_child = WEXITSTATUS(status);
    }
    float x = 1;
    ASSERT_TRUE(comm.AllReduce(&x, 1).ok());  // the ranks' own connections are whole
    EXPECT_EQ(x, 2);
  });
  EXPECT_EQ(sockets_in_child, 0);
}

// Sockets another thread makes while the ranks connect (a socketpair of a
// multiprocessing.Pipe, a client elsewhere) are not taken for Gloo's: they
// stay open in children of fork, and keep no FD_CLOEXEC they did not ask for.
TEST(GlooComm, OtherThreadsSocketsMadeMeanwhileAreNotTakenForGloos) {
  std::atomic<bool> done{false};
  std::vector<int> theirs;
  std::thread app([&] {
    while (!done) {
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0) theirs.insert(theirs.end(), {sv[0], sv[1]});
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  int taken = -1;
  OnThreads(2, 20, [&](int rank, Communicator& comm) {
    float x = 1;
    ASSERT_TRUE(comm.AllReduce(&x, 1).ok());
    if (rank == 0) {  // (while both comms live: they forget theirs when they go)
      done = true;
      app.join();
      taken = 0;
      for (const int fd : theirs) taken += ClosedInForkChild(fd) ? 1 : 0;
    }
    ASSERT_TRUE(comm.AllReduce(&x, 1).ok());
  });
  done = true;
  if (app.joinable()) app.join();
  ASSERT_FALSE(theirs.empty());
  for (const int fd : theirs) ::close(fd);
  EXPECT_EQ(taken, 0) << "of " << theirs.size() << " sockets of another thread";
}

// One rank refusing its own arguments (a null buffer) makes every rank fail
// before any data moves, and the next collective is whole on every rank
// (before, the others went on into the data phase and met its next call).
TEST(GlooComm, ArgumentsOneRankRefusesFailEveryRankAndLeaveItUsable) {
  const int world = 3;
  const size_t per = 100;
  for (bool shm : {true, false})
    OnThreads(
        world, 10,
        [&](int r, Communicator& c) {
          std::vector<uint8_t> in(per, static_cast<uint8_t>(r + 1)), out(per * world, 0);
          Status st = c.AllGather(r == 1 ? nullptr : in.data(), out.data(), per);
          EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
          EXPECT_NE(st.message().find(r == 1 ? "null buffer" : "rank 1 refused"), std::string::npos) << st.ToString();
          for (uint8_t& v : in) v = static_cast<uint8_t>(10 * (r + 1));
          st = c.AllGather(in.data(), out.data(), per);
          ASSERT_TRUE(st.ok()) << st.ToString();
          for (int q = 0; q < world; ++q)
            EXPECT_EQ(out[static_cast<size_t>(q) * per + per - 1], 10 * (q + 1)) << "rank " << r << " from " << q;
        },
        shm);
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

// A reduce-scatter of an input in pieces (gaps read as zeros, a stride
// wider than the parts, an offset) is the same bits as the reduce-scatter
// of its packing, over shared memory (read in place: reads_pieces) and over
// TCP (gathered first), and with the self backend; parts that overlap (a
// stride below n) are refused, naming it.
TEST(GlooComm, ReduceScatterOfPiecesIsTheReduceScatterOfTheirPacking) {
  const size_t per = 1001, stride = per + 5, first = 3;
  auto fill = [&](int r, int world, std::vector<float>& whole, FloatPieces& pieces, std::vector<float>& packed) {
    whole.assign(stride * static_cast<size_t>(world) + first, 0.0f);
    for (size_t i = 0; i < whole.size(); ++i)
      if (i % 50 >= 4) whole[i] = static_cast<float>((i * 31 + static_cast<size_t>(r) * 7) % 97) / 3.0f;
    for (size_t at = 0; at < whole.size(); at += 50)  // pieces [at + 4, at + 50): gaps of 4
      ASSERT_TRUE(pieces.Add(at + 4, std::min<size_t>(46, whole.size() - std::min(whole.size(), at + 4)),
                             whole.data() + std::min(whole.size(), at + 4)));
    packed.assign(per * static_cast<size_t>(world), 0.0f);
    for (int d = 0; d < world; ++d)
      std::copy_n(whole.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(d) * stride + first), per,
                  packed.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(d) * per));
  };
  for (bool shm : {true, false})
    OnThreads(
        3, 10,
        [&](int r, Communicator& c) {
          EXPECT_EQ(c.reads_pieces(), shm);
          std::vector<float> whole, packed, got(per, -1.0f), want(per, -2.0f);
          FloatPieces pieces;
          fill(r, 3, whole, pieces, packed);
          Status st = c.ReduceScatterPieces(pieces, stride, first, got.data(), per);
          ASSERT_TRUE(st.ok()) << st.ToString();
          ASSERT_TRUE(c.ReduceScatter(packed.data(), want.data(), per).ok());
          EXPECT_EQ(std::memcmp(got.data(), want.data(), per * 4), 0) << (shm ? "shm" : "tcp") << " rank " << r;
          st = c.ReduceScatterPieces(pieces, per - 1, first, got.data(), per);
          EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
          EXPECT_NE(st.message().find("overlap"), std::string::npos) << st.ToString();
        },
        shm);
  CommOptions o;
  o.backend = "self";
  auto c = MakeCommunicator(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  std::vector<float> whole, packed, got(per, -1.0f);
  FloatPieces pieces;
  fill(0, 1, whole, pieces, packed);
  ASSERT_TRUE((*c)->ReduceScatterPieces(pieces, stride, first, got.data(), per).ok());
  EXPECT_EQ(std::memcmp(got.data(), packed.data(), per * 4), 0);
}

TEST(GlooComm, APeerThatLeavesBreaksTheCommunicator) {
  // The timeout bounds the rendezvous and the first all-reduce too: generous,
  // for a slow and loaded machine. No time is compared here (CI machines
  // are loaded): a hang meets ctest's timeout, and the status says how the
  // failure was found.
  constexpr auto timeout = 10s;
  OnThreads(2, std::chrono::duration<double>(timeout).count(), [&](int r, Communicator& c) {
    float x = 1;
    ASSERT_TRUE(c.AllReduce(&x, 1).ok());
    if (r == 1) return;  // rank 1 leaves: its communicator is destroyed
    Status s = c.AllReduce(&x, 1);
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
