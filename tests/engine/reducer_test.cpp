// GradReducer (engine/reduce/reducer.h) alone, over real Gloo ranks on
// threads of this process (one rendezvous store on loopback): the sums the
// accumulate hook receives for known gradients, computed here from the
// gradients themselves, at stages 0-2 and for several reduce_bucket_size,
// with and without the communication thread (overlap_comm); a failure of
// the hook returned once by Drain; stage 3's gathers, now and ahead (the
// ranks agree or none gathers).
#include "engine/reduce/reducer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "io/net/store.h"
#include "tests/util/on_ranks.h"
#include "tiers/device_tier.h"
#include "tiers/host_tier.h"

namespace strata {
namespace {

using namespace std::chrono_literals;

using testing::OnRanks;

// Rank r's gradient of group g, element i: full-mantissa values of varied
// magnitude, so that a sum's rounding depends on its order.
float Grad(int r, int g, uint64_t i) {
  uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(g + 1) * 0xC2B2AE3D27D4EB4Full ^
               static_cast<uint64_t>(r + 1) * 0x165667B19E3779F9ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  const float unit = static_cast<float>(h & 0xFFFFFF) / float(1 << 24) - 0.5f;  // [-0.5, 0.5)
  return std::ldexp(unit, static_cast<int>((h >> 24) % 17) - 8);
}

// The groups: sizes that pad (to 2 x 2048 elements) and differ.
const std::vector<uint64_t> kNumel = {5123, 3000, 1};

struct Case {
  int stage;
  uint64_t bucket;
  bool overlap;
  std::string Name() const {
    std::ostringstream o;
    o << "stage " << stage << " bucket " << bucket << (overlap ? " overlap" : "");
    return o.str();
  }
};

// One rank's reducer and what its accumulate hook received.
struct RankRig {
  // `targets`: the sums_target hook gives each group a buffer of its own
  // (NaN until the sums land), as the engine gives G.
  RankRig(net::Communicator& comm, const Case& c, bool targets = false) : comm(comm) {
    config.zero.stage = c.stage;
    config.zero.reduce_bucket_size = c.bucket;
    config.zero.overlap_comm = c.overlap;
    layout.config = &config;
    for (size_t g = 0; g < kNumel.size(); ++g)
      EXPECT_TRUE(layout.part.Add(static_cast<int>(g), "t" + std::to_string(g), kNumel[g]).ok());
    // Stage 0 keeps whole groups on every rank; stages 1-3 cut them in world shards.
    const bool sharded = c.stage >= 1;
    layout.sworld = sharded ? comm.world_size() : 1;
    layout.srank = sharded ? comm.rank() : 0;
    layout.multi = layout.reduces = true;
    layout.p_sharded = c.stage == 3;
    EXPECT_TRUE(layout.part.Finalize(layout.sworld).ok());
    auto d = DeviceTier::Create({.budget = 1 << 20, .device = 0, .force_host_arena = true, .pool = false});
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    device = std::move(*d);
    host = std::make_unique<HostTier>(
        HostTierOptions{.budget = 64ull << 20, .pin = false, .huge_pages = false, .numa_bind = false});
    // A packed group: its padded gradient in fp32 (every rank's pieces).
    uint64_t largest = 0;
    for (int g = 0; g < layout.num_groups(); ++g) largest = std::max(largest, layout.group(g).padded);
    EXPECT_TRUE(staging.Init(host.get(), c.overlap ? 2 : 1, largest * 4).ok());
    GradReducer::Hooks h;
    h.accumulate = [this](int g, const float* sums, uint64_t n) -> Status {
      std::lock_guard<std::mutex> lock(mu);
      ++calls[g];
      if (fail_group == g) {
        fail_group = -1;
        return IoError("injected: accumulate of group " + std::to_string(g));
      }
      received[g].assign(sums, sums + n);
      received_at[g] = sums;
      return Status::Ok();
    };
    if (targets) {
      for (int g = 0; g < layout.num_groups(); ++g)
        target[g].assign(layout.group(g).shard_numel, std::numeric_limits<float>::quiet_NaN());
      h.sums_target = [this](int g) { return target.at(g).data(); };
    }
    h.step = [] { return int64_t{1}; };
    h.grad_calls = [](int) { return 0; };
    h.pin_ahead = [this](int g) { return pin_ahead ? pin_ahead(g) : nullptr; };
    h.end_ahead = [this](int g, bool gathered) {
      std::lock_guard<std::mutex> lock(mu);
      ended_ahead.push_back({g, gathered});
    };
    reducer = std::make_unique<GradReducer>(layout, comm, *device, staging, /*g_staged=*/false, std::move(h));
    Status st = reducer->Init();
    EXPECT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(reducer->threaded(), c.overlap);
  }
  ~RankRig() { reducer.reset(); }

