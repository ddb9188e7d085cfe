// tiers/: budgets, host pinning and alignment, the device tier's host arena,
// and the NVMe tier's swap files, striping, checksums and refusals.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <sstream>

#include "base/align.h"
#include "base/log.h"
#include "io/file_storage.h"
#include "tests/util/temp_dir.h"
#include "tiers/device_tier.h"
#include "tiers/extent_allocator.h"
#include "tiers/gpu.h"
#include "tiers/host_tier.h"
#include "tiers/nvme_tier.h"

namespace strata {
namespace {

using testing::CheckPattern;
using testing::FillPattern;
using testing::TempDir;

std::unique_ptr<FileStorage> MakeStorage(std::shared_ptr<FaultPlan> faults = nullptr) {
  StorageOptions o;
  o.faults = std::move(faults);
  auto r = FileStorage::Create(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return std::move(r).value();
}

TEST(HostTier, AlignedPinnedAndExact) {
  auto storage = MakeStorage();
  HostTier host({.budget = 64 * kMiB, .storage = storage.get()});
  auto a = host.Allocate(5 * kMiB + 1);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_TRUE(IsAligned(a->ptr, kHugePage));
  EXPECT_EQ(a->charged, 5 * kMiB + 4096) << "exact to the page, not a power of two";
  EXPECT_EQ(host.used(), 5 * kMiB + 4096);
  std::memset(a->ptr, 0xAB, a->bytes);  // the whole range is usable
  auto too_big = host.Allocate(60 * kMiB);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), Code::kNoMem);
  EXPECT_NE(too_big.status().message().find("host tier budget exceeded"), std::string::npos);
  EXPECT_NE(too_big.status().message().find("64.00 MiB"), std::string::npos) << too_big.status().message();
  // A size near 2^64 is over the budget too, not rounded round to nothing.
  for (uint64_t huge : {~uint64_t{0}, ~uint64_t{0} - 100}) {
    auto wrapped = host.Allocate(huge);
    ASSERT_FALSE(wrapped.ok()) << huge;
    EXPECT_EQ(wrapped.status().code(), Code::kNoMem) << wrapped.status().ToString();
  }
  host.Free(*a);
  EXPECT_EQ(host.used(), 0u);
  EXPECT_EQ(host.peak(), 5 * kMiB + 4096);
}

TEST(DeviceTier, HostArenaCopiesInOrder) {
  auto t = DeviceTier::Create({.budget = 16 * kMiB, .force_host_arena = true});
  ASSERT_TRUE(t.ok());
  DeviceTier& dev = **t;
  EXPECT_FALSE(dev.on_gpu());
  auto d = dev.Allocate(kMiB);
  ASSERT_TRUE(d.ok());
  std::vector<uint8_t> src(kMiB), back(kMiB);
  FillPattern(src.data(), kMiB, 0, 9);
  auto in = dev.CopyIn(d->ptr, src.data(), kMiB);
  ASSERT_TRUE(in.ok());
  // The two directions are independent queues (like two streams): order
  // across them is the caller's, so wait for `in` before copying out.
  ASSERT_TRUE((*in)->Wait().ok());
  EXPECT_TRUE((*in)->Done());
  auto out = dev.CopyOut(back.data(), d->ptr, kMiB);
  ASSERT_TRUE((*out)->Wait().ok());
  EXPECT_EQ(CheckPattern(back.data(), kMiB, 0, 9), -1);
  EXPECT_FALSE(dev.Allocate(16 * kMiB).ok());
  dev.Free(*d);
}

// The strict host arena (STRATA_STRICT_DEVICE=1): separate memory that
// punishes a missing wait. A copy is not there when CopyIn returns (it lags
// on its thread); new and freed blocks read NaN; a freed block is the next
// one handed out, whatever the next size asked.
TEST(DeviceTier, StrictArenaLagsPoisonsAndReusesAtOnce) {
  auto t = DeviceTier::Create({.budget = 16 * kMiB, .force_host_arena = true, .strict = true});
  ASSERT_TRUE(t.ok());
  DeviceTier& dev = **t;
  EXPECT_FALSE(dev.on_gpu());
  EXPECT_TRUE(dev.strict());
  EXPECT_TRUE(dev.separate());
  const uint64_t n = 64 * kKiB;
  auto a = dev.Allocate(n * 4);
  ASSERT_TRUE(a.ok());
  const float* f = static_cast<const float*>(a->ptr);
  for (uint64_t i = 0; i < n; i += 997) EXPECT_TRUE(std::isnan(f[i])) << "a new block at element " << i;
  std::vector<float> src(n, 1.5f);
  // The copy lags: of 20 copies, (almost) every one is not done when CopyIn
  // returns, so a reader that does not wait reads old data; a loaded machine
  // may let the copy thread win a few times, never 20 times in a row. (Its
  // fence says so without a racy read of the data.)
  int unseen = 0;
  for (int k = 0; k < 20; ++k) {
    src.assign(n, 1.5f + static_cast<float>(k));
    auto in = dev.CopyIn(a->ptr, src.data(), n * 4);
    ASSERT_TRUE(in.ok());
    unseen += !(*in)->Done();
    ASSERT_TRUE((*in)->Wait().ok());
    EXPECT_EQ(f[0], src[0]);
    EXPECT_EQ(f[n - 1], src[n - 1]);
  }
  EXPECT_GT(unseen, 0) << "every copy landed before CopyIn returned: nothing would catch a missing wait";
  void* freed = a->ptr;
  dev.Free(*a);
  for (uint64_t i = 0; i < n; i += 997) EXPECT_TRUE(std::isnan(f[i])) << "a freed block at element " << i;
  auto b = dev.Allocate(n * 2);  // half the size: a plain pool would not take the freed block
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ptr, freed) << "the freed block is the next one handed out";
  dev.Free(*b);
  // The plain arena, for contrast: not separate, and its copies land alike.
  auto plain = DeviceTier::Create({.budget = 16 * kMiB, .force_host_arena = true});
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE((*plain)->separate());
  EXPECT_FALSE((*plain)->strict());
}

