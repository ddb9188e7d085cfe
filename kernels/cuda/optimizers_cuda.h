// CUDA twins of the CPU Lion and Adagrad steps (kernels/cpu/lion.h,
// kernels/cpu/adagrad.h), bitwise equal to their scalar references
// (kernels/cpu/lion_scalar.cpp, adagrad_scalar.cpp), NaN payloads aside (as
// in adam_cuda.h). Adam/AdamW, casts and
// CudaDeviceCount are in adam_cuda.h.
//
//   STRATA_RETURN_IF_ERROR(LionStepCuda(opt, n, w, m, g, w_bf16, stream));
//   // ... then synchronize `stream` and check its result
#pragma once

#include <cstddef>

#include "base/status.h"
#include "kernels/cpu/adagrad.h"
#include "kernels/cpu/lion.h"
#include "kernels/cuda/adam_cuda.h"

namespace strata::kernels {

// The same contracts as LionStep and AdagradStep over device pointers,
// enqueued on `stream` (a cudaStream_t; null = the default stream). Return
// after the launch: errors of the launch are returned, later ones surface at
// the caller's next synchronisation of `stream`.
Status LionStepCuda(const LionOptions& opt, size_t n, float* param, float* exp_avg, const void* grad,
                    void* param_copy, void* stream);
Status AdagradStepCuda(const AdagradOptions& opt, size_t n, float* param, float* state_sum, const void* grad,
                       void* param_copy, void* stream);

}  // namespace strata::kernels
