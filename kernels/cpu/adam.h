// Adam and AdamW on the CPU: one pass over fp32 master weights and fp32 moments
// that folds in a gradient scale, reads f32/bf16/f16 gradients and may write
// the updated weights as bf16/f16. Semantics follow torch.optim.Adam/AdamW.
//
//   AdamOptions opt;  opt.lr = 1e-3; opt.weight_decay = 0.01; opt.step = t;
//   opt.grad_dtype = DType::kBF16; opt.grad_scale = clip / loss_scale;
//   Status st = AdamStep(opt, n, w, m, v, grad_bf16, w_bf16_out);
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cpu/isa.h"

namespace strata::kernels {

enum class AdamMode : uint8_t {
  kAdamW = 0,  // decoupled weight decay: p *= 1 - lr*wd (torch.optim.AdamW)
  kAdam = 1,   // L2 penalty in the gradient: g += wd*p (torch.optim.Adam)
};

// How the first moment takes the gradient in; w = float(1 - beta1). Both are
// torch's arithmetic to the last bit, of different versions:
//   kMulAdd: m = fma(w, g, m*beta1)       exp_avg.mul_(beta1).add_(grad, alpha=1-beta1), torch 1.x
//   kLerp:   m = fma(w, g - m, m)         exp_avg.lerp_(grad, 1-beta1), torch >= 2.0
//                (|w| < 0.5; else m = fma(w - 1, g - m, g), lerp's other branch)
enum class MomentUpdate : uint8_t {
  kMulAdd = 0,
  kLerp = 1,
};
// "mul_add", "lerp"; and back (kInvalid naming the allowed names).
const char* MomentUpdateName(MomentUpdate u);
Result<MomentUpdate> ParseMomentUpdate(std::string_view name);

// Hyperparameters may change every step. Doubles, like torch's Python floats;
// per-step scalars are derived once in double and rounded once to float.
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;                     // 1-based number of this update (bias correction)
  AdamMode mode = AdamMode::kAdamW;
  double grad_scale = 1.0;              // multiplies the gradient first: clip / loss_scale
  DType grad_dtype = DType::kF32;       // element type of `grad`
  DType param_copy_dtype = DType::kBF16;  // element type of `param_copy` (bf16 or f16)
  MomentUpdate moment_update = MomentUpdate::kMulAdd;
};

// One optimizer step over n elements, in place, on the active path
// (ActiveCpuIsa()), in parallel over fixed tiles.
//   param, exp_avg, exp_avg_sq: n floats each (read and written)
//   grad: n elements of opt.grad_dtype (read)
//   param_copy: null, or n elements of opt.param_copy_dtype that receive the
//     updated param rounded to nearest even (NaN stays NaN)
// Any alignment. REQUIRES: the arrays do not overlap. Thread-safe for disjoint
// arrays. Errors: kInvalid for bad options, kUnsupported for a forced path the
// CPU lacks.
Status AdamStep(const AdamOptions& opt, size_t n, float* param, float* exp_avg,
                float* exp_avg_sq, const void* grad, void* param_copy);
// The same on a chosen path (tests, benchmarks). kScalar is the reference.
Status AdamStepOn(CpuIsa isa, const AdamOptions& opt, size_t n, float* param, float* exp_avg,
                  float* exp_avg_sq, const void* grad, void* param_copy);

}  // namespace strata::kernels
