// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") on
// the CPU, with the same fused gradient scale, gradient dtypes and copy-out as
// Adam:  p *= 1 - lr*wd;  c = b1*m + (1-b1)*g;  p -= lr*sign(c);
//        m = b2*m + (1-b2)*g.   sign(0) = 0; a NaN c gives a NaN update.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cpu/isa.h"

namespace strata::kernels {

struct LionOptions {
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.99;
  double weight_decay = 0.0;
  double grad_scale = 1.0;
  DType grad_dtype = DType::kF32;
  DType param_copy_dtype = DType::kBF16;
};

// param, exp_avg: n floats (read and written); grad: n of opt.grad_dtype;
// param_copy: null or n of opt.param_copy_dtype. Same contract as AdamStep.
Status LionStep(const LionOptions& opt, size_t n, float* param, float* exp_avg,
                const void* grad, void* param_copy);
Status LionStepOn(CpuIsa isa, const LionOptions& opt, size_t n, float* param, float* exp_avg,
                  const void* grad, void* param_copy);

}  // namespace strata::kernels
