// Model presets for strata-train, from tiny to 13B (GPT-2 / GPT-3 shapes with
// a byte-level vocabulary of 256).
#pragma once

#include <string>
#include <vector>

#include "kernels/cpu/layers/gpt_config.h"

namespace strata::train {

struct Preset {
  const char* name;
  layers::GptConfig cfg;
  int batch, seq;  // defaults for this preset
};

const std::vector<Preset>& Presets();
const Preset* FindPreset(const std::string& name);

}  // namespace strata::train