// gpu::SetDevice's result is an answer, not a formality: an index past the
// last GPU fails (without a GPU, every index does), naming the GPU.
TEST(Gpu, SetDeviceChecksItsIndex) {
  const int count = gpu::DeviceCount();
  const Status past = gpu::SetDevice(count);
  EXPECT_FALSE(past.ok()) << "GPU " << count << " of " << count;
  EXPECT_EQ(gpu::SetDevice(0).ok(), count > 0);
#if STRATA_HAVE_CUDA
  EXPECT_NE(past.message().find("GPU " + std::to_string(count)), std::string::npos) << past.ToString();
#endif
}

// HostTier with numa_bind false binds nothing; by default it binds to a node.
TEST(HostTier, NumaBindFalseBindsNothing) {
  HostTier unbound({.budget = 4 * kMiB, .pin = false, .numa_bind = false});
  EXPECT_EQ(unbound.numa_node(), -1);
  auto a = unbound.Allocate(kMiB);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  unbound.Free(*a);
  HostTier bound({.budget = 4 * kMiB, .pin = false});
  EXPECT_GE(bound.numa_node(), 0) << "where this process runs";
}

// A swap folder in memory (tmpfs: /dev/shm, /tmp in many containers) takes
// RAM that no budget counts: said once, naming the folder (it was silent,
// and in a memory-limited cgroup the OOM killer ended the build).
TEST(Tiers, ASwapFolderOnTmpfsIsSaid) {
  struct statfs fs {};
  if (::statfs("/dev/shm", &fs) != 0 || fs.f_type != 0x01021994 /* TMPFS_MAGIC */)
    GTEST_SKIP() << "/dev/shm is not a tmpfs here";
  char tmpl[] = "/dev/shm/strata-tiers-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  Logger().sinks().push_back(sink);
  {
    auto storage = MakeStorage();
    auto nvme = NvmeTier::Create({.dirs = {dir}, .budget = 4 * kMiB, .storage = storage.get()});
    EXPECT_TRUE(nvme.ok()) << nvme.status().ToString();
  }
  Logger().sinks().pop_back();
  std::filesystem::remove_all(dir);
  EXPECT_NE(out.str().find("nvme tier: " + dir + " is on tmpfs"), std::string::npos) << out.str();
}

// Random allocate/free on every tier: the peak never passes the budget.
TEST(Tiers, RandomAllocFreeNeverExceedsBudget) {
  TempDir dir;
  auto storage = MakeStorage();
  HostTier host({.budget = 8 * kMiB, .pin = false, .storage = storage.get()});
  auto dev = DeviceTier::Create({.budget = 8 * kMiB, .force_host_arena = true});
  auto nvme = NvmeTier::Create({.dirs = {dir.path()}, .budget = 8 * kMiB, .storage = storage.get()});
  ASSERT_TRUE(nvme.ok()) << nvme.status().ToString();
  std::vector<Tier*> tiers = {&host, dev->get(), nvme->get()};
  for (Tier* t : tiers) {
    std::mt19937_64 rng(7);
    std::vector<Allocation> live;
    int refused = 0;
    for (int i = 0; i < 2000; ++i) {
      if (live.empty() || rng() % 3) {
        const uint64_t bytes = 1 + rng() % (2 * kMiB);
        auto a = t->Allocate(bytes);
        if (a.ok()) {
          live.push_back(*a);
        } else {
          ++refused;
          if (t == dev->get()) {  // the pool's cached blocks never cause a refusal
            ASSERT_GT((*dev)->pool_stats().in_use + AlignUp(bytes, 256), t->budget());
          }
        }
      } else {
        const size_t k = rng() % live.size();
        t->Free(live[k]);
        live.erase(live.begin() + static_cast<long>(k));
      }
      ASSERT_LE(t->used(), t->budget()) << t->name();
    }
    EXPECT_LE(t->peak(), t->budget()) << t->name();
    EXPECT_GT(t->peak(), t->budget() / 2) << t->name() << ": the test should fill the tier";
    EXPECT_GT(refused, 0) << t->name();
    for (auto& a : live) t->Free(a);
    if (t == dev->get()) {
      EXPECT_EQ(t->used(), (*dev)->pool_stats().cached) << "freed device blocks stay cached, and counted";
      (*dev)->Trim();
    }
    EXPECT_EQ(t->used(), 0u) << t->name();
  }
}

// The device pool: a freed block serves the next allocation of its size
// (or up to 1/8 less) without a new device allocation; cached blocks count
// against the budget and give way, the largest first, to a block that would
// not fit otherwise.
// strata.device_pool false: every Free returns its block at once, uncharged.
TEST(DeviceTier, WithoutThePoolFreeReturnsTheBlock) {
  auto made = DeviceTier::Create({.budget = 10000 * 256, .force_host_arena = true, .pool = false});
  ASSERT_TRUE(made.ok());
  DeviceTier& t = **made;
  for (int i = 0; i < 3; ++i) {
    auto a = t.Allocate(4000 * 256);
    ASSERT_TRUE(a.ok());
    t.Free(*a);
    EXPECT_EQ(t.used(), 0u);
    EXPECT_EQ(t.pool_stats().cached, 0u);
  }
  EXPECT_EQ(t.pool_stats().raw_allocs, 3u);
  EXPECT_EQ(t.pool_stats().raw_frees, 3u);
  EXPECT_EQ(t.pool_stats().hits, 0u);
}

