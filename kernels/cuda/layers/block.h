// One transformer block on the GPU: the CPU block's math and contract
// (kernels/cpu/layers/block.h, which documents it), with the parameters as
// the engine fetches them — BlockParamCount(cfg) values of the compute dtype
// on the device — and fp32 activations and gradients on the device.
//
// Precision: the linear layers round their fp32 inputs to the compute dtype
// and multiply on tensor cores with fp32 accumulation (matmul.h); attention's
// GEMMs use TF32 (attention.h); LayerNorm, GELU, softmax, residuals and every
// gradient accumulation are fp32. With dtype f32 every GEMM is plain fp32.
//
// Thread safety: none shared; one BlockActsCuda per stream at a time.
#pragma once

#include <cstddef>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cpu/layers/block.h"
#include "kernels/cpu/layers/gpt_config.h"
#include "kernels/cuda/layers/context.h"

namespace strata::layers {

// The forward's saved activations, the backward's gradient scratch and the
// layers' scratch, on the device, sized by BlockActsCudaInit for (cfg, B, T,
// dtype). One BlockActsCuda can serve every block in turn.
struct BlockActsCuda {
  size_t B = 0, T = 0;
  DType dtype = DType::kF32;
  CudaDeviceBuffer mem;  // one allocation cut into the views below
  // Saved by BlockForwardCuda (or recomputed by BlockBackwardCuda); shapes as BlockActs.
  float *ln1 = nullptr, *ln1_mean = nullptr, *ln1_rstd = nullptr, *qkv = nullptr, *att = nullptr;
  float *atty = nullptr, *res2 = nullptr, *ln2 = nullptr, *ln2_mean = nullptr, *ln2_rstd = nullptr;
  float *fch = nullptr, *fch_gelu = nullptr, *branch = nullptr;
  // Backward scratch.
  float *dres2 = nullptr, *dfch_gelu = nullptr, *dfch = nullptr, *dln2 = nullptr, *datty = nullptr;
  float *dqkv = nullptr, *dln1 = nullptr;
  // (13C) the block's vectors (LayerNorm weights and biases, linear biases)
  // as fp32, refreshed from the parameters at every call.
  float* vectors = nullptr;
  CudaScratch scratch;  // shared by the matmuls, attention and the LayerNorm backward
};
Status BlockActsCudaInit(BlockActsCuda* acts, const GptConfig& cfg, size_t B, size_t T, DType dtype);
// Bytes BlockActsCudaInit allocates: about 4·(31·B·T·C + 4·B·T + B·NH·T²) plus
// attention's scratch (7·B·T·C + B·NH·T² floats).
size_t BlockActsCudaBytes(const GptConfig& cfg, size_t B, size_t T, DType dtype);

// x_in, x_out (B, T, C) fp32; x_out may equal x_in. Fills acts' saved activations.
// REQUIRES: BlockActsCudaInit(acts, cfg, B, T, dtype); T <= cfg.context.
Status BlockForwardCuda(const CudaLayerContext& ctx, const GptConfig& cfg, const void* params, DType dtype,
                        const float* x_in, float* x_out, BlockActsCuda* acts, size_t B, size_t T);

// dx_out (B, T, C): gradient w.r.t. x_out. Accumulates (+=) the parameters'
// gradient into dparams (BlockParamCount fp32, the params layout) and sets (=)
// dx_in (B, T, C). dx_in may equal dx_out, not x_in. Both modes give bitwise
// the same results.
Status BlockBackwardCuda(const CudaLayerContext& ctx, const GptConfig& cfg, const void* params, DType dtype,
                         const float* x_in, const float* dx_out, BlockActsCuda* acts, BlockBackwardMode mode,
                         float* dparams, float* dx_in, size_t B, size_t T);

}  // namespace strata::layers
