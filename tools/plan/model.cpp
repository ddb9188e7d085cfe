// Model input: the preset table, JSON parsing and the activation estimate.
#include "tools/plan/model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace strata::plan {

uint64_t ModelSpec::total_numel() const {
  uint64_t n = 0;
  for (const auto& g : groups) n += g.numel;
  return n;
}

uint64_t ModelSpec::largest_group_numel() const {
  uint64_t n = 0;
  for (const auto& g : groups) n = std::max(n, g.numel);
  return n;
}

double ModelSpec::ForwardFlops(const GroupSpec& g) const {
  const double tokens = static_cast<double>(seq) * static_cast<double>(micro_batch);
  double f = 2.0 * static_cast<double>(g.numel) * tokens;
  if (g.attention) f += 4.0 * tokens * static_cast<double>(seq) * static_cast<double>(hidden);
  return f;
}

double ModelSpec::HeadFlops() const {
  return 6.0 * static_cast<double>(micro_batch) * static_cast<double>(seq) * static_cast<double>(vocab) *
         static_cast<double>(hidden);
}

std::vector<GroupUse> MicroBatchUses(const ModelSpec& m) {
  const double bwd = m.checkpointing ? 3.0 : 2.0;
  const int n = static_cast<int>(m.groups.size());
  auto fwd = [&](int g) { return m.ForwardFlops(m.groups[static_cast<size_t>(g)]); };
  std::vector<GroupUse> u;
  if (m.scheme == GroupScheme::kStrataTrain) {
    u.push_back({0, true, 0, false, false});  // the embeddings (gathers: no FLOPs to speak of)
    for (int g = 1; g < n; ++g) u.push_back({g, true, fwd(g), false, false});
    u.push_back({0, true, m.HeadFlops(), true, false});
    for (int g = n - 1; g >= 1; --g) u.push_back({g, true, bwd * fwd(g), false, true});
    u.push_back({0, false, 0, false, true});  // the embeddings' backward needs no parameters
    return u;
  }
  for (int g = 0; g < n; ++g) u.push_back({g, true, fwd(g), false, false});
  for (int g = n - 1; g >= 0; --g) u.push_back({g, true, bwd * fwd(g), false, true});
  return u;
}

const std::vector<PresetInfo>& Presets() {
  // name, layers, hidden, heads, context, batch, seq. Up to 13b: strata-train's
  // (tools/train/presets.cpp); "1t" is ZeRO-Infinity's 1T shape.
  constexpr GroupScheme kTrain = GroupScheme::kStrataTrain, kGeneric = GroupScheme::kGeneric;
  static const std::vector<PresetInfo> kPresets = {
      {"tiny", 2, 64, 4, 64, 8, 64, kTrain},
      {"small", 4, 128, 4, 128, 8, 128, kTrain},
      {"medium", 6, 384, 6, 256, 8, 128, kTrain},
      {"gpt2", 12, 768, 12, 1024, 4, 256, kTrain},
      {"gpt2-medium", 24, 1024, 16, 1024, 4, 256, kTrain},
      {"gpt2-large", 36, 1280, 20, 1024, 2, 256, kTrain},
      {"gpt2-xl", 48, 1600, 25, 1024, 2, 256, kTrain},
      {"2.7b", 32, 2560, 32, 2048, 1, 512, kTrain},
      {"6.7b", 32, 4096, 32, 2048, 1, 512, kTrain},
      {"13b", 40, 5120, 40, 2048, 1, 512, kTrain},
      {"175b", 96, 12288, 96, 2048, 1, 2048, kGeneric},
      {"1t", 128, 25600, 160, 1024, 1, 1024, kGeneric},
  };
  return kPresets;
}

ModelSpec GptModel(const std::string& name, uint64_t layers, uint64_t hidden, uint64_t heads,
                   uint64_t context, GroupScheme scheme, uint64_t vocab) {
  ModelSpec m;
  m.name = name;
  m.vocab = vocab;
  m.scheme = scheme;
  m.layers = layers;
  m.hidden = hidden;
  m.heads = heads ? heads : std::max<uint64_t>(1, hidden / 128);
  m.seq = context;
  const uint64_t c = hidden, v = m.vocab;
  if (scheme == GroupScheme::kStrataTrain) {  // layers::EmbedParamCount, layers::BlockParamCount
    m.groups.push_back({"embed", v * c + context * c + 2 * c, false});  // wte (the head), wpe, ln_f
    for (uint64_t l = 0; l < layers; ++l)
      m.groups.push_back({"h" + std::to_string(l), 12 * c * c + 13 * c, true});
    return m;
  }
  m.groups.push_back({"embed", v * c + context * c, false});  // token + position (head tied)
  for (uint64_t l = 0; l < layers; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    m.groups.push_back({p + "attn", 4 * c * c + 4 * c + 2 * c, true});     // ln1, qkv, proj
    m.groups.push_back({p + "mlp_fc", 4 * c * c + 4 * c + 2 * c, false});  // ln2, fc
    m.groups.push_back({p + "mlp_proj", 4 * c * c + c, false});
  }
  m.groups.push_back({"ln_f", 2 * c, false});
  return m;
}