TEST(DeviceTier, PoolReusesBlocksWithinTheBudget) {
  auto made = DeviceTier::Create({.budget = 10000 * 256, .force_host_arena = true});
  ASSERT_TRUE(made.ok());
  DeviceTier& t = **made;
  auto a = t.Allocate(4000 * 256);
  ASSERT_TRUE(a.ok());
  void* first = a->ptr;
  t.Free(*a);
  EXPECT_EQ(t.pool_stats().cached, 4000u * 256);
  EXPECT_EQ(t.used(), 4000u * 256) << "a cached block stays charged";
  auto b = t.Allocate(4000 * 256 - 100);  // the same 256-aligned size
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ptr, first);
  EXPECT_EQ(t.pool_stats().raw_allocs, 1u);
  EXPECT_EQ(t.pool_stats().hits, 1u);
  t.Free(*b);
  auto c = t.Allocate(3600 * 256);  // the cached 4000 is within 1/8 of it
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->ptr, first);
  EXPECT_EQ(c->charged, 4000u * 256);
  t.Free(*c);
  auto d = t.Allocate(1000 * 256);  // 4000 is too large for it: a new block beside the cached one
  ASSERT_TRUE(d.ok());
  EXPECT_NE(d->ptr, first);
  EXPECT_EQ(t.pool_stats().raw_allocs, 2u);
  EXPECT_EQ(t.used(), 5000u * 256);
  // 8000 fits only once the cached 4000 goes: it is released, not refused.
  auto e = t.Allocate(8000 * 256);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(t.pool_stats().cached, 0u);
  EXPECT_EQ(t.pool_stats().raw_frees, 1u);
  EXPECT_EQ(t.used(), 9000u * 256);
  EXPECT_LE(t.peak(), t.budget());
  // Past the budget with nothing cached: refused, naming the tier.
  auto f = t.Allocate(2000 * 256);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("device"), std::string::npos) << f.status().ToString();
  t.Free(*d);
  t.Free(*e);
  t.Trim();
  EXPECT_EQ(t.used(), 0u);
  EXPECT_EQ(t.pool_stats().raw_frees, t.pool_stats().raw_allocs);
}

