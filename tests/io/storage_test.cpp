// io/: FileStorage on a real file with a real io_uring, and injected faults.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <string>
#include <tuple>

#include <memory>
#include <vector>

#include "io/direct_file.h"
#include "io/file_storage.h"
#include "tests/util/no_uring.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using testing::AlignedAlloc;
using testing::AlignedFree;
using testing::CheckPattern;
using testing::FillPattern;
using testing::TempDir;

std::unique_ptr<FileStorage> MakeStorage(StorageOptions o = {}) {
  auto r = FileStorage::Create(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

struct Buf {
  explicit Buf(uint64_t n) : len(n), p(AlignedAlloc(n)) {}
  uint64_t len;
  std::unique_ptr<void, AlignedFree> p;
  void* get() const { return p.get(); }
};

// Writes `len` bytes at `off`, reads them back into a fresh buffer, checks.
void RoundTrip(Storage& s, FileId f, uint64_t off, uint64_t len, uint64_t seed) {
  Buf w(len), r(len);
  FillPattern(w.get(), len, off, seed);
  IoOp wop{IoOp::kWrite, f, off, w.get(), len};
  ASSERT_TRUE(s.Run({&wop, 1}).ok());
  std::memset(r.get(), 0, len);
  IoOp rop{IoOp::kRead, f, off, r.get(), len};
  Status st = s.Run({&rop, 1});
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_EQ(CheckPattern(r.get(), len, off, seed), -1) << "len " << len;
}

// Where io_uring is refused (sysctl kernel.io_uring_disabled, a container's
// seccomp profile: io_uring_setup returns EPERM or ENOSYS), "auto" moves its
// files with pread and pwrite on threads, and "io_uring" says why it cannot
// and what to do, not only "Operation not permitted". Any other failure to
// make a ring is an error either way. Each case in a child whose
// io_uring_setup fails with that errno.
// A process started with stdin, stdout and stderr closed: a file the
// storage opens never takes their numbers (it took 2, and every log line
// went into the swap file: its blocks' checksums failed).
TEST(Storage, FilesNeverTakeTheStandardStreamsNumbers) {
  TempDir dir;
  const std::string path = dir.path() + "/f.bin";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(0), ::close(1), ::close(2);
    FileInfo a, b;
    if (!OpenDirectFile(path, OpenMode::kCreateNew, &a, true).ok()) ::_exit(10);
    if (!OpenDirectFile(path, OpenMode::kReadWrite, &b, true).ok()) ::_exit(11);
    ::_exit(a.fd > 2 && b.fd > 2 && (::fcntl(a.fd, F_GETFD) & FD_CLOEXEC) && ::fcntl(0, F_GETFD) < 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(Storage, IoUringRefused) {
  for (int err : {EPERM, ENOSYS, EINVAL, EMFILE}) {
    for (IoBackend b : {IoBackend::kAuto, IoBackend::kUring}) {
      const auto r = testing::RunWithoutIoUring(err, [b] {
        StorageOptions o;
        o.backend = b;
        auto s = FileStorage::Create(o);
        if (!s.ok()) return s.status().ToString();
        TempDir dir;
        auto f = (*s)->Open(dir.path() + "/r.swap", OpenMode::kCreate);
        if (!f.ok()) return f.status().ToString();
        const uint64_t len = 3 << 20;
        Buf w(len), rd(len);
        FillPattern(w.get(), len, 0, 5);
        IoOp ops[] = {{IoOp::kWrite, *f, 0, w.get(), len}};
        Status st = (*s)->Run(ops);
        IoOp back{IoOp::kRead, *f, 0, rd.get(), len};
        if (st.ok()) st = (*s)->Run({&back, 1});
        if (!st.ok()) return st.ToString();
        return std::string("created ") + IoBackendName((*s)->backend()) +
               (CheckPattern(rd.get(), len, 0, 5) == -1 ? ", read back exact" : ", READ BACK WRONG");
      });
      if (!r.filtered) GTEST_SKIP() << "this machine allows no seccomp filter (nothing to test)";
      ASSERT_TRUE(r.exited) << r.out;
      const std::string& msg = r.out;
      if ((err == EPERM || err == ENOSYS) && b == IoBackend::kAuto) {
        EXPECT_EQ(msg, "created threads, read back exact");
      } else if (err == EPERM || err == ENOSYS) {
        EXPECT_NE(msg.find("io_uring is unavailable here"), std::string::npos) << msg;
        EXPECT_NE(msg.find("kernel.io_uring_disabled"), std::string::npos) << msg;
        EXPECT_NE(msg.find("strata.io_backend"), std::string::npos) << msg;
      } else {  // any other failure: refused with its errno, never a ring used unmade (a crash)
        EXPECT_NE(msg.find("io_uring_queue_init: " + std::string(std::strerror(err))), std::string::npos) << msg;
      }
    }
  }
}

// Whether io_uring may be used here (a container may refuse it).
bool UringAllowed() {
  StorageOptions o;
  o.backend = IoBackend::kUring;
  return FileStorage::Create(o).ok();
}

// Every test below runs on both backends: io_uring (skipped where it is
// refused), and pread and pwrite on threads.
class StorageOn : public ::testing::TestWithParam<IoBackend> {
 protected:
  void SetUp() override {
    if (GetParam() == IoBackend::kUring && !UringAllowed()) GTEST_SKIP() << "io_uring is refused here";
  }
  std::unique_ptr<FileStorage> Make(StorageOptions o = {}) {
    o.backend = GetParam();
    auto s = MakeStorage(o);
    if (s) {
      EXPECT_EQ(s->backend(), GetParam());
    }
    return s;
  }
};

TEST_P(StorageOn, RoundTripsAlignedSizesDirect) {
  TempDir dir;
  auto s = Make();
  auto f = s->Open(dir.path() + "/a.swap", OpenMode::kCreate);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const uint64_t a = s->Info(*f).align;
  EXPECT_GE(a, 512u);
  for (uint64_t n : {1ull, 511ull, 512ull, 4095ull, 4096ull, 4097ull, (1ull << 20) + 1}) {
    RoundTrip(*s, *f, 3 * 4096, (n + a - 1) / a * a, n);
  }
}

TEST_P(StorageOn, BufferedFallbackOnTmpfsTakesAnySize) {
  struct stat st {};
  if (::stat("/dev/shm", &st) != 0) GTEST_SKIP() << "no /dev/shm";
  TempDir dir("/dev/shm");
  ASSERT_TRUE(dir.ok());
  // Recent kernels give tmpfs O_DIRECT; where it does, refuse it ourselves,
  // which takes the same fallback path.
  FileInfo probe;
  ASSERT_TRUE(OpenDirectFile(dir.path() + "/probe", OpenMode::kCreate, &probe).ok());
  ::close(probe.fd);
  StorageOptions o;
  o.direct = !probe.direct;
  auto s = Make(o);
  auto f = s->Open(dir.path() + "/b.swap", OpenMode::kCreate);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_FALSE(s->Info(*f).direct);
  EXPECT_EQ(s->Info(*f).align, 1u);
  for (uint64_t n : {1ull, 511ull, 512ull, 4095ull, 4096ull, 4097ull, (1ull << 20) + 1})
    RoundTrip(*s, *f, 7, n, n);
}

TEST_P(StorageOn, ManyChunksOverManyRingsBeyondQueueDepth) {
  TempDir dir;
  StorageOptions o;
  o.rings = 3;
  o.queue_depth = 4;
  o.block_size = 64 << 10;
  auto s = Make(o);
  auto f = s->Open(dir.path() + "/c.swap", OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  const uint64_t len = 8 << 20;  // 128 chunks over 3 rings of depth 4
  Buf w(len);
  s->RegisterBuffer(w.get(), len);
  RoundTrip(*s, *f, 0, len, 42);
  s->UnregisterBuffer(w.get());
  EXPECT_GE(s->ops_submitted(), 256u);
}

TEST_P(StorageOn, MisalignedDirectIoIsRefusedBeforeSubmission) {
  TempDir dir;
  auto s = Make();
  auto f = s->Open(dir.path() + "/d.swap", OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  Buf b(8192);
  IoOp op{IoOp::kWrite, *f, 100, b.get(), 4096};
  const uint64_t before = s->ops_submitted();
  Status st = s->Run({&op, 1});
  EXPECT_EQ(st.code(), Code::kInvalid);
  EXPECT_NE(st.message().find("d.swap"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("offset 100"), std::string::npos) << st.message();
  EXPECT_EQ(s->ops_submitted(), before);
  IoOp bad_file{IoOp::kRead, 99, 0, b.get(), 4096};
  EXPECT_EQ(s->Run({&bad_file, 1}).code(), Code::kInvalid);
}

TEST_P(StorageOn, OpenNamesThePath) {
  auto s = Make();
  auto f = s->Open("/nonexistent-dir/x.swap", OpenMode::kCreate);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("/nonexistent-dir/x.swap"), std::string::npos);
  EXPECT_NE(f.status().message().find("errno 2"), std::string::npos);
}

TEST_P(StorageOn, TruncatedFileReadIsCorrupt) {
  TempDir dir;
  auto s = Make();
  const std::string path = dir.path() + "/t.swap";
  auto f = s->Open(path, OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  RoundTrip(*s, *f, 0, 1 << 20, 1);
  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  Buf r(1 << 20);
  IoOp op{IoOp::kRead, *f, 0, r.get(), 1 << 20};
  Status st = s->Run({&op, 1});
  EXPECT_EQ(st.code(), Code::kCorrupt) << st.ToString();
  EXPECT_NE(st.message().find("t.swap"), std::string::npos);
  EXPECT_NE(st.message().find("offset 4096"), std::string::npos) << st.message();
  // Cut off the alignment: a direct read returns the same 4 tail bytes
  // each time, which advance nothing. Corrupt too, not a loop for ever.
  ASSERT_EQ(::truncate(path.c_str(), 4100), 0);
  IoOp again{IoOp::kRead, *f, 0, r.get(), 1 << 20};
  st = s->Run({&again, 1});
  EXPECT_EQ(st.code(), Code::kCorrupt) << st.ToString();
  EXPECT_NE(st.message().find("offset 4096"), std::string::npos) << st.message();
}

INSTANTIATE_TEST_SUITE_P(Backends, StorageOn, ::testing::Values(IoBackend::kUring, IoBackend::kThreads),
                         [](const auto& info) { return std::string(IoBackendName(info.param)); });

// Faults: retried ones leave the data exact; hard ones fail with a message.
struct FaultCase {
  const char* name;
  Fault::Kind kind;
  int err;
  bool hard;
};

class StorageFault : public ::testing::TestWithParam<std::tuple<FaultCase, IoBackend>> {
 protected:
  void SetUp() override {
    if (std::get<1>(GetParam()) == IoBackend::kUring && !UringAllowed()) GTEST_SKIP() << "io_uring is refused here";
  }
};

TEST_P(StorageFault, AtEveryOpOfAWriteAndARead) {
  const FaultCase fc = std::get<0>(GetParam());
  TempDir dir;
  const uint64_t len = 256 << 10;  // 4 chunks of 64 KiB
  for (uint64_t k = 0; k < 8; ++k) {  // ops 0..3 are the write, 4..7 the read
    StorageOptions o;
    o.block_size = 64 << 10;
    o.queue_depth = 2;
    o.faults = std::make_shared<FaultPlan>(std::vector<Fault>{{k, fc.kind, fc.err}});
    o.backend = std::get<1>(GetParam());
    auto s = MakeStorage(o);
    auto f = s->Open(dir.path() + "/f" + std::to_string(k), OpenMode::kCreate);
    ASSERT_TRUE(f.ok());
    Buf w(len), r(len);
    FillPattern(w.get(), len, 0, k);
    std::memset(r.get(), 0xEE, len);
    IoOp wop{IoOp::kWrite, *f, 0, w.get(), len};
    Status ws = s->Run({&wop, 1});
    IoOp rop{IoOp::kRead, *f, 0, r.get(), len};
    Status rs = ws.ok() ? s->Run({&rop, 1}) : Status::Ok();
    EXPECT_EQ(o.faults->fired(), 1) << fc.name << " op " << k;
    if (!fc.hard) {
      ASSERT_TRUE(ws.ok() && rs.ok()) << fc.name << " op " << k << ": " << ws.ToString() << rs.ToString();
      EXPECT_EQ(CheckPattern(r.get(), len, 0, k), -1) << fc.name << " op " << k;
      continue;
    }
    Status failed = ws.ok() ? rs : ws;
    ASSERT_FALSE(failed.ok()) << fc.name << " op " << k;
    EXPECT_NE(failed.message().find("/f" + std::to_string(k)), std::string::npos) << failed.message();
    EXPECT_NE(failed.message().find("errno " + std::to_string(fc.err)), std::string::npos);
    EXPECT_NE(failed.message().find("offset "), std::string::npos);
    EXPECT_EQ(ws.ok(), k >= 4) << "the failure belongs to the op it hit";
    const Code want = (fc.err == ENOSPC || fc.err == EFBIG) ? Code::kNoSpace : Code::kIo;
    EXPECT_EQ(failed.code(), want) << failed.ToString();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Faults, StorageFault,
    ::testing::Combine(::testing::Values(FaultCase{"short", Fault::kShort, 0, false},
                                         FaultCase{"EAGAIN", Fault::kErrno, EAGAIN, false},
                                         FaultCase{"EINTR", Fault::kErrno, EINTR, false},
                                         FaultCase{"EIO", Fault::kErrno, EIO, true},
                                         FaultCase{"ENOSPC", Fault::kErrno, ENOSPC, true},
                                         FaultCase{"EFBIG", Fault::kErrno, EFBIG, true}),
                       ::testing::Values(IoBackend::kUring, IoBackend::kThreads)),
    [](const auto& info) {
      return std::string(std::get<0>(info.param).name) + "_" + IoBackendName(std::get<1>(info.param));
    });

// kCreateNew (swap files): a new file of this user's alone, whatever the
// umask; never through a name that exists, a symlink to another file above
// all; buffered, not refused, where the file system has no O_DIRECT.
TEST(Storage, CreateNewIsPrivateAndNeverFollowsAName) {
  TempDir dir;
  auto s = MakeStorage();
  ASSERT_NE(s, nullptr);
  const mode_t old_umask = ::umask(0);
  auto f = s->Open(dir.path() + "/new.swap", OpenMode::kCreateNew);
  ::umask(old_umask);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  struct stat st {};
  ASSERT_EQ(::stat((dir.path() + "/new.swap").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_TRUE(s->Info(*f).direct);
  RoundTrip(*s, *f, 0, 8192, 3);
  const std::string victim = dir.path() + "/victim", link = dir.path() + "/link.swap";
  { std::ofstream(victim) << "keep me"; }
  ASSERT_EQ(::symlink(victim.c_str(), link.c_str()), 0);
  auto through = s->Open(link, OpenMode::kCreateNew);
  ASSERT_FALSE(through.ok());
  EXPECT_NE(through.status().message().find("errno " + std::to_string(EEXIST)), std::string::npos)
      << through.status().ToString();
  std::string text;
  std::getline(std::ifstream(victim), text);
  EXPECT_EQ(text, "keep me");
  EXPECT_FALSE(s->Open(dir.path() + "/new.swap", OpenMode::kCreateNew).ok()) << "an existing file is refused";
  struct stat shm {};
  if (::stat("/dev/shm", &shm) == 0) {
    TempDir tmpfs("/dev/shm");
    auto t = s->Open(tmpfs.path() + "/t.swap", OpenMode::kCreateNew);
    ASSERT_TRUE(t.ok()) << t.status().ToString();  // buffered where tmpfs has no O_DIRECT; either way, open
    RoundTrip(*s, *t, 0, 8192, 4);
  }
}

TEST(Storage, RefusesBadOptions) {
  StorageOptions o;
  o.queue_depth = 0;
  EXPECT_EQ(FileStorage::Create(o).status().code(), Code::kInvalid);
  o = {};
  o.backend = static_cast<IoBackend>(7);
  EXPECT_NE(FileStorage::Create(o).status().message().find("io backend 7"), std::string::npos);
  o = {};
  o.block_size = 1000;
  auto r = FileStorage::Create(o);
  EXPECT_NE(r.status().message().find("block size 1000"), std::string::npos);
}

TEST(Storage, AlignmentFromStatx) {
  TempDir dir;
  FileInfo info;
  ASSERT_TRUE(OpenDirectFile(dir.path() + "/s", OpenMode::kCreate, &info).ok());
  EXPECT_TRUE(info.direct);
  EXPECT_TRUE(info.align == 512 || info.align == 4096 || info.align == 1024 || info.align == 2048)
      << info.align;
  ::close(info.fd);
}

}  // namespace
}  // namespace strata
