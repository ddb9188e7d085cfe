// One rank of the multi-process communicator tests: reads its rank from the
// launch variables, rendezvouses through the store and runs a mode:
//   collectives  every collective with known values (53 elements padded over
//                the ranks, in place, bitwise-equal sums), and (Gloo) shared
//                memory against TCP, bitwise; exit 0 when right
//   kill         all_reduce in a loop; the victim rank SIGKILLs itself at
//                iteration 3; the others must fail naming the collective
//   hang         like kill, but the victim sleeps: the others must time out
// Prints "comm_worker rank R: ..." lines; any failure exits 1 (2 for a
// communicator error, which kill/hang expect on the survivors).
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include "io/net/comm.h"

using namespace strata;
using namespace strata::net;

namespace {

int g_rank = -1;
int g_failures = 0;

#define EXPECT(cond, ...)                                                                                \
  do {                                                                                                   \
    if (!(cond)) {                                                                                       \
      std::fprintf(stderr, "comm_worker rank %d: FAILED %s:%d %s: ", g_rank, __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                                 \
      std::fprintf(stderr, "\n");                                                                        \
      ++g_failures;                                                                                      \
    }                                                                                                    \
  } while (0)

#define EXPECT_OK(expr)                           \
  do {                                            \
    Status s_ = (expr);                           \
    EXPECT(s_.ok(), "%s", s_.ToString().c_str()); \
  } while (0)

uint32_t Next(uint32_t* x) {  // xorshift32: reproducible "random" floats
  *x ^= *x << 13;
  *x ^= *x >> 17;
  *x ^= *x << 5;
  return *x;
}

void TestAllReduce(Communicator& c) {
  const int w = c.world_size(), r = c.rank();
  std::vector<float> buf(1000);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(r * 1000 + i);
  EXPECT_OK(c.AllReduce(buf.data(), buf.size()));
  for (size_t i = 0; i < buf.size(); ++i) {
    float want = 1000.0f * w * (w - 1) / 2 + static_cast<float>(w * i);
    if (buf[i] != want) {
      EXPECT(buf[i] == want, "all_reduce[%zu] = %g, want %g", i, buf[i], want);
      break;
    }
  }
}

// Sums of fractions: rounding differs with the order, yet every rank must
// hold the same bits.
void TestAllReduceBitwiseEqual(Communicator& c) {
  const int w = c.world_size();
  std::vector<float> buf(4099);
  uint32_t seed = 12345u + 977u * static_cast<uint32_t>(c.rank());
  for (auto& v : buf) v = static_cast<float>(Next(&seed) % 100000) / 7.0f - 5000.0f;
  EXPECT_OK(c.AllReduce(buf.data(), buf.size()));
  std::vector<float> all(buf.size() * w);
  EXPECT_OK(c.AllGather(buf.data(), all.data(), buf.size() * sizeof(float)));
  for (int k = 0; k < w; ++k)
    EXPECT(std::memcmp(all.data() + k * buf.size(), buf.data(), buf.size() * sizeof(float)) == 0,
           "all_reduce result of rank %d differs bitwise from this rank's", k);
}

// A 53-element group padded to a multiple of the world size: reduce-scatter
// the padded buffer, all-gather the shards back, check values and padding.
void TestPaddedGroup(Communicator& c, bool in_place) {
  const int w = c.world_size(), r = c.rank();
  const size_t n = 53, per = (n + w - 1) / w, padded = per * w;
  std::vector<float> in(padded, 0.0f);
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<float>((r + 1) * (i + 1));
  std::vector<float> shard(per);
  float* out = in_place ? in.data() + r * per : shard.data();
  EXPECT_OK(c.ReduceScatter(in.data(), out, per));
  const float ranks_sum = static_cast<float>(w * (w + 1) / 2);
  for (size_t j = 0; j < per; ++j) {
    size_t g = r * per + j;
    float want = g < n ? ranks_sum * static_cast<float>(g + 1) : 0.0f;
    EXPECT(out[j] == want, "reduce_scatter%s shard[%zu] (element %zu) = %g, want %g",
           in_place ? " (in place)" : "", j, g, out[j], want);
  }
  std::vector<float> full(padded, -1.0f);
  if (in_place) {
    full = in;
    EXPECT_OK(c.AllGather(full.data() + r * per, full.data(), per * sizeof(float)));
  } else {
    EXPECT_OK(c.AllGather(out, full.data(), per * sizeof(float)));
  }
  for (size_t g = 0; g < padded; ++g) {
    float want = g < n ? ranks_sum * static_cast<float>(g + 1) : 0.0f;
    EXPECT(full[g] == want, "all_gather%s element %zu = %g, want %g", in_place ? " (in place)" : "", g,
           full[g], want);
  }
}

void TestLargeReduceScatter(Communicator& c) {
  const int w = c.world_size(), r = c.rank();
  const size_t per = size_t{1} << 18;  // 1 MiB a shard
  std::vector<float> in(per * w), out(per);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>((i % 1024) + r);
  EXPECT_OK(c.ReduceScatter(in.data(), out.data(), per));
  for (size_t j = 0; j < per; ++j) {
    size_t g = r * per + j;
    float want = static_cast<float>(w * (g % 1024) + w * (w - 1) / 2);
    if (out[j] != want) {
      EXPECT(out[j] == want, "large reduce_scatter[%zu] = %g, want %g", j, out[j], want);
      break;
    }
  }
}

void TestBroadcastAndBarrier(Communicator& c) {
  const int w = c.world_size(), r = c.rank(), root = w - 1;
  std::vector<uint8_t> buf(1001, 0);
  if (r == root)
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 7 + 3);
  EXPECT_OK(c.Broadcast(buf.data(), buf.size(), root));
  for (size_t i = 0; i < buf.size(); ++i)
    if (buf[i] != static_cast<uint8_t>(i * 7 + 3)) {
      EXPECT(false, "broadcast byte %zu = %d", i, buf[i]);
      break;
    }
  EXPECT_OK(c.Barrier());
  // A bad root is refused locally and leaves the communicator usable.
  Status bad = c.Broadcast(buf.data(), buf.size(), w);
  EXPECT(bad.code() == Code::kInvalid && bad.message().find("broadcast #") != std::string::npos, "%s",
         bad.ToString().c_str());
  EXPECT_OK(c.Barrier());
}

// Every rank is on this host: the reduce-scatters and all-gathers went
// through shared memory; a second communicator over TCP gives the same bits
// (sums of fractions, 3 million floats a rank: several rounds of the
// 2 MiB slots).
void TestSharedMemoryMatchesTcp(Communicator& c, const CommOptions& tcp_options) {
  EXPECT(c.shared_memory(), "ranks on one host: collectives through shared memory");
  auto tcp = MakeCommunicator(tcp_options);
  if (!tcp.ok()) {
    EXPECT(tcp.ok(), "%s", tcp.status().ToString().c_str());
    return;
  }
  EXPECT(!(*tcp)->shared_memory(), "CommOptions::shared_memory false: over TCP");
  const int w = c.world_size(), r = c.rank();
  const size_t n = 3'000'000 / static_cast<size_t>(w) + 13;
  std::vector<float> in(n * w);
  uint32_t seed = 777u + 31u * static_cast<uint32_t>(r);
  for (auto& v : in) v = static_cast<float>(Next(&seed) % 100000) / 7.0f - 5000.0f;
  std::vector<float> a(n), b(n), ga(n * w), gb(n * w);
  EXPECT_OK(c.ReduceScatter(in.data(), a.data(), n));
  EXPECT_OK((*tcp)->ReduceScatter(in.data(), b.data(), n));
  EXPECT(std::memcmp(a.data(), b.data(), n * 4) == 0, "reduce_scatter: shared memory and TCP differ bitwise");
  EXPECT_OK(c.AllGather(a.data(), ga.data(), n * 4));
  EXPECT_OK((*tcp)->AllGather(b.data(), gb.data(), n * 4));
  EXPECT(std::memcmp(ga.data(), gb.data(), ga.size() * 4) == 0, "all_gather: shared memory and TCP differ");
}

int RunCollectives(Communicator& c, const CommOptions& tcp_options) {
  TestAllReduce(c);
  TestAllReduceBitwiseEqual(c);
  TestPaddedGroup(c, /*in_place=*/false);
  TestPaddedGroup(c, /*in_place=*/true);
  TestLargeReduceScatter(c);
  TestBroadcastAndBarrier(c);
  EXPECT(c.collectives_issued() == 12, "issued %llu collectives, want 12",
         static_cast<unsigned long long>(c.collectives_issued()));
  if (c.world_size() > 1 && std::strcmp(c.backend(), "gloo") == 0) TestSharedMemoryMatchesTcp(c, tcp_options);
  std::fprintf(stdout, "comm_worker rank %d: %s, %d failures\n", c.rank(), c.backend(), g_failures);
  return g_failures ? 1 : 0;
}

// The victim dies (or hangs) at iteration 3; the survivors must fail.
int RunVictim(Communicator& c, bool hang, int victim, double hang_s) {
  std::vector<float> buf(4096, 1.0f);
  for (int it = 0; it < 50; ++it) {
    if (c.rank() == victim && it == 3) {
      std::fprintf(stderr, "comm_worker rank %d: %s at iteration %d\n", c.rank(), hang ? "hanging" : "dying",
                   it);
      std::fflush(stderr);
      if (!hang) raise(SIGKILL);
      usleep(static_cast<useconds_t>(hang_s * 1e6));
      return 3;
    }
    Status s = c.AllReduce(buf.data(), buf.size());
    if (!s.ok()) {
      std::fprintf(stderr, "comm_worker rank %d: error: %s\n", c.rank(), s.ToString().c_str());
      return 2;
    }
  }
  std::fprintf(stderr, "comm_worker rank %d: finished although rank %d %s\n", c.rank(), victim,
               hang ? "hung" : "died");
  return 1;
}

// The victim's 4th collective differs from the others': `kind` "op" calls a
// small all_gather where the others all-reduce 4096 floats (before, Gloo
// aborted the process on the size mismatch); "label" calls the same
// all-reduce under another label. Every rank must fail with COMM naming both
// sides, and none may crash.
int RunDiverge(Communicator& c, int victim, const std::string& kind) {
  std::vector<float> buf(4096, 1.0f);
  for (int it = 0; it < 6; ++it) {
    c.SetLabel("iteration " + std::to_string(it));
    Status s;
    if (c.rank() == victim && it == 3) {
      if (kind == "op") {
        uint64_t mine = 7;
        std::vector<uint64_t> all(static_cast<size_t>(c.world_size()));
        s = c.AllGather(&mine, all.data(), sizeof mine);
      } else {
        c.SetLabel("something else");
        s = c.AllReduce(buf.data(), buf.size());
      }
    } else {
      s = c.AllReduce(buf.data(), buf.size());
    }
    if (!s.ok()) {
      std::fprintf(stderr, "comm_worker rank %d: error: %s\n", c.rank(), s.ToString().c_str());
      return 2;
    }
  }
  std::fprintf(stderr, "comm_worker rank %d: finished although rank %d diverged\n", c.rank(), victim);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "collectives", backend = "gloo";
  double timeout_s = 30, hang_s = 30;
  int victim = 1;
  CLI::App app{"comm test worker"};
  app.add_option("--mode", mode)->check(CLI::IsMember({"collectives", "kill", "hang", "diverge-op", "diverge-label"}));
  app.add_option("--backend", backend);
  app.add_option("--timeout", timeout_s);
  app.add_option("--victim", victim);
  app.add_option("--hang-s", hang_s);
  CLI11_PARSE(app, argc, argv);

  auto info = RankInfoFromEnv();
  if (!info.ok()) {
    std::fprintf(stderr, "comm_worker: %s\n", info.status().ToString().c_str());
    return 1;
  }
  g_rank = info->rank;
  auto fail = [&](const Status& st) {
    std::fprintf(stderr, "comm_worker rank %d: error: %s\n", g_rank, st.ToString().c_str());
    return 2;
  };
  auto store = RendezvousStore::Open(*info, Millis(static_cast<int64_t>(timeout_s * 1000)));
  if (!store.ok()) return fail(store.status());
  CommOptions o;
  o.rank = *info;
  o.backend = backend;
  o.timeout_s = timeout_s;
  o.store = &(*store)->client();
  o.prefix = "comm_worker";
  auto comm = MakeCommunicator(o);
  if (!comm.ok()) return fail(comm.status());
  CommOptions tcp = o;
  tcp.shared_memory = false;
  tcp.prefix = "comm_worker_tcp";
  if (mode == "collectives") return RunCollectives(**comm, tcp);
  if (mode.rfind("diverge-", 0) == 0) return RunDiverge(**comm, victim, mode.substr(8));
  return RunVictim(**comm, mode == "hang", victim, hang_s);
}
