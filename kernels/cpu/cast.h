// Element casts between f32, bf16 and f16: widening is exact, narrowing rounds
// to nearest even, overflows to infinity, keeps subnormals and keeps NaN a NaN
// (bit-identical to base/dtype.h's F32ToBF16 / F32ToF16).
#pragma once

#include <cstddef>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cpu/isa.h"

namespace strata::kernels {

// dst[i] = src[i] converted, for n elements, in parallel over tiles.
// REQUIRES: src and dst do not overlap. Any alignment.
Status Cast(DType src_dtype, const void* src, DType dst_dtype, void* dst, size_t n);
Status CastOn(CpuIsa isa, DType src_dtype, const void* src, DType dst_dtype, void* dst, size_t n);

}  // namespace strata::kernels
