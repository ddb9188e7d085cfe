// ActivationStore on real tiers: a host arena, a real io_uring on a real swap
// file. Stashes come back bitwise, in host memory or through NVMe (read
// ahead of backward's redeems); the budgets hold; a flipped byte on the disk
// is CORRUPT and never handed out; misuse is refused by name. Also through
// the engine: the config keys and their refusals, and under the strict
// device tier (copies through the device tier that lag).
#include <fcntl.h>
#include <sys/stat.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <vector>

#include "engine/activations/activation_store.h"
#include "engine/engine.h"
#include "io/fault.h"
#include "io/file_storage.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using testing::TempDir;

struct Rig {
  TempDir dir;
  std::unique_ptr<FileStorage> storage;
  std::unique_ptr<DeviceTier> device;
  std::unique_ptr<HostTier> host;
  std::unique_ptr<NvmeTier> nvme;
  std::unique_ptr<StatsRecorder> stats;
  std::unique_ptr<ActivationStore> store;

  Rig(uint64_t arena, uint64_t swap, uint64_t window, bool strict = false, int folders = 1) {
    storage = std::move(FileStorage::Create({})).value();
    device = std::move(DeviceTier::Create({.budget = 64 * kMiB, .force_host_arena = true, .strict = strict})).value();
    host = std::make_unique<HostTier>(HostTierOptions{.budget = arena + 8 * kMiB, .pin = false,
                                                      .storage = storage.get()});
    std::vector<std::string> dirs = {dir.path()};
    for (int i = 1; i < folders; ++i) {
      dirs.push_back(dir.path() + "/f" + std::to_string(i));
      EXPECT_EQ(0, ::mkdir(dirs.back().c_str(), 0700));
    }
    if (swap) nvme = std::move(NvmeTier::Create({.dirs = dirs, .budget = swap, .storage = storage.get()})).value();
    stats = std::make_unique<StatsRecorder>(0, "");
    store = std::make_unique<ActivationStore>(ActivationOptions{.host_bytes = arena, .nvme_bytes = swap, .window = window},
                                              *device, *host, nvme.get(), *stats);
    EXPECT_TRUE(store->Init().ok());
  }
};

