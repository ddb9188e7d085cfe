// Lion entry points: validate, derive the step's scalars once, pick the path's
// range kernel and run it over fixed tiles.
#include "kernels/cpu/lion.h"

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/step_scalars.h"

namespace strata::kernels {

using internal::CopyOut;
using internal::LionArrays;
using internal::LionRangeFn;

Status LionStepOn(CpuIsa isa, const LionOptions& opt, size_t n, float* param, float* exp_avg,
                  const void* grad, void* param_copy) {
  STRATA_RETURN_IF_ERROR(ValidateLionOptions(opt));
  STRATA_RETURN_IF_ERROR(CheckCpuIsa(isa));
  if (n == 0) return Status::Ok();
  if (!param || !exp_avg || !grad) return InvalidError("LionStep: null array");
  const LionStepScalars s = MakeLionStepScalars(opt);
  const CopyOut copy = internal::CopyOutFor(param_copy, opt.param_copy_dtype);
  LionRangeFn fn = internal::SelectLionScalar(opt.grad_dtype, copy);
  if (isa == CpuIsa::kAvx2) fn = internal::SelectLionAvx2(opt.grad_dtype, copy);
  if (isa == CpuIsa::kAvx512)
    fn = internal::SelectLionAvx512(opt.grad_dtype, copy, DetectCpuFeatures().avx512_bf16);
  const LionArrays a{param, exp_avg, grad, param_copy};
  ParallelForTiles(n, kElementTile, [&](size_t begin, size_t end) { fn(s, a, begin, end); });
  return Status::Ok();
}

Status LionStep(const LionOptions& opt, size_t n, float* param, float* exp_avg,
                const void* grad, void* param_copy) {
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  return LionStepOn(isa, opt, n, param, exp_avg, grad, param_copy);
}

}  // namespace strata::kernels
