// Compact state entry points: validate, derive the step's scalars once, pick
// the path's range kernel and run it over fixed tiles (multiples of the block,
// so a block never straddles two threads), plus the bounds the tests check.
#include "kernels/cpu/compact.h"

#include <cmath>

#include "kernels/cpu/compact_kernels.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/step_scalars.h"

namespace strata::kernels {
namespace {

static_assert(kElementTile % kCompactBlock == 0, "tiles must hold whole blocks");

bool HasNull(const CompactState& s) {
  return !s.w_hi || !s.w_lo || !s.m_code || !s.m_scale || !s.v_code || !s.v_scale;
}
bool HasNullWM(const CompactState& s) { return !s.w_hi || !s.w_lo || !s.m_code || !s.m_scale; }
// Either v and both v arrays (Adam), or none of them (Lion).
bool BadV(const float* v, const CompactState& s) {
  return (v == nullptr) != (s.v_code == nullptr) || (v == nullptr) != (s.v_scale == nullptr);
}

internal::CompactCopy CompactCopyFor(const void* param_copy, DType dtype) {
  if (param_copy == nullptr) return internal::CompactCopy::kNone;
  if (dtype == DType::kF32) return internal::CompactCopy::kF32;
  return dtype == DType::kF16 ? internal::CompactCopy::kF16 : internal::CompactCopy::kBF16;
}

}  // namespace

double CompactMomentBound(double m, double absmax) {
  return (std::sqrt(std::fabs(m) * absmax) / 127.0 + absmax / 64516.0) * (1.0 + 0x1p-10);
}

double CompactSqrtSecondBound(double v, double sqrt_max) {
  return (std::sqrt(std::sqrt(v) * sqrt_max) / 255.0 + sqrt_max / 260100.0) * (1.0 + 0x1p-10) + 0x1p-74;
}

Status CompactPackOn(CpuIsa isa, size_t n, const float* w, const float* m, const float* v,
                     const CompactState& s) {
  STRATA_RETURN_IF_ERROR(CheckCpuIsa(isa));
  if (n == 0) return Status::Ok();
  if (!w || !m || HasNullWM(s) || BadV(v, s)) return InvalidError("CompactPack: null array");
  const auto fn = isa == CpuIsa::kScalar ? internal::CompactPackRange : internal::CompactPackRangeAvx2;
  ParallelForTiles(n, kElementTile, [&](size_t begin, size_t end) { fn(w, m, v, s, begin, end); });
  return Status::Ok();
}

Status CompactUnpackOn(CpuIsa isa, size_t n, const CompactState& s, float* w, float* m, float* v) {
  STRATA_RETURN_IF_ERROR(CheckCpuIsa(isa));
  if (n == 0) return Status::Ok();
  if (!w || !m || HasNullWM(s) || BadV(v, s)) return InvalidError("CompactUnpack: null array");
  const auto fn = isa == CpuIsa::kScalar ? internal::CompactUnpackRange : internal::CompactUnpackRangeAvx2;
  ParallelForTiles(n, kElementTile, [&](size_t begin, size_t end) { fn(s, w, m, v, begin, end); });
  return Status::Ok();
}

Status CompactPack(size_t n, const float* w, const float* m, const float* v, const CompactState& s) {
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  return CompactPackOn(isa, n, w, m, v, s);
}

Status CompactUnpack(size_t n, const CompactState& s, float* w, float* m, float* v) {
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  return CompactUnpackOn(isa, n, s, w, m, v);
}

Status CompactAdamStepOn(CpuIsa isa, const AdamOptions& opt, size_t n, const CompactState& s,
                         const void* grad, void* param_copy) {
  // AdamOptions refuses an f32 copy (AdamStep has the master already); here
  // the f32 master is worth a copy, so validate it as the bf16 case.
  AdamOptions checked = opt;
  if (checked.param_copy_dtype == DType::kF32) checked.param_copy_dtype = DType::kBF16;
  STRATA_RETURN_IF_ERROR(ValidateAdamOptions(checked));
  STRATA_RETURN_IF_ERROR(CheckCpuIsa(isa));
  if (n == 0) return Status::Ok();
  if (HasNull(s) || !grad) return InvalidError("CompactAdamStep: null array");
  const AdamStepScalars sc = MakeAdamStepScalars(opt);
  const internal::CompactCopy copy = CompactCopyFor(param_copy, opt.param_copy_dtype);
  const bool l2 = opt.mode == AdamMode::kAdam && opt.weight_decay != 0;
  const bool lerp = opt.moment_update == MomentUpdate::kLerp;
  internal::CompactAdamRangeFn fn = internal::SelectCompactAdamScalar(opt.grad_dtype, copy, l2, lerp);
  if (isa == CpuIsa::kAvx2) fn = internal::SelectCompactAdamAvx2(opt.grad_dtype, copy, l2, lerp);
  if (isa == CpuIsa::kAvx512) fn = internal::SelectCompactAdamAvx512(opt.grad_dtype, copy, l2, lerp);
  const internal::CompactArrays a{s, grad, param_copy};
  ParallelForTiles(n, kElementTile, [&](size_t begin, size_t end) { fn(sc, a, begin, end); });
  return Status::Ok();
}

Status CompactLionStepOn(CpuIsa isa, const LionOptions& opt, size_t n, const CompactState& s,
                         const void* grad, void* param_copy) {
  LionOptions checked = opt;  // an f32 copy is allowed here, as for Adam
  if (checked.param_copy_dtype == DType::kF32) checked.param_copy_dtype = DType::kBF16;
  STRATA_RETURN_IF_ERROR(ValidateLionOptions(checked));
  STRATA_RETURN_IF_ERROR(CheckCpuIsa(isa));
  if (n == 0) return Status::Ok();
  if (HasNullWM(s) || !grad) return InvalidError("CompactLionStep: null array");
  const LionStepScalars sc = MakeLionStepScalars(opt);
  const internal::CompactCopy copy = CompactCopyFor(param_copy, opt.param_copy_dtype);
  internal::CompactLionRangeFn fn = internal::SelectCompactLionScalar(opt.grad_dtype, copy);
  if (isa == CpuIsa::kAvx2) fn = internal::SelectCompactLionAvx2(opt.grad_dtype, copy);
  if (isa == CpuIsa::kAvx512) fn = internal::SelectCompactLionAvx512(opt.grad_dtype, copy);
  CompactState lion = s;
  lion.v_code = nullptr;  // the tail and the kernels read no v
  lion.v_scale = nullptr;
  const internal::CompactArrays a{lion, grad, param_copy};
  ParallelForTiles(n, kElementTile, [&](size_t begin, size_t end) { fn(sc, a, begin, end); });
  return Status::Ok();
}

// The AVX-512 twins have not yet run on hardware (written and compiled on
// an AVX2-only machine): the automatic choice takes AVX2 on an AVX-512
// machine until kernels_compact_paths_test has passed on one
// (STRATA_TEST_UNVERIFIED_AVX512=1 runs them there; tools/gpu-check.sh does).
// CompactAdamStepOn/CompactLionStepOn(kAvx512) run them when asked.
static CpuIsa VerifiedCompactIsa(CpuIsa isa) { return isa == CpuIsa::kAvx512 ? CpuIsa::kAvx2 : isa; }

Status CompactLionStep(const LionOptions& opt, size_t n, const CompactState& s, const void* grad,
                       void* param_copy) {
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  return CompactLionStepOn(VerifiedCompactIsa(isa), opt, n, s, grad, param_copy);
}

Status CompactAdamStep(const AdamOptions& opt, size_t n, const CompactState& s, const void* grad,
                       void* param_copy) {
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  return CompactAdamStepOn(VerifiedCompactIsa(isa), opt, n, s, grad, param_copy);
}

}  // namespace strata::kernels
