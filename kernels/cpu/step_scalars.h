// Per-step scalars of the optimizers, derived once per call in double and
// rounded once to float, so that every path (scalar, AVX2, AVX-512, CUDA) uses
// the very same values. Plain structs: the CUDA kernels take them by value.
#pragma once

#include "kernels/cpu/adagrad.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/lion.h"

namespace strata::kernels {

// Per element (every path, this order, no other rounding):
//   g = g_in*grad_scale;  g = fma(p, l2, g) if Adam with wd != 0
//   p = p*decay;  m = fma(1-b1, g, m*b1);  v = fma((1-b2)*g, g, v*b2)
//   p = p + (neg_step_size*m) / (sqrt(v)/sqrt_bc2 + eps)
// which is torch 1.13's CPU arithmetic rounding for rounding (its add_ with
// alpha is an FMA, its tensor/scalar a true division), so that we agree with
// torch.optim to the last bit, not just to 1e-6. With MomentUpdate::kLerp
// (torch >= 2.0's exp_avg.lerp_(grad, 1-b1)) the first moment is instead
//   m = fma(lerp_weight, g - m, lerp_from_grad ? g : m)
// torch's lerp: self + w*(end - self) for |w| < 0.5, else end - (end - self)*(1 - w),
// each one FMA in its vector body and (contracted) in its scalar tail.
// The SIMD paths divide by sqrt_bc2 without the divider: q = x*inv_sqrt_bc2,
// corrected once by an FMA. With inv_sqrt_bc2 = RN(1/sqrt_bc2) and x/sqrt_bc2
// normal, that is the correctly rounded quotient (Markstein's theorem; checked
// for 1.2e10 quotients, and by the path tests), so all paths stay bitwise
// equal while the divider only serves sqrt(v) and the last division.
struct AdamStepScalars {
  float grad_scale;
  float l2;               // Adam: weight_decay; AdamW: 0
  float decay;            // AdamW: 1 - lr*wd; Adam: 1
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float sqrt_bc2;         // sqrt(1 - beta2^step)
  float inv_sqrt_bc2;     // 1.0f / sqrt_bc2, rounded to nearest (see DivideBySqrtBc2)
  float eps;
  float neg_step_size;    // -lr / (1 - beta1^step)
  // MomentUpdate::kLerp, w = one_minus_beta1: w if |w| < 0.5 (lerp_from_grad
  // false), else w - 1 in float (true). Unused by kMulAdd.
  float lerp_weight;
  bool lerp_from_grad;
};
Status ValidateAdamOptions(const AdamOptions& opt);
AdamStepScalars MakeAdamStepScalars(const AdamOptions& opt);  // REQUIRES: valid opt

// Per element: g = g_in*grad_scale; p = p*decay; c = fma(1-b1, g, m*b1);
//   p = fma(neg_lr, sign(c), p); m = fma(1-b2, g, m*b2)
struct LionStepScalars {
  float grad_scale;
  float decay;  // 1 - lr*wd
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float neg_lr;
};
Status ValidateLionOptions(const LionOptions& opt);
LionStepScalars MakeLionStepScalars(const LionOptions& opt);

// Per element: g = g_in*grad_scale; g = fma(p, wd, g) if wd != 0;
//   s = fma(g, g, s); p = fma(neg_clr, g / (sqrt(s) + eps), p)
struct AdagradStepScalars {
  float grad_scale;
  float weight_decay;
  float eps;
  float neg_clr;  // -lr / (1 + (step-1)*lr_decay)
};
Status ValidateAdagradOptions(const AdagradOptions& opt);
AdagradStepScalars MakeAdagradStepScalars(const AdagradOptions& opt);

}  // namespace strata::kernels
