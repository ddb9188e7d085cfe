// The model a plan is made for: parameter groups (the tensors one layer needs
// together, as the trainer registers them), the shape figures that the
// activation estimate and the compute time need, and the order in which the
// trainer uses the groups in a step. From a GPT-2-style preset or from JSON:
// {"groups": [{"name": "...", "numel": N}, ...], "hidden": C, "layers": L,
// "heads": H, "seq": T, "micro_batch": B, "checkpointing": true}.
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

// How a GPT's parameters are cut into groups, and so the step's order of use.
enum class GroupScheme {
  // Any list of groups: forward 0..n-1, backward n-1..0. GPT presets: the
  // embeddings, then three groups a layer (attention, MLP up, MLP down), then ln_f.
  kGeneric,
  // strata-train's (tools/train/gpt.cpp): group 0 = wte, wpe and ln_f (wte is
  // the tied head), group 1 + l = block l. Fetches 0, 1..L, 0 (the head:
  // forward and backward), L..1 (recompute and backward); grads L..1, then 0.
  kStrataTrain,
};

struct ModelSpec {
  std::string name;
  GroupScheme scheme = GroupScheme::kGeneric;
  std::vector<GroupSpec> groups;  // in forward order
  uint64_t hidden = 0;            // C
  uint64_t layers = 0;            // L
  uint64_t heads = 0;             // H
  uint64_t vocab = 256;           // V: byte-level, as strata-train's tokenizer
  uint64_t seq = 1024;            // T: tokens per sequence
  uint64_t micro_batch = 1;       // B: sequences per rank per forward
  uint64_t grad_accum = 1;        // micro-batches per optimizer step
  bool checkpointing = true;      // activation checkpointing (recompute in backward)

  uint64_t total_numel() const;
  uint64_t largest_group_numel() const;
  // Forward FLOPs of one group for one micro-batch: 2·numel·B·T (+ attention).
  double ForwardFlops(const GroupSpec& g) const;
  // The tied LM head's forward and backward for one micro-batch: logits
  // 2·B·T·V·C, their backward twice that.
  double HeadFlops() const;
};

// One use of a group in a micro-batch, in the trainer's order: fetch the
// group (or not), compute `flops` (the head's or the layers'), then hand the
// group's gradient to the engine (or not).
struct GroupUse {
  int group = 0;
  bool fetch = true;
  double flops = 0;
  bool head = false;  // runs at the LM head's rate (ClusterSpec::LayerFlops)
  bool grads = false;
};
// Backward costs 2x the forward, 3x with checkpointing (the recompute).
std::vector<GroupUse> MicroBatchUses(const ModelSpec& m);

// The preset table: strata-train's (tools/train/presets.cpp: its shapes, its
// default batch and seq, its groups: one a block) and ZeRO-Infinity's large
// shapes (175b, 1t: three groups a layer, each about 4·C², the largest unit a
// rank gathers at once). GPT-2 shapes, byte-level vocabulary (V = 256),
// params ≈ 12·L·C² + V·C + T·C.
struct PresetInfo {
  const char* name;
  uint64_t layers, hidden, heads, context;
  uint64_t batch, seq;  // micro_batch and seq defaults
  GroupScheme scheme;
};
const std::vector<PresetInfo>& Presets();
Result<ModelSpec> PresetModel(const std::string& name);
// A model from shape figures (used by the presets and by JSON with "layers"
// and "hidden" but no "groups"); seq = context, micro_batch = 1.
ModelSpec GptModel(const std::string& name, uint64_t layers, uint64_t hidden, uint64_t heads,
                   uint64_t context, GroupScheme scheme = GroupScheme::kGeneric, uint64_t vocab = 256);

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
// What the trainer stashes in the engine's activation store (strata.activation_*,
// engine/activations/): with checkpointing every layer's 2·B·T·C input, without
// it every layer's saved tensors but the one in use. `layer_out` (may be null):
// one layer's share, the unit a host arena holds.
uint64_t StashableActivationBytes(const ModelSpec& m, uint64_t* layer_out = nullptr);

}  // namespace strata::plan
