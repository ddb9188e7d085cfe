// The model's end on the GPU: final LayerNorm, the LM head tied to wte,
// softmax cross-entropy over the B·T tokens. The CPU layer's contract
// (kernels/cpu/layers/head.h) but for the memory it lives in: the embedding
// group arrives as the engine fetched it (compute dtype, device), the mean of
// the per-token losses is the caller's to take (it needs a sync), and the
// gradient may be scaled (fp16 loss scaling).
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cpu/layers/gpt_config.h"
#include "kernels/cuda/layers/context.h"

namespace strata::layers {

// Device workspace of the head for (cfg, B, T, dtype), from HeadActsCudaInit.
// The logits are made for all B·T rows at once: B·T·V floats.
struct HeadActsCuda {
  size_t B = 0, T = 0;
  DType dtype = DType::kF32;
  CudaDeviceBuffer mem;        // one allocation cut into the views below
  float* lnf = nullptr;        // (B, T, C) final LayerNorm output
  float* lnf_mean = nullptr;   // (B, T)
  float* lnf_rstd = nullptr;   // (B, T)
  float* losses = nullptr;     // (B, T) per-token loss
  float* logits = nullptr;     // (B, T, V) logits, then their gradient
  float* dlnf = nullptr;       // (B, T, C)
  float* lnf_param = nullptr;  // (2C) lnf.weight | lnf.bias as fp32
  CudaScratch scratch;         // for the LM head's matmul and the LayerNorm backward
};
Status HeadActsCudaInit(HeadActsCuda* acts, const GptConfig& cfg, size_t B, size_t T, DType dtype);

// x (B, T, C): the last block's output; targets (B, T) on the device, in
// [0, V) (checked by the caller). embed_params: the embedding group,
// EmbedParamCount(cfg) values of `dtype` (gpt_config.h's layout). Writes each
// token's loss to acts->losses. When dx is not null, also the backward of
// loss_scale · mean(losses): dx (B, T, C) is set (=), and dembed (fp32, the
// group's layout) accumulates (+=) into wte and lnf; wpe untouched.
// REQUIRES: HeadActsCudaInit(acts, cfg, B, T, dtype); T <= cfg.context; dx
// does not overlap x.
Status HeadForwardBackwardCuda(const CudaLayerContext& ctx, const GptConfig& cfg, const void* embed_params,
                               DType dtype, const float* x, const int32_t* targets, size_t B, size_t T,
                               HeadActsCuda* acts, float* dx, float* dembed, float loss_scale);

}  // namespace strata::layers
