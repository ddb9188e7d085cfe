// The memory bound of an in-place optimizer step: the same streams as the
// kernel (read param, grad, m, v; write param, m, v in place; optionally write
// a bf16 copy; grad f32 or bf16) moved by the simplest loop the compiler cannot
// elide (each written value depends on what was read). A STREAM triad is the
// wrong bound here: it pays write-allocate traffic an in-place update does not.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/compact.h"

namespace strata::bench {

struct BoundArrays {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;  // f32, or bf16 when bf16_grad
  uint16_t* param_copy;  // null, or receives the top half of param (bf16 by truncation)
};

using BoundRangeFn = void (*)(const BoundArrays& a, size_t begin, size_t end);
// 8-lane AVX2 loops (REQUIRES: the CPU has AVX2) and plain C++ ones.
BoundRangeFn SelectBoundAvx2(bool bf16_grad, bool copy);
BoundRangeFn SelectBoundPlain(bool bf16_grad, bool copy);

// The compact step's streams (kernels/cpu/compact.h, no copy-out): read a
// bf16 gradient; read and write in place the bf16 master half, its int8
// correction, the int8 m and u8 v codes and one float scale of each moment
// per 32 elements: 12.5 bytes a parameter. Each written value depends on what
// was read. REQUIRES: begin and end are multiples of 32.
struct CompactBoundArrays {
  kernels::CompactState s;  // the compact step's six arrays
  const uint16_t* grad;
};
using CompactBoundRangeFn = void (*)(const CompactBoundArrays& a, size_t begin, size_t end);
CompactBoundRangeFn SelectCompactBoundAvx2();
CompactBoundRangeFn SelectCompactBoundPlain();

}  // namespace strata::bench
