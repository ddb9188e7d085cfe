// CUDA twins of the compact-state steps (kernels/cpu/compact.h): Adam/AdamW
// and Lion on the bf16 half + int8 correction master and the 8-bit moment
// codes with a scale per block of 32, bitwise equal to the CPU scalar
// reference (kernels/cpu/compact_scalar.cpp) in every code, scale and half.
//
//   CompactState s{hi, lo, m_code, m_scale, v_code, v_scale};  // device pointers
//   STRATA_RETURN_IF_ERROR(CompactAdamStepCuda(opt, n, s, grad, nullptr, stream));
//   // ... then synchronize `stream` and check its result
#pragma once

#include <cstddef>

#include "base/status.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/compact.h"
#include "kernels/cpu/lion.h"

namespace strata::kernels {

// The contracts of CompactAdamStep and CompactLionStep (compact.h) over
// device pointers: `s`'s arrays, grad (n of opt.grad_dtype) and param_copy
// (null, or n of opt.param_copy_dtype: bf16, f16 or f32) all on the device,
// the state's block 0 at element 0 (a shard starts at a multiple of
// kCompactBlock). Enqueued on `stream` (a cudaStream_t; null = the default
// stream); return after the launch: invalid options and null arrays are
// refused before it (nothing changed), launch errors are returned, later ones
// surface at the caller's next synchronisation of `stream`.
// Bitwise equal to CompactAdamStepOn/CompactLionStepOn(CpuIsa::kScalar), NaN
// payloads aside: an element whose master becomes NaN keeps a NaN (hi a bf16
// NaN, lo 0) but its payload bits are the GPU's, as in the other CUDA twins.
// Lion reads and writes no v (s.v_code, s.v_scale may be null).
Status CompactAdamStepCuda(const AdamOptions& opt, size_t n, const CompactState& s, const void* grad,
                           void* param_copy, void* stream);
Status CompactLionStepCuda(const LionOptions& opt, size_t n, const CompactState& s, const void* grad,
                           void* param_copy, void* stream);

}  // namespace strata::kernels
