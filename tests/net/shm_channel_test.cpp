// ShmChannel across threads (each rank its own mapping, descriptor and
// lock) and across a fork: the sums in Gloo's ring order at 2-4 ranks over
// many rounds, in place and not; a peer that exited fails the wait at once;
// one that hangs times out; a segment of another shape is refused; nothing
// is left in /dev/shm.
#include "io/net/shm_channel.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>

using namespace strata;
using namespace strata::net;
using namespace std::chrono_literals;

namespace {

constexpr uint64_t kSlot = 4096;  // small: a few thousand floats take several rounds

ShmChannel::Deadline In(std::chrono::milliseconds ms) { return std::chrono::steady_clock::now() + ms; }

// Rank 0's channel and the others', opened on the name.
std::vector<std::unique_ptr<ShmChannel>> Channels(int world, uint64_t slot = kSlot) {
  std::string name;
  auto c0 = ShmChannel::Create(world, slot, &name);
  EXPECT_TRUE(c0.ok()) << c0.status().ToString();
  std::vector<std::unique_ptr<ShmChannel>> out;
  if (!c0.ok()) return out;
  out.push_back(std::move(*c0));
  for (int r = 1; r < world; ++r) {
    auto c = ShmChannel::Open(name, r, world, slot);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return {};
    out.push_back(std::move(*c));
  }
  out[0]->Unlink();
  return out;
}

// Runs fn(rank) on one thread per rank.
void OnRanks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) ts.emplace_back(fn, r);
  for (auto& t : ts) t.join();
}

float Value(int rank, size_t i) {  // fractions: a sum's bits depend on its order
  uint32_t x = static_cast<uint32_t>(rank * 7919 + i * 104729 + 1);
  x ^= x << 13;
  x ^= x >> 17;
  x ^= x << 5;
  return static_cast<float>(x % 100000) / 7.0f - 5000.0f;
}

TEST(ShmChannel, ReduceScatterAddsInTheRingsOrderAndAllGatherCopies) {
  for (int world : {2, 3, 4})
    for (size_t n : {size_t{0}, size_t{1}, size_t{53}, size_t{1000}, size_t{5000}})
      for (bool in_place : {false, true}) {
        auto ch = Channels(world);
        ASSERT_EQ(ch.size(), static_cast<size_t>(world));
        std::vector<std::vector<float>> in(world), out(world);
        for (int r = 0; r < world; ++r) {
          in[r].resize(n * world);
          for (size_t i = 0; i < in[r].size(); ++i) in[r][i] = Value(r, i);
          out[r].assign(n, -1.0f);
        }
        const auto orig = in;
        std::vector<Status> st(world);
        OnRanks(world, [&](int r) {
          float* o = in_place ? in[r].data() + r * n : out[r].data();
          st[r] = ch[r]->ReduceScatter(in[r].data(), o, n, In(20s));
          if (st[r].ok() && !in_place) std::memcpy(in[r].data() + r * n, o, n * 4);
          // All-gather the shards back (in place), through the same slots.
          if (st[r].ok()) st[r] = ch[r]->AllGather(in[r].data() + r * n, in[r].data(), n * 4, In(20s));
        });
        for (int r = 0; r < world; ++r) {
          ASSERT_TRUE(st[r].ok()) << st[r].ToString();
          for (int s = 0; s < world; ++s)  // every rank holds every shard
            for (size_t i = 0; i < n; ++i) {
              float want = orig[(s + 1) % world][s * n + i];  // rank s's sum: s+1, s+2, ..., s
              for (int j = 2; j <= world; ++j) want += orig[(s + j) % world][s * n + i];
              ASSERT_EQ(std::memcmp(&in[r][s * n + i], &want, 4), 0)
                  << "world " << world << " n " << n << (in_place ? " in place" : "") << ": rank " << r
                  << " element " << i << " of shard " << s << " = " << in[r][s * n + i] << ", want " << want;
            }
        }
      }
}

