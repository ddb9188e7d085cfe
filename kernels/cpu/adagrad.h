// Adagrad on the CPU, as torch.optim.Adagrad (1.13):
//   g += wd*p (when wd != 0);  clr = lr / (1 + (step-1)*lr_decay);
//   sum += g*g;  p -= clr * g / (sqrt(sum) + eps)
// with the same fused gradient scale, gradient dtypes and copy-out as Adam.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cpu/isa.h"

namespace strata::kernels {

struct AdagradOptions {
  double lr = 1e-2;
  double lr_decay = 0.0;
  double weight_decay = 0.0;
  double eps = 1e-10;
  int64_t step = 1;  // 1-based
  double grad_scale = 1.0;
  DType grad_dtype = DType::kF32;
  DType param_copy_dtype = DType::kBF16;
};

// param, state_sum: n floats (read and written); grad: n of opt.grad_dtype;
// param_copy: null or n of opt.param_copy_dtype. Same contract as AdamStep.
Status AdagradStep(const AdagradOptions& opt, size_t n, float* param, float* state_sum,
                   const void* grad, void* param_copy);
Status AdagradStepOn(CpuIsa isa, const AdagradOptions& opt, size_t n, float* param,
                     float* state_sum, const void* grad, void* param_copy);

}  // namespace strata::kernels
