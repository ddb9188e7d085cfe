// Validation of a GptConfig and the offsets of each group's tensors.
#include "kernels/cpu/layers/gpt_config.h"

#include <string>

namespace strata::layers {
namespace {

template <size_t N>
std::array<ParamTensor, N> Lay(const std::array<const char*, N>& names,
                               const std::array<std::array<size_t, 2>, N>& shapes) {
  std::array<ParamTensor, N> out{};
  size_t offset = 0;
  for (size_t i = 0; i < N; ++i) {
    const size_t count = shapes[i][0] * shapes[i][1];
    out[i] = ParamTensor{names[i], offset, count, shapes[i][0], shapes[i][1]};
    offset += count;
  }
  return out;
}

Status Positive(const char* field, int value) {
  if (value > 0) return Status::Ok();
  return InvalidError(std::string("GptConfig.") + field + " must be positive, got " + std::to_string(value));
}

}  // namespace

Status ValidateGptConfig(const GptConfig& cfg) {
  for (auto [field, value] : {std::pair{"vocab", cfg.vocab},
                              {"context", cfg.context},
                              {"channels", cfg.channels},
                              {"heads", cfg.heads},
                              {"layers", cfg.layers}}) {
    Status s = Positive(field, value);
    if (!s.ok()) return s;
  }
  if (cfg.channels % cfg.heads != 0) {
    return InvalidError("GptConfig.channels (" + std::to_string(cfg.channels) +
                        ") must be a multiple of GptConfig.heads (" + std::to_string(cfg.heads) + ")");
  }
  return Status::Ok();
}

std::array<ParamTensor, kBlockTensorCount> BlockParamTensors(const GptConfig& cfg) {
  const size_t C = static_cast<size_t>(cfg.channels);
  return Lay<kBlockTensorCount>(
      {"ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
       "ln2.weight", "ln2.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"},
      {{{1, C},
        {1, C},
        {3 * C, C},
        {1, 3 * C},
        {C, C},
        {1, C},
        {1, C},
        {1, C},
        {4 * C, C},
        {1, 4 * C},
        {C, 4 * C},
        {1, C}}});
}

size_t BlockParamCount(const GptConfig& cfg) {
  const size_t C = static_cast<size_t>(cfg.channels);
  return 12 * C * C + 13 * C;
}

std::array<ParamTensor, kEmbedTensorCount> EmbedParamTensors(const GptConfig& cfg) {
  const size_t C = static_cast<size_t>(cfg.channels);
  return Lay<kEmbedTensorCount>(
      {"wte", "wpe", "lnf.weight", "lnf.bias"},
      {{{static_cast<size_t>(cfg.vocab), C}, {static_cast<size_t>(cfg.context), C}, {1, C}, {1, C}}});
}

size_t EmbedParamCount(const GptConfig& cfg) {
  const size_t C = static_cast<size_t>(cfg.channels);
  return (static_cast<size_t>(cfg.vocab) + static_cast<size_t>(cfg.context) + 2) * C;
}

size_t GptParamCount(const GptConfig& cfg) {
  return EmbedParamCount(cfg) + static_cast<size_t>(cfg.layers) * BlockParamCount(cfg);
}

}  // namespace strata::layers
