// Which instruction set the CPU kernels run: detected once with cpuid and XCR0
// (an OS that does not save AVX state counts as lacking AVX), or forced with
// STRATA_CPU_ISA=scalar|avx2|avx512 for tests and benchmarks. A forced path the
// CPU lacks is refused with an error, never run (no SIGILL).
#pragma once

#include <cstdint>
#include <string_view>

#include "base/status.h"

namespace strata::kernels {

enum class CpuIsa : uint8_t {
  kScalar = 0,  // plain C++: the reference, runs anywhere
  kAvx2 = 1,    // AVX2 + FMA + F16C
  kAvx512 = 2,  // AVX-512 F + BW + VL (+ AVX512-BF16 conversions where present)
};

struct CpuFeatures {
  bool avx2 = false;         // AVX2, FMA and F16C, with OS support for YMM state
  bool avx512 = false;       // AVX-512 F, BW, VL, with OS support for ZMM state
  bool avx512_bf16 = false;  // AVX512-BF16 (vcvtneps2bf16)
};

const CpuFeatures& DetectCpuFeatures();  // cpuid once; thread-safe
bool CpuSupports(CpuIsa isa);
const char* CpuIsaName(CpuIsa isa);  // "scalar", "avx2", "avx512"
Result<CpuIsa> ParseCpuIsa(std::string_view name);
CpuIsa BestCpuIsa();
// OK when this CPU can run `isa`, else kUnsupported naming what is missing.
Status CheckCpuIsa(CpuIsa isa);
// Without STRATA_CPU_ISA: BestCpuIsa(), except that where both AVX-512 and
// AVX2 run, the faster of them on a short Adam measurement at first use
// (about a millisecond; isa_choice.cpp says why). Decided once per process.
// All paths give bitwise the same results: the choice moves time only.
CpuIsa MeasuredCpuIsa();
// The path the kernels use: STRATA_CPU_ISA when set (an error if the name is
// unknown or the CPU lacks it), else MeasuredCpuIsa(). Decided once per process.
Result<CpuIsa> ActiveCpuIsa();

}  // namespace strata::kernels