std::vector<float> Values(size_t n, int seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Forward stashes, backward redeems in reverse: bitwise, every one.
void ForwardBackward(ActivationStore& s, int items, size_t floats, int seed) {
  std::vector<uint64_t> handles;
  for (int i = 0; i < items; ++i) {
    const std::vector<float> v = Values(floats + static_cast<size_t>(i), seed + i);
    auto h = s.Stash(v.data(), v.size() * 4);
    ASSERT_TRUE(h.ok()) << i << ": " << h.status().ToString();
    handles.push_back(*h);
  }
  for (int i = items - 1; i >= 0; --i) {
    const std::vector<float> want = Values(floats + static_cast<size_t>(i), seed + i);
    std::vector<float> got(want.size(), -1.0f);
    Status st = s.Redeem(handles[static_cast<size_t>(i)], got.data(), got.size() * 4);
    ASSERT_TRUE(st.ok()) << i << ": " << st.ToString();
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << "stash " << i << " came back changed";
  }
}

TEST(Activations, HostArenaRoundTripAndFullIsRefusedByName) {
  Rig r(1 * kMiB, 0, 0);
  ForwardBackward(*r.store, 6, 30000, 1);
  ActivationStats a = r.store->stats();
  EXPECT_GT(a.stashed_host_bytes, 0u);
  EXPECT_EQ(a.stashed_nvme_bytes, 0u);
  EXPECT_EQ(a.redeemed, 6u);
  EXPECT_EQ(a.live_bytes, 0u);
  // Full, and no swap: refused, naming the key; nothing changed.
  std::vector<float> v(100000);
  std::vector<uint64_t> kept;
  Status last;
  for (int i = 0; i < 4; ++i) {
    auto h = r.store->Stash(v.data(), v.size() * 4);
    if (!h.ok()) { last = h.status(); break; }
    kept.push_back(*h);
  }
  ASSERT_EQ(last.code(), Code::kNoMem) << last.ToString();
  EXPECT_NE(last.message().find("strata.activation_host_bytes"), std::string::npos) << last.message();
  EXPECT_NE(last.message().find("activation_nvme_bytes 0"), std::string::npos) << last.message();
  for (uint64_t h : kept) EXPECT_TRUE(r.store->Drop(h).ok());
  EXPECT_EQ(r.store->stats().live_bytes, 0u);
  EXPECT_LE(r.host->peak(), r.host->budget());
}

// A stash larger than the arena less the prefetch window goes on to NVMe at
// once: it passes through the arena all the same, and counts as stashed into
// host memory as every stash does (strata.h), and as sent on to NVMe.
// Before, it counted as NVMe bytes only.
TEST(Activations, AStashSentToNvmeAtOnceCountsAsStashedToHostToo) {
  Rig r(512 * kKiB, 16 * kMiB, 256 * kKiB);
  const std::vector<float> v = Values(75 * 1024, 7);  // 300 KiB: over 512 KiB less the 256 KiB window
  auto h = r.store->Stash(v.data(), v.size() * 4);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  const ActivationStats a = r.store->stats();
  EXPECT_EQ(a.stashed_nvme_bytes, v.size() * 4) << "it went on to NVMe at once";
  EXPECT_EQ(a.stashed_host_bytes, v.size() * 4);
  std::vector<float> got(v.size());
  ASSERT_TRUE(r.store->Redeem(*h, got.data(), got.size() * 4).ok());
  EXPECT_EQ(0, std::memcmp(got.data(), v.data(), v.size() * 4));
}

TEST(Activations, NvmeSpillIsReadAheadOfTheRedeems) {
  // 24 stashes of about 128 KiB through a 512 KiB arena: most go to NVMe.
  Rig r(512 * kKiB, 16 * kMiB, 256 * kKiB);
  for (int step = 0; step < 2; ++step) ForwardBackward(*r.store, 24, 32 * 1024, 10 * step);
  const ActivationStats a = r.store->stats();
  EXPECT_GT(a.stashed_nvme_bytes, 24u * 100 * 1024) << "most stashes should have gone to NVMe";
  // Every stash counts as stashed into host memory (it is, at first); those
  // sent on to NVMe count there too, once (strata.h: act_host_bytes, act_nvme_bytes).
  uint64_t stashed = 0;  // ForwardBackward's stash i holds floats + i floats
  for (int i = 0; i < 24; ++i) stashed += 2 * (32 * 1024 + static_cast<uint64_t>(i)) * 4;
  EXPECT_EQ(a.stashed_host_bytes, stashed);
  EXPECT_LE(a.stashed_nvme_bytes, a.stashed_host_bytes);
  EXPECT_GT(a.prefetch_hits, 0u) << "no redeem found its stash read ahead";
  EXPECT_EQ(a.redeemed, 48u);
  EXPECT_EQ(a.live_bytes, 0u);
  EXPECT_LE(r.host->peak(), r.host->budget());
  EXPECT_LE(r.nvme->peak(), r.nvme->budget());
  r.store->WaitIdle();
  EXPECT_EQ(r.nvme->used(), 0u) << "a redeemed stash left its swap taken";
}

// With several swap folders a block on NVMe is striped, each stripe
// aligned, but its I/O moves only the block's aligned bytes: a stash takes
// that of the arena, not the stripes' padding. Before, at 3 folders a 4 KiB
// stash took 12 KiB of the arena, so 12 of them sent 8 on to NVMe.
TEST(Activations, AStashTakesItsAlignedBytesOfTheArenaAtAnyNumberOfFolders) {
  Rig r(48 * kKiB, 16 * kMiB, 0, /*strict=*/false, /*folders=*/3);
  ForwardBackward(*r.store, 12, 1024 - 12, 3);  // 4 KiB each, less a few floats
  const ActivationStats a = r.store->stats();
  EXPECT_EQ(a.stashed_nvme_bytes, 0u) << "twelve 4 KiB stashes fit a 48 KiB arena";
  EXPECT_EQ(a.redeemed, 12u);
  // Beyond it they go through three folders' stripes and come back bitwise
  // (odd sizes: each block's last stripe is short), the swap charged by what
  // they take on disk and given back.
  for (int step = 0; step < 2; ++step) ForwardBackward(*r.store, 20, 3000 + 7 * static_cast<size_t>(step), 20 * step);
  const ActivationStats b = r.store->stats();
  EXPECT_GT(b.stashed_nvme_bytes, 0u) << "forty 12 KiB stashes should not all fit a 48 KiB arena";
  EXPECT_EQ(b.live_bytes, 0u);
  EXPECT_LE(r.host->peak(), r.host->budget());
  EXPECT_LE(r.nvme->peak(), r.nvme->budget());
  r.store->WaitIdle();
  EXPECT_EQ(r.nvme->used(), 0u) << "a redeemed stash left its swap taken";
}

TEST(Activations, StrictDeviceTierCopiesBitwise) {
  Rig r(512 * kKiB, 16 * kMiB, 128 * kKiB, /*strict=*/true);
  ASSERT_TRUE(r.device->separate());
  ForwardBackward(*r.store, 12, 40000, 3);
}

TEST(Activations, AFlippedByteOnTheDiskIsCorruptNeverData) {
  Rig r(128 * kKiB, 4 * kMiB, 64 * kKiB);
  const std::vector<float> v = Values(24 * 1024, 7);  // 96 KiB: leaves less than the window free: to NVMe
  auto h = r.store->Stash(v.data(), v.size() * 4);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  r.store->WaitIdle();
  ASSERT_EQ(r.store->stats().stashed_nvme_bytes, v.size() * 4);
  const int fd = ::open(r.nvme->paths()[0].c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, 4096), 1);
  b ^= 0x01;
  ASSERT_EQ(::pwrite(fd, &b, 1, 4096), 1);
  ::close(fd);
  std::vector<float> got(v.size(), 0.0f);
  Status st = r.store->Redeem(*h, got.data(), got.size() * 4);
  ASSERT_EQ(st.code(), Code::kCorrupt) << st.ToString();
  EXPECT_NE(st.message().find("stash"), std::string::npos) << st.message();
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float x) { return x == 0.0f; })) << "corrupt data was handed out";
}

