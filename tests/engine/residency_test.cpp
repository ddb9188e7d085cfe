// Residency (engine/residency/residency.h) alone: a fake source of P that
// fills each copy with its group's pattern and logs its loads, a real device
// tier (host arena) and a real stats recorder. Fetched data, the budget, the
// eviction order (least recently used while the first step records its
// trace, then the copy used farthest ahead: checked against a simulation of
// Belady's rule written here), pins, NOMEM, load failures, the prefetch
// thread and its hits, sharded fetches with a Gatherer, gathers ahead, and
// home mode.
#include "engine/residency/residency.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "base/sizes.h"

namespace strata {
namespace {

using namespace std::chrono_literals;

// Word i of group g's copy: differs between groups and between words.
uint32_t Pattern(int g, uint64_t i) {
  return static_cast<uint32_t>(g + 1) * 0x9E3779B1u ^ static_cast<uint32_t>(i * 2654435761u + 17);
}

// Empty when `copy` holds group g's pattern over `bytes`; else the first bad word.
std::string CheckPattern(int g, const void* copy, uint64_t bytes) {
  const auto* w = static_cast<const uint32_t*>(copy);
  for (uint64_t i = 0; i < bytes / 4; ++i)
    if (w[i] != Pattern(g, i)) {
      std::ostringstream o;
      o << "group " << g << " word " << i << ": " << w[i] << ", expected " << Pattern(g, i);
      return o.str();
    }
  return "";
}

std::string Join(const std::vector<int>& v) {
  std::ostringstream o;
  o << "{";
  for (size_t i = 0; i < v.size(); ++i) o << (i ? "," : "") << v[i];
  o << "}";
  return o.str();
}

// P's home, faked: Load writes the group's pattern and logs the group and the
// loading thread. It can fail a group's next loads (after scribbling on the
// copy, so that a copy handed out after a failure shows) and hold a group's
// loads until released, to test what runs while a load is in flight.
class FakeSource final : public PSource {
 public:
  explicit FakeSource(std::function<uint64_t(int)> bytes) : bytes_(std::move(bytes)) {}

  Status Load(int g, void* copy) override {
    std::unique_lock<std::mutex> lock(mu_);
    loads_.push_back(g);
    threads_.push_back(std::this_thread::get_id());
    ++in_load_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return blocked_.count(g) == 0; });
    --in_load_;
    const uint64_t bytes = bytes_(g);
    if (auto it = failures_.find(g); it != failures_.end() && it->second > 0) {
      --it->second;
      lock.unlock();
      std::memset(copy, 0xAB, bytes);
      return IoError("fake source: load of group " + std::to_string(g) + " failed");
    }
    lock.unlock();
    auto* w = static_cast<uint32_t*>(copy);
    for (uint64_t i = 0; i < bytes / 4; ++i) w[i] = Pattern(g, i);
    return Status::Ok();
  }

  void Block(int g) {
    std::lock_guard<std::mutex> lock(mu_);
    blocked_.insert(g);
  }
  void Unblock(int g) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocked_.erase(g);
    }
    cv_.notify_all();
  }
  void FailNext(int g, int times) {
    std::lock_guard<std::mutex> lock(mu_);
    failures_[g] = times;
  }
  // Waits until at least n loads have begun. The bound only keeps a broken
  // residency from hanging the suite; no result depends on it.
  bool WaitForLoads(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, 20s, [&] { return loads_.size() >= n; });
  }
  std::vector<int> loads() const {
    std::lock_guard<std::mutex> lock(mu_);
    return loads_;
  }
  std::vector<std::thread::id> threads() const {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_;
  }
  int LoadsOf(int g) const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(std::count(loads_.begin(), loads_.end(), g));
  }

 private:
  const std::function<uint64_t(int)> bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> loads_;
  std::vector<std::thread::id> threads_;
  std::set<int> blocked_;
  std::map<int, int> failures_;
  int in_load_ = 0;
};

// A residency over `sizes` (bytes per group) with a device tier of `budget`.
struct Rig {
  Rig(std::vector<uint64_t> sizes, uint64_t budget, bool pool = false, uint64_t window = 0, bool sharded = false,
      Gatherer gatherer = {}, std::function<void*(int)> home = nullptr, bool keep_gathered = false, int shards = 1,
      int shard_rank = 0)
      : sizes(std::move(sizes)), source([this](int g) { return this->sizes[static_cast<size_t>(g)]; }) {
    auto d = DeviceTier::Create({.budget = budget, .device = 0, .force_host_arena = true, .pool = pool});
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    device = std::move(*d);
    ResidencyOptions o;
    o.groups = static_cast<int>(this->sizes.size());
    o.bytes = [this](int g) { return this->sizes[static_cast<size_t>(g)]; };
    o.window = window;
    o.sharded = sharded;
    o.home = std::move(home);
    o.keep_gathered = keep_gathered;
    o.shards = shards;
    o.shard_rank = shard_rank;
    residency = std::make_unique<Residency>(std::move(o), *device, source, stats, std::move(gatherer));
  }
  ~Rig() {
    residency.reset();
    EXPECT_EQ(device->pool_stats().in_use, 0u) << "the residency's destructor frees every copy";
  }
  uint64_t bytes(int g) const { return sizes[static_cast<size_t>(g)]; }

