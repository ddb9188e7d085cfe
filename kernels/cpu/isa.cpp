// cpuid / XCR0 detection of the SIMD paths and the STRATA_CPU_ISA override.
#include "kernels/cpu/isa.h"

#include <cpuid.h>

#include <cstdlib>
#include <string>

namespace strata::kernels {
namespace {

uint64_t ReadXcr0() {
  uint32_t eax = 0, edx = 0;
  // xgetbv is only legal when cpuid says OSXSAVE; the caller checks that.
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures Detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28);
  const bool f16c = c & (1u << 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = ReadXcr0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;           // XMM and YMM saved
  const bool zmm_state = (xcr0 & 0xe6) == 0xe6;         // + opmask, ZMM_Hi256, Hi16_ZMM
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512bw = b & (1u << 30);
  const bool avx512vl = b & (1u << 31);
  f.avx2 = ymm_state && avx2 && fma && f16c;
  f.avx512 = f.avx2 && zmm_state && avx512f && avx512bw && avx512vl;
  __cpuid_count(7, 1, a, b, c, d);
  f.avx512_bf16 = f.avx512 && (a & (1u << 5));
  return f;
}

}  // namespace

const CpuFeatures& DetectCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

bool CpuSupports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2: return DetectCpuFeatures().avx2;
    case CpuIsa::kAvx512: return DetectCpuFeatures().avx512;
  }
  return false;
}

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "?";
}

Result<CpuIsa> ParseCpuIsa(std::string_view name) {
  if (name == "scalar") return CpuIsa::kScalar;
  if (name == "avx2") return CpuIsa::kAvx2;
  if (name == "avx512") return CpuIsa::kAvx512;
  return InvalidError("CPU ISA '" + std::string(name) + "' is not one of scalar, avx2, avx512");
}

CpuIsa BestCpuIsa() {
  if (CpuSupports(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (CpuSupports(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

Status CheckCpuIsa(CpuIsa isa) {
  if (CpuSupports(isa)) return Status::Ok();
  const char* need = isa == CpuIsa::kAvx512 ? "AVX-512 F, BW and VL" : "AVX2, FMA and F16C";
  return UnsupportedError(std::string("CPU path ") + CpuIsaName(isa) + " needs " + need +
                          ", which this CPU (or its OS) does not provide");
}

Result<CpuIsa> ActiveCpuIsa() {
  static const Result<CpuIsa> active = []() -> Result<CpuIsa> {
    const char* env = std::getenv("STRATA_CPU_ISA");
    if (env == nullptr || *env == '\0') return MeasuredCpuIsa();
    Result<CpuIsa> isa = ParseCpuIsa(env);
    if (!isa.ok()) return isa.status().WithContext("STRATA_CPU_ISA");
    Status st = CheckCpuIsa(*isa);
    if (!st.ok()) return st.WithContext("STRATA_CPU_ISA");
    return *isa;
  }();
  return active;
}

}  // namespace strata::kernels
