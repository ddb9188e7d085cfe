// Ranks that fail alone fail every rank at once: a refusal or failure of one
// rank's own (its disk, its device budget, a group it still holds) before a
// collective is agreed over the ranks, so that the others fail within
// seconds naming it, instead of waiting in that collective until
// strata.timeout; and the communicator stays usable, so that the ranks go
// on once the cause is gone. Two ranks as threads over real Gloo (OnRanks),
// a real io_uring on real files, faults injected per engine (FaultPlan).
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "io/fault.h"
#include "tests/util/on_ranks.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using testing::TempDir;
constexpr double kTimeoutS = 30;          // strata.timeout of every collective here

// Both ranks' results of one call.
struct Outcome {
  std::vector<Status> st = std::vector<Status>(2);
};

// The two rank threads meet here after each call: a rank that failed stays
// alive (its communicator open, as a trainer that handles the error) while
// the other may still wait in a collective. (A rank that returned would
// close its sockets, and its peer would fail at once for that reason.)
class Meet {
 public:
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int gen = gen_;
    if (++count_ == 2) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    // A rank whose assertion failed left its body: its peer goes on after
    // the bound (the test has failed already) instead of hanging the join.
    if (!cv_.wait_for(lock, std::chrono::duration<double>(3 * kTimeoutS), [&] { return gen_ != gen; }))
      ADD_FAILURE() << "the other rank never came (its body ended early: see its failure)";
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int count_ = 0, gen_ = 0;
};

template <typename Fn>
void Timed(Outcome& o, int rank, Meet& meet, Fn&& fn) {
  o.st[static_cast<size_t>(rank)] = fn();
  meet.Wait();
}

// Every rank failed, fast; rank 0 names rank 1 as the one that failed.
void ExpectAllFailFastNamingRank1(const Outcome& o, const char* what) {
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(o.st[static_cast<size_t>(r)].ok()) << what << ": rank " << r << " returned OK beside rank 1's failure";
    // Fast: by the agreement, not by the timeout (no time compared: CI is loaded).
    EXPECT_NE(o.st[static_cast<size_t>(r)].code(), Code::kTimeout)
        << what << ": rank " << r << " waited for its peer: " << o.st[static_cast<size_t>(r)].ToString();
  }
  EXPECT_NE(o.st[0].message().find("rank 1"), std::string::npos) << what << ": " << o.st[0].ToString();
}

std::unique_ptr<Engine> MakeEngine(const std::string& json, net::Communicator& comm,
                                   std::shared_ptr<FaultPlan> faults = nullptr, bool overlap_step = false) {
  auto c = ParseConfig(json);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (!c.ok()) return nullptr;
  EngineOptions eo;
  eo.comm = &comm;
  eo.force_no_gpu = true;
  eo.faults = std::move(faults);
  eo.overlap_step = overlap_step;
  auto e = Engine::Create(*c, eo);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

std::vector<float> Values(uint64_t n, float base) {
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = base + 0.001f * static_cast<float>(i % 997);
  return v;
}

constexpr uint64_t kNumel = 65536;

Status AddGroups(Engine& e) {
  for (int g = 0; g < 2; ++g) {
    const std::vector<float> init = Values(kNumel, 0.5f + static_cast<float>(g));
    STRATA_RETURN_IF_ERROR(e.AddParam(g, "g" + std::to_string(g), kNumel, init.data()).status());
  }
  return Status::Ok();
}

// Stage 2, W, M, V on NVMe in `dir`.
std::string Stage2(const std::string& dir) {
  return R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir +
         R"("}}, "strata": {"device_budget": "64MiB", "host_budget": "64MiB", "timeout": )" +
         std::to_string(static_cast<int>(kTimeoutS)) + "}}";
}

// Build's rank-local part (the NVMe tier here: rank 1's swap folder is a
// file) failed on that rank alone: the other built on into the components'
// collectives and failed only at strata.timeout, naming the collective.
TEST(RanksAgree, ABuildThatFailsOnOneRankFailsEveryRankAtOnce) {
  TempDir d0, d1;
  const std::string not_a_folder = d1.path() + "/file";
  std::ofstream(not_a_folder) << "x";
  Outcome o;
  Meet meet;
  testing::OnRanks(2, [&](int rank, net::Communicator& comm) {
    auto e = MakeEngine(Stage2(rank == 0 ? d0.path() : not_a_folder), comm);
    ASSERT_TRUE(e);
    ASSERT_TRUE(AddGroups(*e).ok());
    Timed(o, rank, meet, [&] { return e->Build(); });
  }, kTimeoutS);
  ExpectAllFailFastNamingRank1(o, "build");
  EXPECT_NE(o.st[1].message().find(not_a_folder), std::string::npos) << o.st[1].ToString();
}

