// Builds a safetensors header (see safetensors.h).
#include "tools/export/safetensors.h"

#include <nlohmann/json.hpp>

namespace strata::exporter {

namespace {

const char* SafetensorsDType(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
  }
  return "F32";
}

}  // namespace

uint64_t LayOutEntries(std::vector<SafetensorsEntry>& entries) {
  uint64_t at = 0;
  for (SafetensorsEntry& e : entries) {
    uint64_t n = 1;
    for (uint64_t d : e.shape) n *= d;
    e.begin = at;
    e.end = at + n * DTypeSize(e.dtype);
    at = e.end;
  }
  return at;
}

std::string SafetensorsPrefix(const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  for (const SafetensorsEntry& e : entries)
    h[e.name] = {{"dtype", SafetensorsDType(e.dtype)}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  std::string json = h.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json;
}

}  // namespace strata::exporter