// A buffer of exactly `bytes` (a multiple of 4096) with an inaccessible page
// right after it: an I/O that reads or writes past the end fails (EFAULT).
class GuardedBuffer {
 public:
  explicit GuardedBuffer(uint64_t bytes) : bytes_(bytes) {
    void* m = ::mmap(nullptr, bytes + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(m, MAP_FAILED);
    EXPECT_EQ(::mprotect(static_cast<char*>(m) + bytes, 4096, PROT_NONE), 0);
    ptr_ = m;
  }
  ~GuardedBuffer() { ::munmap(ptr_, bytes_ + 4096); }
  void* get() const { return ptr_; }

 private:
  uint64_t bytes_;
  void* ptr_;
};

class NvmeRoundTrip : public ::testing::TestWithParam<int> {};

// Striped over 1, 2 or 3 folders, a block's I/O touches only its aligned
// size of the caller's buffer (BufferSize), whatever each stripe's padding.
TEST_P(NvmeRoundTrip, ByteSizesWithOffsetStampedPattern) {
  const int ndirs = GetParam();
  TempDir d[3];
  std::vector<std::string> dirs;
  for (int i = 0; i < ndirs; ++i) dirs.push_back(d[i].path());
  auto storage = MakeStorage();
  auto t = NvmeTier::Create({.dirs = dirs, .budget = 16 * kMiB, .storage = storage.get()});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  NvmeTier& nvme = **t;
  ASSERT_EQ(nvme.paths().size(), static_cast<size_t>(ndirs));
  EXPECT_NE(nvme.paths()[0].find("strata-swap.r0.s0.bin"), std::string::npos);
  for (const std::string& path : nvme.paths()) {  // the weights and moments: this user's alone, whatever the umask
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << path;
  }
  std::vector<Allocation> blocks;
  const std::vector<uint64_t> sizes = {1, 511, 512, 4095, 4096, 4097, 8192, 12288 + 5, kMiB + 1};
  for (uint64_t n : sizes) {
    auto a = nvme.Allocate(n);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_EQ(nvme.BufferSize(n), AlignUp(n, 4096));
    ASSERT_GE(nvme.PaddedSize(n), nvme.BufferSize(n));
    GuardedBuffer buf(nvme.BufferSize(n));
    FillPattern(buf.get(), n, a->id * 1000003, n);
    Status st = nvme.Write(*a, buf.get());
    ASSERT_TRUE(st.ok()) << n << " bytes over " << ndirs << " folders: " << st.ToString();
    blocks.push_back(*a);
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    // Nothing is read past the aligned size (the guard page after it).
    GuardedBuffer buf(nvme.BufferSize(sizes[i]));
    Status st = nvme.Read(blocks[i], buf.get());
    ASSERT_TRUE(st.ok()) << sizes[i] << " bytes over " << ndirs << " folders: " << st.ToString();
    EXPECT_EQ(CheckPattern(buf.get(), sizes[i], blocks[i].id * 1000003, sizes[i]), -1) << sizes[i];
  }
  for (auto& a : blocks) nvme.Free(a);
  EXPECT_EQ(nvme.used(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Dirs, NvmeRoundTrip, ::testing::Values(1, 2, 3));

struct Fixture {
  TempDir dir;
  std::unique_ptr<FileStorage> storage;
  std::unique_ptr<NvmeTier> nvme;
  Allocation block;
  void* buf = nullptr;
  uint64_t n = 300000;
  explicit Fixture(std::shared_ptr<FaultPlan> faults = nullptr) {
    storage = MakeStorage(std::move(faults));
    nvme = std::move(NvmeTier::Create({.dirs = {dir.path()}, .budget = 4 * kMiB, .storage = storage.get()})).value();
    block = *nvme->Allocate(n);
    buf = testing::AlignedAlloc(nvme->PaddedSize(n), nvme->align());
    FillPattern(buf, n, 0, 5);
  }
  ~Fixture() { std::free(buf); }
  void Poke(uint64_t offset) {
    int fd = ::open(nvme->paths()[0].c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    uint8_t b;
    ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
    b ^= 0x10;
    ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
    ::close(fd);
  }
};

TEST(NvmeTier, ASizeNearTwoToThe64IsOverTheBudget) {
  Fixture f;
  const uint64_t used = f.nvme->used();
  for (uint64_t huge : {~uint64_t{0}, ~uint64_t{0} - 100}) {
    auto a = f.nvme->Allocate(huge);
    ASSERT_FALSE(a.ok()) << huge << ": charged " << (a.ok() ? a->charged : 0);
    EXPECT_EQ(a.status().code(), Code::kNoSpace) << a.status().ToString();
  }
  EXPECT_EQ(f.nvme->used(), used);
}

TEST(NvmeTier, FlippedByteIsCorruptNamingFileAndOffset) {
  Fixture f;
  ASSERT_TRUE(f.nvme->Write(f.block, f.buf).ok());
  f.Poke(123456);
  Status st = f.nvme->Read(f.block, f.buf);
  ASSERT_EQ(st.code(), Code::kCorrupt) << st.ToString();
  EXPECT_NE(st.message().find(f.nvme->paths()[0]), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("offset 0"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("checksum mismatch"), std::string::npos);
}

TEST(NvmeTier, TruncatedSwapFileIsDetected) {
  Fixture f;
  ASSERT_TRUE(f.nvme->Write(f.block, f.buf).ok());
  ASSERT_EQ(::truncate(f.nvme->paths()[0].c_str(), 8192), 0);
  Status st = f.nvme->Read(f.block, f.buf);
  EXPECT_EQ(st.code(), Code::kCorrupt) << st.ToString();
  EXPECT_NE(st.message().find("strata-swap"), std::string::npos) << st.message();
}

TEST(NvmeTier, FailedWriteIsNeverServedAndCanBeRedone) {
  // Op 0 is the first write; op 1 the retry write.
  auto faults = std::make_shared<FaultPlan>(std::vector<Fault>{{0, Fault::kErrno, EIO}});
  Fixture f(faults);
  Status st = f.nvme->Write(f.block, f.buf);
  ASSERT_EQ(st.code(), Code::kIo);
  EXPECT_NE(st.message().find("strata-swap"), std::string::npos);
  EXPECT_EQ(testing::CheckPattern(f.buf, f.n, 0, 5), -1) << "the caller's data is untouched";
  void* back = testing::AlignedAlloc(f.nvme->PaddedSize(f.n), f.nvme->align());
  Status rs = f.nvme->Read(f.block, back);
  EXPECT_EQ(rs.code(), Code::kState) << rs.ToString();
  ASSERT_TRUE(f.nvme->Write(f.block, f.buf).ok());
  ASSERT_TRUE(f.nvme->Read(f.block, back).ok());
  EXPECT_EQ(testing::CheckPattern(back, f.n, 0, 5), -1);
  std::free(back);
}

// Copy on write: a failed rewrite of a block leaves its previous contents
// readable; WaitWrite + Settle let several writes land (or not) together.
TEST(NvmeTier, FailedRewriteKeepsThePreviousContents) {
  auto faults = std::make_shared<FaultPlan>();
  Fixture f(faults);
  ASSERT_TRUE(f.nvme->Write(f.block, f.buf).ok());
  void* next = testing::AlignedAlloc(f.nvme->PaddedSize(f.n), f.nvme->align());
  FillPattern(next, f.n, 0, 9);
  faults->Arm(FaultPlan::Ops::kWrites, EIO, 0, 1);
  Status st = f.nvme->Write(f.block, next);
  ASSERT_EQ(st.code(), Code::kIo) << st.ToString();
  void* back = testing::AlignedAlloc(f.nvme->PaddedSize(f.n), f.nvme->align());
  ASSERT_TRUE(f.nvme->Read(f.block, back).ok());
  EXPECT_EQ(testing::CheckPattern(back, f.n, 0, 5), -1) << "the old contents, whole";
  // A write that succeeded but is discarded changes nothing either.
  auto p = f.nvme->StartWrite(f.block, next);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_TRUE(f.nvme->WaitWrite(*p).ok());
  f.nvme->Settle(*p, /*publish=*/false);
  ASSERT_TRUE(f.nvme->Read(f.block, back).ok());
  EXPECT_EQ(testing::CheckPattern(back, f.n, 0, 5), -1);
  // Published: the new contents.
  auto q = f.nvme->StartWrite(f.block, next);
  ASSERT_TRUE(q.ok());
  ASSERT_TRUE(f.nvme->WaitWrite(*q).ok());
  f.nvme->Settle(*q, /*publish=*/true);
  ASSERT_TRUE(f.nvme->Read(f.block, back).ok());
  EXPECT_EQ(testing::CheckPattern(back, f.n, 0, 9), -1);
  std::free(back);
  std::free(next);
}

// ExtentAllocator's best fit (smallest free range that fits, lowest offset
// among equals) against a plain scan of a reference free list, over random
// allocations, frees and growths of a few sizes (as a step's rewrites are):
// the same offset every time, the same free bytes and largest range.
TEST(ExtentAllocator, BestFitMatchesAScanOfTheFreeRanges) {
  std::mt19937_64 rng(11);
  constexpr uint64_t kAlign = 4096;
  ExtentAllocator ea(256 * kAlign, kAlign);
  std::map<uint64_t, uint64_t> ref{{0, 256 * kAlign}};  // offset -> length, coalesced
  uint64_t cap = 256 * kAlign;
  std::map<uint64_t, uint64_t> live;  // offset -> length
  auto ref_free = [&](uint64_t off, uint64_t len) {
    auto it = ref.emplace(off, len).first;
    auto next = std::next(it);
    if (next != ref.end() && off + it->second == next->first) {
      it->second += next->second;
      ref.erase(next);
    }
    if (it != ref.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == off) {
        prev->second += it->second;
        ref.erase(it);
      }
    }
  };
  const uint64_t sizes[] = {1, 3, 3, 7, 12, 12, 12, 30};
  for (int i = 0; i < 20000; ++i) {
    const uint64_t r = rng() % 100;
    if (r < 55 || live.empty()) {
      const uint64_t len = sizes[rng() % 8] * kAlign;
      auto best = ref.end();
      for (auto it = ref.begin(); it != ref.end(); ++it)
        if (it->second >= len && (best == ref.end() || it->second < best->second)) best = it;
      const uint64_t got = ea.Allocate(len);
      if (best == ref.end()) {
        ASSERT_EQ(got, UINT64_MAX) << "op " << i;
        continue;
      }
      ASSERT_EQ(got, best->first) << "op " << i;
      const uint64_t off = best->first, rest = best->second - len;
      ref.erase(best);
      if (rest) ref[off + len] = rest;
      live[off] = len;
    } else if (r < 98) {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      ea.Free(it->first, it->second);
      ref_free(it->first, it->second);
      live.erase(it);
    } else {
      const uint64_t grown = cap + (1 + rng() % 16) * kAlign;
      ea.Grow(grown);
      ref_free(cap, grown - cap);
      cap = grown;
    }
    uint64_t free_bytes = 0, largest = 0;
    for (const auto& [off, len] : ref) {
      free_bytes += len;
      largest = std::max(largest, len);
    }
    ASSERT_EQ(ea.free_bytes(), free_bytes) << "op " << i;
    ASSERT_EQ(ea.largest_free(), largest) << "op " << i;
    ASSERT_EQ(ea.free_ranges(), ref) << "op " << i;
  }
}

// AllocateScattered: the largest holes whole, the rest best fit; nothing
// taken when the holes together are too small; each piece frees alone.
TEST(ExtentAllocator, ScatteredTakesTheLargestHolesThenTheBestFit) {
  ExtentAllocator ea(16 * 4096, 4096);
  // Holes of 3, 5 and 2 pages, between taken pages.
  const uint64_t p = 4096;
  ASSERT_EQ(ea.Allocate(16 * p), 0u);
  ea.Free(1 * p, 3 * p);
  ea.Free(5 * p, 5 * p);
  ea.Free(11 * p, 2 * p);
  EXPECT_TRUE(ea.AllocateScattered(11 * p).empty()) << "10 pages free";
  EXPECT_EQ(ea.free_bytes(), 10 * p) << "nothing taken by a refusal";
  const auto got = ea.AllocateScattered(9 * p);
  const std::vector<std::pair<uint64_t, uint64_t>> want = {{5 * p, 5 * p}, {1 * p, 3 * p}, {11 * p, p}};
  EXPECT_EQ(got, want) << "5 whole, 3 whole, then 1 page best fit (from the 2-page hole)";
  EXPECT_EQ(ea.free_bytes(), p);
  for (const auto& [off, len] : got) ea.Free(off, len);
  EXPECT_EQ(ea.free_bytes(), 10 * p);
  EXPECT_EQ(ea.largest_free(), 5 * p);
  EXPECT_EQ(ea.AllocateScattered(4 * p), (std::vector<std::pair<uint64_t, uint64_t>>{{5 * p, 4 * p}}))
      << "one hole holds it: best fit, one piece";
}

// The rewrite tests' start: a tier over a fresh folder with two n-byte
// blocks in a budget of 2n, both written (pattern 3); `spare` and `grow`
// are NvmeTierOptions' spare and grow_for_holes. `buf` holds n bytes.
struct TwoWrittenBlocks {
  TwoWrittenBlocks(uint64_t n, uint64_t spare, bool grow) : n(n) {
    auto t = NvmeTier::Create(
        {.dirs = {dir.path()}, .budget = 2 * n, .spare = spare, .grow_for_holes = grow, .storage = storage.get()});
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    if (!t.ok()) return;
    tier = std::move(*t);
    auto x = tier->Allocate(n), y = tier->Allocate(n);
    EXPECT_TRUE(x.ok() && y.ok());
    if (!x.ok() || !y.ok()) return;
    a = *x;
    b = *y;
    buf = testing::AlignedAlloc(n, tier->align());
    FillPattern(buf, n, 0, 3);
    EXPECT_TRUE(tier->Write(a, buf).ok());
    EXPECT_TRUE(tier->Write(b, buf).ok());
    file = tier->paths()[0];
    size = std::filesystem::file_size(file);
  }
  ~TwoWrittenBlocks() { std::free(buf); }
  bool ok() const { return buf != nullptr; }
  // Both blocks read back hold pattern `p`.
  void ExpectBothHold(int p) {
    void* back = testing::AlignedAlloc(n, tier->align());
    for (const Allocation* x : {&a, &b}) {
      ASSERT_TRUE(tier->Read(*x, back).ok());
      EXPECT_EQ(testing::CheckPattern(back, n, 0, p), -1);
    }
    std::free(back);
  }

  const uint64_t n;
  TempDir dir;
  std::unique_ptr<FileStorage> storage = MakeStorage();
  std::unique_ptr<NvmeTier> tier;
  Allocation a, b;
  void* buf = nullptr;
  std::string file;
  uint64_t size = 0;  // the file's, once both are written
};

// GrowSpare: the swap file grows and its new end serves copy-on-write
// extents that did not fit before; a growth past the disk is NoSpace naming
// the folder, and the tier goes on as it was.
TEST(NvmeTier, GrowSpareMakesRoomForRewrites) {
  TwoWrittenBlocks t(2 * kMiB, 0, false);  // no spare: a rewrite has nowhere to go
  ASSERT_TRUE(t.ok());
  NvmeTier& nvme = *t.tier;
  FillPattern(t.buf, t.n, 0, 4);
  Status full = nvme.Write(t.a, t.buf);
  ASSERT_EQ(full.code(), Code::kNoSpace) << full.ToString();
  ASSERT_TRUE(nvme.GrowSpare(t.n).ok());
  EXPECT_GE(std::filesystem::file_size(t.file), t.size + t.n);
  ASSERT_TRUE(nvme.Write(t.a, t.buf).ok()) << "the grown end takes the rewrite";
  ASSERT_TRUE(nvme.Write(t.b, t.buf).ok()) << "and a's old extent the next";
  t.ExpectBothHold(4);
  Status past = nvme.GrowSpare(1ull << 50);
  EXPECT_EQ(past.code(), Code::kNoSpace) << past.ToString();
  EXPECT_NE(past.message().find(t.dir.path()), std::string::npos) << past.ToString();
  ASSERT_TRUE(nvme.Write(t.a, t.buf).ok()) << "unchanged after a refused growth";
}

// grow_for_holes: a rewrite that the free ranges together cannot hold grows
// the file by its size and lands; the data of every block stays as written.
TEST(NvmeTier, ARewriteWithNoHoleGrowsTheFiles) {
  TwoWrittenBlocks t(2 * kMiB, kMiB, true);  // a 1 MiB spare: no rewrite fits until the files grow
  ASSERT_TRUE(t.ok());
  NvmeTier& nvme = *t.tier;
  EXPECT_EQ(nvme.hole_growths(), 0u);
  FillPattern(t.buf, t.n, 0, 4);
  ASSERT_TRUE(nvme.Write(t.a, t.buf).ok()) << "grown for the rewrite";
  EXPECT_EQ(nvme.hole_growths(), 1u);
  EXPECT_GE(std::filesystem::file_size(t.file), t.size + t.n - kMiB);
  ASSERT_TRUE(nvme.Write(t.b, t.buf).ok()) << "a's old extent takes b's rewrite";
  EXPECT_EQ(nvme.hole_growths(), 1u) << "no growth while a hole fits";
  t.ExpectBothHold(4);
}

// A rewrite whose size no free range holds, though the free ranges together
// do, is scattered over them (no growth), reads back, and moves back to one
// range when one frees; a snapshot refuses a scattered block (the
// checkpoint then copies).
TEST(NvmeTier, ARewriteWithoutAHoleOfItsSizeIsScattered) {
  TempDir dir;
  auto storage = MakeStorage();
  const uint64_t n = 2 * kMiB;
  // a, b (2 MiB each) and three 1 MiB blocks fill 7 MiB; the first and the
  // last of those go: 2 MiB free, 1 MiB apart.
  auto made = NvmeTier::Create({.dirs = {dir.path()}, .budget = 7 * kMiB, .grow_for_holes = true, .storage = storage.get()});
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  NvmeTier& nvme = **made;
  std::vector<Allocation> x;
  for (uint64_t bytes : {n, n, kMiB, kMiB, kMiB}) {
    auto b = nvme.Allocate(bytes);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    x.push_back(*b);
  }
  const Allocation a = x[0], b = x[1];
  void* buf = testing::AlignedAlloc(n, nvme.align());
  void* back = testing::AlignedAlloc(n, nvme.align());
  FillPattern(buf, n, 0, 3);
  ASSERT_TRUE(nvme.Write(a, buf).ok());
  ASSERT_TRUE(nvme.Write(b, buf).ok());
  const uint64_t size = std::filesystem::file_size(nvme.paths()[0]);
  nvme.Free(x[2]);
  nvme.Free(x[4]);
  FillPattern(buf, n, 0, 5);
  ASSERT_TRUE(nvme.Write(a, buf).ok());
  EXPECT_EQ(nvme.scattered_writes(), 1u);
  EXPECT_EQ(nvme.hole_growths(), 0u);
  EXPECT_EQ(std::filesystem::file_size(nvme.paths()[0]), size) << "no growth";
  ASSERT_TRUE(nvme.Read(a, back).ok());
  EXPECT_EQ(testing::CheckPattern(back, n, 0, 5), -1);
  std::vector<NvmeTier::SnapshotRef> refs;
  Status snap = nvme.Snapshot(dir.path() + "/link", {a, b}, &refs);
  EXPECT_EQ(snap.code(), Code::kUnsupported) << snap.ToString();
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/link"));
  // b's rewrite takes a's old range whole, and a's next takes b's.
  FillPattern(buf, n, 0, 6);
  ASSERT_TRUE(nvme.Write(b, buf).ok());
  ASSERT_TRUE(nvme.Write(a, buf).ok());
  EXPECT_EQ(nvme.scattered_writes(), 1u);
  for (const Allocation* y : {&a, &b}) {
    ASSERT_TRUE(nvme.Read(*y, back).ok());
    EXPECT_EQ(testing::CheckPattern(back, n, 0, 6), -1);
  }
  std::free(buf);
  std::free(back);
}

TEST(NvmeTier, ReservationBeyondFreeSpaceNamesDirAndSizes) {
  TempDir dir;
  auto storage = MakeStorage();
  auto t = NvmeTier::Create({.dirs = {dir.path()}, .budget = 1ull << 50, .storage = storage.get()});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kNoSpace);
  EXPECT_NE(t.status().message().find(dir.path()), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("1125899906842624 bytes"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("free"), std::string::npos);
}

TEST(NvmeTier, ReservationUnderFileSizeLimitIsRefused) {
  TempDir dir;
  auto storage = MakeStorage();
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = kMiB;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  auto t = NvmeTier::Create({.dirs = {dir.path()}, .budget = 64 * kMiB, .storage = storage.get()});
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kNoSpace) << t.status().ToString();
  EXPECT_NE(t.status().message().find("strata-swap.r0.s0.bin"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("67108864 bytes"), std::string::npos) << t.status().message();
}

TEST(NvmeTier, RefusesBadDirectories) {
  auto storage = MakeStorage();
  auto t = NvmeTier::Create({.dirs = {"/nonexistent/strata"}, .budget = kMiB, .storage = storage.get()});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("/nonexistent/strata"), std::string::npos);
  auto t2 = NvmeTier::Create({.dirs = {"/etc/hostname"}, .budget = kMiB, .storage = storage.get()});
  ASSERT_FALSE(t2.ok());
  EXPECT_NE(t2.status().message().find("not a directory"), std::string::npos);
}

TEST(NvmeTier, OneEnginePerSwapFileAndNoLeftovers) {
  TempDir dir;
  auto storage = MakeStorage();
  std::string path;
  {
    auto a = NvmeTier::Create({.dirs = {dir.path()}, .budget = kMiB, .storage = storage.get()});
    ASSERT_TRUE(a.ok());
    path = (*a)->paths()[0];
    auto b = NvmeTier::Create({.dirs = {dir.path()}, .budget = kMiB, .storage = storage.get()});
    ASSERT_FALSE(b.ok());
    EXPECT_NE(b.status().message().find("in use by another"), std::string::npos) << b.status().message();
    EXPECT_TRUE(std::filesystem::exists(path));
    auto c = NvmeTier::Create({.dirs = {dir.path()}, .budget = kMiB, .rank = 1, .storage = storage.get()});
    EXPECT_TRUE(c.ok()) << "another rank has its own file";
  }
  EXPECT_FALSE(std::filesystem::exists(path)) << "swap files are removed with the tier";
}

// A snapshot links the swap file away; later writes go to a fresh file and
// never touch what the link holds.
TEST(NvmeTier, SnapshotLinksTheFileAndWritesMoveOn) {
  TempDir dir, ck;
  auto storage = MakeStorage();
  auto t = NvmeTier::Create({.dirs = {dir.path()}, .budget = 4 * kMiB, .storage = storage.get()});
  ASSERT_TRUE(t.ok());
  NvmeTier& nvme = **t;
  const uint64_t n = 100000;
  std::vector<Allocation> blocks;
  void* buf = testing::AlignedAlloc(nvme.PaddedSize(n), nvme.align());
  for (uint64_t k = 0; k < 3; ++k) {
    blocks.push_back(*nvme.Allocate(n));
    FillPattern(buf, n, 0, k);
    ASSERT_TRUE(nvme.Write(blocks.back(), buf).ok());
  }
  const std::string old_path = nvme.paths()[0], link = ck.path() + "/snap.bin";
  std::vector<NvmeTier::SnapshotRef> refs;
  ASSERT_TRUE(nvme.Snapshot(link, blocks, &refs).ok());
  ASSERT_EQ(refs.size(), 3u);
  EXPECT_NE(nvme.paths()[0], old_path) << "a fresh swap file";
  // A second snapshot before anything is rewritten: the blocks are not in the current file.
  std::vector<NvmeTier::SnapshotRef> again;
  EXPECT_EQ(nvme.Snapshot(ck.path() + "/snap2.bin", blocks, &again).code(), Code::kUnsupported);
  FillPattern(buf, n, 0, 99);
  ASSERT_TRUE(nvme.Write(blocks[1], buf).ok());  // moves to the new file
  ASSERT_TRUE(nvme.Read(blocks[1], buf).ok());
  EXPECT_EQ(CheckPattern(buf, n, 0, 99), -1);
  ASSERT_TRUE(nvme.Read(blocks[2], buf).ok());  // still read from the linked file
  EXPECT_EQ(CheckPattern(buf, n, 0, 2), -1);
  EXPECT_TRUE(std::filesystem::exists(old_path)) << "blocks 0 and 2 still live there";
  for (uint64_t k : {0u, 2u}) {
    FillPattern(buf, n, 0, 50 + k);
    ASSERT_TRUE(nvme.Write(blocks[k], buf).ok());
  }
  EXPECT_FALSE(std::filesystem::exists(old_path)) << "the old swap file leaves once empty";
  // The link still holds the snapshot, bit for bit, at the offsets given.
  int fd = ::open(link.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  for (uint64_t k = 0; k < 3; ++k) {
    std::vector<uint8_t> got(n);
    ASSERT_EQ(::pread(fd, got.data(), n, static_cast<off_t>(refs[k].offset)), static_cast<ssize_t>(n));
    EXPECT_EQ(CheckPattern(got.data(), n, 0, k), -1) << k;
    EXPECT_EQ(refs[k].bytes, n);
  }
  ::close(fd);
  std::free(buf);
  for (auto& a : blocks) nvme.Free(a);
}

// A block freed while its first write (in place: its own extent) is in
// flight keeps that extent, and its charge, until the write settles: a
// block allocated meanwhile gets another one, so the late write cannot land
// on its data (it got the same offset).
TEST(NvmeTier, AFreedBlocksExtentWaitsForItsWriteInFlight) {
  TempDir dir;
  auto storage = MakeStorage();
  auto t = NvmeTier::Create({.dirs = {dir.path()}, .budget = 4 * kMiB, .storage = storage.get()});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  NvmeTier& nvme = **t;
  const uint64_t n = kMiB;
  void* a_buf = testing::AlignedAlloc(nvme.BufferSize(n), nvme.align());
  void* b_buf = testing::AlignedAlloc(nvme.BufferSize(n), nvme.align());
  FillPattern(a_buf, n, 0, 1);
  FillPattern(b_buf, n, 0, 2);
  Allocation a = *nvme.Allocate(n);
  auto wa = nvme.StartWrite(a, a_buf);
  ASSERT_TRUE(wa.ok()) << wa.status().ToString();
  ASSERT_TRUE(wa->in_place);
  nvme.Free(a);
  EXPECT_GT(nvme.used(), 0u) << "the freed block's charge went before its write settled";
  Allocation b = *nvme.Allocate(n);
  auto wb = nvme.StartWrite(b, b_buf);
  ASSERT_TRUE(wb.ok()) << wb.status().ToString();
  EXPECT_NE(wb->offset, wa->offset) << "a new block was given the extent a freed block's write still goes to";
  EXPECT_TRUE(nvme.Finish(*wb).ok());
  (void)nvme.Finish(*wa);
  ASSERT_TRUE(nvme.Read(b, b_buf).ok());
  EXPECT_EQ(CheckPattern(b_buf, n, 0, 2), -1);
  nvme.Free(b);
  EXPECT_EQ(nvme.used(), 0u);
  std::free(a_buf);
  std::free(b_buf);
}

// A snapshot that cannot link says so (UNSUPPORTED: the checkpoint copies)
// before it reserves the next swap file: a link folder on another file
// system, and a swap disk without room for a second reservation (here the
// file size limit below it), were a failed save (NOSPACE). In a child: the
// limit is the process's.
TEST(NvmeTier, ASnapshotThatCannotLinkIsUnsupportedNotNoSpace) {
  TempDir dir, ck, shm("/dev/shm");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int bad = 0;
    auto storage = FileStorage::Create(StorageOptions{});
    if (!storage.ok()) ::_exit(100);
    auto t = NvmeTier::Create({.dirs = {dir.path()}, .budget = 8 * kMiB, .storage = storage->get()});
    if (!t.ok()) ::_exit(101);
    NvmeTier& nvme = **t;
    const uint64_t n = 100000;
    std::vector<Allocation> blocks;
    void* buf = testing::AlignedAlloc(nvme.BufferSize(n), nvme.align());
    for (uint64_t k = 0; k < 2; ++k) {
      blocks.push_back(*nvme.Allocate(n));
      FillPattern(buf, n, 0, k);
      if (!nvme.Write(blocks.back(), buf).ok()) ::_exit(102);
    }
    std::vector<NvmeTier::SnapshotRef> refs;
    struct stat a{}, b{};
    if (::stat(dir.path().c_str(), &a) == 0 && ::stat(shm.path().c_str(), &b) == 0 && a.st_dev != b.st_dev &&
        nvme.Snapshot(shm.path() + "/snap.bin", blocks, &refs).code() != Code::kUnsupported)
      bad |= 1;
    const rlimit limit{4 * kMiB, 4 * kMiB};  // below the next swap file's reservation
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(103);
    if (nvme.Snapshot(ck.path() + "/snap.bin", blocks, &refs).code() != Code::kUnsupported) bad |= 2;
    for (const auto& e : std::filesystem::directory_iterator(dir.path()))
      if (e.path().filename().string().find(".g1.") != std::string::npos) bad |= 4;
    if (std::filesystem::exists(ck.path() + "/snap.bin")) bad |= 8;
    if (!nvme.Read(blocks[1], buf).ok() || CheckPattern(buf, n, 0, 1) != -1) bad |= 16;  // the tier goes on
    std::free(buf);
    for (auto& x : blocks) nvme.Free(x);
    ::_exit(bad);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child killed by signal " << WTERMSIG(status);
  const int bad = WEXITSTATUS(status);
  EXPECT_EQ(bad & 1, 0) << "a link folder on another file system was not UNSUPPORTED";
  EXPECT_EQ(bad & 2, 0) << "no room for the next swap file was not UNSUPPORTED";
  EXPECT_EQ(bad & 4, 0) << "a next-generation swap file was left";
  EXPECT_EQ(bad & 8, 0) << "a link was made although the snapshot failed";
  EXPECT_EQ(bad & 16, 0) << "the tier did not go on after the refusal";
  EXPECT_LT(bad, 100) << "setup failed in the child (" << bad << ")";
}

// A killed engine's swap files (its first generation's name, and a later
// generation's) do not count against the next engine's free-space check: on
// a 16 MiB file system holding a stale 10 MiB file, an 8 MiB swap file is
// made (before, NOSPACE: "has 6 MiB free"). Run by tiers_small_fs_test.
TEST(NvmeTierSmallFs, AKilledEnginesSwapFileDoesNotCountAgainstTheNext) {
  const char* small = std::getenv("STRATA_SMALL_FS");
  if (!small) GTEST_SKIP() << "needs STRATA_SMALL_FS, a 16 MiB file system (tiers_small_fs_test)";
  const std::string dir = small;
  for (const char* stale : {"strata-swap.r0.s0.bin", "strata-swap.r0.s0.g3.bin"}) {
    const std::string path = dir + "/" + stale;
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);  // what a killed engine leaves
    ASSERT_GE(fd, 0) << path;
    ASSERT_EQ(::posix_fallocate(fd, 0, 10 * kMiB), 0) << path;
    ::close(fd);
    auto storage = MakeStorage();
    auto t = NvmeTier::Create({.dirs = {dir}, .budget = 8 * kMiB, .storage = storage.get()});
    ASSERT_TRUE(t.ok()) << stale << ": " << t.status().ToString();
    EXPECT_FALSE(std::filesystem::exists(dir + "/strata-swap.r0.s0.g3.bin"));
    t->reset();
    EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the swap file goes with the tier";
  }
}

TEST(NvmeTier, WorksOnTmpfs) {
  TempDir dir("/dev/shm");
  if (!dir.ok()) GTEST_SKIP() << "no /dev/shm";
  auto storage = MakeStorage();
  auto t = NvmeTier::Create({.dirs = {dir.path()}, .budget = 4 * kMiB, .storage = storage.get()});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto a = (*t)->Allocate(4097);
  ASSERT_TRUE(a.ok());
  void* buf = testing::AlignedAlloc((*t)->PaddedSize(4097), (*t)->align());
  FillPattern(buf, 4097, 0, 3);
  ASSERT_TRUE((*t)->Write(*a, buf).ok());
  std::memset(buf, 0, 4097);
  ASSERT_TRUE((*t)->Read(*a, buf).ok());
  EXPECT_EQ(CheckPattern(buf, 4097, 0, 3), -1);
  std::free(buf);
}

}  // namespace
}  // namespace strata