// Build's last steps (the overlapped step's room: its allocation fails on
// rank 1, injected) failed on rank 1 alone: rank 0 had built its room and
// copies of G, and its failed build kept them, charged to its host budget (a
// failed build must leave nothing behind: a build called again found its
// budget short).
TEST(RanksAgree, ABuildFailingInItsLastStepsLeavesNothingBehind) {
  Outcome o;
  Meet meet;
  std::vector<uint64_t> used_after(2, 1);
  std::vector<int> fired(2, 0);
  testing::OnRanks(2, [&](int rank, net::Communicator& comm) {
    auto faults = std::make_shared<FaultPlan>();
    if (rank == 1) faults->ArmHostAllocations(1 << 20);  // the room's
    auto e = MakeEngine(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, )"
                        R"("gradient_clipping": 1.0, "strata": {"host_budget": "64MiB", "speculation": "always", )"
                        R"("speculation_host_bytes": "1MiB", "timeout": )" +
                            std::to_string(static_cast<int>(kTimeoutS)) + "}}",
                        comm, faults, /*overlap_step=*/true);
    ASSERT_TRUE(e);
    ASSERT_TRUE(AddGroups(*e).ok());
    Timed(o, rank, meet, [&] { return e->Build(); });
    used_after[static_cast<size_t>(rank)] = e->stats().host.used;
    fired[static_cast<size_t>(rank)] = faults->fired();
  }, kTimeoutS);
  ASSERT_EQ(fired[1], 1) << "rank 1's room was not allocated: the case is not made";
  ExpectAllFailFastNamingRank1(o, "build");
  EXPECT_NE(o.st[1].message().find("speculation_host_bytes"), std::string::npos) << o.st[1].ToString();
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(used_after[static_cast<size_t>(r)], 0u) << "rank " << r << "'s failed build left host memory charged";
}

// A step whose peer is gone (its communicator closed: the process died)
// cannot be finished by calling it again, as its error said: no collective
// can run on the broken communicator. The error says to restart every rank.
TEST(RanksAgree, AStepWhosePeerIsGoneSaysRestartNotCallAgain) {
  TempDir d0, d1;
  Status step;
  testing::OnRanks(2, [&](int rank, net::Communicator& comm) {
    auto e = MakeEngine(Stage2(rank == 0 ? d0.path() : d1.path()), comm);
    ASSERT_TRUE(e);
    ASSERT_TRUE(AddGroups(*e).ok());
    ASSERT_TRUE(e->Build().ok());
    for (int g = 0; g < 2; ++g) {
      const std::vector<float> grads = Values(e->group_numel(g), 0.01f);
      ASSERT_TRUE(e->Grads(g, grads.data(), DType::kF32).ok());
    }
    if (rank == 1) return;  // rank 1 leaves: its sockets close
    auto r = e->Step({});
    step = r.ok() ? Status::Ok() : r.status();
  }, kTimeoutS);
  ASSERT_FALSE(step.ok()) << "rank 0's step went through without its peer";
  EXPECT_NE(step.message().find("restart every rank"), std::string::npos) << step.ToString();
  EXPECT_EQ(step.message().find("call step again"), std::string::npos) << step.ToString();
}

