// A block's forward and backward on the GPU, composed from the CUDA layers in
// the CPU block's order (kernels/cpu/layers/block.cpp), all on ctx.stream.
#include <algorithm>
#include <string>

#include "kernels/cuda/adam_cuda.h"
#include "kernels/cuda/layers/attention.h"
#include "kernels/cuda/layers/block.h"
#include "kernels/cuda/layers/elementwise.h"
#include "kernels/cuda/layers/layernorm.h"
#include "kernels/cuda/layers/matmul.h"
#include "kernels/cuda/layers/status_cuda.h"

namespace strata::layers {
namespace {

struct Dims {
  size_t B, T, C, NH, N;
};

Dims DimsOf(const GptConfig& cfg, size_t B, size_t T) {
  return Dims{B, T, static_cast<size_t>(cfg.channels), static_cast<size_t>(cfg.heads), B * T};
}

// Piece sizes in floats, each rounded up so that every piece starts kScratchAlign-aligned.
size_t Floats(size_t n) { return AlignScratch(n * sizeof(float)) / sizeof(float); }

size_t ScratchBytes(const Dims& d, DType dtype) {
  const size_t C = d.C, N = d.N;
  return std::max({MatmulScratchBytes(N, C, 3 * C, dtype), MatmulScratchBytes(N, C, C, dtype),
                   MatmulScratchBytes(N, C, 4 * C, dtype), MatmulScratchBytes(N, 4 * C, C, dtype),
                   AttentionScratchBytes(d.B, d.T, C, d.NH), LayerNormBackwardScratchBytes(C)});
}

// Cuts acts' views from `base` in order and returns the floats they take;
// with base null it only counts (the views stay null).
size_t CutViews(const Dims& d, float* base, BlockActsCuda* a) {
  const size_t NC = d.N * d.C;
  size_t used = 0;
  auto take = [&](size_t n) {
    float* v = base != nullptr ? base + used : nullptr;
    used += Floats(n);
    return v;
  };
  a->ln1 = take(NC);
  a->ln1_mean = take(d.N);
  a->ln1_rstd = take(d.N);
  a->qkv = take(3 * NC);
  a->att = take(d.B * d.NH * d.T * d.T);
  a->atty = take(NC);
  a->res2 = take(NC);
  a->ln2 = take(NC);
  a->ln2_mean = take(d.N);
  a->ln2_rstd = take(d.N);
  a->fch = take(4 * NC);
  a->fch_gelu = take(4 * NC);
  a->branch = take(NC);
  a->dres2 = take(NC);
  a->dfch_gelu = take(4 * NC);
  a->dfch = take(4 * NC);
  a->dln2 = take(NC);
  a->datty = take(NC);
  a->dqkv = take(3 * NC);
  a->dln1 = take(NC);
  a->vectors = take(13 * d.C);
  return used;
}

size_t ActFloats(const Dims& d) {
  BlockActsCuda counting;
  return CutViews(d, nullptr, &counting);
}

// The block's tensors inside its parameter buffer (compute dtype) and its
// gradient buffer (fp32); vectors (1-row tensors) also as fp32 copies.
struct BlockTensorsCuda {
  const void* weight[kBlockTensorCount];  // in the parameter buffer
  const float* vec[kBlockTensorCount];    // fp32 copy of a 1-row tensor; null for matrices
  float* grad[kBlockTensorCount];         // in the gradient buffer; null when no gradient is wanted
};

// Points at the tensors and queues the fp32 copies of the vectors into acts->vectors.
Status Locate(const CudaLayerContext& ctx, const GptConfig& cfg, const void* params, DType dtype,
              float* dparams, BlockActsCuda* a, BlockTensorsCuda* t) {
  const auto layout = BlockParamTensors(cfg);
  const char* base = static_cast<const char*>(params);
  float* vec = a->vectors;
  for (int i = 0; i < kBlockTensorCount; ++i) {
    t->weight[i] = base + layout[i].offset * DTypeSize(dtype);
    t->grad[i] = dparams != nullptr ? dparams + layout[i].offset : nullptr;
    t->vec[i] = nullptr;
    if (layout[i].rows != 1) continue;
    STRATA_RETURN_IF_ERROR(
        kernels::CastCuda(dtype, t->weight[i], DType::kF32, vec, layout[i].count, ctx.stream));
    t->vec[i] = vec;
    vec += layout[i].count;
  }
  return Status::Ok();
}

Status CheckActs(const char* fn, const GptConfig& cfg, const BlockActsCuda* a, size_t B, size_t T,
                 DType dtype) {
  if (a->B != B || a->T != T || a->dtype != dtype)
    return InvalidError(std::string(fn) + ": BlockActsCuda sized for another (B, T, dtype)");
  if (T > static_cast<size_t>(cfg.context))
    return InvalidError(std::string(fn) + ": T " + std::to_string(T) + " above the context");
  return Status::Ok();
}

Status Zero(const CudaLayerContext& ctx, float* p, size_t n) {
  STRATA_CUDA_OK("cudaMemsetAsync", cudaMemsetAsync(p, 0, n * sizeof(float), ctx.stream));
  return Status::Ok();
}

Status CopyFloats(const CudaLayerContext& ctx, float* dst, const float* src, size_t n) {
  STRATA_CUDA_OK("cudaMemcpyAsync",
                 cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, ctx.stream));
  return Status::Ok();
}

Status Forward(const CudaLayerContext& ctx, const Dims& d, DType dtype, const BlockTensorsCuda& p,
               const float* x_in, float* x_out, BlockActsCuda* a) {
  const size_t C = d.C, N = d.N;
  STRATA_RETURN_IF_ERROR(LayerNormForwardCuda(ctx, a->ln1, a->ln1_mean, a->ln1_rstd, x_in, p.vec[kLn1Weight],
                                              p.vec[kLn1Bias], N, C));
  STRATA_RETURN_IF_ERROR(MatmulForwardCuda(ctx, a->qkv, a->ln1, p.weight[kQkvWeight], dtype, p.vec[kQkvBias],
                                           N, C, 3 * C, a->scratch));
  STRATA_RETURN_IF_ERROR(
      AttentionForwardCuda(ctx, a->atty, a->att, a->qkv, d.B, d.T, C, d.NH, dtype, a->scratch));
  STRATA_RETURN_IF_ERROR(MatmulForwardCuda(ctx, a->branch, a->atty, p.weight[kAttnProjWeight], dtype,
                                           p.vec[kAttnProjBias], N, C, C, a->scratch));
  STRATA_RETURN_IF_ERROR(ResidualForwardCuda(ctx, a->res2, x_in, a->branch, N * C));
  STRATA_RETURN_IF_ERROR(LayerNormForwardCuda(ctx, a->ln2, a->ln2_mean, a->ln2_rstd, a->res2,
                                              p.vec[kLn2Weight], p.vec[kLn2Bias], N, C));
  STRATA_RETURN_IF_ERROR(MatmulForwardCuda(ctx, a->fch, a->ln2, p.weight[kFcWeight], dtype, p.vec[kFcBias], N,
                                           C, 4 * C, a->scratch));
  STRATA_RETURN_IF_ERROR(GeluForwardCuda(ctx, a->fch_gelu, a->fch, 4 * N * C));
  STRATA_RETURN_IF_ERROR(MatmulForwardCuda(ctx, a->branch, a->fch_gelu, p.weight[kFcProjWeight], dtype,
                                           p.vec[kFcProjBias], N, 4 * C, C, a->scratch));
  return ResidualForwardCuda(ctx, x_out, a->res2, a->branch, N * C);
}

}  // namespace