// FloatPieces alone: pieces added in any order are kept sorted, one that
// overlaps is refused and changes nothing, Read fills gaps with zeros
// across piece ends, and Find answers only a range one piece holds whole.
TEST(FloatPieces, ReadsAcrossPiecesAndGapsAndRefusesOverlaps) {
  std::vector<float> a(10), b(5);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 1.0f + static_cast<float>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = 100.0f + static_cast<float>(i);
  FloatPieces p;
  ASSERT_TRUE(p.Add(20, 5, b.data()));  // [20, 25)
  ASSERT_TRUE(p.Add(3, 10, a.data()));  // [3, 13)
  ASSERT_TRUE(p.Add(7, 0, a.data()));   // empty: not kept
  EXPECT_FALSE(p.Add(12, 2, b.data()));  // overlaps [3, 13)'s end
  EXPECT_FALSE(p.Add(0, 4, b.data()));   // overlaps its start
  EXPECT_FALSE(p.Add(24, 9, a.data()));  // overlaps [20, 25)
  ASSERT_EQ(p.pieces().size(), 2u);
  EXPECT_EQ(p.pieces()[0].first, 3u);
  EXPECT_EQ(p.pieces()[1].first, 20u);
  std::vector<float> got(30, -1.0f), want(30, 0.0f);
  for (int i = 0; i < 10; ++i) want[3 + i] = a[i];
  for (int i = 0; i < 5; ++i) want[20 + i] = b[i];
  for (uint64_t at : {0, 2, 3, 5, 12, 13, 19, 22, 25})
    for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{4}, uint64_t{11}, 29 - at}) {
      if (at + n > 29) continue;
      std::fill(got.begin(), got.end(), -1.0f);
      p.Read(at, n, got.data());
      for (uint64_t i = 0; i < n; ++i)
        ASSERT_EQ(got[i], want[at + i]) << "Read(" << at << ", " << n << ")[" << i << "]";
      EXPECT_EQ(got[n], -1.0f) << "Read(" << at << ", " << n << ") wrote past its end";
    }
  EXPECT_EQ(p.Find(3, 10), a.data());
  EXPECT_EQ(p.Find(5, 2), a.data() + 2);
  EXPECT_EQ(p.Find(21, 4), b.data() + 1);
  EXPECT_EQ(p.Find(2, 2), nullptr);    // starts in a gap
  EXPECT_EQ(p.Find(12, 2), nullptr);   // runs past the piece
  EXPECT_EQ(p.Find(13, 1), nullptr);   // in a gap
  EXPECT_EQ(p.Find(24, 2), nullptr);   // past the last piece
}

// A reduce-scatter of an input in pieces (a gradient lent a parameter at a
// time, out of order, with gaps and rank parts that cross pieces) is the
// same bits as the reduce-scatter of the same input packed, at 2-4 ranks,
// over many rounds, with a stride wider than the parts (a bucket's columns).
TEST(ShmChannel, ReduceScatterOfPiecesIsTheReduceScatterOfTheirPackingBitwise) {
  for (int world : {2, 3, 4})
    for (size_t n : {size_t{1}, size_t{53}, size_t{1000}, size_t{5000}}) {
      const size_t stride = n + 37, first = 11, total = stride * world + first;
      auto ch = Channels(world);
      ASSERT_EQ(ch.size(), static_cast<size_t>(world));
      // Rank r's array: every element but those in gaps (every 97th run of
      // 13); its pieces cut at uneven places, added last to first.
      std::vector<std::vector<float>> whole(world), packed(world), out(world), want(world);
      std::vector<FloatPieces> pieces(world);
      for (int r = 0; r < world; ++r) {
        whole[r].resize(total);
        for (size_t i = 0; i < total; ++i) whole[r][i] = (i % 97) < 13 ? 0.0f : Value(r, i);
        std::vector<std::pair<size_t, size_t>> cuts;
        for (size_t at = 0; at < total;) {
          size_t len = std::min(total - at, size_t{1} + (at * 7 + 3 * r) % 211);
          if (at % 97 < 13) len = std::min(len, 13 - at % 97);  // a gap: no piece
          else cuts.push_back({at, len});
          at += len;
        }
        for (auto c = cuts.rbegin(); c != cuts.rend(); ++c)
          ASSERT_TRUE(pieces[r].Add(c->first, c->second, whole[r].data() + c->first));
        packed[r].resize(n * world);
        for (int d = 0; d < world; ++d)
          std::memcpy(packed[r].data() + d * n, whole[r].data() + d * stride + first, n * 4);
        out[r].assign(n, -1.0f);
        want[r].assign(n, -2.0f);
      }
      std::vector<Status> st(world);
      OnRanks(world, [&](int r) {
        st[r] = ch[r]->ReduceScatter(pieces[r], stride, first, out[r].data(), n, In(20s));
        if (st[r].ok()) st[r] = ch[r]->ReduceScatter(packed[r].data(), want[r].data(), n, In(20s));
      });
      for (int r = 0; r < world; ++r) {
        ASSERT_TRUE(st[r].ok()) << st[r].ToString();
        ASSERT_EQ(std::memcmp(out[r].data(), want[r].data(), n * 4), 0)
            << "world " << world << " n " << n << " rank " << r;
      }
    }
}

