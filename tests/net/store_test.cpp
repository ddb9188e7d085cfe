// The rendezvous store over loopback: set/get/add/wait, waits that block
// until another client sets the key, timeouts naming the key, and a server
// that goes away (kComm naming the store and the key).
#include "io/net/store.h"
#include "io/net/free_port.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

using namespace strata;
using namespace strata::net;
using namespace std::chrono_literals;

namespace {

struct Fixture {
  std::unique_ptr<StoreServer> server;
  std::unique_ptr<StoreClient> client;
};

// A port nobody listens on now, for a test that binds it (or connects to it)
// later (net::FreeListenPort: outside the ephemeral range).
int FreePort() {
  const int port = net::FreeListenPort(/*pair=*/false);
  if (port < 0) ADD_FAILURE() << "no free port outside the ephemeral range";
  return port < 0 ? 0 : port;
}

Fixture Start() {
  Fixture f;
  auto s = StoreServer::Start("127.0.0.1", 0);  // a free port
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  f.server = std::move(s).value();
  auto c = StoreClient::Connect("127.0.0.1", f.server->port(), 5s);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  f.client = std::move(c).value();
  return f;
}

TEST(Store, SetGetAdd) {
  auto f = Start();
  ASSERT_TRUE(f.client->Set("a", {1, 2, 3}).ok());
  auto v = f.client->Get("a", 1s);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(*v, (Bytes{1, 2, 3}));
  ASSERT_TRUE(f.client->Set("a", {}).ok());
  EXPECT_TRUE(f.client->Get("a", 1s)->empty());
  EXPECT_EQ(f.client->Add("n", 5).value(), 5);
  EXPECT_EQ(f.client->Add("n", -7).value(), -2);
  EXPECT_EQ(f.client->Get("n", 1s).value(), (Bytes{'-', '2'}));
  auto bad = f.client->Add("a", 1);  // "a" is empty, not an integer
  EXPECT_EQ(bad.status().code(), Code::kInvalid);
  EXPECT_TRUE(f.client->Wait({"a", "n"}, 1s).ok());
}

// An accept that fails for want of descriptors (EMFILE) does not stop the
// server: once descriptors are free again a new client is served. This
// process is held at its open descriptors while a child connects (the
// server's accept fails), then let go.
TEST(Store, AcceptFailingForWantOfDescriptorsResumes) {
  auto server = StoreServer::Start("127.0.0.1", 0).value();
  const int port = server->port();
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  int open_now = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++open_now;
  rlimit tight = old;
  tight.rlim_cur = static_cast<rlim_t>(open_now + 8);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0);
  std::vector<int> fillers;  // every descriptor left taken: the next one is EMFILE
  for (int fd; (fd = ::open("/dev/null", O_RDONLY)) >= 0;) fillers.push_back(fd);
  ASSERT_EQ(errno, EMFILE);
  const pid_t child = ::fork();
  if (child == 0) {  // async-signal-safe calls only: a socket to the server, held a while
    ::setrlimit(RLIMIT_NOFILE, &old);
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) ::_exit(3);
    const timespec hold{1, 0};
    ::nanosleep(&hold, nullptr);
    ::_exit(0);
  }
  ASSERT_GT(child, 0);
  std::this_thread::sleep_for(300ms);  // the server's accept of it fails meanwhile (EMFILE)
  for (int fd : fillers) ::close(fd);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  auto c = StoreClient::Connect("127.0.0.1", port, 5s);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Status st = (*c)->Set("after", {7});
  EXPECT_TRUE(st.ok()) << st.ToString();
  auto v = (*c)->Get("after", 2s);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(*v, (Bytes{7}));
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child could not connect";
}

TEST(Store, GetAndWaitBlockUntilSet) {
  auto f = Start();
  auto other = StoreClient::Connect("127.0.0.1", f.server->port(), 5s).value();
  std::atomic<bool> setting{false};
  std::thread setter([&] {
    std::this_thread::sleep_for(200ms);
    setting = true;
    EXPECT_TRUE(other->Set("late", {42}).ok());
    std::this_thread::sleep_for(100ms);
    EXPECT_TRUE(other->Add("count", 1).ok());
  });
  auto v = f.client->Get("late", 10s);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(*v, Bytes{42});
  EXPECT_TRUE(setting) << "Get returned before the key was set";
  EXPECT_TRUE(f.client->Wait({"late", "count"}, 10s).ok());
  setter.join();
}

TEST(Store, TimeoutsNameTheKeyAndTheSeconds) {
  auto f = Start();
  auto v = f.client->Get("never", 300ms);
  ASSERT_EQ(v.status().code(), Code::kTimeout) << v.status().ToString();
  EXPECT_NE(v.status().message().find("'never'"), std::string::npos) << v.status().ToString();
  EXPECT_NE(v.status().message().find("0.3 s"), std::string::npos) << v.status().ToString();
  ASSERT_TRUE(f.client->Set("here", {1}).ok());
  Status w = f.client->Wait({"here", "absent"}, 200ms);
  EXPECT_EQ(w.code(), Code::kTimeout);
  EXPECT_NE(w.message().find("waiting for 'absent'"), std::string::npos) << w.ToString();
  // The connection stays usable after a server-side timeout.
  EXPECT_TRUE(f.client->Get("here", 1s).ok());
}

