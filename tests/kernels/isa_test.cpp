// ISA detection and the STRATA_CPU_ISA override. Registered several times with
// different STRATA_CPU_ISA values: a path the CPU lacks must be refused with an
// error (never run), an unknown name too, and a supported one used.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "kernels/cpu/adam.h"
#include "kernels/cpu/isa.h"

namespace strata::kernels {
namespace {

TEST(Isa, DetectionIsConsistent) {
  const CpuFeatures& f = DetectCpuFeatures();
  EXPECT_TRUE(CpuSupports(CpuIsa::kScalar));
  EXPECT_EQ(CpuSupports(CpuIsa::kAvx2), f.avx2);
  EXPECT_EQ(CpuSupports(CpuIsa::kAvx512), f.avx512);
  if (f.avx512) {
    EXPECT_TRUE(f.avx2);
  }
  if (f.avx512_bf16) {
    EXPECT_TRUE(f.avx512);
  }
  EXPECT_TRUE(CpuSupports(BestCpuIsa()));
  std::printf("cpu: avx2=%d avx512=%d avx512_bf16=%d best=%s\n", f.avx2, f.avx512,
              f.avx512_bf16, CpuIsaName(BestCpuIsa()));
}

TEST(Isa, NamesRoundTrip) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512})
    EXPECT_EQ(*ParseCpuIsa(CpuIsaName(isa)), isa);
  EXPECT_FALSE(ParseCpuIsa("sse9").ok());
}

TEST(Isa, EnvironmentOverride) {
  const char* env = std::getenv("STRATA_CPU_ISA");
  const Result<CpuIsa> active = ActiveCpuIsa();
  float p = 1, m = 0, v = 0, g = 1;
  const Status step = AdamStep(AdamOptions{}, 1, &p, &m, &v, &g, nullptr);
  if (env == nullptr || *env == '\0') {
    ASSERT_TRUE(active.ok());
    EXPECT_EQ(active.value(), MeasuredCpuIsa()) << "decided once";
    if (CpuSupports(CpuIsa::kAvx512)) {  // measured: either wide path, never scalar
      EXPECT_NE(active.value(), CpuIsa::kScalar);
    } else {
      EXPECT_EQ(active.value(), BestCpuIsa());
    }
    std::printf("chosen path: %s (best supported: %s)\n", CpuIsaName(active.value()), CpuIsaName(BestCpuIsa()));
    EXPECT_TRUE(step.ok());
    return;
  }
  const Result<CpuIsa> wanted = ParseCpuIsa(env);
  if (!wanted.ok()) {
    EXPECT_EQ(active.status().code(), Code::kInvalid);
    EXPECT_EQ(step.code(), Code::kInvalid);
  } else if (!CpuSupports(wanted.value())) {
    EXPECT_EQ(active.status().code(), Code::kUnsupported) << active.status().ToString();
    EXPECT_EQ(step.code(), Code::kUnsupported);
    EXPECT_NE(step.message().find("STRATA_CPU_ISA"), std::string::npos) << step.ToString();
    std::printf("refused as expected: %s\n", step.ToString().c_str());
  } else {
    ASSERT_TRUE(active.ok());
    EXPECT_EQ(active.value(), wanted.value());
    EXPECT_TRUE(step.ok());
  }
}

}  // namespace
}  // namespace strata::kernels
