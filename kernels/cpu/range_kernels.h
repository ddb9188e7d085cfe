// Internal: the per-path range kernels behind the public entry points. Each
// path's file returns a function for one variant (gradient dtype, copy-out,
// flag); the dispatch files validate, pick once per call and run the tiles.
// Keep this header free of inline code: files built with -mavx2/-mavx512*
// must not emit shared (COMDAT) functions that a scalar caller could pick up.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "kernels/cpu/step_scalars.h"

namespace strata::kernels::internal {

enum class CopyOut : uint8_t { kNone = 0, kBF16 = 1, kF16 = 2 };
CopyOut CopyOutFor(const void* param_copy, DType dtype);

struct AdamArrays {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  void* param_copy;
};
using AdamRangeFn = void (*)(const AdamStepScalars& s, const AdamArrays& a, size_t begin,
                             size_t end);
// l2: Adam mode with weight_decay != 0 (adds wd*p to the gradient);
// lerp: MomentUpdate::kLerp (step_scalars.h).
AdamRangeFn SelectAdamScalar(DType grad, CopyOut copy, bool l2, bool lerp);
AdamRangeFn SelectAdamAvx2(DType grad, CopyOut copy, bool l2, bool lerp);
AdamRangeFn SelectAdamAvx512(DType grad, CopyOut copy, bool l2, bool lerp, bool bf16_insn);

struct LionArrays {
  float* param;
  float* exp_avg;
  const void* grad;
  void* param_copy;
};
using LionRangeFn = void (*)(const LionStepScalars& s, const LionArrays& a, size_t begin,
                             size_t end);
LionRangeFn SelectLionScalar(DType grad, CopyOut copy);
LionRangeFn SelectLionAvx2(DType grad, CopyOut copy);
LionRangeFn SelectLionAvx512(DType grad, CopyOut copy, bool bf16_insn);

struct AdagradArrays {
  float* param;
  float* state_sum;
  const void* grad;
  void* param_copy;
};
using AdagradRangeFn = void (*)(const AdagradStepScalars& s, const AdagradArrays& a,
                                size_t begin, size_t end);
// l2: weight_decay != 0.
AdagradRangeFn SelectAdagradScalar(DType grad, CopyOut copy, bool l2);
AdagradRangeFn SelectAdagradAvx2(DType grad, CopyOut copy, bool l2);
AdagradRangeFn SelectAdagradAvx512(DType grad, CopyOut copy, bool l2, bool bf16_insn);

// Sum of x*x over [begin, end) in 16 interleaved fp64 lanes (see norm.h).
// REQUIRES: begin is a multiple of 16.
using SumSquaresRangeFn = double (*)(const void* x, size_t begin, size_t end);
SumSquaresRangeFn SelectSumSquaresScalar(DType dtype);
SumSquaresRangeFn SelectSumSquaresAvx2(DType dtype);
SumSquaresRangeFn SelectSumSquaresAvx512(DType dtype);

using CastRangeFn = void (*)(const void* src, void* dst, size_t begin, size_t end);
CastRangeFn SelectCastScalar(DType src, DType dst);
CastRangeFn SelectCastAvx2(DType src, DType dst);
CastRangeFn SelectCastAvx512(DType src, DType dst, bool bf16_insn);

}  // namespace strata::kernels::internal
