// The preset table.
#include "tools/train/presets.h"

namespace strata::train {

const std::vector<Preset>& Presets() {
  // {vocab, context, channels, heads, layers}, batch, seq
  static const std::vector<Preset> kPresets = {
      {"tiny", {256, 64, 64, 4, 2}, 8, 64},
      {"small", {256, 128, 128, 4, 4}, 8, 128},  // the README default: ~0.84M parameters
      {"medium", {256, 256, 384, 6, 6}, 8, 128},
      {"gpt2", {256, 1024, 768, 12, 12}, 4, 256},
      {"gpt2-medium", {256, 1024, 1024, 16, 24}, 4, 256},
      {"gpt2-large", {256, 1024, 1280, 20, 36}, 2, 256},
      {"gpt2-xl", {256, 1024, 1600, 25, 48}, 2, 256},
      {"2.7b", {256, 2048, 2560, 32, 32}, 1, 512},
      {"6.7b", {256, 2048, 4096, 32, 32}, 1, 512},
      {"13b", {256, 2048, 5120, 40, 40}, 1, 512},
  };
  return kPresets;
}

const Preset* FindPreset(const std::string& name) {
  for (const auto& p : Presets())
    if (name == p.name) return &p;
  return nullptr;
}

}  // namespace strata::train
