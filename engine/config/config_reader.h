// Reads one JSON object of the config at a known key path: typed values with
// DeepSpeed's leniencies ("auto" and null mean the default, 1e8 is an integer)
// and the unknown-key check that names the nearest valid key. Internal to
// engine/config*.cpp.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace strata {
struct Config;
}

namespace strata::config_internal {

using Json = nlohmann::json;

// Contradictions inside one document (bf16 with fp16, nvme without a path,
// ...): run by ParseConfig and again by ValidateConfig (config_validate.cpp).
Status CheckConfigConsistency(const Config& c);

// Levenshtein distance, case-insensitive.
size_t EditDistance(std::string_view a, std::string_view b);
// The entry of `valid` nearest to `key` (first on ties); "" when `valid` is empty.
std::string NearestKey(std::string_view key, const std::vector<std::string>& valid);
// config_json.cpp. Nesting deeper than this is refused.
inline constexpr size_t kMaxConfigDepth = 64;
// Parses the document: invalid JSON, nesting past kMaxConfigDepth, a key given
// twice in one object and numbers that overflow a double are kConfig errors
// naming the position or the key path; never throws.
Result<Json> ParseConfigJson(std::string_view text);
// A value as JSON for an error message, at most 40 characters (cut with
// "..."), whatever its size or depth.
std::string BriefJson(const Json& v);
// A key for an error message, at most 64 characters.
std::string BriefKey(std::string_view key);
// "string \"yes\"", "number -3", "array [1,2]": BriefJson with its type.
std::string DescribeJson(const Json& v);

// One object of the document. Every getter declares its key valid at this
// level; a key that is absent, null or "auto" leaves *out at its default.
// Not thread-safe; `object` must outlive the reader.
class ObjectReader {
 public:
  // `object` may be null: an absent section, every value at its default.
  ObjectReader(const Json* object, std::string path);

  const std::string& path() const { return path_; }
  std::string KeyPath(std::string_view key) const;
  // Declares `key` valid and returns its value, or null when absent/null/"auto".
  const Json* Find(std::string_view key);

  Status Bool(std::string_view key, bool* out);
  Status Uint(std::string_view key, uint64_t* out, uint64_t min = 0,
              uint64_t max = std::numeric_limits<uint64_t>::max());
  Status Int(std::string_view key, int* out, int min, int max);
  Status IntChoice(std::string_view key, int* out, std::initializer_list<int> allowed);
  Status Double(std::string_view key, double* out, double min, double max);
  Status String(std::string_view key, std::string* out);
  // Case-insensitive; stores the lower-cased choice.
  Status Choice(std::string_view key, std::string* out,
                std::initializer_list<std::string_view> allowed);
  // A number of bytes or a size string ("8GiB", "1e9"), at least `min`.
  Status ByteSize(std::string_view key, uint64_t* out, uint64_t min);
  Status StringList(std::string_view key, std::vector<std::string>* out);
  // A section: a reader over the object (over nothing when absent/null/"auto").
  Result<ObjectReader> Object(std::string_view key);

  // Two spellings of one key (e.g. "stage3_max_live_parameters" and
  // "max_live_parameters"): declares both, refuses both with different values,
  // and returns the one present (the first when neither is).
  Result<std::string> Alias(std::initializer_list<std::string_view> names);

  // Keys owned by the trainer: accepted; each present one appended to `notes`.
  void Noted(std::initializer_list<std::string_view> keys, std::vector<std::string>* notes);
  // DeepSpeed keys Strata does not implement: accepted; each present one
  // appended to `warnings` with the reason.
  void Unimplemented(std::initializer_list<std::string_view> keys,
                     std::vector<std::string>* warnings);

  // The first key not declared valid, named with the nearest valid key.
  Status CheckUnknownKeys() const;

 private:
  Status TypeError(std::string_view key, const Json& v, std::string_view expected) const;

  const Json* object_;
  std::string path_;
  std::vector<std::string> valid_;  // declaration order: ties in NearestKey go to the first
};

}  // namespace strata::config_internal