TEST(Store, ServerGoneIsCommNamingStoreAndKey) {
  auto f = Start();
  std::string addr = f.client->address();
  Status blocked;
  std::thread waiter([&] { blocked = f.client->Get("k", 20s).status(); });
  std::this_thread::sleep_for(200ms);
  f.server->Stop();
  waiter.join();
  EXPECT_EQ(blocked.code(), Code::kComm) << blocked.ToString();
  EXPECT_NE(blocked.message().find("store " + addr), std::string::npos) << blocked.ToString();
  EXPECT_NE(blocked.message().find("get 'k'"), std::string::npos) << blocked.ToString();
}

TEST(Store, ConnectRetriesUntilTheServerListens) {
  // Find a free port, then start the server on it a little after the client.
  int port = FreePort();
  ASSERT_NE(port, 0);
  std::unique_ptr<StoreServer> server;
  std::thread later([&] {
    std::this_thread::sleep_for(300ms);
    server = StoreServer::Start("127.0.0.1", port).value();
  });
  auto c = StoreClient::Connect("127.0.0.1", port, 10s);
  later.join();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE((*c)->Set("x", {1}).ok());
}

TEST(Store, UnreachableIsCommNamingTheAddress) {
  int port = FreePort();  // nobody listens there
  ASSERT_NE(port, 0);
  auto c = StoreClient::Connect("127.0.0.1", port, 300ms);
  ASSERT_EQ(c.status().code(), Code::kComm);
  EXPECT_NE(c.status().message().find("127.0.0.1:" + std::to_string(port)), std::string::npos);
  EXPECT_NE(c.status().message().find("no answer within 0.3 s"), std::string::npos) << c.status().ToString();
}

// A child of fork (a data loader's worker) or a program it runs keeps no
// copy of the server's sockets: a rank's store stopped while such a child
// lives leaves the port free for the next job (a child's listener kept it:
// "port ... is in use"), and its clients see the connection close.
TEST(Store, AChildOfForkKeepsNoneOfTheServersSockets) {
  auto f = Start();
  ASSERT_TRUE(f.client->Set("a", {1}).ok());  // a session open on the server
  const int port = f.server->port();
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(60);  // (gone even if the parent fails before its kill)
    (void)!::write(ready[1], "x", 1);  // (fork has returned here: the fork handlers ran)
    ::pause();
    ::_exit(0);
  }
  char x = 0;
  ASSERT_EQ(::read(ready[0], &x, 1), 1);
  ::close(ready[0]);
  ::close(ready[1]);
  f.server.reset();  // stopped while the child lives
  auto again = StoreServer::Start("127.0.0.1", port);
  EXPECT_TRUE(again.ok()) << again.status().ToString();
  // The old session's peer saw its connection close, not a silent server.
  auto gone = f.client->Get("a", 2s);
  EXPECT_FALSE(gone.ok());
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
}

TEST(Store, PortInUseIsNamed) {
  auto first = StoreServer::Start("127.0.0.1", 0).value();
  auto second = StoreServer::Start("127.0.0.1", first->port());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), Code::kComm);
  EXPECT_NE(second.status().message().find("port " + std::to_string(first->port()) + " is in use"), std::string::npos)
      << second.status().ToString();
  EXPECT_NE(second.status().message().find("MASTER_PORT"), std::string::npos);
}

TEST(Store, RendezvousStoreOnRankZeroAndOne) {
  RankInfo r0;
  r0.world_size = 2;
  r0.store_port = FreePort();
  ASSERT_NE(r0.store_port, 0);
  RankInfo r1 = r0;
  r1.rank = 1;
  auto s0 = RendezvousStore::Open(r0, 5s);
  ASSERT_TRUE(s0.ok()) << s0.status().ToString();
  auto s1 = RendezvousStore::Open(r1, 5s);
  ASSERT_TRUE(s1.ok()) << s1.status().ToString();
  EXPECT_NE((*s0)->server(), nullptr);
  EXPECT_EQ((*s1)->server(), nullptr);
  ASSERT_TRUE((*s1)->client().Set("from1", {9}).ok());
  EXPECT_EQ((*s0)->client().Get("from1", 1s).value(), Bytes{9});
}

// Two jobs given the same store address: a rank of the second, at the
// first's store, is refused there at once, naming both jobs, before it
// writes anything (it joined the first job's rendezvous); so is a rank
// whose world size is another. The same job is let in.
TEST(Store, ARankOfAnotherJobIsRefusedAtTheStore) {
  RankInfo r0;
  r0.world_size = 2;
  r0.store_port = FreePort();
  r0.job = "SLURM_JOB_ID=100";
  ASSERT_NE(r0.store_port, 0);
  auto s0 = RendezvousStore::Open(r0, 5s);
  ASSERT_TRUE(s0.ok()) << s0.status().ToString();
  RankInfo other = r0;
  other.rank = 1;
  other.job = "SLURM_JOB_ID=200";
  auto refused = RendezvousStore::Open(other, 5s);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kComm);
  EXPECT_NE(refused.status().message().find("is rank 0's of job SLURM_JOB_ID=100 of 2 ranks; this rank (1) is of "
                                            "job SLURM_JOB_ID=200 of 2 ranks: two jobs were given the same "
                                            "MASTER_ADDR and MASTER_PORT"),
            std::string::npos)
      << refused.status().ToString();
  RankInfo bigger = r0;
  bigger.rank = 1;
  bigger.world_size = 4;
  EXPECT_FALSE(RendezvousStore::Open(bigger, 5s).ok()) << "another world size";
  RankInfo same = r0;
  same.rank = 1;
  auto s1 = RendezvousStore::Open(same, 5s);
  ASSERT_TRUE(s1.ok()) << s1.status().ToString();
  auto keys = (*s0)->client().Get("from1", 100ms);
  EXPECT_FALSE(keys.ok()) << "nothing written by the refused ranks";
}

}  // namespace