TEST(Activations, MisuseIsRefusedByName) {
  Rig r(256 * kKiB, 0, 0);
  std::vector<float> v(1000, 1.0f);
  EXPECT_EQ(r.store->Stash(v.data(), 0).status().code(), Code::kInvalid);
  EXPECT_EQ(r.store->Stash(nullptr, 4).status().code(), Code::kInvalid);
  std::vector<float> big(300 * 1024);
  Status st = r.store->Stash(big.data(), big.size() * 4).status();
  EXPECT_EQ(st.code(), Code::kInvalid);
  EXPECT_NE(st.message().find("larger than strata.activation_host_bytes"), std::string::npos) << st.message();
  // A count near 2^64 (a -1 through a binding) is too large as well, not
  // padded round to a small one (and 2^64 bytes copied).
  for (uint64_t huge : {~uint64_t{0}, ~uint64_t{0} - 4000}) {
    st = r.store->Stash(v.data(), huge).status();
    EXPECT_EQ(st.code(), Code::kInvalid) << huge;
    EXPECT_NE(st.message().find("larger than strata.activation_host_bytes"), std::string::npos) << st.message();
  }
  auto h = r.store->Stash(v.data(), v.size() * 4);
  ASSERT_TRUE(h.ok());
  std::vector<float> got(1000);
  st = r.store->Redeem(*h, got.data(), 999 * 4);
  EXPECT_EQ(st.code(), Code::kInvalid);
  EXPECT_NE(st.message().find("holds 4000 bytes, not 3996"), std::string::npos) << st.message();
  EXPECT_TRUE(r.store->Redeem(*h, got.data(), 4000).ok());
  st = r.store->Redeem(*h, got.data(), 4000);
  EXPECT_EQ(st.code(), Code::kInvalid) << "a second redeem";
  EXPECT_EQ(r.store->Drop(*h).code(), Code::kInvalid);
}

