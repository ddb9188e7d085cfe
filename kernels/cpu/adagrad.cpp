// Adagrad entry points: validate, derive the step's scalars once, pick the
// path's range kernel and run it over fixed tiles.
#include "kernels/cpu/adagrad.h"

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/step_scalars.h"

namespace strata::kernels {

using internal::AdagradArrays;
using internal::AdagradRangeFn;
using internal::CopyOut;

Status AdagradStepOn(CpuIsa isa, const AdagradOptions& opt, size_t n, float* param,
                     float* state_sum, const void* grad, void* param_copy) {
  STRATA_RETURN_IF_ERROR(ValidateAdagradOptions(opt));
  STRATA_RETURN_IF_ERROR(CheckCpuIsa(isa));
  if (n == 0) return Status::Ok();
  if (!param || !state_sum || !grad) return InvalidError("AdagradStep: null array");
  const AdagradStepScalars s = MakeAdagradStepScalars(opt);
  const CopyOut copy = internal::CopyOutFor(param_copy, opt.param_copy_dtype);
  const bool l2 = opt.weight_decay != 0;
  AdagradRangeFn fn = internal::SelectAdagradScalar(opt.grad_dtype, copy, l2);
  if (isa == CpuIsa::kAvx2) fn = internal::SelectAdagradAvx2(opt.grad_dtype, copy, l2);
  if (isa == CpuIsa::kAvx512)
    fn = internal::SelectAdagradAvx512(opt.grad_dtype, copy, l2, DetectCpuFeatures().avx512_bf16);
  const AdagradArrays a{param, state_sum, grad, param_copy};
  ParallelForTiles(n, kElementTile, [&](size_t begin, size_t end) { fn(s, a, begin, end); });
  return Status::Ok();
}

Status AdagradStep(const AdagradOptions& opt, size_t n, float* param, float* state_sum,
                   const void* grad, void* param_copy) {
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  return AdagradStepOn(isa, opt, n, param, state_sum, grad, param_copy);
}

}  // namespace strata::kernels