  // Fetches g and checks its data; returns the pointer (null on failure).
  void* FetchChecked(int g) {
    auto p = residency->Fetch(g);
    EXPECT_TRUE(p.ok()) << "fetch " << g << ": " << p.status().ToString();
    if (!p.ok()) return nullptr;
    EXPECT_EQ(CheckPattern(g, *p, bytes(g)), "");
    return *p;
  }
  void ReleaseOk(int g) {
    Status st = residency->Release(g);
    EXPECT_TRUE(st.ok()) << "release " << g << ": " << st.ToString();
  }
  // Fetches and releases g, then gathers it ahead as the communication
  // thread would (PinForAhead, EndAhead(true)); returns its copy.
  void* HoldAhead(int g) {
    void* p = FetchChecked(g);
    ReleaseOk(g);
    EXPECT_EQ(residency->PinForAhead(g), p) << "group " << g << " is resident and not gathered";
    residency->EndAhead(g, true);
    return p;
  }

  std::vector<uint64_t> sizes;
  FakeSource source;
  StatsRecorder stats{0, ""};
  std::unique_ptr<DeviceTier> device;
  std::unique_ptr<Residency> residency;
};

constexpr uint64_t kS = 4096;  // a copy: a multiple of the device tier's 256-byte granularity

// One step of the trainer: fetches and releases in order.
struct Op {
  bool fetch;
  int g;
};
std::vector<Op> FetchRelease(const std::vector<int>& order) {
  std::vector<Op> ops;
  for (int g : order) {
    ops.push_back({true, g});
    ops.push_back({false, g});
  }
  return ops;
}

enum class Policy { kLruThenFarthest, kLruAlways, kIgnorePins };

// The loads expected when `step` runs `steps` times with room for `k` copies
// of equal size and nothing prefetched: on a miss with no room, the unpinned
// copy used least recently goes in the first step (no trace yet), then the
// one whose next use in the repeated trace (the first step's fetches) is
// farthest. The other policies exist to show that a script tells them apart.
// Returns the loads in order; empty when a fetch would find every copy pinned.
std::vector<int> SimulateLoads(const std::vector<Op>& step, int steps, int k, Policy policy) {
  std::vector<int> trace;
  for (const Op& op : step)
    if (op.fetch) trace.push_back(op.g);
  std::map<int, int> pins;
  std::map<int, uint64_t> last_use;  // resident copies -> their latest fetch
  uint64_t clock = 0;
  std::vector<int> loads;
  for (int s = 0; s < steps; ++s) {
    size_t pos = 0;  // fetches of this step so far
    for (const Op& op : step) {
      if (!op.fetch) {
        --pins[op.g];
        continue;
      }
      ++pos;
      if (!last_use.count(op.g)) {
        if (static_cast<int>(last_use.size()) == k) {
          // The future as the schedule sees it: the rest of this step, then the trace again.
          std::vector<int> future(trace.begin() + static_cast<long>(pos), trace.end());
          future.insert(future.end(), trace.begin(), trace.end());
          int victim = -1;
          uint64_t best = 0;
          for (const auto& [h, used] : last_use) {
            if (pins[h] > 0 && policy != Policy::kIgnorePins) continue;
            uint64_t score;
            if (s == 0 || policy == Policy::kLruAlways) {
              score = UINT64_MAX - used;
            } else {
              score = static_cast<uint64_t>(std::find(future.begin(), future.end(), h) - future.begin());
            }
            if (victim < 0 || score > best) victim = h, best = score;
          }
          if (victim < 0) return {};
          last_use.erase(victim);
        }
        loads.push_back(op.g);
      }
      last_use[op.g] = ++clock;
      ++pins[op.g];
    }
  }
  return loads;
}

// Runs the script on the residency (no prefetch thread: every load is a
// fetch's), checking each fetch's data and the budget.
void RunScript(Rig& rig, const std::vector<Op>& step, int steps) {
  for (int s = 0; s < steps; ++s) {
    for (const Op& op : step) {
      if (op.fetch) {
        ASSERT_NE(rig.FetchChecked(op.g), nullptr) << "step " << s;
      } else {
        rig.ReleaseOk(op.g);
      }
      ASSERT_LE(rig.device->used(), rig.device->budget());
    }
    rig.residency->OnStep();
  }
}

class ResidencyPool : public testing::TestWithParam<bool> {};

TEST_P(ResidencyPool, DataIsTheGroupsAndRefetchDoesNotReload) {
  Rig rig({kS, 2 * kS, 768, 3 * kS}, 16 * kS, GetParam());
  for (int g = 0; g < 4; ++g) rig.FetchChecked(g);
  EXPECT_EQ(rig.source.loads(), (std::vector<int>{0, 1, 2, 3}));
  for (int g = 0; g < 4; ++g) EXPECT_EQ(rig.residency->pins(g), 1);
  // A second fetch of a pinned copy: the same pointer, another pin, no load.
  auto again = rig.residency->Fetch(2);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(rig.residency->pins(2), 2);
  for (int g = 0; g < 4; ++g) rig.ReleaseOk(g);
  rig.ReleaseOk(2);
  for (int g = 3; g >= 0; --g) rig.FetchChecked(g);
  EXPECT_EQ(rig.source.loads(), (std::vector<int>{0, 1, 2, 3})) << "resident copies are not loaded again";
  for (int g = 0; g < 4; ++g) rig.ReleaseOk(g);
  EXPECT_LE(rig.device->peak(), rig.device->budget());
}

