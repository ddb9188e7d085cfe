// Validation of optimizer options and their per-step scalars.
#include "kernels/cpu/step_scalars.h"

#include <cmath>
#include <string>

namespace strata::kernels {
namespace {

Status CheckCommon(const char* who, double lr, double grad_scale, DType grad, DType copy) {
  const std::string w(who);
  if (!(lr >= 0) || !std::isfinite(lr)) return InvalidError(w + ": lr must be finite and >= 0");
  if (!std::isfinite(grad_scale)) return InvalidError(w + ": grad_scale must be finite");
  if (grad != DType::kF32 && grad != DType::kBF16 && grad != DType::kF16)
    return InvalidError(w + ": unknown grad_dtype");
  if (copy != DType::kBF16 && copy != DType::kF16)
    return InvalidError(w + ": param_copy_dtype must be bf16 or f16");
  return Status::Ok();
}

Status CheckBeta(const char* who, const char* name, double beta) {
  if (beta >= 0 && beta < 1) return Status::Ok();
  return InvalidError(std::string(who) + ": " + name + " must be in [0, 1)");
}

}  // namespace

const char* MomentUpdateName(MomentUpdate u) {
  switch (u) {
    case MomentUpdate::kMulAdd: return "mul_add";
    case MomentUpdate::kLerp: return "lerp";
  }
  return "unknown";
}

Result<MomentUpdate> ParseMomentUpdate(std::string_view name) {
  if (name == "mul_add") return MomentUpdate::kMulAdd;
  if (name == "lerp") return MomentUpdate::kLerp;
  return InvalidError("moment_update: unknown value \"" + std::string(name) + "\"; allowed: mul_add, lerp");
}

Status ValidateAdamOptions(const AdamOptions& o) {
  STRATA_RETURN_IF_ERROR(CheckCommon("Adam", o.lr, o.grad_scale, o.grad_dtype, o.param_copy_dtype));
  STRATA_RETURN_IF_ERROR(CheckBeta("Adam", "beta1", o.beta1));
  STRATA_RETURN_IF_ERROR(CheckBeta("Adam", "beta2", o.beta2));
  if (o.step < 1) return InvalidError("Adam: step is 1-based and must be >= 1");
  if (!(o.eps >= 0) || !std::isfinite(o.eps))
    return InvalidError("Adam: eps must be finite and >= 0");
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay))
    return InvalidError("Adam: weight_decay must be finite and >= 0");
  if (o.mode != AdamMode::kAdam && o.mode != AdamMode::kAdamW)
    return InvalidError("Adam: unknown mode");
  if (o.moment_update != MomentUpdate::kMulAdd && o.moment_update != MomentUpdate::kLerp)
    return InvalidError("Adam: unknown moment_update " + std::to_string(static_cast<int>(o.moment_update)) +
                        "; allowed: mul_add, lerp");
  // sqrt(v) <= 2^64 for any float v: keep sqrt(v)/sqrt_bc2 finite and normal.
  const double sqrt_bc2 = std::sqrt(1.0 - std::pow(o.beta2, static_cast<double>(o.step)));
  if (static_cast<float>(sqrt_bc2) < 0x1p-60f)
    return InvalidError("Adam: beta2 too close to 1 (sqrt(1 - beta2^step) < 2^-60)");
  return Status::Ok();
}

AdamStepScalars MakeAdamStepScalars(const AdamOptions& o) {
  const double t = static_cast<double>(o.step);
  const double bc1 = 1.0 - std::pow(o.beta1, t);
  const double bc2 = 1.0 - std::pow(o.beta2, t);
  const bool adamw = o.mode == AdamMode::kAdamW;
  AdamStepScalars s;
  s.grad_scale = static_cast<float>(o.grad_scale);
  s.l2 = adamw ? 0.0f : static_cast<float>(o.weight_decay);
  s.decay = adamw ? static_cast<float>(1.0 - o.lr * o.weight_decay) : 1.0f;
  s.beta1 = static_cast<float>(o.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
  s.beta2 = static_cast<float>(o.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  s.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  s.inv_sqrt_bc2 = 1.0f / s.sqrt_bc2;
  s.eps = static_cast<float>(o.eps);
  s.neg_step_size = static_cast<float>(-o.lr / bc1);
  // torch's is_lerp_weight_small and its `weight - 1`, both on the float weight.
  s.lerp_from_grad = !(std::fabs(s.one_minus_beta1) < 0.5f);
  s.lerp_weight = s.lerp_from_grad ? s.one_minus_beta1 - 1.0f : s.one_minus_beta1;
  return s;
}

Status ValidateLionOptions(const LionOptions& o) {
  STRATA_RETURN_IF_ERROR(CheckCommon("Lion", o.lr, o.grad_scale, o.grad_dtype, o.param_copy_dtype));
  STRATA_RETURN_IF_ERROR(CheckBeta("Lion", "beta1", o.beta1));
  STRATA_RETURN_IF_ERROR(CheckBeta("Lion", "beta2", o.beta2));
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay))
    return InvalidError("Lion: weight_decay must be finite and >= 0");
  return Status::Ok();
}

LionStepScalars MakeLionStepScalars(const LionOptions& o) {
  LionStepScalars s;
  s.grad_scale = static_cast<float>(o.grad_scale);
  s.decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
  s.beta1 = static_cast<float>(o.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
  s.beta2 = static_cast<float>(o.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  s.neg_lr = static_cast<float>(-o.lr);
  return s;
}

Status ValidateAdagradOptions(const AdagradOptions& o) {
  STRATA_RETURN_IF_ERROR(
      CheckCommon("Adagrad", o.lr, o.grad_scale, o.grad_dtype, o.param_copy_dtype));
  if (o.step < 1) return InvalidError("Adagrad: step is 1-based and must be >= 1");
  if (!(o.lr_decay >= 0) || !std::isfinite(o.lr_decay))
    return InvalidError("Adagrad: lr_decay must be finite and >= 0");
  if (!(o.eps >= 0) || !std::isfinite(o.eps))
    return InvalidError("Adagrad: eps must be finite and >= 0");
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay))
    return InvalidError("Adagrad: weight_decay must be finite and >= 0");
  return Status::Ok();
}

AdagradStepScalars MakeAdagradStepScalars(const AdagradOptions& o) {
  AdagradStepScalars s;
  s.grad_scale = static_cast<float>(o.grad_scale);
  s.weight_decay = static_cast<float>(o.weight_decay);
  s.eps = static_cast<float>(o.eps);
  s.neg_clr = static_cast<float>(-o.lr / (1.0 + static_cast<double>(o.step - 1) * o.lr_decay));
  return s;
}

}  // namespace strata::kernels