std::unique_ptr<Engine> EngineWith(const std::string& strata_keys, const std::string& dir, Status* built) {
  auto cfg = ParseConfig(R"({"strata": {)" + strata_keys + R"("host_budget": "64MiB", "nvme_paths": [")" + dir +
                         R"("]}})");
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  EngineOptions eo;
  eo.force_no_gpu = true;
  auto e = Engine::Create(*cfg, eo);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  std::vector<float> w(1000, 0.5f);
  EXPECT_TRUE((*e)->AddParam(0, "w", w.size(), w.data()).ok());
  *built = (*e)->Build();
  return std::move(e).value();
}

TEST(Activations, ThroughTheEngine) {
  TempDir dir;
  Status built;
  auto e = EngineWith(R"("activation_host_bytes": "256KiB", "activation_nvme_bytes": "8MiB", )"
                      R"("activation_prefetch_bytes": "128KiB", )",
                      dir.path(), &built);
  ASSERT_TRUE(built.ok()) << built.ToString();
  std::vector<uint64_t> hs;
  for (int i = 0; i < 10; ++i) {
    const std::vector<float> v = Values(20000, i);
    auto h = e->Stash(v.data(), v.size() * 4);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    hs.push_back(*h);
  }
  for (int i = 9; i >= 0; --i) {
    std::vector<float> got(20000);
    Status rd = e->Redeem(hs[static_cast<size_t>(i)], got.data(), got.size() * 4);
    ASSERT_TRUE(rd.ok()) << i << ": " << rd.ToString();
    const std::vector<float> want = Values(20000, i);
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << i;
  }
  const EngineStats s = e->stats();
  EXPECT_GT(s.act_nvme_bytes, 0u);
  EXPECT_EQ(s.act_redeemed, 10u);
  EXPECT_LE(s.host.peak, s.host.budget);
  EXPECT_LE(s.nvme.peak, s.nvme.budget);
  // No store configured: stash says which key makes one.
  TempDir dir2;
  auto plain = EngineWith("", dir2.path(), &built);
  ASSERT_TRUE(built.ok()) << built.ToString();
  std::vector<float> v(10);
  Status st = plain->Stash(v.data(), 40).status();
  EXPECT_EQ(st.code(), Code::kState);
  EXPECT_NE(st.message().find("strata.activation_host_bytes is 0"), std::string::npos) << st.message();
  // An arena that does not fit the host budget beside the staging: CONFIG
  // before anything is allocated, naming it with the plan (it was NOMEM at
  // the arena's allocation, after the state was built).
  TempDir dir4;
  auto big = EngineWith(R"("activation_host_bytes": "64MiB", )", dir4.path(), &built);
  EXPECT_EQ(built.code(), Code::kConfig) << built.ToString();
  EXPECT_NE(built.message().find("64.00 MiB of the activations' arena (strata.activation_host_bytes)"), std::string::npos)
      << built.message();
  EXPECT_EQ(big->stats().host.peak, 0u) << "refused after allocating";
  // NVMe swap without the arena it passes through: refused at build, by name.
  TempDir dir3;
  auto bad = EngineWith(R"("activation_nvme_bytes": "8MiB", )", dir3.path(), &built);
  EXPECT_EQ(built.code(), Code::kConfig) << built.ToString();
  EXPECT_NE(built.message().find("activation_host_bytes"), std::string::npos) << built.message();
}

// An engine of `json` with `faults`, one parameter group of 1000 halves, built.
std::unique_ptr<Engine> BuiltWithFaults(const std::string& json, std::shared_ptr<FaultPlan> faults) {
  auto cfg = ParseConfig(json);
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  if (!cfg.ok()) return nullptr;
  EngineOptions eo;
  eo.force_no_gpu = true;
  eo.faults = std::move(faults);
  auto e = Engine::Create(*cfg, eo);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return nullptr;
  std::vector<float> w(1000, 0.5f);
  const Status added = (*e)->AddParam(0, "w", w.size(), w.data()).status();
  const Status built = added.ok() ? (*e)->Build() : added;
  EXPECT_TRUE(built.ok()) << built.ToString();
  return built.ok() ? std::move(e).value() : nullptr;
}