// The script's loads are the simulation's: least recently used in the first
// step, farthest next use after it. The simulation's LRU-only answer differs,
// so the check can fail.
TEST_P(ResidencyPool, EvictsTheCopyUsedFarthestAheadOnceATraceExists) {
  const int k = 3, steps = 3;
  const std::vector<Op> step = FetchRelease({0, 1, 2, 3, 0, 1, 4, 0, 1, 2, 3, 4});
  const std::vector<int> want = SimulateLoads(step, steps, k, Policy::kLruThenFarthest);
  ASSERT_FALSE(want.empty());
  ASSERT_NE(want, SimulateLoads(step, steps, k, Policy::kLruAlways)) << "the script tells the policies apart";
  Rig rig(std::vector<uint64_t>(5, kS), k * kS, GetParam());
  RunScript(rig, step, steps);
  EXPECT_EQ(Join(rig.source.loads()), Join(want));
  EXPECT_LE(rig.device->peak(), rig.device->budget());
  EXPECT_EQ(rig.device->peak(), k * kS) << "the budget is used, not left idle";
}

// A pinned copy is passed over even when it is the one used farthest ahead
// (or least recently, in the first step).
TEST_P(ResidencyPool, APinnedCopyIsNeverEvicted) {
  const int k = 3, steps = 3;
  // Group 2 is held from its first fetch to the step's end; group 0 from its
  // second fetch across the fetches of 3 and 4.
  const std::vector<Op> step = {{true, 0}, {false, 0}, {true, 1}, {false, 1}, {true, 2}, {true, 3},
                                {false, 3}, {true, 0}, {true, 4}, {false, 4}, {true, 1}, {false, 1},
                                {true, 3}, {false, 3}, {false, 0}, {false, 2}};
  const std::vector<int> want = SimulateLoads(step, steps, k, Policy::kLruThenFarthest);
  ASSERT_FALSE(want.empty());
  ASSERT_NE(want, SimulateLoads(step, steps, k, Policy::kIgnorePins)) << "the pins change the victims";
  Rig rig(std::vector<uint64_t>(5, kS), k * kS, GetParam());
  RunScript(rig, step, steps);
  EXPECT_EQ(Join(rig.source.loads()), Join(want));
  EXPECT_LE(rig.device->peak(), rig.device->budget());
}

INSTANTIATE_TEST_SUITE_P(Pool, ResidencyPool, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& p) { return p.param ? "pool" : "no_pool"; });

TEST(Residency, EverythingPinnedFailsWithNoMemNamingTheBudget) {
  Rig rig(std::vector<uint64_t>(3, kS), 2 * kS);
  void* p0 = rig.FetchChecked(0);
  void* p1 = rig.FetchChecked(1);
  ASSERT_TRUE(p0 && p1);
  auto r = rig.residency->Fetch(2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kNoMem) << r.status().ToString();
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("group 2"), std::string::npos) << m;
  EXPECT_NE(m.find("budget " + FormatBytes(2 * kS)), std::string::npos) << m;
  EXPECT_NE(m.find("2 groups fetched and not released"), std::string::npos) << m;
  EXPECT_EQ(rig.residency->pins(2), 0);
  EXPECT_EQ(rig.source.LoadsOf(2), 0);
  // The pinned copies are untouched.
  EXPECT_EQ(CheckPattern(0, p0, kS), "");
  EXPECT_EQ(CheckPattern(1, p1, kS), "");
  // One released: the next fetch of 2 takes its place; 1 stays.
  rig.ReleaseOk(0);
  rig.FetchChecked(2);
  EXPECT_EQ(CheckPattern(1, p1, kS), "");
  rig.FetchChecked(1);
  EXPECT_EQ(rig.source.loads(), (std::vector<int>{0, 1, 2}));
  rig.ReleaseOk(1);
  rig.ReleaseOk(1);
  rig.ReleaseOk(2);
  EXPECT_LE(rig.device->peak(), 2 * kS);
}

TEST(Residency, ReleaseOfAGroupNotFetchedIsAStateError) {
  Rig rig(std::vector<uint64_t>(4, kS), 4 * kS);
  Status st = rig.residency->Release(3);
  EXPECT_EQ(st.code(), Code::kState) << st.ToString();
  EXPECT_NE(st.message().find("group 3"), std::string::npos) << st.ToString();
  rig.FetchChecked(3);
  rig.ReleaseOk(3);
  st = rig.residency->Release(3);
  EXPECT_EQ(st.code(), Code::kState) << "a second release: " << st.ToString();
  EXPECT_EQ(rig.residency->pins(3), 0);
}

TEST(Residency, ALoadFailureSurfacesAndTheNextFetchLoadsAgain) {
  Rig rig(std::vector<uint64_t>(3, kS), 3 * kS);
  rig.FetchChecked(0);
  const uint64_t before = rig.device->pool_stats().in_use;
  rig.source.FailNext(1, 1);
  auto r = rig.residency->Fetch(1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kIo) << r.status().ToString();
  EXPECT_NE(r.status().message().find("fetch: group 1"), std::string::npos) << r.status().ToString();
  EXPECT_NE(r.status().message().find("fake source: load of group 1 failed"), std::string::npos);
  EXPECT_EQ(rig.residency->pins(1), 0);
  EXPECT_EQ(rig.device->pool_stats().in_use, before) << "the failed copy's memory is given back";
  EXPECT_EQ(rig.residency->Release(1).code(), Code::kState) << "a failed fetch holds no pin";
  rig.FetchChecked(1);  // loads again: the pattern, not the failed load's scribble
  EXPECT_EQ(rig.source.loads(), (std::vector<int>{0, 1, 1}));
  rig.ReleaseOk(0);
  rig.ReleaseOk(1);
}

