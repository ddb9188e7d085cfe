// The model a plan is made for: parameter groups (the tensors one layer needs
// together, as the trainer registers them) and the shape figures that the
// activation estimate and the compute time need. From a GPT-2-style preset
// or from JSON: {"groups": [{"name": "...", "numel": N}, ...], "hidden": C,
// "layers": L, "heads": H, "seq": T, "micro_batch": B, "checkpointing": true}.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace strata::plan {

struct GroupSpec {
  std::string name;
  uint64_t numel = 0;
  bool attention = false;  // carries the layer's attention score FLOPs (4·B·T²·C forward)
};

struct ModelSpec {
  std::string name;
  std::vector<GroupSpec> groups;  // in forward order
  uint64_t hidden = 0;            // C
  uint64_t layers = 0;            // L
  uint64_t heads = 0;             // H
  uint64_t seq = 1024;            // T: tokens per sequence
  uint64_t micro_batch = 1;       // B: sequences per rank per forward
  uint64_t grad_accum = 1;        // micro-batches per optimizer step
  bool checkpointing = true;      // activation checkpointing (recompute in backward)

  uint64_t total_numel() const;
  uint64_t largest_group_numel() const;
  // Forward FLOPs of one group for one micro-batch: 2·numel·B·T (+ attention).
  double ForwardFlops(const GroupSpec& g) const;
};

// The preset table (strata-plan's own until strata-train's presets land):
// GPT-2 shapes with a byte-level vocabulary (V = 256), params ≈ 12·L·C² +
// V·C + T·C; each layer is three groups (attention, MLP up, MLP down) of
// about 4·C² each, the largest unit a rank has to gather at once.
struct PresetInfo {
  const char* name;
  uint64_t layers, hidden, heads, context;
};
const std::vector<PresetInfo>& Presets();
Result<ModelSpec> PresetModel(const std::string& name);
// A model from shape figures (used by the presets and by JSON with "layers"
// and "hidden" but no "groups").
ModelSpec GptModel(const std::string& name, uint64_t layers, uint64_t hidden, uint64_t heads,
                   uint64_t context);

// JSON text or a file. Errors name the key.
Result<ModelSpec> ParseModelJson(const std::string& text);
Result<ModelSpec> LoadModelFile(const std::string& path);
// A preset name, or a path to a JSON file.
Result<ModelSpec> ResolveModel(const std::string& name_or_path);

// Activation bytes per rank on the device for one micro-batch (16-bit
// activations, Korthikanti et al. 2022): without checkpointing every layer
// keeps B·T·C·(34 + 5·H·T/C); with it, each layer keeps its 2·B·T·C input and
// one layer at a time is recomputed in full.
uint64_t ActivationBytes(const ModelSpec& m);

}  // namespace strata::plan