size_t BlockActsCudaBytes(const GptConfig& cfg, size_t B, size_t T, DType dtype) {
  const Dims d = DimsOf(cfg, B, T);
  return ActFloats(d) * sizeof(float) + ScratchBytes(d, dtype);
}

Status BlockActsCudaInit(BlockActsCuda* a, const GptConfig& cfg, size_t B, size_t T, DType dtype) {
  const Dims d = DimsOf(cfg, B, T);
  STRATA_RETURN_IF_ERROR(
      a->mem.Allocate(BlockActsCudaBytes(cfg, B, T, dtype)).WithContext("BlockActsCudaInit"));
  a->B = B;
  a->T = T;
  a->dtype = dtype;
  const size_t used = CutViews(d, static_cast<float*>(a->mem.get()), a) * sizeof(float);
  a->scratch = CudaScratch{static_cast<char*>(a->mem.get()) + used, a->mem.bytes() - used};
  return Status::Ok();
}

Status BlockForwardCuda(const CudaLayerContext& ctx, const GptConfig& cfg, const void* params, DType dtype,
                        const float* x_in, float* x_out, BlockActsCuda* a, size_t B, size_t T) {
  STRATA_RETURN_IF_ERROR(CheckActs("BlockForwardCuda", cfg, a, B, T, dtype));
  BlockTensorsCuda p;
  STRATA_RETURN_IF_ERROR(Locate(ctx, cfg, params, dtype, nullptr, a, &p));
  return Forward(ctx, DimsOf(cfg, B, T), dtype, p, x_in, x_out, a);
}

