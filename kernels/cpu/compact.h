// Compact optimizer state (FlashOptim, Gonzalez Ortiz et al. 2026): about 5
// bytes a parameter instead of 12 for W, M, V, converted from and to fp32, and
// one fused Adam/AdamW pass that dequantizes, updates with AdamStep's exact
// arithmetic, requantizes and writes P. Deterministic: every path (scalar,
// AVX2, AVX-512) and every thread count gives the same bits.
//
//   CompactState s{hi, lo, m_code, m_scale, v_code, v_scale};   // see below
//   Status st = CompactPack(n, w, m, v, s);                      // from fp32
//   st = CompactAdamStep(opt, n, s, grad_bf16, nullptr);        // P is s.w_hi
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/lion.h"

namespace strata::kernels {

// ---- Format -----------------------------------------------------------------
// Six arrays per n elements, each a plain stream (no headers, little endian):
//   w_hi[n]     uint16  bf16 of the fp32 master w, round to nearest even (base
//                       F32ToBF16): bitwise what AdamStep writes as a bf16 P.
//   w_lo[n]     int8    correction q = floor((d*127 + 16384) / 32768), where
//                       d = |w|bits - |hi|bits (in fp32 ULPs of w's binade,
//                       |d| <= 32768 = half a bf16 ULP); q = 0 for NaN;
//                       q = min(q, -1) when a finite w rounds to bf16 inf.
//   m_code[n]   int8    round(127 * sqrt(|m| / A)) with m's sign, A = m_scale
//   m_scale[b]  float   A: max |m| over block b (kCompactBlock elements)
//   v_code[n]   uint8   round(255 * sqrt(sqrt(v) / R)), R = v_scale
//   v_scale[b]  float   R: max sqrt(v) over block b
// Codes, exactly: for y = |m| * RN(16129/A) (resp. sqrt(v) * RN(65025/R))
// in fp32, q = min(rint(sqrt(y)), 127 (255)): IEEE sqrt and round to nearest
// even, so every path gets the same q.
// Rebuilt values:
//   w = bits(sign(hi) | (|hi|bits + floor((q*33026 + 64) / 128)))  (integers;
//       bits are linear across binades, so the rounding crossing a binade,
//       subnormals and the overflow of w to a bf16 infinity need no case)
//   m = sign(q) * float(q*q) * (A / 16129)
//   v = t*t with t = float(q*q) * (R / 65025)
// Special values:
//   w: ±0 and ±inf round-trip exactly; subnormals obey the bound below (in
//      2^-149 steps); NaN stays NaN (payload's top bits, as F32ToBF16); a
//      finite w beyond bf16's range (|w| >= 0x1.ff8p127) keeps hi = ±inf (P is
//      inf, as AdamStep's copy would be) and a finite master, within 258 ULPs.
//   m, v: a block holding a NaN, an infinite m (or a negative v) stores
//      scale NaN and codes 0: the whole block reads back NaN. An infinite v
//      (a finite gradient's square overflowed: fp32's update of that element
//      is then 0, its neighbours' as usual) is quantized as sqrt(v) = the
//      largest float: its code is the top one and reads back infinite, the
//      block's others read back 0 (their m codes too) and stay finite. A
//      block of m with A < kCompactMinScale is stored as zeros. -0 reads
//      back +0.
//   A zero v code forces the element's m code to 0 (else m/(sqrt(v)+eps)
//   would turn a tiny m into a huge step).
// Why 32 and these compandings: on the moments of a 300-step AdamW run over
// 2^18 elements with curvatures and noise spread over 4 decades, the update
// m/sqrt(v) read back from the codes has relative RMS error 0.20 / 0.24 /
// 0.27 / 0.30 at blocks of 32 / 64 / 128 / 256 (median 4.5% / 5.4% / 6.1% /
// 6.8%), for 5.25 / 5.13 / 5.06 / 5.03 bytes a parameter. Against the same
// blocks, 2x/(1+|x|) on m gives 0.51 and a linear sqrt(v) code gives 0.48
// (that one also zeroes v under m: 69k of 262k elements).
// Blocks: block b covers elements [b*32, b*32 + 32); the last may be partial
// (its scale covers only its elements). Tiles of the parallel loops are
// multiples of the block, so results never depend on the thread count.
// For an engine buffer split into shards, every shard must start at a
// multiple of kCompactBlock elements (the engine pads groups to 1024).
inline constexpr size_t kCompactBlock = 32;
inline constexpr float kCompactMinScale = 0x1p-100f;

// ---- Error bounds (tests/kernels/compact_test.cpp checks each) ----------------
// W: for every non-NaN fp32 w, the rebuilt master w' has w's sign and
//    |bits(w') - bits(w)| <= kCompactMasterUlps: at most 129 fp32 values
//    apart, u/508 for u the bf16 ULP at w (65536 fp32 ULPs); relative error
//    below 2^-15.9 for normal w. 129 is reached (d = -32639). Finite w stay
//    finite (twice the bound past bf16's range, see above).
inline constexpr uint32_t kCompactMasterUlps = 129;
// Both moment bounds hold for |m|, v <= 2^127; above, the dequantized value
// (q*q * (A/16129), t*t) may round past the largest float to inf.
// M: for a finite block with A >= kCompactMinScale and a nonzero v code,
//    |m' - m| <= (sqrt(|m|*A)/127 + A/64516) * (1 + 2^-10).
// V: for a finite block with R = max sqrt(v):
//    |sqrt(v') - sqrt(v)| <= (sqrt(sqrt(v)*R)/255 + R/260100) * (1 + 2^-10) + 2^-74
//    (the last term: v' = t*t below 2^-126 is an fp32 subnormal).
double CompactMomentBound(double m, double absmax);        // the M bound above
double CompactSqrtSecondBound(double v, double sqrt_max);  // the V bound above

// Scale entries for n elements: ceil(n / kCompactBlock).
inline constexpr size_t CompactScaleCount(size_t n) { return (n + kCompactBlock - 1) / kCompactBlock; }
// Bytes of the six arrays for n elements (2 + 1 + 1 + 1 bytes an element and
// 2 floats a block: 5.25 bytes a parameter).
inline constexpr size_t CompactBytes(size_t n) { return 5 * n + 8 * CompactScaleCount(n); }

// The six arrays of n elements (n, n, n, CompactScaleCount(n), n,
// CompactScaleCount(n) entries). Any alignment; no overlap.
struct CompactState {
  uint16_t* w_hi;
  int8_t* w_lo;
  int8_t* m_code;
  float* m_scale;
  uint8_t* v_code;
  float* v_scale;
};

// fp32 -> compact (checkpoint conversion, ReadState). w, m, v: n floats each.
// Runs over tiles in parallel, in AVX2 vectors where the active path is
// SIMD (AVX-512 machines use them too), bitwise the scalar reference's.
// Errors: kInvalid on null.
// Lion's state has no v: v, s.v_code and s.v_scale all null (then no zero-v
// rule applies to m); in CompactUnpack likewise.
Status CompactPack(size_t n, const float* w, const float* m, const float* v, const CompactState& s);
// compact -> fp32, the values the step itself reads (definitions above). A
// rebuilt master packs back to itself, so checkpoint round trips do not drift
// (its (hi, lo) may move from (h, 127) to (h + 1 ulp, -127) at an exact tie);
// moments are requantized (within their bounds), not bitwise fixed points.
Status CompactUnpack(size_t n, const CompactState& s, float* w, float* m, float* v);
// The same on a chosen path: kScalar (the reference) or a SIMD one (AVX2
// vectors for kAvx2 and kAvx512). kUnsupported for a path the CPU lacks.
Status CompactPackOn(CpuIsa isa, size_t n, const float* w, const float* m, const float* v,
                     const CompactState& s);
Status CompactUnpackOn(CpuIsa isa, size_t n, const CompactState& s, float* w, float* m, float* v);

// Speed (bench/adam_vs_peers.sh, 2-core Zen 3 VM, AVX2, 2 threads): about
// 0.85-1.07 G params/s, the same in cache (n = 64K) as out of it (n = 16M):
// the step is bound by its instructions, not by memory, and reaches about a
// third of a streaming loop over its own 12.5 bytes a parameter (31-40 GB/s
// here). The two code square roots (CodeOf) are about 40% of its time: with
// them dropped (a timing experiment, wrong codes) it ran at 1.48 G params/s,
// and with every square root and division dropped at 1.38, so no choice of
// sqrt or division can take it near that loop on this machine. They are
// kept because they define the codes bitwise on every path (CPU and CUDA).
// On a 2-core AVX-512 EPYC VM: AVX-512 1.52, AVX2 1.33 G params/s against
// a streaming loop (prefetching as the kernels do) at 6.3 G params/s (79
// GB/s), a ratio of 0.23: there too the instructions bound it.
// Against a disk it is far from the limit: 1 G params/s is 7 GB/s of
// compact state read from NVMe.
// One fused Adam/AdamW step over n elements, in place on `s`, on the active
// path. Bitwise equal to CompactPack(AdamStep(CompactUnpack(s))) with the same
// options (the f32 master AdamStep computes is what gets split and written).
//   grad: n elements of opt.grad_dtype (f32, bf16, f16), times opt.grad_scale.
//   param_copy: null (a bf16 P is s.w_hi: nothing more to write), or n
//     elements of opt.param_copy_dtype, which here may also be kF32 (the
//     updated fp32 master before it is split) or kBF16 (a copy of w_hi).
// Thread-safe for disjoint arrays. Errors: kInvalid (options, null arrays),
// kUnsupported (a forced path the CPU lacks).
Status CompactAdamStep(const AdamOptions& opt, size_t n, const CompactState& s, const void* grad,
                       void* param_copy);
Status CompactAdamStepOn(CpuIsa isa, const AdamOptions& opt, size_t n, const CompactState& s,
                         const void* grad, void* param_copy);

// One fused Lion step (lion.h's arithmetic) on w_hi, w_lo, m_code, m_scale;
// s.v_code and s.v_scale are not used (may be null). Bitwise equal to
// CompactPack(LionStep(CompactUnpack(s))) with no v. param_copy as above.
Status CompactLionStep(const LionOptions& opt, size_t n, const CompactState& s, const void* grad,
                       void* param_copy);
Status CompactLionStepOn(CpuIsa isa, const LionOptions& opt, size_t n, const CompactState& s,
                         const void* grad, void* param_copy);

}  // namespace strata::kernels