// A save, or a write_state, that one rank refuses (it still holds a group it
// fetched) is refused on every rank at once; the communicator is intact, so
// once the group is released both go through.
TEST(RanksAgree, ASaveOrWriteStateOneRankRefusesIsRefusedOnEveryRankAndTheRanksGoOn) {
  TempDir d0, d1, ckpt;
  Outcome save, write, save_after, write_after;
  Meet meet;
  testing::OnRanks(2, [&](int rank, net::Communicator& comm) {
    auto e = MakeEngine(Stage2(rank == 0 ? d0.path() : d1.path()), comm);
    ASSERT_TRUE(e);
    ASSERT_TRUE(AddGroups(*e).ok());
    ASSERT_TRUE(e->Build().ok());
    if (rank == 1) {
      ASSERT_TRUE(e->Fetch(0).ok());  // (stage 2: a fetch gathers nothing)
    }
    Timed(save, rank, meet, [&] { return e->SaveCheckpoint(ckpt.path(), "t", nullptr, 0); });
    const std::vector<float> m = Values(e->group_numel(1), 3.0f);
    Timed(write, rank, meet, [&] { return e->WriteState(1, Engine::OptimizerState::kExpAvg, m.data()); });
    if (rank == 1) {
      ASSERT_TRUE(e->Release(0).ok());
    }
    Timed(save_after, rank, meet, [&] { return e->SaveCheckpoint(ckpt.path(), "t", nullptr, 0); });
    Timed(write_after, rank, meet, [&] { return e->WriteState(1, Engine::OptimizerState::kExpAvg, m.data()); });
  }, kTimeoutS);
  ExpectAllFailFastNamingRank1(save, "checkpoint save");
  ExpectAllFailFastNamingRank1(write, "write_state");
  EXPECT_NE(save.st[1].message().find("group 0 is fetched"), std::string::npos) << save.st[1].ToString();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(save_after.st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << save_after.st[static_cast<size_t>(r)].ToString();
    EXPECT_TRUE(write_after.st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << write_after.st[static_cast<size_t>(r)].ToString();
  }
}

// A load whose writes fail on one rank (EIO) is agreed before P is
// recomputed (a gather at stage 2): the failing rank skipped the gathers its
// peer was in, both failed COMM with the communicator broken, and no load
// could ever mend the state. Now both fail naming the I/O error's rank, and
// the next load restores the saved state on both.
TEST(RanksAgree, ALoadFailingOnOneRankLeavesTheRanksAbleToLoadAgain) {
  TempDir d0, d1, ckpt;
  Outcome bad, good;
  Meet meet;
  std::vector<std::vector<float>> saved(2), loaded(2);
  testing::OnRanks(2, [&](int rank, net::Communicator& comm) {
    auto faults = std::make_shared<FaultPlan>();
    auto e = MakeEngine(Stage2(rank == 0 ? d0.path() : d1.path()), comm, faults);
    ASSERT_TRUE(e);
    ASSERT_TRUE(AddGroups(*e).ok());
    ASSERT_TRUE(e->Build().ok());
    const uint64_t n = e->group_numel(0);
    saved[static_cast<size_t>(rank)].resize(n);
    ASSERT_TRUE(e->ReadState(0, Engine::OptimizerState::kMaster, saved[static_cast<size_t>(rank)].data()).ok());
    ASSERT_TRUE(e->SaveCheckpoint(ckpt.path(), "t", nullptr, 0).ok());
    const std::vector<float> other = Values(n, 9.0f);
    ASSERT_TRUE(e->WriteState(0, Engine::OptimizerState::kMaster, other.data()).ok());
    if (rank == 1) faults->Arm(FaultPlan::Ops::kWrites, EIO, /*skip=*/0, 1);
    Timed(bad, rank, meet, [&] { return e->LoadCheckpoint(ckpt.path(), "t", nullptr); });
    faults->Disarm();
    Timed(good, rank, meet, [&] { return e->LoadCheckpoint(ckpt.path(), "t", nullptr); });
    loaded[static_cast<size_t>(rank)].resize(n);
    ASSERT_TRUE(e->ReadState(0, Engine::OptimizerState::kMaster, loaded[static_cast<size_t>(rank)].data()).ok());
  }, kTimeoutS);
  ExpectAllFailFastNamingRank1(bad, "checkpoint load");
  EXPECT_EQ(bad.st[1].code(), Code::kIo) << bad.st[1].ToString();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(good.st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << good.st[static_cast<size_t>(r)].ToString();
    EXPECT_EQ(loaded[static_cast<size_t>(r)], saved[static_cast<size_t>(r)]) << "rank " << r;
  }
}

// Stage 3: a fetch whose copy cannot be made on one rank (its device budget
// full of a group it holds) enters the gather refusing it: the other rank's
// fetch fails at once (it waited for the gather until strata.timeout), and
// once the group is released both fetch.
TEST(RanksAgree, AStage3FetchOneRankCannotMakeFailsEveryRankAtOnceAndTheRanksGoOn) {
  Outcome fetch, again;
  Meet meet;
  testing::OnRanks(2, [&](int rank, net::Communicator& comm) {
    // Room for one group's copy (P fp32: 256 KiB), not two.
    auto e = MakeEngine(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"}, "stage3_prefetch_bucket_size": 1},
        "strata": {"device_budget": "384KiB", "host_budget": "64MiB", "timeout": )" +
                            std::to_string(static_cast<int>(kTimeoutS)) + "}}",
                        comm);
    ASSERT_TRUE(e);
    ASSERT_TRUE(AddGroups(*e).ok());
    Status built = e->Build();
    ASSERT_TRUE(built.ok()) << built.ToString();
    ASSERT_TRUE(e->Fetch(0).ok());
    if (rank == 0) {
      ASSERT_TRUE(e->Release(0).ok());
    }
    Timed(fetch, rank, meet, [&] { return e->Fetch(1).status(); });
    if (fetch.st[static_cast<size_t>(rank)].ok()) {
      ASSERT_TRUE(e->Release(1).ok());
    }
    if (rank == 1) {
      ASSERT_TRUE(e->Release(0).ok());
    }
    Timed(again, rank, meet, [&] { return e->Fetch(1).status(); });
    if (again.st[static_cast<size_t>(rank)].ok()) {
      ASSERT_TRUE(e->Release(1).ok());
    }
  }, kTimeoutS);
  ExpectAllFailFastNamingRank1(fetch, "stage-3 fetch");
  // Every rank fails with the refusing rank's code (a trainer that retries a
  // NOMEM does so on every rank alike).
  EXPECT_EQ(fetch.st[1].code(), Code::kNoMem) << fetch.st[1].ToString();
  EXPECT_EQ(fetch.st[0].code(), Code::kNoMem) << fetch.st[0].ToString();
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(again.st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << again.st[static_cast<size_t>(r)].ToString();
}

}  // namespace
}  // namespace strata