// The prefetch thread's failed load leaves the group absent: the fetch loads it.
TEST(Residency, APrefetchFailureLeavesTheGroupForTheFetch) {
  Rig rig(std::vector<uint64_t>(2, kS), 2 * kS);
  rig.residency->Start();
  rig.source.FailNext(1, 1);
  rig.residency->Prefetch({1});
  ASSERT_TRUE(rig.source.WaitForLoads(1));
  rig.residency->WaitIdle();
  EXPECT_EQ(rig.device->pool_stats().in_use, 0u);
  rig.FetchChecked(1);
  EXPECT_EQ(rig.source.loads(), (std::vector<int>{1, 1}));
  const auto threads = rig.source.threads();
  EXPECT_NE(threads[0], std::this_thread::get_id()) << "the first load was the prefetch thread's";
  EXPECT_EQ(threads[1], std::this_thread::get_id()) << "the second the fetch's";
  rig.ReleaseOk(1);
}

// After the first step, OnStep names the trace's first groups within the
// window; prefetched copies are loaded by the prefetch thread and their
// fetches count as hits; the whole step is hits when the window covers it.
TEST(Residency, PrefetchAfterOnStepLoadsAheadAndCountsHits) {
  const std::vector<int> order = {2, 0, 3, 1};
  Rig rig(std::vector<uint64_t>(4, kS), 4 * kS, false, /*window=*/4 * kS);
  rig.residency->Start();
  for (int g : order) {
    rig.FetchChecked(g);
    rig.ReleaseOk(g);
  }
  EXPECT_EQ(rig.stats.Snapshot().fetches, 0u) << "fetches before a trace exists are not counted";
  const std::vector<int> ahead = rig.residency->OnStep();
  EXPECT_EQ(ahead, order) << "the window holds the whole step";
  rig.residency->WaitIdle();
  rig.residency->Drop();  // every copy gone: what the next step finds is the prefetcher's
  EXPECT_EQ(rig.device->pool_stats().in_use, 0u);
  rig.residency->Prefetch(ahead);
  ASSERT_TRUE(rig.source.WaitForLoads(8));
  rig.residency->WaitIdle();
  const std::vector<int> loads = rig.source.loads();
  EXPECT_EQ(std::vector<int>(loads.begin() + 4, loads.end()), order) << "prefetched in the trace's order";
  const auto threads = rig.source.threads();
  for (size_t i = 4; i < 8; ++i) EXPECT_NE(threads[i], std::this_thread::get_id()) << "load " << i;
  for (int g : order) {
    rig.FetchChecked(g);
    rig.ReleaseOk(g);
  }
  EXPECT_EQ(rig.source.loads().size(), 8u) << "no copy loaded twice";
  const EngineStats s = rig.stats.Snapshot();
  EXPECT_EQ(s.fetches, 4u);
  EXPECT_EQ(s.prefetch_hits, 4u);
  EXPECT_LE(rig.device->peak(), rig.device->budget());
}

// A window of one copy: each fetch queues the next group. With every copy
// dropped and nothing prefetched, the step's first fetch misses and every
// later one was queued by the fetch before it: a hit.
TEST(Residency, EachFetchQueuesTheNextWithinTheWindow) {
  const std::vector<int> order = {1, 3, 0, 2};
  Rig rig(std::vector<uint64_t>(4, kS), 4 * kS, false, /*window=*/kS);
  rig.residency->Start();
  for (int g : order) {
    rig.FetchChecked(g);
    rig.ReleaseOk(g);
  }
  EXPECT_EQ(rig.residency->OnStep(), (std::vector<int>{1})) << "one copy's window";
  rig.residency->WaitIdle();
  rig.residency->Drop();
  for (int g : order) {
    rig.FetchChecked(g);
    rig.ReleaseOk(g);
  }
  const EngineStats s = rig.stats.Snapshot();
  EXPECT_EQ(s.fetches, 4u);
  EXPECT_EQ(s.prefetch_hits, 3u);
  rig.residency->WaitIdle();
  EXPECT_EQ(rig.source.loads().size(), 8u) << Join(rig.source.loads());
}

// A fetch of a group the prefetch thread is loading waits for that load
// instead of loading it again.
TEST(Residency, AFetchDuringItsGroupsPrefetchLoadsItOnce) {
  Rig rig(std::vector<uint64_t>(2, kS), 2 * kS);
  rig.residency->Start();
  rig.source.Block(0);
  rig.residency->Prefetch({0});
  ASSERT_TRUE(rig.source.WaitForLoads(1));  // the prefetch thread is inside Load(0)
  Result<void*> fetched = InternalError("not run");
  std::thread t([&] { fetched = rig.residency->Fetch(0); });
  // The result holds whenever the fetch arrives; the pause only makes it
  // likely that it arrives while the load is in flight.
  std::this_thread::sleep_for(50ms);
  rig.source.Unblock(0);
  t.join();
  ASSERT_TRUE(fetched.ok()) << fetched.status().ToString();
  EXPECT_EQ(CheckPattern(0, *fetched, kS), "");
  EXPECT_EQ(rig.source.loads(), (std::vector<int>{0}));
  rig.ReleaseOk(0);
}

