// Final LayerNorm → tied LM head (cuBLAS) → cross-entropy, then the backward
// through the same three.
#include <algorithm>
#include <string>

#include "kernels/cuda/adam_cuda.h"
#include "kernels/cuda/layers/cross_entropy.h"
#include "kernels/cuda/layers/head.h"
#include "kernels/cuda/layers/layernorm.h"
#include "kernels/cuda/layers/matmul.h"
#include "kernels/cuda/layers/status_cuda.h"

namespace strata::layers {
namespace {

struct HeadDims {
  size_t C, V, N;
};

HeadDims DimsOf(const GptConfig& cfg, size_t B, size_t T) {
  return HeadDims{static_cast<size_t>(cfg.channels), static_cast<size_t>(cfg.vocab), B * T};
}

size_t HeadScratchBytes(const HeadDims& d, DType dtype) {
  return std::max(MatmulScratchBytes(d.N, d.C, d.V, dtype), LayerNormBackwardScratchBytes(d.C));
}

// Piece sizes in floats, each rounded up so that every piece starts kScratchAlign-aligned.
size_t Floats(size_t n) { return AlignScratch(n * sizeof(float)) / sizeof(float); }

}  // namespace

Status HeadActsCudaInit(HeadActsCuda* acts, const GptConfig& cfg, size_t B, size_t T, DType dtype) {
  const HeadDims d = DimsOf(cfg, B, T);
  const size_t floats = 2 * Floats(d.N * d.C) + 3 * Floats(d.N) + Floats(d.N * d.V) + Floats(2 * d.C);
  const size_t scratch = HeadScratchBytes(d, dtype);
  STRATA_RETURN_IF_ERROR(
      acts->mem.Allocate(floats * sizeof(float) + scratch).WithContext("HeadActsCudaInit"));
  acts->B = B;
  acts->T = T;
  acts->dtype = dtype;
  float* p = static_cast<float*>(acts->mem.get());
  auto take = [&p](size_t n) {
    float* v = p;
    p += Floats(n);
    return v;
  };
  acts->lnf = take(d.N * d.C);
  acts->lnf_mean = take(d.N);
  acts->lnf_rstd = take(d.N);
  acts->losses = take(d.N);
  acts->logits = take(d.N * d.V);
  acts->dlnf = take(d.N * d.C);
  acts->lnf_param = take(2 * d.C);
  acts->scratch = CudaScratch{p, scratch};
  return Status::Ok();
}

Status HeadForwardBackwardCuda(const CudaLayerContext& ctx, const GptConfig& cfg, const void* embed_params,
                               DType dtype, const float* x, const int32_t* targets, size_t B, size_t T,
                               HeadActsCuda* acts, float* dx, float* dembed, float loss_scale) {
  if (acts->B != B || acts->T != T || acts->dtype != dtype)
    return InvalidError("HeadForwardBackwardCuda: HeadActsCuda sized for another (B, T, dtype)");
  if (T > static_cast<size_t>(cfg.context))
    return InvalidError("HeadForwardBackwardCuda: T " + std::to_string(T) + " above the context");
  if (dx != nullptr && dembed == nullptr) return InvalidError("HeadForwardBackwardCuda: dx without dembed");
  const HeadDims d = DimsOf(cfg, B, T);
  const auto tensors = EmbedParamTensors(cfg);
  const char* base = static_cast<const char*>(embed_params);
  const size_t esize = DTypeSize(dtype);
  const void* wte = base + tensors[kWte].offset * esize;
  float* lnfw = acts->lnf_param;
  float* lnfb = acts->lnf_param + d.C;
  STRATA_RETURN_IF_ERROR(kernels::CastCuda(dtype, base + tensors[kLnfWeight].offset * esize, DType::kF32,
                                           lnfw, d.C, ctx.stream));
  STRATA_RETURN_IF_ERROR(
      kernels::CastCuda(dtype, base + tensors[kLnfBias].offset * esize, DType::kF32, lnfb, d.C, ctx.stream));
  STRATA_RETURN_IF_ERROR(
      LayerNormForwardCuda(ctx, acts->lnf, acts->lnf_mean, acts->lnf_rstd, x, lnfw, lnfb, d.N, d.C));
  STRATA_RETURN_IF_ERROR(
      MatmulForwardCuda(ctx, acts->logits, acts->lnf, wte, dtype, nullptr, d.N, d.C, d.V, acts->scratch));
  const bool backward = dx != nullptr;
  const float dloss = static_cast<float>(static_cast<double>(loss_scale) / static_cast<double>(d.N));
  STRATA_RETURN_IF_ERROR(CrossEntropyForwardBackwardCuda(ctx, acts->losses, backward ? acts->logits : nullptr,
                                                         acts->logits, targets, d.N, d.V, dloss));
  if (!backward) return Status::Ok();
  STRATA_CUDA_OK("cudaMemsetAsync dlnf",
                 cudaMemsetAsync(acts->dlnf, 0, d.N * d.C * sizeof(float), ctx.stream));
  STRATA_RETURN_IF_ERROR(MatmulBackwardCuda(ctx, acts->dlnf, dembed + tensors[kWte].offset, nullptr,
                                            acts->logits, acts->lnf, wte, dtype, d.N, d.C, d.V,
                                            acts->scratch));
  STRATA_CUDA_OK("cudaMemsetAsync dx", cudaMemsetAsync(dx, 0, d.N * d.C * sizeof(float), ctx.stream));
  return LayerNormBackwardCuda(ctx, dx, dembed + tensors[kLnfWeight].offset,
                               dembed + tensors[kLnfBias].offset, acts->dlnf, x, lnfw, acts->lnf_mean,
                               acts->lnf_rstd, d.N, d.C, acts->scratch);
}

}  // namespace strata::layers
