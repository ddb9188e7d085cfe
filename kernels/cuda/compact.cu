// CUDA compact Adam/AdamW and Lion: one warp per block of kCompactBlock (32)
// elements, a lane per element. The block's largest |m| and sqrt(v) are an
// integer max over the warp (exact and order-free, as MaxAbsBits); every
// other operation is compact_elements.h's and compact_scalar.cpp's, in the
// same order, with explicit round-to-nearest intrinsics (and -fmad=false), so
// codes, scales and halves are bitwise the CPU reference's.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cpu/step_scalars.h"
#include "kernels/cuda/compact_cuda.h"
#include "kernels/cuda/device_elements.cuh"

namespace strata::kernels {

unsigned CudaGridFor(size_t n, int threads);  // adam.cu

namespace {

using cuda_detail::LoadAsF32;
using cuda_detail::StoreFromF32;
using cuda_detail::ToBF16;

static_assert(kCompactBlock == 32, "a scale block is one warp");
constexpr int kThreads = 256;  // 8 scale blocks per CUDA block
constexpr unsigned kFullMask = 0xffffffffu;
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kNanScaleBits = 0x7fc00000u;  // a non-finite block's scale
constexpr float kMinScale = kCompactMinScale;
constexpr float kMCodeSq = 16129.0f;  // 127^2
constexpr float kVCodeSq = 65025.0f;  // 255^2

// kCopy, as internal::CompactCopy: 0 none, 1 bf16 (the half), 2 f16, 3 f32.
template <int kCopy>
__device__ __forceinline__ void StoreCopy(void* copy, size_t e, float p, uint16_t hi) {
  if constexpr (kCopy == 1) static_cast<uint16_t*>(copy)[e] = hi;
  if constexpr (kCopy == 2) StoreFromF32<DType::kF16>(copy, e, p);
  if constexpr (kCopy == 3) StoreFromF32<DType::kF32>(copy, e, p);
}

// compact_elements.h's Split: bf16 round to nearest even and the correction.
__device__ __forceinline__ void Split(float w, uint16_t* hi_out, int8_t* lo_out) {
  const uint32_t bits = __float_as_uint(w);
  const uint16_t hi = ToBF16(w);
  *hi_out = hi;
  if ((bits & kAbsMask) > kInfBits) {  // NaN
    *lo_out = 0;
    return;
  }
  const int32_t d = static_cast<int32_t>(bits & kAbsMask) -
                    static_cast<int32_t>((static_cast<uint32_t>(hi) << 16) & kAbsMask);
  const int32_t q = (d * 127 + 16384) >> 15;
  const bool over = (hi & 0x7fffu) == 0x7f80u && d < 0;  // a finite w rounding to bf16 inf
  *lo_out = static_cast<int8_t>(over ? (q < -1 ? q : -1) : q);
}

__device__ __forceinline__ float Rebuild(uint16_t hi, int8_t lo) {
  const uint32_t h = static_cast<uint32_t>(hi) << 16;
  const int32_t d = (static_cast<int32_t>(lo) * 33026 + 64) >> 7;
  return __uint_as_float((h & ~kAbsMask) | static_cast<uint32_t>(static_cast<int32_t>(h & kAbsMask) + d));
}

__device__ __forceinline__ float DequantizeM(int8_t q, float step) {
  const int32_t qi = q;
  return __fmul_rn(__int2float_rn(qi * (qi < 0 ? -qi : qi)), step);
}
__device__ __forceinline__ float DequantizeV(uint8_t q, float step) {
  const int32_t qi = q;
  const float t = __fmul_rn(__int2float_rn(qi * qi), step);
  return __fmul_rn(t, t);
}

// CodeOf: sqrt(y) correctly rounded, to the nearest integer (ties to even), capped.
__device__ __forceinline__ int32_t CodeOf(float y, int32_t cap) {
  const int32_t q = __float2int_rn(__fsqrt_rn(y));
  return q < cap ? q : cap;
}

// The largest |x| of the warp's block as bits; lanes past the block's end
// give 0, which cannot raise it (MaxAbsBits starts at 0 too).
__device__ __forceinline__ uint32_t WarpMaxAbsBits(float x, bool active) {
  return __reduce_max_sync(kFullMask, active ? (__float_as_uint(x) & kAbsMask) : 0u);
}

// QuantizeM for this lane's m: its code, and the block's scale (every lane).
__device__ __forceinline__ float QuantizeM(float m, bool active, int8_t* code) {
  const uint32_t amax = WarpMaxAbsBits(m, active);
  const float a = __uint_as_float(amax);
  const bool finite = amax < kInfBits, live = finite && a >= kMinScale;
  if (!live) {
    *code = 0;
    return finite ? 0.0f : __uint_as_float(kNanScaleBits);
  }
  const float k = __fdiv_rn(kMCodeSq, a);
  const int32_t q = CodeOf(__fmul_rn(fabsf(m), k), 127);
  *code = static_cast<int8_t>((__float_as_uint(m) >> 31) ? -q : q);  // signbit
  return a;
}

// QuantizeV for this lane's r = sqrt(v).
__device__ __forceinline__ float QuantizeV(float r, bool active, uint8_t* code) {
  if (__float_as_uint(r) == kInfBits) r = __uint_as_float(0x7f7fffffu);  // SaturateRoot (compact_scale.h)
  const uint32_t rmax = WarpMaxAbsBits(r, active);
  const float big = __uint_as_float(rmax);
  const bool finite = rmax < kInfBits, live = finite && big > 0.0f;
  if (!live) {
    *code = 0;
    return finite ? 0.0f : __uint_as_float(kNanScaleBits);
  }
  const float k = __fdiv_rn(kVCodeSq, big);
  *code = static_cast<uint8_t>(CodeOf(__fmul_rn(fabsf(r), k), 255));
  return big;
}

// A block's stored scale, read by lane 0 (which alone writes it back later)
// and given to the whole warp.
__device__ __forceinline__ float BlockScale(const float* scale, size_t b, unsigned lane) {
  return __shfl_sync(kFullMask, lane == 0 ? scale[b] : 0.0f, 0);
}

// The warp's scale block b and this lane's element e = b*32 + lane, for a
// grid-stride loop over blocks that every lane of a warp runs alike.
struct WarpBlocks {
  unsigned lane;
  size_t first, stride;
};
__device__ __forceinline__ WarpBlocks MyBlocks() {
  return {threadIdx.x % 32u, (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32u,
          static_cast<size_t>(gridDim.x) * (blockDim.x / 32u)};
}

// compact_scalar.cpp's CompactAdamScalar::Block, one warp per block.
template <DType G, int kCopy, bool kL2, bool kLerp>
__global__ void CompactAdamKernel(AdamStepScalars s, size_t n, CompactState st, const void* __restrict__ grad,
                                  void* __restrict__ copy) {
  const WarpBlocks w = MyBlocks();
  const size_t nb = (n + kCompactBlock - 1) / kCompactBlock;  // CompactScaleCount (host-only)
  for (size_t b = w.first; b < nb; b += w.stride) {
    const size_t e = b * kCompactBlock + w.lane;
    const bool active = e < n;
    const float m_step = __fdiv_rn(BlockScale(st.m_scale, b, w.lane), kMCodeSq);
    const float v_step = __fdiv_rn(BlockScale(st.v_scale, b, w.lane), kVCodeSq);
    float m = 0.0f, r = 0.0f;
    if (active) {
      float g = __fmul_rn(LoadAsF32<G>(grad, e), s.grad_scale);
      float p = Rebuild(st.w_hi[e], st.w_lo[e]);
      if constexpr (kL2) g = __fmaf_rn(p, s.l2, g);
      p = __fmul_rn(p, s.decay);
      m = cuda_detail::FirstMoment<kLerp>(s, DequantizeM(st.m_code[e], m_step), g);
      const float v =
          __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(DequantizeV(st.v_code[e], v_step), s.beta2));
      r = __fsqrt_rn(v);
      const float denom = __fadd_rn(__fdiv_rn(r, s.sqrt_bc2), s.eps);
      p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));  // addcdiv_ order
      uint16_t hi;
      int8_t lo;
      Split(p, &hi, &lo);
      st.w_hi[e] = hi;
      st.w_lo[e] = lo;
      StoreCopy<kCopy>(copy, e, p, hi);
    }
    int8_t mq;
    uint8_t vq;
    const float m_scale = QuantizeM(m, active, &mq);  // every lane: warp collectives
    const float v_scale = QuantizeV(r, active, &vq);
    if (active) {
      st.m_code[e] = vq == 0 ? int8_t{0} : mq;  // ZeroMWhereVZero
      st.v_code[e] = vq;
    }
    if (w.lane == 0) {
      st.m_scale[b] = m_scale;
      st.v_scale[b] = v_scale;
    }
  }
}