// With no room and nothing evictable but a copy being prefetched, a fetch
// waits for that load and then evicts it (never NOMEM, never a hang).
TEST(Residency, AFetchWithNoRoomWaitsForTheLoadInFlight) {
  Rig rig(std::vector<uint64_t>(2, kS), kS);
  rig.residency->Start();
  rig.source.Block(0);
  rig.residency->Prefetch({0});
  ASSERT_TRUE(rig.source.WaitForLoads(1));
  Result<void*> fetched = InternalError("not run");
  std::thread t([&] { fetched = rig.residency->Fetch(1); });
  std::this_thread::sleep_for(50ms);  // as above: likely, not required, that the fetch finds the load in flight
  rig.source.Unblock(0);
  t.join();
  ASSERT_TRUE(fetched.ok()) << fetched.status().ToString();
  EXPECT_EQ(CheckPattern(1, *fetched, kS), "");
  EXPECT_EQ(rig.source.loads(), (std::vector<int>{0, 1}));
  EXPECT_LE(rig.device->peak(), kS);
  rig.ReleaseOk(1);
}

// The prefetch thread evicts only a copy used later than the one it loads:
// with group 0 pinned and 2 resident (next used sooner than 3), prefetching
// 3 finds no room and loads nothing; prefetching 1 (next) evicts 2. The
// queue is one thread's, in order, so the load of 1 shows that 3's turn is over.
TEST(Residency, APrefetchDoesNotEvictACopyNeededSooner) {
  Rig rig(std::vector<uint64_t>(4, kS), 2 * kS);
  const std::vector<Op> step = FetchRelease({0, 1, 2, 3});
  RunScript(rig, step, 1);  // least recently used: 2 and 3 stay
  ASSERT_EQ(rig.source.loads(), (std::vector<int>{0, 1, 2, 3}));
  rig.FetchChecked(0);  // farthest ahead is 3: {0, 2}; held
  ASSERT_EQ(rig.source.loads(), (std::vector<int>{0, 1, 2, 3, 0}));
  rig.residency->WaitIdle();  // drops what the fetch queued: the thread starts with an empty queue
  rig.residency->Start();
  rig.residency->Prefetch({3, 1});
  ASSERT_TRUE(rig.source.WaitForLoads(6));
  rig.residency->WaitIdle();
  EXPECT_EQ(Join(rig.source.loads()), Join({0, 1, 2, 3, 0, 1}));
  rig.FetchChecked(1);
  EXPECT_EQ(rig.source.loads().size(), 6u) << "1 was prefetched";
  rig.ReleaseOk(1);
  rig.ReleaseOk(0);
}

// The prefetch thread and the fetches compete for a tight budget of unequal
// copies, for many steps: every fetch's data is its group's, and the tier
// never passes its budget.
TEST_P(ResidencyPool, UnderPrefetchTheBudgetHoldsAndDataIsRight) {
  const std::vector<uint64_t> sizes = {kS, 2 * kS, kS, 3 * kS, kS, 256};
  const uint64_t budget = 4 * kS;
  Rig rig(sizes, budget, GetParam(), /*window=*/3 * kS);
  rig.residency->Start();
  const std::vector<int> order = {0, 1, 2, 3, 4, 1, 5, 3, 0};
  for (int s = 0; s < 25; ++s) {
    for (int g : order) {
      ASSERT_NE(rig.FetchChecked(g), nullptr) << "step " << s;
      ASSERT_LE(rig.device->used(), budget);
      rig.ReleaseOk(g);
    }
    rig.residency->Prefetch(rig.residency->OnStep());
  }
  rig.residency->WaitIdle();
  EXPECT_LE(rig.device->peak(), budget);
  EXPECT_EQ(rig.stats.Snapshot().fetches, 24u * order.size());
}

// --- Sharded P: fetches gather ---

struct GatherLog {
  std::mutex mu;
  std::vector<int> gathers, before;
  std::vector<int> queued_ahead;
  int fail_next = -1;  // group whose next gather fails
  Gatherer Make(bool with_ahead) {
    Gatherer ga;
    ga.gather = [this](int g, void* copy) -> Status {
      std::lock_guard<std::mutex> lock(mu);
      gathers.push_back(g);
      if (fail_next == g) {
        fail_next = -1;
        return CommError("fake gather of group " + std::to_string(g) + " failed");
      }
      (void)copy;
      return Status::Ok();
    };
    ga.before_fetch = [this](int g) {
      std::lock_guard<std::mutex> lock(mu);
      before.push_back(g);
      return Status::Ok();
    };
    if (with_ahead)
      ga.queue_ahead = [this](int g) {
        std::lock_guard<std::mutex> lock(mu);
        queued_ahead.push_back(g);
      };
    return ga;
  }
  int GathersOf(int g) {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<int>(std::count(gathers.begin(), gathers.end(), g));
  }
};