Result<ModelSpec> PresetModel(const std::string& name) {
  for (const auto& p : Presets())
    if (name == p.name) {
      ModelSpec m = GptModel(p.name, p.layers, p.hidden, p.heads, p.context, p.scheme);
      m.micro_batch = p.batch;
      m.seq = p.seq;
      return m;
    }
  std::string all;
  for (const auto& p : Presets()) all += std::string(all.empty() ? "" : ", ") + p.name;
  return InvalidError("model '" + name + "': not a preset (" + all + ") nor a JSON file");
}

namespace {

// The largest value each count may take: the model's sizes stay within
// what a uint64 holds (12 * hidden^2 at 2^24 is 3.4e15), every layer is a
// group of at most Partition's 10^6, and a group at most 2^40 elements.
uint64_t MaxOf(const char* key) {
  const std::string k = key;
  if (k == "layers") return 1000000;
  if (k == "hidden" || k == "heads") return uint64_t{1} << 24;
  if (k == "seq" || k == "context") return uint64_t{1} << 26;
  if (k == "vocab") return uint64_t{1} << 32;
  if (k == "micro_batch") return uint64_t{1} << 20;
  return uint64_t{1} << 30;  // grad_accum
}

// A whole number in [0, max] (a JSON float too, when whole), named when not:
// 2048.7 was 2048, 2^64 undefined, a hidden of 2^32 wrapped its groups' sizes.
Status ReadCount(const nlohmann::json& v, const std::string& at, uint64_t max, uint64_t* out) {
  if (v.is_number_unsigned() || v.is_number_integer()) {
    if (v.is_number_integer() && !v.is_number_unsigned() && v.get<int64_t>() < 0)
      return ConfigError(at + ": " + v.dump() + " is negative; expected a whole number from 0 to " + std::to_string(max));
    if (v.get<uint64_t>() > max)
      return ConfigError(at + ": " + v.dump() + " is out of range; expected a whole number from 0 to " + std::to_string(max));
    *out = v.get<uint64_t>();
    return Status::Ok();
  }
  if (!v.is_number()) return ConfigError(at + ": expected a non-negative whole number");
  const double d = v.get<double>();
  if (!(d >= 0) || d != std::floor(d) || d > static_cast<double>(max))
    return ConfigError(at + ": " + v.dump() + " is not a whole number from 0 to " + std::to_string(max));
  *out = static_cast<uint64_t>(d);
  return Status::Ok();
}

template <typename T>
Status Read(const nlohmann::json& j, const char* key, T* out) {
  if (!j.contains(key)) return Status::Ok();
  const auto& v = j.at(key);
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return ConfigError(std::string("model.") + key + ": expected true or false");
    *out = v.get<bool>();
    return Status::Ok();
  } else {
    uint64_t n = 0;
    STRATA_RETURN_IF_ERROR(ReadCount(v, std::string("model.") + key, MaxOf(key), &n));
    *out = static_cast<T>(n);
    return Status::Ok();
  }
}

Status ReadGroups(const nlohmann::json& j, ModelSpec* m) {
  if (!j.is_array()) return ConfigError("model.groups: expected a list of {\"name\", \"numel\"}");
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& g = j[i];
    const std::string at = "model.groups[" + std::to_string(i) + "]";
    if (!g.is_object() || !g.contains("numel"))
      return ConfigError(at + ".numel: required, a positive element count");
    uint64_t numel = 0;
    STRATA_RETURN_IF_ERROR(ReadCount(g["numel"], at + ".numel", uint64_t{1} << 40, &numel));
    if (numel == 0) return ConfigError(at + ".numel: 0; expected a positive element count");
    if ((g.contains("name") && !g["name"].is_string()) ||
        (g.contains("attention") && !g["attention"].is_boolean()))
      return ConfigError(at + ": name must be a string and attention true or false");
    GroupSpec s;
    s.name = g.value("name", "group" + std::to_string(i));
    s.numel = numel;
    s.attention = g.value("attention", false);
    m->groups.push_back(std::move(s));
  }
  return Status::Ok();
}

}  // namespace

