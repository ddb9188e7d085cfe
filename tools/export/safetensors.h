// The safetensors layout: an 8-byte little-endian header length N, N bytes of
// UTF-8 JSON ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {string: string}}, padded with spaces to a multiple of 8),
// then the tensors' raw little-endian bytes, offsets counted from the end of
// the header, with no holes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "base/dtype.h"

namespace strata::exporter {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  uint64_t begin = 0, end = 0;  // bytes into the data section
};

// Lays `entries` out back to back in their order (sets begin/end) and
// returns the data section's size.
uint64_t LayOutEntries(std::vector<SafetensorsEntry>& entries);

// The file's first bytes: the length prefix and the padded JSON header.
std::string SafetensorsPrefix(const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata);

}  // namespace strata::exporter