TEST(ResidencySharded, GathersOnceFromZeroPinsAndAgainAfterRelease) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(3, kS), 3 * kS, false, 0, /*sharded=*/true, log.Make(false));
  rig.FetchChecked(0);
  EXPECT_EQ(log.GathersOf(0), 1);
  rig.FetchChecked(0);  // pinned and gathered: no second gather
  EXPECT_EQ(log.GathersOf(0), 1);
  EXPECT_EQ(rig.residency->pins(0), 2);
  rig.ReleaseOk(0);
  rig.FetchChecked(0);  // still pinned once
  EXPECT_EQ(log.GathersOf(0), 1);
  rig.ReleaseOk(0);
  rig.ReleaseOk(0);
  rig.FetchChecked(0);  // from zero pins: gathers again, without loading again
  EXPECT_EQ(log.GathersOf(0), 2);
  EXPECT_EQ(rig.source.LoadsOf(0), 1);
  rig.ReleaseOk(0);
  EXPECT_EQ(log.before, (std::vector<int>{0, 0, 0, 0})) << "before_fetch on every fetch";
  // A failed gather: the fetch fails and holds no pin; the next one gathers.
  log.fail_next = 1;
  auto r = rig.residency->Fetch(1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kComm);
  EXPECT_NE(r.status().message().find("fake gather of group 1 failed"), std::string::npos);
  EXPECT_EQ(rig.residency->pins(1), 0);
  rig.FetchChecked(1);
  EXPECT_EQ(log.GathersOf(1), 2);
  rig.ReleaseOk(1);
}

// keep_gathered: a copy gathered once stays gathered through releases (no
// gather in backward, none ahead), is never evicted, and gathers again only
// after a drop (the step's). Its stat counts the gathers.
TEST(ResidencySharded, KeptGatheredCopiesGatherOnceUntilDropped) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(3, kS), 3 * kS, false, 0, /*sharded=*/true, log.Make(false), nullptr,
          /*keep_gathered=*/true);
  for (int pass = 0; pass < 2; ++pass)  // forward, then backward
    for (int g = 0; g < 3; ++g) {
      rig.FetchChecked(g);
      rig.ReleaseOk(g);
    }
  for (int g = 0; g < 3; ++g) EXPECT_EQ(log.GathersOf(g), 1) << "group " << g << ": kept from forward";
  EXPECT_EQ(rig.stats.Snapshot().p_gathers, 3u);
  EXPECT_EQ(rig.residency->PinForAhead(1), nullptr) << "gathered already: nothing to gather ahead";
  rig.residency->Drop(nullptr);  // the step: P changed
  rig.FetchChecked(1);
  EXPECT_EQ(log.GathersOf(1), 2) << "dropped: gathered again";
  EXPECT_EQ(rig.stats.Snapshot().p_gathers, 4u);
  rig.ReleaseOk(1);
}

// The step's new shard (rank 1 of 2) goes to its place in a resident copy,
// which is then no longer gathered: the next fetch gathers, as after a load,
// and loads nothing; the other rank's half is left for the gather. A pinned
// or absent copy does not take it.
TEST(ResidencySharded, ARefreshedShardIsGatheredAgainAndNotReadBack) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(2, kS), 2 * kS, false, 0, /*sharded=*/true, log.Make(false), nullptr,
          /*keep_gathered=*/true, /*shards=*/2, /*shard_rank=*/1);
  void* p = rig.FetchChecked(0);
  const std::vector<uint8_t> shard(kS / 2, 0xAB);
  EXPECT_FALSE(rig.residency->Refresh(0, shard.data())) << "pinned";
  rig.ReleaseOk(0);
  EXPECT_FALSE(rig.residency->Refresh(1, shard.data())) << "absent";
  ASSERT_TRUE(rig.residency->Refresh(0, shard.data()));
  rig.residency->Drop([](int g) { return g == 0; });  // the step's end keeps it
  auto q = rig.residency->Fetch(0);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(*q, p);
  EXPECT_EQ(log.GathersOf(0), 2) << "the other ranks' shards are old: gathered again";
  EXPECT_EQ(rig.source.LoadsOf(0), 1) << "this rank's shard is not read back";
  EXPECT_EQ(CheckPattern(0, *q, kS / 2), "") << "the first half is rank 0's, left for the gather";
  EXPECT_EQ(std::memcmp(static_cast<const char*>(*q) + kS / 2, shard.data(), kS / 2), 0) << "rank 1's half";
  rig.ReleaseOk(0);
}

// With room for two copies and both kept gathered, a third fetch evicts
// neither (a rank that evicted would gather where the others do not): NOMEM.
TEST(ResidencySharded, AKeptGatheredCopyIsNeverEvicted) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(3, kS), 2 * kS, false, 0, true, log.Make(false), nullptr, /*keep_gathered=*/true);
  for (int g = 0; g < 2; ++g) {
    rig.FetchChecked(g);
    rig.ReleaseOk(g);
  }
  auto r = rig.residency->Fetch(2);
  EXPECT_EQ(r.status().code(), Code::kNoMem) << r.status().ToString();
  for (int g = 0; g < 2; ++g) EXPECT_EQ(rig.source.LoadsOf(g), 1) << g;
}

