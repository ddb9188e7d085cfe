// Validation of optimizer options and their per-step scalars.
#include "kernels/cpu/step_scalars.h"

#include <cfloat>
#include <cmath>
#include <cstdio>
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

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// A scalar the kernels take as a float (they compute in float): beyond
// float's range its cast is undefined (inf in practice: every master
// weight it touches goes inf or NaN).
Status CheckFloat(const char* who, const std::string& what, double v) {
  if (std::fabs(v) <= static_cast<double>(FLT_MAX)) return Status::Ok();
  return InvalidError(std::string(who) + ": " + what + " is " + Num(v) + ", beyond float's range (" +
                      Num(static_cast<double>(FLT_MAX)) + "): the update computes in float");
}

// An eps asked for (> 0) that is 0 as a float: an element whose gradient
// and moments are 0 would update by 0/0 (NaN).
Status CheckEps(const char* who, double eps) {
  STRATA_RETURN_IF_ERROR(CheckFloat(who, "eps", eps));
  // (The C API passes an eps of 0 asked for as the least positive double.)
  if (eps > DBL_TRUE_MIN && static_cast<float>(eps) == 0.0f)
    return InvalidError(std::string(who) + ": eps " + Num(eps) +
                        " is 0 as a float: an element whose gradient and moments are 0 would update by 0/0 (NaN); "
                        "give at least 1.5e-45 (or 0, as asked)");
  return Status::Ok();
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
  // MakeAdamStepScalars's casts.
  STRATA_RETURN_IF_ERROR(CheckFloat("Adam", "grad_scale", o.grad_scale));
  STRATA_RETURN_IF_ERROR(CheckEps("Adam", o.eps));
  if (o.mode == AdamMode::kAdamW)
    STRATA_RETURN_IF_ERROR(CheckFloat("Adam", "1 - lr * weight_decay", 1.0 - o.lr * o.weight_decay));
  else
    STRATA_RETURN_IF_ERROR(CheckFloat("Adam", "weight_decay", o.weight_decay));
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(o.step));
  return CheckFloat("Adam", "lr / (1 - beta1^step) at step " + std::to_string(o.step), o.lr / bc1);
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
  // MakeLionStepScalars's casts.
  STRATA_RETURN_IF_ERROR(CheckFloat("Lion", "grad_scale", o.grad_scale));
  STRATA_RETURN_IF_ERROR(CheckFloat("Lion", "lr", o.lr));
  return CheckFloat("Lion", "1 - lr * weight_decay", 1.0 - o.lr * o.weight_decay);
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
  // MakeAdagradStepScalars's casts.
  STRATA_RETURN_IF_ERROR(CheckFloat("Adagrad", "grad_scale", o.grad_scale));
  STRATA_RETURN_IF_ERROR(CheckFloat("Adagrad", "weight_decay", o.weight_decay));
  STRATA_RETURN_IF_ERROR(CheckEps("Adagrad", o.eps));
  return CheckFloat("Adagrad", "lr / (1 + (step - 1) * lr_decay) at step " + std::to_string(o.step),
                    o.lr / (1.0 + static_cast<double>(o.step - 1) * o.lr_decay));
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
