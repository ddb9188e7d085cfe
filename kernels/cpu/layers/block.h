// One transformer block (= one engine group): pre-LayerNorm causal
// self-attention and GELU MLP, each added to the residual stream.
//
//   ln1 = LN1(x_in)           qkv = ln1·Wqkvᵀ + b     atty = attention(qkv)
//   res2 = x_in + atty·Wprojᵀ + b
//   ln2 = LN2(res2)           fch = ln2·Wfcᵀ + b      fch_gelu = gelu(fch)
//   x_out = res2 + fch_gelu·Wfcprojᵀ + b
//
// The block's parameters are one flat fp32 buffer of BlockParamCount(cfg)
// values laid out as BlockParamTensors(cfg) (gpt_config.h). Activation
// checkpointing: the trainer keeps only each block's x_in and BlockBackward in
// kRecompute mode reruns the forward into its workspace first.
//
// One step of the model (groups: 0 = embedding, see gpt_config.h; 1 + l = block l):
//   EncoderForward(x[0], tokens, wte, wpe, B, T, C, V);                 // group 0
//   for l: BlockForward(cfg, block[l], x[l], x[l + 1], &acts, B, T);     // group 1 + l
//   loss = HeadForwardBackward(cfg, embed, x[L], targets, B, T, &head, dx, dembed);
//   for l = L-1..0: BlockBackward(cfg, block[l], x[l], dx, &acts, BlockBackwardMode::kRecompute,
//                                 dblock[l], dx, B, T);                  // hand dblock[l] over
//   EncoderBackward(dembed + wte offset, dembed + wpe offset, dx, tokens, B, T, C);
//
// Thread safety: no shared state (but OpenBLAS's thread count, see matmul.h);
// calls on different BlockActs may run concurrently. Parallel inside via oneTBB,
// in the caller's task arena.
#pragma once

#include <cstddef>
#include <vector>

#include "kernels/cpu/layers/gpt_config.h"

namespace strata::layers {

// The forward's saved activations and the backward's gradient scratch, sized
// by BlockActsInit for (cfg, B, T). One BlockActs can serve every block in turn.
struct BlockActs {
  size_t B = 0, T = 0;
  std::vector<float> mem;  // one allocation cut into the views below
  // Saved by BlockForward (or recomputed by BlockBackward).
  float* ln1 = nullptr;       // (B, T, C)
  float* ln1_mean = nullptr;  // (B, T)
  float* ln1_rstd = nullptr;  // (B, T)
  float* qkv = nullptr;       // (B, T, 3C)
  float* att = nullptr;       // (B, NH, T, T) softmax probabilities
  float* atty = nullptr;      // (B, T, C) attention output before its projection
  float* res2 = nullptr;      // (B, T, C) x_in + attention branch
  float* ln2 = nullptr;       // (B, T, C)
  float* ln2_mean = nullptr;  // (B, T)
  float* ln2_rstd = nullptr;  // (B, T)
  float* fch = nullptr;       // (B, T, 4C) MLP hidden before GELU
  float* fch_gelu = nullptr;  // (B, T, 4C)
  float* branch = nullptr;    // (B, T, C) output of a projection before its residual add
  // Backward scratch.
  float* dres2 = nullptr;      // (B, T, C)
  float* dfch_gelu = nullptr;  // (B, T, 4C)
  float* dfch = nullptr;       // (B, T, 4C)
  float* dln2 = nullptr;       // (B, T, C)
  float* datty = nullptr;      // (B, T, C)
  float* dqkv = nullptr;       // (B, T, 3C)
  float* dln1 = nullptr;       // (B, T, C)
};
void BlockActsInit(BlockActs* acts, const GptConfig& cfg, size_t B, size_t T);
// Floats BlockActsInit allocates: 31·B·T·C + 4·B·T + B·NH·T².
size_t BlockActsFloats(const GptConfig& cfg, size_t B, size_t T);

// x_in, x_out (B, T, C); x_out may equal x_in. Fills acts' saved activations.
// REQUIRES: BlockActsInit(acts, cfg, B, T); T <= cfg.context.
void BlockForward(const GptConfig& cfg, const float* params, const float* x_in, float* x_out, BlockActs* acts,
                  size_t B, size_t T);

enum class BlockBackwardMode {
  kRecompute,  // rerun the forward from x_in into acts first (activation checkpointing)
  kSaved,      // acts holds this block's forward of this x_in (BlockForward ran last on it)
};

// dx_out (B, T, C): gradient of the loss w.r.t. x_out. Accumulates (+=) the
// parameters' gradient into dparams (BlockParamCount floats, the params
// layout: zero it before the first micro-batch) and sets (=) dx_in (B, T, C).
// dx_in may equal dx_out, not x_in. Both modes give bitwise the same results.
void BlockBackward(const GptConfig& cfg, const float* params, const float* x_in, const float* dx_out,
                   BlockActs* acts, BlockBackwardMode mode, float* dparams, float* dx_in, size_t B, size_t T);

}  // namespace strata::layers
