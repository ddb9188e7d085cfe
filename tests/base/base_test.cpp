// base/: Status, byte sizes, dtype conversions, alignment.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <new>
#include <stdexcept>
#include <system_error>

#include "base/align.h"
#include "base/fork_close.h"
#include "base/dtype.h"
#include "base/sizes.h"
#include "base/status.h"

namespace strata {
namespace {

// An exception caught at a boundary: NOMEM for bad_alloc; a thread that
// could not start names the thread limit (it said only "Resource
// temporarily unavailable"); others are INTERNAL with their text.
TEST(Status, OfAnExceptionNamesTheThreadLimit) {
  const Status mem = StatusOfException(std::bad_alloc(), "build: ");
  EXPECT_EQ(mem.code(), Code::kNoMem);
  EXPECT_EQ(mem.message().rfind("build: out of memory", 0), 0u) << mem.message();
  const Status threads =
      StatusOfException(std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again)), "");
  EXPECT_EQ(threads.code(), Code::kInternal);
  EXPECT_NE(threads.message().find("pids.max or RLIMIT_NPROC"), std::string::npos) << threads.message();
  const Status other = StatusOfException(std::runtime_error("boom"), "x: ");
  EXPECT_EQ(other.code(), Code::kInternal);
  EXPECT_EQ(other.message(), "x: uncaught exception: boom");
}

TEST(Status, OkIsCheapAndErrorsCarryMessages) {
  Status ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(sizeof(Status), sizeof(void*));
  Status e = PosixError("pread", "/tmp/x.swap", 4096, 512, EIO);
  EXPECT_EQ(e.code(), Code::kIo);
  EXPECT_NE(e.message().find("/tmp/x.swap"), std::string::npos);
  EXPECT_NE(e.message().find("offset 4096"), std::string::npos);
  EXPECT_NE(e.message().find("length 512"), std::string::npos);
  EXPECT_NE(e.message().find("errno 5"), std::string::npos);
  EXPECT_EQ(PosixError("write", "/f", ENOSPC).code(), Code::kNoSpace);
  EXPECT_EQ(PosixError("write", "/f", EFBIG).code(), Code::kNoSpace);
  Status copy = e;
  EXPECT_EQ(copy.ToString(), e.ToString());
  EXPECT_EQ(e.WithContext("swap").message().rfind("swap: ", 0), 0u);
}

Result<int> Half(int x) {
  if (x % 2) return InvalidError("odd " + std::to_string(x));
  return x / 2;
}
Status UseHalf(int x, int* out) {
  STRATA_ASSIGN_OR_RETURN(*out, Half(x));
  return Status::Ok();
}

TEST(Status, ResultAndMacros) {
  int v = 0;
  EXPECT_TRUE(UseHalf(8, &v).ok());
  EXPECT_EQ(v, 4);
  Status s = UseHalf(7, &v);
  EXPECT_EQ(s.code(), Code::kInvalid);
  EXPECT_EQ(s.message(), "odd 7");
}

TEST(Sizes, Parses) {
  EXPECT_EQ(*ParseByteSize("64MiB"), 64ull << 20);
  EXPECT_EQ(*ParseByteSize("2GB"), 2000000000ull);
  EXPECT_EQ(*ParseByteSize("1e8"), 100000000ull);
  EXPECT_EQ(*ParseByteSize("4096"), 4096ull);
  EXPECT_EQ(*ParseByteSize("1.5 GiB"), 3ull << 29);
  EXPECT_EQ(*ParseByteSize("8gib"), 8ull << 30);
  EXPECT_EQ(*ParseByteSize("0"), 0ull);
  // Exact, not through a double: these were refused as "not a whole number of
  // bytes" (4.1 * 1e9 is 4099999999.9999995 in doubles), or rounded.
  EXPECT_EQ(*ParseByteSize("4.1GB"), 4100000000ull);
  EXPECT_EQ(*ParseByteSize("8.2TB"), 8200000000000ull);
  EXPECT_EQ(*ParseByteSize("2.01KB"), 2010ull);
  EXPECT_EQ(*ParseByteSize("32.2GB"), 32200000000ull);
  EXPECT_EQ(*ParseByteSize("9007199254740993"), 9007199254740993ull);
  EXPECT_EQ(*ParseByteSize("0.25KiB"), 256ull);
  EXPECT_EQ(*ParseByteSize("1e-3KB"), 1ull);
  EXPECT_EQ(*ParseByteSize(".5kb"), 500ull);
  EXPECT_EQ(*ParseByteSize("1.50000000000000000000000000000000000000000GiB"), 3ull << 29);
  EXPECT_EQ(*ParseByteSize("9223372036854775807"), 9223372036854775807ull);
  EXPECT_EQ(*ParseByteSize("9.094947017729282379150390625e-13TiB"), 1ull);  // 5^40 / 10^40 * 2^40, exactly
  EXPECT_EQ(*ParseByteSize("0.0009765625KiB"), 1ull);
}

