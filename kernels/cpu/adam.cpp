// Adam/AdamW entry points: validate, derive the step's scalars once, pick the
// path's range kernel and run it over fixed tiles.
#include "kernels/cpu/adam.h"

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/step_scalars.h"

namespace strata::kernels {

using internal::AdamArrays;
using internal::AdamRangeFn;
using internal::CopyOut;

Status AdamStepOn(CpuIsa isa, const AdamOptions& opt, size_t n, float* param, float* exp_avg,
                  float* exp_avg_sq, const void* grad, void* param_copy) {
  STRATA_RETURN_IF_ERROR(ValidateAdamOptions(opt));
  STRATA_RETURN_IF_ERROR(CheckCpuIsa(isa));
  if (n == 0) return Status::Ok();
  if (!param || !exp_avg || !exp_avg_sq || !grad) return InvalidError("AdamStep: null array");
  const AdamStepScalars s = MakeAdamStepScalars(opt);
  const CopyOut copy = internal::CopyOutFor(param_copy, opt.param_copy_dtype);
  const bool l2 = opt.mode == AdamMode::kAdam && opt.weight_decay != 0;
  const bool lerp = opt.moment_update == MomentUpdate::kLerp;
  AdamRangeFn fn = internal::SelectAdamScalar(opt.grad_dtype, copy, l2, lerp);
  if (isa == CpuIsa::kAvx2) fn = internal::SelectAdamAvx2(opt.grad_dtype, copy, l2, lerp);
  if (isa == CpuIsa::kAvx512)
    fn = internal::SelectAdamAvx512(opt.grad_dtype, copy, l2, lerp, DetectCpuFeatures().avx512_bf16);
  const AdamArrays a{param, exp_avg, exp_avg_sq, grad, param_copy};
  ParallelForTiles(n, kElementTile, [&](size_t begin, size_t end) { fn(s, a, begin, end); });
  return Status::Ok();
}

Status AdamStep(const AdamOptions& opt, size_t n, float* param, float* exp_avg,
                float* exp_avg_sq, const void* grad, void* param_copy) {
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  return AdamStepOn(isa, opt, n, param, exp_avg, exp_avg_sq, grad, param_copy);
}

}  // namespace strata::kernels