TEST(ResidencySharded, APinTakenAheadIsTheNextFetchsWithoutGathering) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(3, kS), 3 * kS, false, 0, true, log.Make(false));
  EXPECT_EQ(rig.residency->PinForAhead(0), nullptr) << "absent: nothing to gather ahead";
  void* p0 = rig.FetchChecked(0);
  EXPECT_EQ(rig.residency->PinForAhead(0), nullptr) << "gathered (pinned by a fetch): nothing to do";
  rig.ReleaseOk(0);
  EXPECT_EQ(rig.residency->PinForAhead(0), p0);
  EXPECT_EQ(rig.residency->pins(0), 1) << "held while the ranks decide";
  rig.residency->EndAhead(0, true);
  EXPECT_EQ(rig.residency->PinForAhead(0), nullptr) << "already gathered ahead";
  EXPECT_EQ(rig.residency->pins(0), 1);
  EXPECT_EQ(rig.FetchChecked(0), p0);
  EXPECT_EQ(log.GathersOf(0), 1) << "the gather ahead stands for the fetch's";
  EXPECT_EQ(rig.residency->pins(0), 1) << "the fetch took the pin held ahead";
  rig.ReleaseOk(0);
  EXPECT_EQ(rig.residency->pins(0), 0);
  rig.FetchChecked(0);
  EXPECT_EQ(log.GathersOf(0), 2) << "after its release a copy gathers again";
  rig.ReleaseOk(0);
  // Declined: the pin is given back and the fetch gathers.
  ASSERT_EQ(rig.residency->PinForAhead(0), p0);
  rig.residency->EndAhead(0, false);
  EXPECT_EQ(rig.residency->pins(0), 0);
  rig.FetchChecked(0);
  EXPECT_EQ(log.GathersOf(0), 3);
  rig.ReleaseOk(0);
}

TEST(ResidencySharded, DropAheadPinsGivesThePinsBack) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(3, kS), 3 * kS, false, 0, true, log.Make(false));
  for (int g = 0; g < 2; ++g) {
    ASSERT_NE(rig.HoldAhead(g), nullptr);
    EXPECT_EQ(rig.residency->pins(g), 1);
  }
  rig.residency->DropAheadPins();
  for (int g = 0; g < 2; ++g) EXPECT_EQ(rig.residency->pins(g), 0) << g;
  rig.FetchChecked(1);
  EXPECT_EQ(log.GathersOf(1), 2) << "no longer gathered: the fetch gathers";
  EXPECT_EQ(rig.residency->pins(1), 1);
  rig.ReleaseOk(1);
}

// A copy held ahead is pinned: with room for two copies, one held ahead and
// one fetched, a third fetch finds nothing to evict.
TEST(ResidencySharded, ACopyHeldAheadIsNotEvicted) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(3, kS), 2 * kS, false, 0, true, log.Make(false));
  void* p0 = rig.HoldAhead(0);
  rig.FetchChecked(1);
  auto r = rig.residency->Fetch(2);
  EXPECT_EQ(r.status().code(), Code::kNoMem) << r.status().ToString();
  rig.ReleaseOk(1);
  rig.FetchChecked(2);  // evicts 1, not 0
  EXPECT_EQ(rig.FetchChecked(0), p0);
  EXPECT_EQ(rig.source.LoadsOf(0), 1);
  EXPECT_EQ(log.GathersOf(0), 1);
  rig.ReleaseOk(0);
  rig.ReleaseOk(2);
}

// With a trace, each fetch queues the trace's next group for a gather ahead;
// a fetch off the trace gives back the pins held ahead for it.
TEST(ResidencySharded, QueuesTheNextGroupAheadAndAStepOffTheTraceDropsThePins) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(3, kS), 3 * kS, false, /*window=*/kS, true, log.Make(true));
  rig.residency->Start();
  for (int g : {0, 1, 2}) {
    rig.FetchChecked(g);
    rig.ReleaseOk(g);
  }
  EXPECT_TRUE(log.queued_ahead.empty()) << "no trace yet";
  rig.residency->OnStep();
  rig.FetchChecked(0);
  rig.ReleaseOk(0);
  EXPECT_EQ(log.queued_ahead, (std::vector<int>{1}));
  rig.residency->WaitIdle();
  void* p1 = rig.residency->PinForAhead(1);
  ASSERT_NE(p1, nullptr);
  rig.residency->EndAhead(1, true);
  EXPECT_EQ(rig.residency->pins(1), 1);
  rig.FetchChecked(2);  // the trace expected 1: a departure
  EXPECT_EQ(rig.residency->pins(1), 0) << "the pin held ahead for a fetch that will not come is given back";
  rig.ReleaseOk(2);
  rig.FetchChecked(1);
  EXPECT_EQ(log.GathersOf(1), 2) << "its gather ahead was given up: the fetch gathers";
  rig.ReleaseOk(1);
  rig.residency->WaitIdle();
}

