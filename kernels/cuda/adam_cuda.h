// CUDA twins of the CPU Adam/AdamW step and casts, bitwise equal to the scalar
// reference (kernels/cpu/adam_scalar.cpp, base/dtype.h), NaN payloads aside: a
// NaN that the update makes (strata.nonfinite "apply" with a NaN gradient)
// is a NaN on both, but the x86 FPU passes the first NaN operand's sign and
// payload through (quieted) where CUDA gives its canonical 0x7FFFFFFF, so
// the bits, and checksums over them, differ. Plain entry points over device
// pointers; whether a GPU exists is decided at run time.
//
//   if (Result<int> gpus = CudaDeviceCount(); gpus.ok() && *gpus > 0)
//     STRATA_RETURN_IF_ERROR(AdamStepCuda(opt, n, w, m, v, g, nullptr, stream));
#pragma once

#include <cstddef>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cpu/adam.h"

namespace strata::kernels {

// Usable GPUs; kUnsupported (with cudaGetErrorString) when the runtime or the
// driver cannot be used, e.g. "CUDA driver version is insufficient".
Result<int> CudaDeviceCount();

// The same contract as AdamStep (kernels/cpu/adam.h) over device pointers,
// enqueued on `stream` (a cudaStream_t; null = the default stream). Returns
// after the launch; errors of the launch are returned, later ones surface at
// the caller's next synchronisation.
Status AdamStepCuda(const AdamOptions& opt, size_t n, float* param, float* exp_avg,
                    float* exp_avg_sq, const void* grad, void* param_copy, void* stream);

// dst[i] = src[i] converted (see kernels/cpu/cast.h), device pointers, on `stream`.
Status CastCuda(DType src_dtype, const void* src, DType dst_dtype, void* dst, size_t n,
                void* stream);

}  // namespace strata::kernels