Result<ModelSpec> ParseModelJson(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return ConfigError("model: not a JSON object");
  static const char* kKeys[] = {"name",       "groups",        "hidden", "layers", "heads",
                                "seq",        "context",       "vocab",  "scheme", "micro_batch",
                                "grad_accum", "checkpointing", "preset"};
  for (auto it = j.begin(); it != j.end(); ++it)
    if (std::find_if(std::begin(kKeys), std::end(kKeys), [&](const char* k) { return it.key() == k; }) ==
        std::end(kKeys))
      return ConfigError("model." + it.key() + ": unknown key");
  for (const char* k : {"name", "preset", "scheme"})
    if (j.contains(k) && !j[k].is_string())
      return ConfigError(std::string("model.") + k + ": expected a string");
  GroupScheme scheme = GroupScheme::kGeneric;
  if (j.contains("scheme")) {
    const std::string s = j["scheme"].get<std::string>();
    if (s != "generic" && s != "strata-train")
      return ConfigError("model.scheme: '" + s + "' is not generic or strata-train");
    scheme = s == "strata-train" ? GroupScheme::kStrataTrain : GroupScheme::kGeneric;
  }
  ModelSpec m;
  if (j.contains("preset")) {
    STRATA_ASSIGN_OR_RETURN(m, PresetModel(j["preset"].get<std::string>()));
  } else if (!j.contains("groups")) {
    uint64_t layers = 0, hidden = 0, heads = 0, context = 1024, vocab = 256;
    STRATA_RETURN_IF_ERROR(Read(j, "layers", &layers));
    STRATA_RETURN_IF_ERROR(Read(j, "hidden", &hidden));
    STRATA_RETURN_IF_ERROR(Read(j, "heads", &heads));
    STRATA_RETURN_IF_ERROR(Read(j, "context", &context));
    STRATA_RETURN_IF_ERROR(Read(j, "vocab", &vocab));
    if (layers == 0 || hidden == 0)
      return ConfigError("model: give \"groups\", a \"preset\", or \"layers\" and \"hidden\"");
    m = GptModel("custom", layers, hidden, heads, context, scheme, vocab);
  }
  if (j.contains("groups")) {
    m.groups.clear();
    STRATA_RETURN_IF_ERROR(ReadGroups(j["groups"], &m));
  }
  m.name = j.value("name", m.name.empty() ? std::string("custom") : m.name);
  STRATA_RETURN_IF_ERROR(Read(j, "hidden", &m.hidden));
  STRATA_RETURN_IF_ERROR(Read(j, "layers", &m.layers));
  STRATA_RETURN_IF_ERROR(Read(j, "heads", &m.heads));
  STRATA_RETURN_IF_ERROR(Read(j, "vocab", &m.vocab));
  STRATA_RETURN_IF_ERROR(Read(j, "seq", &m.seq));
  STRATA_RETURN_IF_ERROR(Read(j, "micro_batch", &m.micro_batch));
  STRATA_RETURN_IF_ERROR(Read(j, "grad_accum", &m.grad_accum));
  STRATA_RETURN_IF_ERROR(Read(j, "checkpointing", &m.checkpointing));
  if (j.contains("scheme")) m.scheme = scheme;
  if (m.groups.empty()) return ConfigError("model.groups: empty");
  if (m.micro_batch == 0 || m.seq == 0 || m.grad_accum == 0)
    return ConfigError("model: seq, micro_batch and grad_accum must be at least 1");
  return m;
}

Result<ModelSpec> LoadModelFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return IoError("model file " + path + ": cannot be opened");
  std::stringstream ss;
  ss << f.rdbuf();
  auto m = ParseModelJson(ss.str());
  if (!m.ok()) return m.status().WithContext(path);
  return m;
}

Result<ModelSpec> ResolveModel(const std::string& name_or_path) {
  if (name_or_path.find('/') != std::string::npos || name_or_path.ends_with(".json"))
    return LoadModelFile(name_or_path);
  return PresetModel(name_or_path);
}

namespace {
// A byte estimate as a uint64: saturated at its largest (a plan that far
// over never fits), where a plain conversion of 2^64 or more is undefined
// (0 on x86-64 GCC: a 28 EB shortfall planned as fitting).
uint64_t Saturated(double bytes) {
  return bytes >= 18446744073709551615.0 || std::isnan(bytes) ? UINT64_MAX : static_cast<uint64_t>(bytes);
}
}  // namespace

uint64_t StashableActivationBytes(const ModelSpec& m, uint64_t* layer_out) {
  if (layer_out) *layer_out = 0;
  if (m.hidden == 0 || m.layers == 0) return 0;
  const double s = static_cast<double>(m.seq), b = static_cast<double>(m.micro_batch);
  const double h = static_cast<double>(m.hidden), a = static_cast<double>(m.heads ? m.heads : 1);
  const double one = m.checkpointing ? 2.0 * s * b * h : s * b * h * (34.0 + 5.0 * a * s / h);
  const double layers = static_cast<double>(m.checkpointing ? m.layers : m.layers - 1);
  if (layer_out) *layer_out = Saturated(one);
  return Saturated(layers * one);
}

uint64_t ActivationBytes(const ModelSpec& m) {
  if (m.hidden == 0 || m.layers == 0) return 0;  // a group list without shape: no estimate
  const double s = static_cast<double>(m.seq), b = static_cast<double>(m.micro_batch);
  const double h = static_cast<double>(m.hidden), a = static_cast<double>(m.heads ? m.heads : 1);
  const double layer = s * b * h * (34.0 + 5.0 * a * s / h);
  const double logits = s * b * static_cast<double>(m.vocab) * 4.0;  // fp32 logits and their gradient
  const double total = m.checkpointing ? static_cast<double>(m.layers) * 2.0 * s * b * h + layer
                                       : static_cast<double>(m.layers) * layer;
  return Saturated(total + 2.0 * logits);
}

}  // namespace strata::plan
