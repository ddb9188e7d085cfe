// Casts: every path against base/dtype.h's reference conversions: f32 -> bf16 /
// f16 on the SIMD paths over a sample of float bit patterns that reaches every
// binade and rounding boundary (all 2^32 with STRATA_EXHAUSTIVE=1), all 2^16
// patterns for the widening casts, and misaligned, odd-sized ranges.
#include <gtest/gtest.h>

#include "kernels/cpu/cast.h"
#include "tests/kernels/kernel_test_util.h"

namespace strata::kernels::test {
namespace {

uint16_t Narrow(DType d, float f) { return d == DType::kBF16 ? F32ToBF16(f) : F32ToF16(f); }
float Widen(DType d, uint16_t h) { return d == DType::kBF16 ? BF16ToF32(h) : F16ToF32(h); }

// The float bit patterns a narrowing sweep covers: all 2^32 when exhaustive;
// else every upper half (sign, exponent, top mantissa bits: every binade,
// infinities, NaNs, subnormals) with the lower halves where bf16's and f16's
// round-to-nearest-even decide (just below, at and above each tie) and the ends.
std::vector<uint32_t> NarrowingPatterns(uint64_t base, size_t chunk) {
  std::vector<uint32_t> src(chunk);
  if (Exhaustive()) {
    for (size_t i = 0; i < chunk; ++i) src[i] = static_cast<uint32_t>(base + i);
    return src;
  }
  static const uint16_t kLow[16] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x2001,
                                    0x7fff, 0x8000, 0x8001, 0xbfff, 0xe000, 0xf000, 0xf001, 0xffff};
  for (size_t i = 0; i < chunk; ++i) {
    const uint64_t k = base + i;  // k / 16: the upper half; k % 16: which lower half
    src[i] = static_cast<uint32_t>(((k / 16) << 16) | kLow[k % 16]);
  }
  return src;
}

TEST(Cast, NarrowingIsEqualToReference) {
  const size_t chunk = size_t{1} << 20;
  const uint64_t total = Exhaustive() ? uint64_t{1} << 32 : uint64_t{1} << 20;  // sampled: 2^16 x 16
  std::vector<uint16_t> dst(chunk);
  for (CpuIsa isa : SimdPathsHere())
    for (DType d : {DType::kBF16, DType::kF16})
      for (uint64_t base = 0; base < total; base += chunk) {
        const std::vector<uint32_t> src = NarrowingPatterns(base, chunk);
        ASSERT_TRUE(CastOn(isa, DType::kF32, src.data(), d, dst.data(), chunk).ok());
        for (size_t i = 0; i < chunk; ++i)
          if (dst[i] != Narrow(d, BitsF32(src[i])))
            FAIL() << CpuIsaName(isa) << " f32->" << DTypeName(d) << " of 0x" << std::hex
                   << src[i] << ": got 0x" << dst[i] << " want 0x" << Narrow(d, BitsF32(src[i]));
      }
}

TEST(Cast, WideningIsExhaustivelyEqualToReference) {
  std::vector<uint16_t> src(65536);
  std::vector<float> dst(65536);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint16_t>(i);
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!CpuSupports(isa)) continue;
    for (DType d : {DType::kBF16, DType::kF16}) {
      ASSERT_TRUE(CastOn(isa, d, src.data(), DType::kF32, dst.data(), src.size()).ok());
      for (size_t i = 0; i < src.size(); ++i)  // bits, NaNs too: a signalling f16 NaN is quieted on every ISA
        ASSERT_EQ(F32Bits(dst[i]), F32Bits(Widen(d, src[i])))
            << CpuIsaName(isa) << " " << DTypeName(d) << " 0x" << std::hex << i;
    }
  }
  // The semantics pinned, as vcvtph2ps has them: sign and payload kept, quieted.
  EXPECT_EQ(F32Bits(F16ToF32(0x7c01)), 0x7fc02000u);
  EXPECT_EQ(F32Bits(F16ToF32(0xfdff)), 0xffffe000u);
  EXPECT_EQ(F32Bits(F16ToF32(0x7e00)), 0x7fc00000u);
  EXPECT_EQ(F32Bits(F16ToF32(0x7c00)), 0x7f800000u);
}

TEST(Cast, AllPairsMisalignedOddSizes) {
  for (DType s : {DType::kF32, DType::kBF16, DType::kF16})
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16})
      for (size_t n : {1, 7, 15, 16, 17, 1023, 1024, 1025, (1 << 20) + 3})
        for (size_t off : {0, 1, 13}) {
          Buffer src(n, DTypeSize(s), off), want(n, DTypeSize(d), 0);
          Rng rng(n);
          for (size_t i = 0; i < n; ++i) StoreAs(s, src.data(), i, rng.Spread() * 1e3f);
          ASSERT_TRUE(CastOn(CpuIsa::kScalar, s, src.data(), d, want.data(), n).ok());
          for (CpuIsa isa : SimdPathsHere()) {
            Buffer got(n, DTypeSize(d), (off + 3) % 16);
            ASSERT_TRUE(CastOn(isa, s, src.data(), d, got.data(), n).ok());
            ASSERT_EQ(std::memcmp(got.data(), want.data(), n * DTypeSize(d)), 0)
                << CpuIsaName(isa) << " " << DTypeName(s) << "->" << DTypeName(d) << " n=" << n;
          }
        }
}

}  // namespace
}  // namespace strata::kernels::test

int main(int argc, char** argv) { return strata::kernels::test::RunPathTests(argc, argv); }