// keep_gathered: the first fetch of a pass queues every group of the window
// ahead, each trace position once a pass (a later fetch queues only what
// came into the window), and no fetch queues a copy kept gathered: backward
// after forward queues nothing, nor does a group's second use in the window
// (3 at positions 3 and 5) or its second use in the pass (0, a tied embedding). After a drop (the step) forward queues again.
TEST(ResidencySharded, KeptCopiesQueueTheWindowAheadOnceAndNothingForBackward) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(4, kS), 4 * kS, false, /*window=*/3 * kS, true, log.Make(true), nullptr,
          /*keep_gathered=*/true);
  rig.residency->Start();
  const std::vector<int> order = {0, 1, 2, 3, 0, 3, 2, 1, 0};  // forward (0 used twice), backward
  auto pass = [&] {
    for (int g : order) {
      rig.FetchChecked(g);
      rig.ReleaseOk(g);
    }
  };
  pass();
  EXPECT_TRUE(log.queued_ahead.empty()) << "no trace yet";
  rig.residency->OnStep();
  rig.residency->Drop(nullptr);  // the step: P changed, nothing gathered
  rig.FetchChecked(0);
  EXPECT_EQ(log.queued_ahead, (std::vector<int>{1, 2, 3})) << "the first fetch queues the whole window";
  rig.ReleaseOk(0);
  for (size_t i = 1; i < order.size(); ++i) {
    rig.FetchChecked(order[i]);
    rig.ReleaseOk(order[i]);
  }
  EXPECT_EQ(log.queued_ahead, (std::vector<int>{1, 2, 3}))
      << "fetch 0 queues the window (1, 2, 3), fetch 1 what came into it (0 again, fetched and kept); backward "
         "queues nothing";
  log.queued_ahead.clear();
  rig.residency->OnStep();
  pass();
  EXPECT_TRUE(log.queued_ahead.empty()) << "nothing dropped: every copy is still kept";
  rig.residency->OnStep();
  rig.residency->Drop(nullptr);
  pass();
  EXPECT_EQ(log.queued_ahead, (std::vector<int>{1, 2, 3})) << "a new pass after a drop queues again";
  rig.residency->DropAheadPins();
  rig.residency->WaitIdle();
}

// Without keep_gathered a fetch queues only the next group, as many times as
// the trace has it (a copy is gathered again after its release).
TEST(ResidencySharded, WithoutKeepingAFetchQueuesTheNextGroupOnly) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(4, kS), 4 * kS, false, /*window=*/3 * kS, true, log.Make(true));
  rig.residency->Start();
  const std::vector<int> order = {0, 1, 2, 3, 3, 2, 1, 0};
  for (int step = 0; step < 2; ++step) {
    for (int g : order) {
      rig.FetchChecked(g);
      rig.ReleaseOk(g);
    }
    rig.residency->OnStep();
  }
  EXPECT_EQ(log.queued_ahead, (std::vector<int>{1, 2, 3, 2, 1, 0}))
      << "each fetch's next (not its own group: 3 then 3; nothing after the trace's last fetch)";
  rig.residency->DropAheadPins();
  rig.residency->WaitIdle();
}

// The prefetch thread loads this rank's shard only: it never gathers.
TEST(ResidencySharded, PrefetchLoadsWithoutGathering) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(2, kS), 2 * kS, false, 0, true, log.Make(false));
  rig.residency->Start();
  rig.residency->Prefetch({1});
  ASSERT_TRUE(rig.source.WaitForLoads(1));
  rig.residency->WaitIdle();
  EXPECT_EQ(log.GathersOf(1), 0);
  rig.FetchChecked(1);
  EXPECT_EQ(log.GathersOf(1), 1);
  EXPECT_EQ(rig.source.LoadsOf(1), 1);
  rig.ReleaseOk(1);
}

// A release without a fetch is refused even while the copy holds a pin
// for a gather ahead; that pin stays the next fetch's.
// (Before the fix Release counted the pin held ahead as a fetch's: it
// returned OK, pins dropped to 0 with `ahead` still set, and the next fetch
// took a pin that was gone, so the fetched copy could be evicted and
// overwritten while in use.)
TEST(ResidencySharded, AReleaseWithoutAFetchDoesNotTakeAPinHeldAhead) {
  GatherLog log;
  Rig rig(std::vector<uint64_t>(3, kS), 2 * kS, false, 0, true, log.Make(false));
  void* p0 = rig.HoldAhead(0);
  Status st = rig.residency->Release(0);
  EXPECT_EQ(st.code(), Code::kState) << "group 0 is not fetched: " << st.ToString();
  EXPECT_EQ(rig.residency->pins(0), 1) << "the pin held ahead stays";
  void* again = rig.FetchChecked(0);
  EXPECT_EQ(again, p0);
  EXPECT_EQ(rig.residency->pins(0), 1) << "fetched: pinned";
  rig.FetchChecked(1);
  rig.ReleaseOk(1);
  rig.FetchChecked(2);  // needs room: must evict 1, never the fetched 0
  EXPECT_EQ(CheckPattern(0, p0, kS), "") << "fetched copy overwritten";
  EXPECT_EQ(rig.source.LoadsOf(0), 1);
}

// --- Home mode: P's home is the device ---

TEST(Residency, HomeModeHandsOutTheHomeWithoutLoading) {
  std::vector<std::vector<uint32_t>> homes(3, std::vector<uint32_t>(kS / 4, 7));
  Rig rig(std::vector<uint64_t>(3, kS), kS, false, 3 * kS, false, {},
          [&](int g) { return static_cast<void*>(homes[static_cast<size_t>(g)].data()); });
  rig.residency->Start();
  for (int s = 0; s < 2; ++s) {
    for (int g = 0; g < 3; ++g) {
      auto p = rig.residency->Fetch(g);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      EXPECT_EQ(*p, homes[static_cast<size_t>(g)].data());
      EXPECT_EQ(rig.residency->pins(g), 1);
    }
    for (int g = 0; g < 3; ++g) rig.ReleaseOk(g);
    rig.residency->Prefetch(rig.residency->OnStep());
  }
  rig.residency->WaitIdle();
  EXPECT_EQ(rig.residency->Release(0).code(), Code::kState);
  EXPECT_TRUE(rig.source.loads().empty());
  EXPECT_EQ(rig.device->peak(), 0u) << "no device copy";
  EXPECT_EQ(homes[1][0], 7u) << "the home is not written";
}

}  // namespace
}  // namespace strata