TEST(Sizes, RefusesWithTheText) {
  for (const char* bad : {"", "abc", "-1", "12XB", "0.5", "1e30", "nan", "inf", "9223372036854775808", "0.1KiB",
                          "1e", "1.2.3", "1e-50", "18446744073709551616000", "1.0000000000000000001",
                          "0.0009765626KiB", "123456789012345678901234567890123456789012345"}) {
    auto r = ParseByteSize(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), Code::kInvalid);
    EXPECT_NE(r.status().message().find(std::string("'") + bad + "'"), std::string::npos)
        << r.status().message();
  }
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(3ull << 29), "1.50 GiB");
}

TEST(Align, Helpers) {
  EXPECT_EQ(AlignUp(4097, 4096), 8192u);
  EXPECT_EQ(AlignDown(4097, 4096), 4096u);
  EXPECT_EQ(RoundUpTo(53, 4), 56u);
  EXPECT_EQ(Lcm(64, 4096), 4096u);
  EXPECT_EQ(Lcm(6, 4), 12u);
  EXPECT_TRUE(IsPowerOfTwo(4096));
  EXPECT_FALSE(IsPowerOfTwo(4095));
}

// Reference rounding through double: nearest even in the target's grid.
TEST(DType, BF16RoundsToNearestEven) {
  EXPECT_EQ(F32ToBF16(1.0f), 0x3f80);
  EXPECT_EQ(F32ToBF16(BitsF32(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(F32ToBF16(BitsF32(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(F32ToBF16(BitsF32(0x3f808001u)), 0x3f81);
  EXPECT_EQ(F32ToBF16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(F32ToBF16(BitsF32(0x7f7fffffu)), 0x7f80);  // max float rounds to inf
  const uint16_t n = F32ToBF16(BitsF32(0x7f800001u));  // NaN with low payload only
  EXPECT_TRUE(std::isnan(BF16ToF32(n)));
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(-std::nanf("")))));
  EXPECT_EQ(BF16ToF32(0x3f80), 1.0f);
}

TEST(DType, F16MatchesExhaustiveRoundTripAndRounding) {
  // Every half converts to float and back exactly.
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = F16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(f))));
      continue;
    }
    ASSERT_EQ(F32ToF16(f), h) << h;
  }
  // Midpoints between neighbouring halves round to the even one.
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const double lo = F16ToF32(static_cast<uint16_t>(h)), hi = F16ToF32(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(F32ToF16(mid), (h % 2 == 0) ? h : h + 1) << h;
    ASSERT_EQ(F32ToF16(std::nextafter(mid, 0.0f)), h) << h;
    ASSERT_EQ(F32ToF16(std::nextafter(mid, 1e9f)), h + 1) << h;
  }
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);
  EXPECT_EQ(F32ToF16(65519.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(1e-10f), 0);
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
}

TEST(DType, Names) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("fp16"), DType::kF16);
  EXPECT_FALSE(ParseDType("int8").ok());
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
}


// ---- descriptors closed in a child of fork (base/fork_close.h) ----

namespace fork_close_test {

// In a child of fork: 1 where `fd` is open, 0 where not (-1: fork failed).
int OpenInChild(int fd) {
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) ::_exit(::fcntl(fd, F_GETFD) >= 0 ? 1 : 0);
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

TEST(ForkClose, ARegisteredDescriptorIsClosedInTheChildOnly) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  EXPECT_EQ(OpenInChild(p[0]), 1);
  KeepFromForkAndExec(p[0]);
  EXPECT_TRUE(ClosedInForkChild(p[0]));
  EXPECT_NE(::fcntl(p[0], F_GETFD) & FD_CLOEXEC, 0);
  EXPECT_EQ(OpenInChild(p[0]), 0);
  EXPECT_EQ(OpenInChild(p[1]), 1) << "one not registered stays";
  EXPECT_GE(::fcntl(p[0], F_GETFD), 0) << "the parent's stays open";
  ForgetInForkChild(p[0]);
  EXPECT_EQ(OpenInChild(p[0]), 1);
  ::close(p[0]);
  ::close(p[1]);
}

// A registered number closed and reused without ForgetInForkChild names
// another file: the child leaves it alone (closing it would close what
// someone else opened).
TEST(ForkClose, ANumberReusedForAnotherFileIsLeftAlone) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  CloseInForkChild(p[0]);
  const int number = p[0];
  ::close(p[0]);
  ::close(p[1]);
  const int again = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_EQ(again, number) << "the lowest free number is reused";
  EXPECT_EQ(OpenInChild(again), 1);
  ForgetInForkChild(again);
  ::close(again);
}

}  // namespace fork_close_test

}  // namespace
}  // namespace strata
