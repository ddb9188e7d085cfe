// Parameters arrive in the engine's compute dtype (f32, bf16 or f16); the CPU
// layers compute in fp32. These copy a buffer to fp32 scratch and back, with
// base/dtype.h's scalar conversions (round to nearest even).
#pragma once

#include <cstddef>

#include "base/dtype.h"

namespace strata::layers {

// out (n fp32) = in (n values of `dtype`). For kF32 a plain copy.
void ToF32(DType dtype, const void* in, float* out, size_t n);
// out (n values of `dtype`) = in (n fp32), rounded to nearest even.
void FromF32(DType dtype, const float* in, void* out, size_t n);

}  // namespace strata::layers