  std::vector<float> Gradients(int g) const {
    std::vector<float> v(kNumel[static_cast<size_t>(g)]);
    for (uint64_t i = 0; i < v.size(); ++i) v[i] = Grad(comm.rank(), g, i);
    return v;
  }
  // This rank's n sums of group g, as the ranks' gradients say: element
  // srank*n + j of the group, padding past numel. A sum of two in either
  // order is the same float.
  std::vector<float> ExpectedTwoRanks(int g) const {
    const GroupLayout& L = layout.group(g);
    std::vector<float> want(L.shard_numel);
    for (uint64_t j = 0; j < want.size(); ++j) {
      const uint64_t e = static_cast<uint64_t>(layout.srank) * L.shard_numel + j;
      want[j] = e < L.numel ? Grad(0, g, e) + Grad(1, g, e) : 0.0f;
    }
    return want;
  }
  std::vector<float> Received(int g) {
    std::lock_guard<std::mutex> lock(mu);
    return received[g];
  }
  int Calls(int g) {
    std::lock_guard<std::mutex> lock(mu);
    return calls[g];
  }

  net::Communicator& comm;
  Config config;
  Layout layout;
  std::unique_ptr<DeviceTier> device;
  std::unique_ptr<HostTier> host;
  StagingPool staging;
  std::mutex mu;
  std::map<int, std::vector<float>> received;
  std::map<int, const float*> received_at;  // where the hook found them
  std::map<int, std::vector<float>> target;  // the sums_target buffers
  std::map<int, int> calls;
  int fail_group = -1;
  std::function<void*(int)> pin_ahead;
  std::vector<std::pair<int, bool>> ended_ahead;
  std::unique_ptr<GradReducer> reducer;
};

// The first element where two float vectors differ bitwise, or "".
std::string FirstDifference(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size())
    return "size " + std::to_string(got.size()) + ", expected " + std::to_string(want.size());
  for (size_t j = 0; j < got.size(); ++j)
    if (F32Bits(got[j]) != F32Bits(want[j])) {
      std::ostringstream o;
      o.precision(9);
      o << "element " << j << ": " << got[j] << ", expected " << want[j];
      return o.str();
    }
  return "";
}

TEST(GradReducer, TwoRanksSumTheGradientsAtEveryStageAndBucketSize) {
  std::vector<Case> cases;
  for (int stage : {0, 1, 2})
    for (uint64_t bucket : {uint64_t{1000}, uint64_t{2050}, uint64_t{6000}, uint64_t{500'000'000}})
      for (bool overlap : {false, true}) cases.push_back({stage, bucket, overlap});
  OnRanks(2, [&](int r, net::Communicator& comm) {
    for (const Case& c : cases) {
      RankRig rig(comm, c);
      const uint64_t issued = comm.collectives_issued();
      uint64_t buckets = 0;  // collectives of at most reduce_bucket_size elements
      for (int g = 0; g < rig.layout.num_groups(); ++g) {
        const std::vector<float> grads = rig.Gradients(g);
        Status st = rig.reducer->Grads(g, grads.data(), DType::kF32);
        ASSERT_TRUE(st.ok()) << c.Name() << ": " << st.ToString();
        const GroupLayout& L = rig.layout.group(g);
        if (c.stage >= 2) {  // reduce-scatter: bucket / world columns of every rank's piece a collective
          const uint64_t columns = std::max<uint64_t>(c.bucket / 2, 1);
          buckets += (L.shard_numel + columns - 1) / columns;
        } else {  // all-reduce of the whole padded group
          buckets += (L.padded + c.bucket - 1) / c.bucket;
        }
      }
      Status st = rig.reducer->Drain();
      ASSERT_TRUE(st.ok()) << c.Name() << ": " << st.ToString();
      EXPECT_EQ(comm.collectives_issued() - issued, buckets) << c.Name();
      for (int g = 0; g < rig.layout.num_groups(); ++g) {
        EXPECT_EQ(rig.Calls(g), 1) << c.Name() << " group " << g;
        EXPECT_EQ(FirstDifference(rig.Received(g), rig.ExpectedTwoRanks(g)), "")
            << c.Name() << ", rank " << r << ", group " << g;
      }
    }
  });
}

// Every group's gradients of this rank through the rig's reducer, drained.
void ReduceEveryGroup(RankRig& rig, const Case& c) {
  for (int g = 0; g < rig.layout.num_groups(); ++g) {
    const std::vector<float> grads = rig.Gradients(g);
    ASSERT_TRUE(rig.reducer->Grads(g, grads.data(), DType::kF32).ok()) << c.Name();
  }
  Status st = rig.reducer->Drain();
  ASSERT_TRUE(st.ok()) << c.Name() << ": " << st.ToString();
}

std::string Where(const Case& c, bool shm, int r, int g) {
  return c.Name() + (shm ? " shm" : " tcp") + ", rank " + std::to_string(r) + ", group " + std::to_string(g);
}

// Where the composition gives a target (G), the sums are written there by
// the collectives themselves, over shared memory and over TCP alike: the
// hook finds them in place, the same bits as in the reducer's buffer.
TEST(GradReducer, SumsLandInTheirTargetWithoutACopyOverSharedMemoryAndTcp) {
  for (bool shm : {true, false}) {
    std::vector<Case> cases;
    for (int stage : {0, 1, 2})
      for (uint64_t bucket : {uint64_t{1000}, uint64_t{500'000'000}})
        for (bool overlap : {false, true}) cases.push_back({stage, bucket, overlap});
    OnRanks(
        2,
        [&](int r, net::Communicator& comm) {
          ASSERT_EQ(comm.shared_memory(), shm);
          for (const Case& c : cases) {
            RankRig rig(comm, c, /*targets=*/true);
            ReduceEveryGroup(rig, c);
            if (HasFatalFailure()) return;
            for (int g = 0; g < rig.layout.num_groups(); ++g) {
              EXPECT_EQ(rig.received_at[g], rig.target[g].data()) << Where(c, shm, r, g) << ": not found in place";
              EXPECT_EQ(FirstDifference(rig.target[g], rig.ExpectedTwoRanks(g)), "") << Where(c, shm, r, g);
            }
          }
        },
        30, shm);
  }
}

// Three ranks (the shared-memory channel's sum out of place over more than
// one peer, and the TCP ring's last step): the sums in their targets are
// bitwise the sums the reducer leaves in its own buffer, at every bucket
// size, with and without the thread.
TEST(GradReducer, ThreeRanksSumsInTheirTargetAreTheBufferedSumsBitwise) {
  for (bool shm : {true, false}) {
    OnRanks(
        3,
        [&](int r, net::Communicator& comm) {
          ASSERT_EQ(comm.shared_memory(), shm);
          for (uint64_t bucket : {uint64_t{999}, uint64_t{500'000'000}})
            for (bool overlap : {false, true}) {
              const Case c{2, bucket, overlap};
              RankRig plain(comm, c), straight(comm, c, /*targets=*/true);
              for (RankRig* rig : {&plain, &straight}) ReduceEveryGroup(*rig, c);
              if (HasFatalFailure()) return;
              for (int g = 0; g < plain.layout.num_groups(); ++g) {
                EXPECT_EQ(straight.received_at[g], straight.target[g].data())
                    << Where(c, shm, r, g) << ": not found in place";
                EXPECT_EQ(FirstDifference(straight.target[g], plain.Received(g)), "") << Where(c, shm, r, g);
              }
            }
        },
        30, shm);
  }
}

// bf16 gradients are widened exactly before the sum.
TEST(GradReducer, Bf16GradientsAreSummedAsTheirFp32Values) {
  OnRanks(2, [&](int r, net::Communicator& comm) {
    RankRig rig(comm, {2, 1000, true});
    const int g = 0;
    const GroupLayout& L = rig.layout.group(g);
    std::vector<uint16_t> mine(L.numel);
    for (uint64_t i = 0; i < L.numel; ++i) mine[i] = F32ToBF16(Grad(r, g, i));
    ASSERT_TRUE(rig.reducer->Grads(g, mine.data(), DType::kBF16).ok());
    ASSERT_TRUE(rig.reducer->Drain().ok());
    std::vector<float> want(L.shard_numel);
    for (uint64_t j = 0; j < want.size(); ++j) {
      const uint64_t e = static_cast<uint64_t>(r) * L.shard_numel + j;
      want[j] = e < L.numel ? BF16ToF32(F32ToBF16(Grad(0, g, e))) + BF16ToF32(F32ToBF16(Grad(1, g, e))) : 0.0f;
    }
    EXPECT_EQ(FirstDifference(rig.Received(g), want), "") << "rank " << r;
  });
}

// Three ranks: a reduce-scatter's sums are the same bits whatever the bucket
// size (the order of a sum is its owner's ring), and each is the sum of the
// three gradients to within the rounding of two additions.
TEST(GradReducer, ThreeRanksReduceScatterIsBitwiseTheSameForEveryBucketSize) {
  std::mutex mu;
  std::map<int, std::map<uint64_t, std::map<int, std::vector<float>>>> sums;  // rank -> bucket -> group -> sums
  const std::vector<uint64_t> buckets = {999, 3000, 500'000'000};
  OnRanks(3, [&](int r, net::Communicator& comm) {
    for (uint64_t bucket : buckets)
      for (bool overlap : {false, true}) {
        RankRig rig(comm, {2, bucket, overlap});
        for (int g = 0; g < rig.layout.num_groups(); ++g) {
          const std::vector<float> grads = rig.Gradients(g);
          ASSERT_TRUE(rig.reducer->Grads(g, grads.data(), DType::kF32).ok());
        }
        ASSERT_TRUE(rig.reducer->Drain().ok());
        for (int g = 0; g < rig.layout.num_groups(); ++g) {
          const std::vector<float> got = rig.Received(g);
          const GroupLayout& L = rig.layout.group(g);
          ASSERT_EQ(got.size(), L.shard_numel);
          for (uint64_t j = 0; j < got.size(); ++j) {
            const uint64_t e = static_cast<uint64_t>(r) * L.shard_numel + j;
            double want = 0, mag = 0;
            for (int k = 0; k < 3 && e < L.numel; ++k) {
              want += Grad(k, g, e);
              mag += std::fabs(Grad(k, g, e));
            }
            ASSERT_LE(std::fabs(got[j] - want), mag * 2.5e-7) << "rank " << r << " group " << g << " element " << j;
          }
          std::lock_guard<std::mutex> lock(mu);
          auto& slot = sums[r][bucket][g];
          if (slot.empty()) slot = got;
          else EXPECT_EQ(FirstDifference(got, slot), "") << "overlap vs not, bucket " << bucket;
        }
      }
  });
  for (const auto& [r, by_bucket] : sums)
    for (const auto& [bucket, by_group] : by_bucket)
      for (const auto& [g, got] : by_group)
        EXPECT_EQ(FirstDifference(got, sums.at(r).at(buckets[0]).at(g)), "")
            << "rank " << r << " group " << g << ": bucket " << bucket << " vs " << buckets[0];
}

// ---- Parts lent (PartsBegin/Part with lend): read where they lie ------------

// One part of a group's gradient as a test hands it: elements [first,
// first + count), lent or not, given again (added), in bf16.
struct TestPart {
  uint64_t first, count;
  bool lend = true, again = false, bf16 = false;
};

// Hands group g's gradient `grads` in `parts` (a bf16 part from `narrow`,
// grads rounded) and ends the call. Returns whether the reducer lent them.
void HandParts(RankRig& rig, int g, const std::vector<float>& grads, const std::vector<uint16_t>& narrow,
               const std::vector<TestPart>& parts, const std::function<void()>& before_end = nullptr) {
  ASSERT_TRUE(rig.reducer->PartsBegin(g, parts.front().lend).ok());
  std::map<uint64_t, uint64_t> given;
  for (const TestPart& p : parts) {
    const void* src = p.bf16 ? static_cast<const void*>(narrow.data() + p.first)
                             : static_cast<const void*>(grads.data() + p.first);
    const Status st = rig.reducer->Part(g, p.first, p.count, src, p.bf16 ? DType::kBF16 : DType::kF32, p.again,
                                        p.lend);
    ASSERT_TRUE(st.ok()) << st.ToString();
    given.emplace(p.first, p.count);
  }
  if (before_end) before_end();
  const Status st = rig.reducer->PartsEnd(g, given);
  ASSERT_TRUE(st.ok()) << st.ToString();
}

// Over shared memory, where the sums go straight into their target (G),
// parts lent are not packed: the reduce-scatter reads them where they lie
// (a change the caller makes before the call's end is in the sums), and
// the sums are bitwise those of the same parts packed — out of order, with
// a gap (zeros), at every bucket size and stage 2-3. A part not lent, in
// bf16 or given again packs what was lent before it: the same bits again;
// so does SettleLent (a step or load returned while the call was open).
// ReadsLent says whether the parts may still be read, and
// lent_reduced_bytes counts the reductions that read them in place.
// Over TCP, or without a target, parts are packed (nothing is read late).
// At 2 and 3 ranks (the channel's sum in place of one peer, and of more).
TEST(GradReducer, LentPartsAreReadWhereTheyLieAndSumAsThePackedParts) {
  const uint64_t n = kNumel[0], h = n / 2;
  const std::vector<std::pair<std::string, std::vector<TestPart>>> hands = {
      {"lent", {{h, n - h}, {0, 7}, {9, h - 9}}},  // [7, 9): no part
      {"one not lent", {{h, n - h}, {0, 7, false}, {9, h - 9}}},
      {"one given again", {{h, n - h}, {0, 7}, {9, h - 9}, {0, 7, true, true}}},
      {"one in bf16", {{h, n - h}, {0, 7}, {9, h - 9, true, false, true}}},
      {"settled", {{h, n - h}, {0, 7}, {9, h - 9}}},  // SettleLent before the end: packed then
  };
  for (int world : {2, 3})
    for (bool shm : {true, false})
      OnRanks(
          world,
          [&](int r, net::Communicator& comm) {
            // Element h+3 as every rank changed it: 1024 + r, summed.
            const float changed_sum =
                1024.0f * static_cast<float>(world) + static_cast<float>(world * (world - 1) / 2);
            for (int stage : {2, 3})
              for (uint64_t bucket : {uint64_t{1000}, uint64_t{500'000'000}})
                for (bool targets : {true, false})
                  for (const auto& [name, parts] : hands) {
                    const Case c{stage, bucket, true};
                    const std::string where = Where(c, shm, r, 0) + (targets ? "" : " (no target)") + ", " + name +
                                              ", " + std::to_string(world) + " ranks";
                    RankRig lent(comm, c, targets), packed(comm, c, targets);
                    const bool lends = shm && targets;
                    EXPECT_EQ(lent.reducer->LendsParts(0), lends) << where;
                    std::vector<float> grads = lent.Gradients(0);
                    std::vector<uint16_t> narrow(n);
                    for (uint64_t i = 0; i < n; ++i) narrow[i] = F32ToBF16(grads[i]);
                    // The packed run: no part lent, each part's values as the lent run will have them.
                    std::vector<float> changed = grads;
                    const bool late = name == "lent" && lends;  // read at the reduction, so the change counts
                    if (late) changed[h + 3] = 1024.0f + static_cast<float>(r);
                    std::vector<TestPart> copied = parts;
                    for (TestPart& p : copied) p.lend = false;
                    // One rig's collectives at a time: they share the communicator.
                    HandParts(packed, 0, changed, narrow, copied);
                    if (HasFatalFailure()) return;
                    Status st = packed.reducer->Drain();
                    ASSERT_TRUE(st.ok()) << where << ": " << st.ToString();
                    HandParts(lent, 0, grads, narrow, parts, [&] {
                      if (name == "settled") lent.reducer->SettleLent();  // a step returned with the call open
                      // Read later (the call's pieces) only where every part so far stayed lent.
                      EXPECT_EQ(lent.reducer->ReadsLent(0), late) << where << ": before the end";
                      grads[h + 3] = 1024.0f + static_cast<float>(r);
                    });
                    if (HasFatalFailure()) return;
                    st = lent.reducer->Drain();
                    ASSERT_TRUE(st.ok()) << where << ": " << st.ToString();
                    EXPECT_FALSE(lent.reducer->ReadsLent(0)) << where << ": after the drain";
                    EXPECT_EQ(lent.reducer->lent_reduced_bytes(), late ? lent.layout.group(0).padded * 4 : 0) << where;
                    EXPECT_EQ(FirstDifference(lent.Received(0), packed.Received(0)), "") << where;
                    // The gap is zeros, the change is in (or not) as said: element h+3
                    // lies in rank (h+3)/shard's shard.
                    const GroupLayout& L = lent.layout.group(0);
                    const uint64_t e = h + 3, mine = static_cast<uint64_t>(r) * L.shard_numel;
                    if (e >= mine && e < mine + L.shard_numel) {
                      const float got = lent.Received(0)[e - mine];
                      if (late) {
                        EXPECT_EQ(got, changed_sum) << where << ": the lent part was copied, not read late";
                      } else if (name == "lent" || name == "settled") {
                        EXPECT_NE(got, changed_sum) << where << ": packed or settled, yet read late";
                      }
                    }
                    if (mine == 0) {
                      EXPECT_EQ(lent.Received(0)[7], 0.0f) << where << ": the gap";
                      EXPECT_EQ(lent.Received(0)[8], 0.0f) << where << ": the gap";
                    }
                  }
          },
          60, shm);
}

// Without the thread the hook's failure is the grads call's; with it, Drain
// returns it once, nothing more is reduced until then, and afterwards the
// reductions run again.
TEST(GradReducer, AnAccumulateFailureIsReturnedOnceThenReductionsResume) {
  OnRanks(2, [&](int r, net::Communicator& comm) {
    {
      RankRig rig(comm, {2, 1000, false});
      rig.fail_group = 1;
      const std::vector<float> g0 = rig.Gradients(0), g1 = rig.Gradients(1);
      ASSERT_TRUE(rig.reducer->Grads(0, g0.data(), DType::kF32).ok());
      Status st = rig.reducer->Grads(1, g1.data(), DType::kF32);
      EXPECT_EQ(st.code(), Code::kIo) << st.ToString();
      EXPECT_NE(st.message().find("grads: group 1"), std::string::npos) << st.ToString();
      EXPECT_NE(st.message().find("injected: accumulate of group 1"), std::string::npos) << st.ToString();
      ASSERT_TRUE(rig.reducer->Grads(1, g1.data(), DType::kF32).ok());
      EXPECT_EQ(FirstDifference(rig.Received(1), rig.ExpectedTwoRanks(1)), "") << "rank " << r;
    }
    RankRig rig(comm, {2, 1000, true});
    rig.fail_group = 0;  // on both ranks alike, so that they issue the same collectives
    std::vector<std::vector<float>> grads;
    for (int g = 0; g < 3; ++g) grads.push_back(rig.Gradients(g));
    for (int g = 0; g < 3; ++g) ASSERT_TRUE(rig.reducer->Grads(g, grads[g].data(), DType::kF32).ok());
    Status st = rig.reducer->Drain();
    EXPECT_EQ(st.code(), Code::kIo) << st.ToString();
    EXPECT_NE(st.message().find("grads: group 0"), std::string::npos) << st.ToString();
    EXPECT_NE(st.message().find("injected: accumulate of group 0"), std::string::npos) << st.ToString();
    EXPECT_EQ(rig.Calls(1) + rig.Calls(2), 0) << "nothing is reduced after a failure";
    st = rig.reducer->Drain();
    EXPECT_TRUE(st.ok()) << "returned once: " << st.ToString();
    for (int g = 0; g < 3; ++g) ASSERT_TRUE(rig.reducer->Grads(g, grads[g].data(), DType::kF32).ok());
    st = rig.reducer->Drain();
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (int g = 0; g < 3; ++g)
      EXPECT_EQ(FirstDifference(rig.Received(g), rig.ExpectedTwoRanks(g)), "") << "rank " << r << " group " << g;
  });
}

// Stage 3 with overlap: a gather after a failed background reduction fails,
// and leaves the failure for the drain (the engine's DrainComm, which breaks
// the engine: the groups queued after it got no gradients). Before, the
// gather took it: the fetch failed once and the next step found nothing
// wrong, updating those groups with no gradients.
TEST(GradReducer, AGatherAfterAFailedReductionLeavesTheFailureForTheDrain) {
  OnRanks(2, [&](int r, net::Communicator& comm) {
    RankRig rig(comm, {3, 1000, true});
    rig.fail_group = 0;  // on both ranks alike
    std::vector<std::vector<float>> grads;
    for (int g = 0; g < 2; ++g) grads.push_back(rig.Gradients(g));
    for (int g = 0; g < 2; ++g) ASSERT_TRUE(rig.reducer->Grads(g, grads[g].data(), DType::kF32).ok());
    std::vector<float> full(rig.layout.group(2).padded, 0.0f);
    Status st = rig.reducer->Gather(2, full.data());
    EXPECT_EQ(st.code(), Code::kIo) << "rank " << r << ": " << st.ToString();
    EXPECT_NE(st.message().find("injected: accumulate of group 0"), std::string::npos) << st.ToString();
    st = rig.reducer->Drain();
    EXPECT_EQ(st.code(), Code::kIo) << "rank " << r << ": the gather took the failure: " << st.ToString();
    EXPECT_TRUE(rig.reducer->Drain().ok()) << "returned once";
  });
}

// Stage 3: Gather fills every rank's slice of P; a gather ahead runs only
// when every rank has its copy pinned (else none gathers and the pins are
// given back), and then leaves the whole group in the copy.
TEST(GradReducer, Stage3GathersNowAndAheadWhenEveryRankAgrees) {
  OnRanks(2, [&](int r, net::Communicator& comm) {
    RankRig rig(comm, {3, 1000, true});
    const int g = 0;
    const GroupLayout& L = rig.layout.group(g);
    auto fill_mine = [&](std::vector<float>& full) {
      full.assign(L.padded, -1.0f);
      for (uint64_t j = 0; j < L.shard_numel; ++j) full[r * L.shard_numel + j] = Grad(r, 7, j);
    };
    auto check_all = [&](const std::vector<float>& full) {
      for (int k = 0; k < 2; ++k)
        for (uint64_t j = 0; j < L.shard_numel; ++j)
          if (full[k * L.shard_numel + j] != Grad(k, 7, j)) return "rank " + std::to_string(k) + " slice, element " + std::to_string(j);
      return std::string();
    };
    std::vector<float> full;
    fill_mine(full);
    ASSERT_TRUE(rig.reducer->Gather(g, full.data()).ok());
    EXPECT_EQ(check_all(full), "");

    // Rank 1 has no copy ready: nobody gathers; rank 0's pin is given back.
    fill_mine(full);
    rig.pin_ahead = [&](int) -> void* { return r == 0 ? full.data() : nullptr; };
    rig.reducer->QueueGatherAhead(g);
    rig.reducer->WaitAheadOf(g);
    ASSERT_TRUE(rig.reducer->Drain().ok());
    EXPECT_EQ(rig.reducer->gathers_ahead(), 0u);
    EXPECT_EQ(rig.reducer->gathers_ahead_declined(), 1u);
    if (r == 0) {
      EXPECT_EQ(rig.ended_ahead, (std::vector<std::pair<int, bool>>{{g, false}}));
    } else {
      EXPECT_TRUE(rig.ended_ahead.empty()) << "no pin, nothing to end";
    }
    EXPECT_EQ(full[(1 - r) * L.shard_numel], -1.0f) << "not gathered";

    // Both ready: gathered ahead.
    rig.ended_ahead.clear();
    rig.pin_ahead = [&](int) -> void* { return full.data(); };
    rig.reducer->QueueGatherAhead(g);
    rig.reducer->WaitAheadOf(g);
    ASSERT_TRUE(rig.reducer->Drain().ok());
    EXPECT_EQ(rig.reducer->gathers_ahead(), 1u);
    EXPECT_EQ(rig.ended_ahead, (std::vector<std::pair<int, bool>>{{g, true}}));
    EXPECT_EQ(check_all(full), "");
  });
}

}  // namespace
}  // namespace strata