TEST(ShmChannel, AllGatherOfBytesAcrossRoundsOutOfPlace) {
  const int world = 3;
  auto ch = Channels(world);
  ASSERT_EQ(ch.size(), 3u);
  const size_t bytes = 3 * kSlot + 17;
  std::vector<std::vector<uint8_t>> in(world), out(world);
  for (int r = 0; r < world; ++r) {
    in[r].resize(bytes);
    for (size_t i = 0; i < bytes; ++i) in[r][i] = static_cast<uint8_t>(i * 31 + r * 7);
    out[r].assign(bytes * world, 0);
  }
  std::vector<Status> st(world);
  OnRanks(world, [&](int r) {
    for (int rep = 0; rep < 3 && st[r].ok(); ++rep) st[r] = ch[r]->AllGather(in[r].data(), out[r].data(), bytes, In(20s));
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].ToString();
    for (int s = 0; s < world; ++s)
      EXPECT_EQ(std::memcmp(out[r].data() + s * bytes, in[s].data(), bytes), 0) << "rank " << r << ", shard " << s;
  }
}

// Rank 1 (a child process) opens the segment, forks a child of its own that
// lives on, and exits: rank 0's wait finds rank 1's lock gone and fails at
// once, naming it, long before the deadline.
TEST(ShmChannel, APeerThatExitedFailsTheWaitAtOnce) {
  std::string name;
  auto c0 = ShmChannel::Create(2, kSlot, &name);
  ASSERT_TRUE(c0.ok()) << c0.status().ToString();
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto c1 = ShmChannel::Open(name, 1, 2, kSlot);
    // A child of the rank (a DataLoader worker, say) outlives it: it must
    // not keep the rank's lock.
    const pid_t grandchild = fork();
    if (grandchild == 0) {
      sleep(30);
      _exit(0);
    }
    const std::string pid = std::to_string(grandchild);
    if (write(pipefd[1], pid.data(), pid.size()) < 0) _exit(2);
    _exit(c1.ok() ? 0 : 1);
  }
  close(pipefd[1]);
  char pid_text[32] = {};
  ASSERT_GT(read(pipefd[0], pid_text, sizeof pid_text - 1), 0);
  close(pipefd[0]);
  const pid_t grandchild = static_cast<pid_t>(std::stol(pid_text));
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child could not open " << name;
  (*c0)->Unlink();
  std::vector<float> buf(2 * 100, 1.0f);
  // "At once": found by the lock (COMM naming the exit), not by the deadline
  // (TIMEOUT), which no time comparison needs to tell on a loaded machine.
  Status st = (*c0)->AllGather(buf.data(), buf.data(), 400, In(20s));
  EXPECT_EQ(st.code(), Code::kComm) << st.ToString() << " (TIMEOUT: the rank's child kept its lock?)";
  EXPECT_NE(st.message().find("rank 1 closed its shared memory (it exited)"), std::string::npos) << st.ToString();
  kill(grandchild, SIGKILL);
}

// Rank 1 lives but never calls: rank 0 times out at its deadline, naming it.
TEST(ShmChannel, APeerThatHangsTimesOut) {
  auto ch = Channels(2);
  ASSERT_EQ(ch.size(), 2u);
  std::vector<float> in(2 * 64, 1.0f), out(64);
  Status st = ch[0]->ReduceScatter(in.data(), out.data(), 64, In(300ms));
  EXPECT_EQ(st.code(), Code::kTimeout) << st.ToString();
  EXPECT_NE(st.message().find("timed out in shared memory waiting for rank 1"), std::string::npos) << st.ToString();
}