Status BlockBackwardCuda(const CudaLayerContext& ctx, const GptConfig& cfg, const void* params, DType dtype,
                         const float* x_in, const float* dx_out, BlockActsCuda* a, BlockBackwardMode mode,
                         float* dparams, float* dx_in, size_t B, size_t T) {
  STRATA_RETURN_IF_ERROR(CheckActs("BlockBackwardCuda", cfg, a, B, T, dtype));
  if (dparams == nullptr) return InvalidError("BlockBackwardCuda: dparams must not be null");
  const Dims d = DimsOf(cfg, B, T);
  BlockTensorsCuda p;
  STRATA_RETURN_IF_ERROR(Locate(ctx, cfg, params, dtype, dparams, a, &p));
  // The recomputed x_out is not needed; it lands in `branch`, which the backward does not read.
  if (mode == BlockBackwardMode::kRecompute)
    STRATA_RETURN_IF_ERROR(Forward(ctx, d, dtype, p, x_in, a->branch, a));
  const size_t C = d.C, N = d.N, NC = N * C;
  float* const* g = p.grad;
  // x_out = res2 + mlp: both get dx_out. Copy it first so that dx_in may alias it.
  STRATA_RETURN_IF_ERROR(CopyFloats(ctx, a->dres2, dx_out, NC));
  STRATA_RETURN_IF_ERROR(Zero(ctx, a->dfch_gelu, 4 * NC));
  STRATA_RETURN_IF_ERROR(MatmulBackwardCuda(ctx, a->dfch_gelu, g[kFcProjWeight], g[kFcProjBias], a->dres2,
                                            a->fch_gelu, p.weight[kFcProjWeight], dtype, N, 4 * C, C,
                                            a->scratch));
  STRATA_RETURN_IF_ERROR(Zero(ctx, a->dfch, 4 * NC));
  STRATA_RETURN_IF_ERROR(GeluBackwardCuda(ctx, a->dfch, a->fch, a->dfch_gelu, 4 * NC));
  STRATA_RETURN_IF_ERROR(Zero(ctx, a->dln2, NC));
  STRATA_RETURN_IF_ERROR(MatmulBackwardCuda(ctx, a->dln2, g[kFcWeight], g[kFcBias], a->dfch, a->ln2,
                                            p.weight[kFcWeight], dtype, N, C, 4 * C, a->scratch));
  STRATA_RETURN_IF_ERROR(LayerNormBackwardCuda(ctx, a->dres2, g[kLn2Weight], g[kLn2Bias], a->dln2, a->res2,
                                               p.vec[kLn2Weight], a->ln2_mean, a->ln2_rstd, N, C,
                                               a->scratch));
  // res2 = x_in + attn: both get dres2.
  STRATA_RETURN_IF_ERROR(Zero(ctx, a->datty, NC));
  STRATA_RETURN_IF_ERROR(MatmulBackwardCuda(ctx, a->datty, g[kAttnProjWeight], g[kAttnProjBias], a->dres2,
                                            a->atty, p.weight[kAttnProjWeight], dtype, N, C, C, a->scratch));
  STRATA_RETURN_IF_ERROR(Zero(ctx, a->dqkv, 3 * NC));
  STRATA_RETURN_IF_ERROR(
      AttentionBackwardCuda(ctx, a->dqkv, a->datty, a->qkv, a->att, d.B, d.T, C, d.NH, dtype, a->scratch));
  STRATA_RETURN_IF_ERROR(Zero(ctx, a->dln1, NC));
  STRATA_RETURN_IF_ERROR(MatmulBackwardCuda(ctx, a->dln1, g[kQkvWeight], g[kQkvBias], a->dqkv, a->ln1,
                                            p.weight[kQkvWeight], dtype, N, C, 3 * C, a->scratch));
  STRATA_RETURN_IF_ERROR(CopyFloats(ctx, dx_in, a->dres2, NC));
  return LayerNormBackwardCuda(ctx, dx_in, g[kLn1Weight], g[kLn1Bias], a->dln1, x_in, p.vec[kLn1Weight],
                               a->ln1_mean, a->ln1_rstd, N, C, a->scratch);
}

}  // namespace strata::layers
