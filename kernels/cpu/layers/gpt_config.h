// The GPT-2-style decoder's shape and the layout of its parameter groups: what
// the trainer registers into each engine group, tensor by tensor, in order, so
// that a group's flat buffer is exactly the concatenation the kernels read.
#pragma once

#include <array>
#include <cstddef>

#include "base/status.h"

namespace strata::layers {

struct GptConfig {
  int vocab = 0;     // V: token ids are in [0, V); no padding of the vocabulary
  int context = 0;   // maxT: rows of wpe; every T passed to a kernel is <= this
  int channels = 0;  // C
  int heads = 0;     // NH; C % NH == 0, head size hs = C / NH
  int layers = 0;    // L: blocks, one engine group each
};

// OK when every field is positive and channels % heads == 0; otherwise an
// InvalidError naming the field.
Status ValidateGptConfig(const GptConfig& cfg);

// One tensor of a group: `count` fp32 values at `offset` (in elements) of the
// group's flat buffer, shape rows x cols (cols == count, rows == 1 for vectors).
struct ParamTensor {
  const char* name;
  size_t offset;
  size_t count;
  size_t rows;
  size_t cols;
};

// Group of block l (one per block). Weights are (out, in) row-major: a linear
// layer computes out = in · Wᵀ + b.
enum BlockTensor : int {
  kLn1Weight = 0,   // (C)       "ln1.weight"
  kLn1Bias,         // (C)       "ln1.bias"
  kQkvWeight,       // (3C, C)   "attn.qkv.weight"   rows: q | k | v, head h at h*hs in each
  kQkvBias,         // (3C)      "attn.qkv.bias"
  kAttnProjWeight,  // (C, C)    "attn.proj.weight"
  kAttnProjBias,    // (C)       "attn.proj.bias"
  kLn2Weight,       // (C)       "ln2.weight"
  kLn2Bias,         // (C)       "ln2.bias"
  kFcWeight,        // (4C, C)   "mlp.fc.weight"
  kFcBias,          // (4C)      "mlp.fc.bias"
  kFcProjWeight,    // (C, 4C)   "mlp.proj.weight"
  kFcProjBias,      // (C)       "mlp.proj.bias"
  kBlockTensorCount
};

// The embedding group (group 0) holds the token and position embeddings and
// the final LayerNorm: the tied LM head reads wte again after the last block,
// so lnf lives where wte already is and the head needs no other group.
enum EmbedTensor : int {
  kWte = 0,    // (V, C)     "wte"   also the LM head's weight (tied)
  kWpe,        // (maxT, C)  "wpe"
  kLnfWeight,  // (C)        "lnf.weight"
  kLnfBias,    // (C)        "lnf.bias"
  kEmbedTensorCount
};

// 12·C² + 13·C.
size_t BlockParamCount(const GptConfig& cfg);
// The block group's tensors in registration order; offsets are the running sum.
std::array<ParamTensor, kBlockTensorCount> BlockParamTensors(const GptConfig& cfg);
// V·C + maxT·C + 2·C.
size_t EmbedParamCount(const GptConfig& cfg);
std::array<ParamTensor, kEmbedTensorCount> EmbedParamTensors(const GptConfig& cfg);
// Every parameter of the model: EmbedParamCount + layers · BlockParamCount.
size_t GptParamCount(const GptConfig& cfg);

}  // namespace strata::layers