TEST(ShmChannel, ASegmentOfAnotherShapeOrNameIsRefusedAndNothingIsLeft) {
  std::string name;
  {
    auto c0 = ShmChannel::Create(2, kSlot, &name);
    ASSERT_TRUE(c0.ok()) << c0.status().ToString();
    EXPECT_TRUE(std::filesystem::exists("/dev/shm" + name));
    auto other = ShmChannel::Open(name, 1, 3, kSlot);
    EXPECT_EQ(other.status().code(), Code::kComm) << "3 ranks on a segment of 2";
    auto slots = ShmChannel::Open(name, 1, 2, 2 * kSlot);
    EXPECT_EQ(slots.status().code(), Code::kComm) << "other slots";
    auto rank = ShmChannel::Open(name, 0, 2, kSlot);
    EXPECT_EQ(rank.status().code(), Code::kInvalid) << "rank 0 creates, never opens";
    EXPECT_EQ(ShmChannel::Create(2, 1000, &name).status().code(), Code::kInvalid) << "slots under 4096 bytes";
  }
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + name)) << "rank 0's channel removes its name";
  auto gone = ShmChannel::Open(name, 1, 2, kSlot);
  EXPECT_EQ(gone.status().code(), Code::kComm);
  EXPECT_NE(gone.status().message().find("shm_open"), std::string::npos) << gone.status().ToString();
}

// A segment others may open (another user's, or one made 0666 to read or
// change what the ranks write) is refused, whatever its header says.
TEST(ShmChannel, ASegmentOthersMayOpenIsRefused) {
  std::string name;
  auto c0 = ShmChannel::Create(2, kSlot, &name);
  ASSERT_TRUE(c0.ok()) << c0.status().ToString();
  ASSERT_EQ(::chmod(("/dev/shm" + name).c_str(), 0666), 0);
  auto opened = ShmChannel::Open(name, 1, 2, kSlot);
  EXPECT_EQ(opened.status().code(), Code::kComm);
  EXPECT_NE(opened.status().message().find("mode 0666"), std::string::npos) << opened.status().ToString();
  ASSERT_EQ(::chmod(("/dev/shm" + name).c_str(), 0600), 0);
  EXPECT_TRUE(ShmChannel::Open(name, 1, 2, kSlot).ok()) << "the same segment, 0600: this job's";
}

// A segment whose creator was killed before its unlink (a launcher stopping
// the job then) is removed by the next Create; one whose creator lives (the
// test's parent stands for another job's rank 0) is left, as is a name of
// another scheme. Before, each such kill left its segment in /dev/shm.
TEST(ShmChannel, ASegmentLeftByACreatorThatIsGoneIsRemovedAtTheNextCreate) {
  const pid_t dead = fork();
  ASSERT_GE(dead, 0);
  if (dead == 0) _exit(0);
  ASSERT_EQ(waitpid(dead, nullptr, 0), dead);
  auto make = [](const std::string& name) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    EXPECT_GE(fd, 0) << name;
    if (fd >= 0) close(fd);
  };
  char stale[64], live[64];
  std::snprintf(stale, sizeof stale, "/strata-%d-%08x%08x", static_cast<int>(dead), 0xdeadbeefu, 0x1234u);
  std::snprintf(live, sizeof live, "/strata-%d-%08x%08x", static_cast<int>(getppid()), 0xfeedu, 0x1234u);
  const std::string other = "/strata-" + std::to_string(dead) + "-not-ours";
  make(stale);
  make(live);
  make(other);
  std::string name;
  auto c = ShmChannel::Create(2, kSlot, &name);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_FALSE(std::filesystem::exists(std::string("/dev/shm") + stale)) << "left by a creator that is gone";
  EXPECT_TRUE(std::filesystem::exists(std::string("/dev/shm") + live)) << "its creator lives";
  EXPECT_TRUE(std::filesystem::exists("/dev/shm" + other)) << "another scheme's name";
  EXPECT_TRUE(std::filesystem::exists("/dev/shm" + name));
  shm_unlink(stale);
  shm_unlink(live);
  shm_unlink(other.c_str());
}

}  // namespace