// A stash dropped while its write to the swap is in flight: the write goes
// on in the store's thread. A checkpoint save then links the swap file (W,
// M, V on NVMe, one folder): it waits for the write, where it failed
// ("snapshot with writes in flight", INTERNAL).
TEST(Activations, ASaveWaitsForTheWriteOfADroppedStash) {
  TempDir dir, ckpt;
  auto faults = std::make_shared<FaultPlan>();
  auto e = BuiltWithFaults(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                               dir.path() + R"("}}, "strata": {"activation_host_bytes": "256KiB",
      "activation_nvme_bytes": "8MiB", "activation_prefetch_bytes": "128KiB", "host_budget": "64MiB"}})",
                           faults);
  ASSERT_TRUE(e);
  faults->SlowWrites(300);
  std::vector<uint64_t> hs;
  for (int i = 0; i < 6; ++i) {  // 480 KB through a 256 KiB arena: the first ones go on to NVMe
    const std::vector<float> v = Values(20000, i);
    auto h = e->Stash(v.data(), v.size() * 4);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    hs.push_back(*h);
  }
  for (uint64_t h : hs) ASSERT_TRUE(e->DropStash(h).ok());
  ASSERT_GT(e->stats().act_nvme_bytes, 0u) << "nothing went to NVMe: the case is not made";
  const Status st = e->SaveCheckpoint(ckpt.path(), "t", nullptr, 0);
  EXPECT_TRUE(st.ok()) << st.ToString();
  faults->SlowWrites(0);
}

// The disk fails every write: a stash that needs the arena's room (its
// earliest stashes spilled to make it) fails at once, naming the failed
// write; it waited forever before, spilling the same stash again and again.
// Nothing is lost: the stashes kept in the arena redeem bitwise.
TEST(Activations, AFailingDiskRefusesTheStashNotHangs) {
  TempDir dir;
  auto faults = std::make_shared<FaultPlan>();
  auto e = BuiltWithFaults(R"({"strata": {"activation_host_bytes": "256KiB", "activation_nvme_bytes": "8MiB", )"
                           R"("activation_prefetch_bytes": "64KiB", "host_budget": "64MiB", "nvme_paths": [")" +
                               dir.path() + R"("]}})",
                           faults);
  ASSERT_TRUE(e);
  faults->Arm(FaultPlan::Ops::kWrites, EIO);
  std::vector<uint64_t> hs;
  Status refused;
  auto stashing = std::async(std::launch::async, [&] {
    for (int i = 0; i < 8 && refused.ok(); ++i) {  // 80 KB each through a 256 KiB arena
      const std::vector<float> v = Values(20000, i);
      auto h = e->Stash(v.data(), v.size() * 4);
      if (h.ok()) hs.push_back(*h);
      else refused = h.status();
    }
  });
  if (stashing.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    ADD_FAILURE() << "a stash waited 20 s on a disk whose writes fail";
    std::_Exit(1);  // (the stash never returns: nothing to join)
  }
  ASSERT_FALSE(refused.ok()) << "8 stashes of 80 KB fit a 256 KiB arena with every write failing";
  EXPECT_EQ(refused.code(), Code::kNoMem) << refused.ToString();
  EXPECT_NE(refused.message().find("write to NVMe failed"), std::string::npos) << refused.ToString();
  faults->Disarm();
  for (size_t i = hs.size(); i-- > 0;) {
    std::vector<float> got(20000);
    ASSERT_TRUE(e->Redeem(hs[i], got.data(), got.size() * 4).ok()) << i;
    const std::vector<float> want = Values(20000, static_cast<int>(i));
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << i;
  }
  // The disk back, the arena empty: stashes go on to NVMe again.
  for (int i = 0; i < 6; ++i) {
    const std::vector<float> v = Values(20000, i);
    auto h = e->Stash(v.data(), v.size() * 4);
    ASSERT_TRUE(h.ok()) << i << ": " << h.status().ToString();
  }
  EXPECT_GT(e->stats().act_nvme_bytes, 0u);
}

}  // namespace
}  // namespace strata