// lion_scalar.cpp's LionSign: +1, -1, 0 for ±0, and c itself for NaN.
__device__ __forceinline__ float LionSign(float c) {
  if (c > 0) return 1.0f;
  if (c < 0) return -1.0f;
  return c == 0 ? 0.0f : c;
}

// compact_scalar.cpp's CompactLionScalar, one warp per block; no v.
template <DType G, int kCopy>
__global__ void CompactLionKernel(LionStepScalars s, size_t n, CompactState st, const void* __restrict__ grad,
                                  void* __restrict__ copy) {
  const WarpBlocks w = MyBlocks();
  const size_t nb = (n + kCompactBlock - 1) / kCompactBlock;  // CompactScaleCount (host-only)
  for (size_t b = w.first; b < nb; b += w.stride) {
    const size_t e = b * kCompactBlock + w.lane;
    const bool active = e < n;
    const float m_step = __fdiv_rn(BlockScale(st.m_scale, b, w.lane), kMCodeSq);
    float new_m = 0.0f;
    if (active) {
      const float g = __fmul_rn(LoadAsF32<G>(grad, e), s.grad_scale);
      const float m = DequantizeM(st.m_code[e], m_step);
      float p = __fmul_rn(Rebuild(st.w_hi[e], st.w_lo[e]), s.decay);
      const float c = __fmaf_rn(s.one_minus_beta1, g, __fmul_rn(m, s.beta1));
      p = __fmaf_rn(s.neg_lr, LionSign(c), p);
      uint16_t hi;
      int8_t lo;
      Split(p, &hi, &lo);
      st.w_hi[e] = hi;
      st.w_lo[e] = lo;
      StoreCopy<kCopy>(copy, e, p, hi);
      new_m = __fmaf_rn(s.one_minus_beta2, g, __fmul_rn(m, s.beta2));
    }
    int8_t mq;
    const float m_scale = QuantizeM(new_m, active, &mq);
    if (active) st.m_code[e] = mq;
    if (w.lane == 0) st.m_scale[b] = m_scale;
  }
}

