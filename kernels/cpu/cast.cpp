// Cast entry points and the copy-out selector shared by the optimizers.
#include "kernels/cpu/cast.h"

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/range_kernels.h"

namespace strata::kernels {
namespace internal {

CopyOut CopyOutFor(const void* param_copy, DType dtype) {
  if (param_copy == nullptr) return CopyOut::kNone;
  return dtype == DType::kF16 ? CopyOut::kF16 : CopyOut::kBF16;
}

}  // namespace internal

Status CastOn(CpuIsa isa, DType src_dtype, const void* src, DType dst_dtype, void* dst, size_t n) {
  STRATA_RETURN_IF_ERROR(CheckCpuIsa(isa));
  if (n > 0 && (src == nullptr || dst == nullptr)) return InvalidError("Cast: null array");
  internal::CastRangeFn fn = internal::SelectCastScalar(src_dtype, dst_dtype);
  if (isa == CpuIsa::kAvx2) fn = internal::SelectCastAvx2(src_dtype, dst_dtype);
  if (isa == CpuIsa::kAvx512)
    fn = internal::SelectCastAvx512(src_dtype, dst_dtype, DetectCpuFeatures().avx512_bf16);
  ParallelForTiles(n, kElementTile, [&](size_t begin, size_t end) { fn(src, dst, begin, end); });
  return Status::Ok();
}

Status Cast(DType src_dtype, const void* src, DType dst_dtype, void* dst, size_t n) {
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  return CastOn(isa, src_dtype, src, dst_dtype, dst, n);
}

}  // namespace strata::kernels
