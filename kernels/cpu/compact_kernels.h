// Internal: the per-path range kernels of the compact state (compact.h). Like
// range_kernels.h, no inline code: files built with ISA flags must not emit
// shared functions a scalar caller could pick up.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "kernels/cpu/compact.h"
#include "kernels/cpu/step_scalars.h"

namespace strata::kernels::internal {

// What the step writes beside the compact state: nothing (a bf16 P is w_hi),
// or a copy of the new param as bf16, f16 or f32.
enum class CompactCopy : uint8_t { kNone = 0, kBF16 = 1, kF16 = 2, kF32 = 3 };

struct CompactArrays {
  CompactState s;
  const void* grad;
  void* param_copy;
};

// Runs the step over [begin, end). REQUIRES: begin is a multiple of
// kCompactBlock (end may not be: the last block of the array).
using CompactAdamRangeFn = void (*)(const AdamStepScalars& s, const CompactArrays& a, size_t begin,
                                    size_t end);
// l2: Adam mode with weight_decay != 0; lerp: MomentUpdate::kLerp.
CompactAdamRangeFn SelectCompactAdamScalar(DType grad, CompactCopy copy, bool l2, bool lerp);
CompactAdamRangeFn SelectCompactAdamAvx2(DType grad, CompactCopy copy, bool l2, bool lerp);
CompactAdamRangeFn SelectCompactAdamAvx512(DType grad, CompactCopy copy, bool l2, bool lerp);

// Lion on the compact state (v arrays unused).
using CompactLionRangeFn = void (*)(const LionStepScalars& s, const CompactArrays& a, size_t begin,
                                    size_t end);
CompactLionRangeFn SelectCompactLionScalar(DType grad, CompactCopy copy);
CompactLionRangeFn SelectCompactLionAvx2(DType grad, CompactCopy copy);
CompactLionRangeFn SelectCompactLionAvx512(DType grad, CompactCopy copy);

// The scalar reference conversions over [begin, end), same REQUIRES.
void CompactPackRange(const float* w, const float* m, const float* v, const CompactState& s, size_t begin,
                      size_t end);
void CompactUnpackRange(const CompactState& s, float* w, float* m, float* v, size_t begin, size_t end);
// The same in AVX2 vectors, bitwise equal (AVX-512 machines run these too).
void CompactPackRangeAvx2(const float* w, const float* m, const float* v, const CompactState& s, size_t begin,
                          size_t end);
void CompactUnpackRangeAvx2(const CompactState& s, float* w, float* m, float* v, size_t begin, size_t end);

}  // namespace strata::kernels::internal