using CompactAdamKernelFn = void (*)(AdamStepScalars, size_t, CompactState, const void*, void*);
using CompactLionKernelFn = void (*)(LionStepScalars, size_t, CompactState, const void*, void*);

template <DType G, int kCopy>
CompactAdamKernelFn PickAdamL2(bool l2, bool lerp) {
  if (l2) return lerp ? &CompactAdamKernel<G, kCopy, true, true> : &CompactAdamKernel<G, kCopy, true, false>;
  return lerp ? &CompactAdamKernel<G, kCopy, false, true> : &CompactAdamKernel<G, kCopy, false, false>;
}

template <DType G>
CompactAdamKernelFn PickAdamCopy(int copy, bool l2, bool lerp) {
  if (copy == 1) return PickAdamL2<G, 1>(l2, lerp);
  if (copy == 2) return PickAdamL2<G, 2>(l2, lerp);
  if (copy == 3) return PickAdamL2<G, 3>(l2, lerp);
  return PickAdamL2<G, 0>(l2, lerp);
}

CompactAdamKernelFn PickAdam(DType grad, int copy, bool l2, bool lerp) {
  if (grad == DType::kBF16) return PickAdamCopy<DType::kBF16>(copy, l2, lerp);
  if (grad == DType::kF16) return PickAdamCopy<DType::kF16>(copy, l2, lerp);
  return PickAdamCopy<DType::kF32>(copy, l2, lerp);
}

template <DType G>
CompactLionKernelFn PickLionCopy(int copy) {
  if (copy == 1) return &CompactLionKernel<G, 1>;
  if (copy == 2) return &CompactLionKernel<G, 2>;
  if (copy == 3) return &CompactLionKernel<G, 3>;
  return &CompactLionKernel<G, 0>;
}

CompactLionKernelFn PickLion(DType grad, int copy) {
  if (grad == DType::kBF16) return PickLionCopy<DType::kBF16>(copy);
  if (grad == DType::kF16) return PickLionCopy<DType::kF16>(copy);
  return PickLionCopy<DType::kF32>(copy);
}

// compact.cpp's CompactCopyFor, as kCopy.
int CopyKind(const void* param_copy, DType dtype) {
  if (param_copy == nullptr) return 0;
  if (dtype == DType::kF32) return 3;
  return dtype == DType::kF16 ? 2 : 1;
}

// One thread per element of whole blocks: a warp per scale block.
unsigned GridFor(size_t n) { return CudaGridFor(CompactScaleCount(n) * kCompactBlock, kThreads); }

Status LaunchResult(const char* who) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return InternalError(std::string(who) + " launch: " + cudaGetErrorString(e));
}

}  // namespace

Status CompactAdamStepCuda(const AdamOptions& opt, size_t n, const CompactState& s, const void* grad,
                           void* param_copy, void* stream) {
  AdamOptions checked = opt;  // an f32 copy is allowed here, as in CompactAdamStepOn
  if (checked.param_copy_dtype == DType::kF32) checked.param_copy_dtype = DType::kBF16;
  STRATA_RETURN_IF_ERROR(ValidateAdamOptions(checked));
  if (n == 0) return Status::Ok();
  if (!s.w_hi || !s.w_lo || !s.m_code || !s.m_scale || !s.v_code || !s.v_scale || !grad)
    return InvalidError("CompactAdamStepCuda: null array");
  const AdamStepScalars sc = MakeAdamStepScalars(opt);
  const bool l2 = opt.mode == AdamMode::kAdam && opt.weight_decay != 0;
  const bool lerp = opt.moment_update == MomentUpdate::kLerp;
  const CompactAdamKernelFn kernel =
      PickAdam(opt.grad_dtype, CopyKind(param_copy, opt.param_copy_dtype), l2, lerp);
  cuda_detail::ClearLastErrorBeforeLaunch();
  kernel<<<GridFor(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(sc, n, s, grad, param_copy);
  return LaunchResult("CompactAdamStepCuda");
}

Status CompactLionStepCuda(const LionOptions& opt, size_t n, const CompactState& s, const void* grad,
                           void* param_copy, void* stream) {
  LionOptions checked = opt;  // an f32 copy is allowed here, as in CompactLionStepOn
  if (checked.param_copy_dtype == DType::kF32) checked.param_copy_dtype = DType::kBF16;
  STRATA_RETURN_IF_ERROR(ValidateLionOptions(checked));
  if (n == 0) return Status::Ok();
  if (!s.w_hi || !s.w_lo || !s.m_code || !s.m_scale || !grad) return InvalidError("CompactLionStepCuda: null array");
  const LionStepScalars sc = MakeLionStepScalars(opt);
  CompactState lion = s;  // the kernel reads no v
  lion.v_code = nullptr;
  lion.v_scale = nullptr;
  const CompactLionKernelFn kernel = PickLion(opt.grad_dtype, CopyKind(param_copy, opt.param_copy_dtype));
  cuda_detail::ClearLastErrorBeforeLaunch();
  kernel<<<GridFor(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(sc, n, lion, grad, param_copy);
  return LaunchResult("CompactLionStepCuda");
}

}  // namespace strata::kernels
