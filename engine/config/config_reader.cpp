// Typed reads from one JSON object of the config, with key paths in errors.
#include "engine/config/config_reader.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "base/sizes.h"

namespace strata::config_internal {
namespace {

char Lower(char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); }

std::string LowerString(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), Lower);
  return out;
}

bool IsAuto(const Json& v) { return v.is_null() || (v.is_string() && v.get_ref<const std::string&>() == "auto"); }

template <typename T>
std::string JoinList(const std::vector<T>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    if constexpr (std::is_arithmetic_v<T>) out += std::to_string(items[i]);
    else out += std::string(items[i]);
  }
  return out;
}

std::string RangeText(double min, double max) {
  const Json lo = min, hi = max;
  if (max == std::numeric_limits<double>::max()) return "at least " + lo.dump();
  return "from " + lo.dump() + " to " + hi.dump();
}

}  // namespace

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t subst = prev[j - 1] + (Lower(a[i - 1]) == Lower(b[j - 1]) ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, subst});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string NearestKey(std::string_view key, const std::vector<std::string>& valid) {
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const auto& v : valid) {
    const size_t d = EditDistance(key, v);
    if (d < best_distance) best = v, best_distance = d;
  }
  return best;
}

ObjectReader::ObjectReader(const Json* object, std::string path)
    : object_(object), path_(std::move(path)) {}

std::string ObjectReader::KeyPath(std::string_view key) const {
  return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

const Json* ObjectReader::Find(std::string_view key) {
  if (std::find(valid_.begin(), valid_.end(), key) == valid_.end()) valid_.emplace_back(key);
  if (object_ == nullptr) return nullptr;
  const auto it = object_->find(key);
  if (it == object_->end() || IsAuto(*it)) return nullptr;
  return &*it;
}

Status ObjectReader::TypeError(std::string_view key, const Json& v,
                               std::string_view expected) const {
  return ConfigError(KeyPath(key) + ": expected " + std::string(expected) + ", got " +
                     DescribeJson(v));
}

Status ObjectReader::Bool(std::string_view key, bool* out) {
  const Json* v = Find(key);
  if (v == nullptr) return Status::Ok();
  if (!v->is_boolean()) return TypeError(key, *v, "true or false");
  *out = v->get<bool>();
  return Status::Ok();
}

Status ObjectReader::Uint(std::string_view key, uint64_t* out, uint64_t min, uint64_t max) {
  const Json* v = Find(key);
  if (v == nullptr) return Status::Ok();
  const std::string expected = "a non-negative integer";
  if (!v->is_number()) return TypeError(key, *v, expected);
  uint64_t value = 0;
  if (v->is_number_unsigned()) {
    value = v->get<uint64_t>();
  } else if (v->is_number_integer()) {  // nlohmann keeps non-negative integers unsigned
    return ConfigError(KeyPath(key) + ": " + BriefJson(*v) + " is negative; expected " + expected);
  } else {
    const double d = v->get<double>();
    if (!(d >= 0)) return ConfigError(KeyPath(key) + ": " + BriefJson(*v) + " is negative; expected " + expected);
    if (d != std::floor(d))
      return ConfigError(KeyPath(key) + ": " + BriefJson(*v) + " is not a whole number; expected " + expected);
    if (d >= 18446744073709551616.0) return ConfigError(KeyPath(key) + ": " + BriefJson(*v) + " is too large");
    value = static_cast<uint64_t>(d);
  }
  if (value < min || value > max) {
    const std::string range = max == std::numeric_limits<uint64_t>::max()
                                  ? "at least " + std::to_string(min)
                                  : "from " + std::to_string(min) + " to " + std::to_string(max);
    return ConfigError(KeyPath(key) + ": " + BriefJson(*v) + " is out of range; allowed: " + range);
  }
  *out = value;
  return Status::Ok();
}

Status ObjectReader::Int(std::string_view key, int* out, int min, int max) {
  const Json* v = Find(key);
  if (v == nullptr) return Status::Ok();
  if (!v->is_number()) return TypeError(key, *v, "an integer");
  const double d = v->get<double>();
  if (d != std::floor(d))
    return ConfigError(KeyPath(key) + ": " + BriefJson(*v) + " is not a whole number; expected an integer");
  if (d < min || d > max)
    return ConfigError(KeyPath(key) + ": " + BriefJson(*v) + " is out of range; allowed: from " +
                       std::to_string(min) + " to " + std::to_string(max));
  *out = static_cast<int>(d);
  return Status::Ok();
}

Status ObjectReader::IntChoice(std::string_view key, int* out, std::initializer_list<int> allowed) {
  const Json* v = Find(key);
  if (v == nullptr) return Status::Ok();
  if (!v->is_number()) return TypeError(key, *v, "an integer");
  const double d = v->get<double>();
  for (int a : allowed) {
    if (d == a) {
      *out = a;
      return Status::Ok();
    }
  }
  return ConfigError(KeyPath(key) + ": " + BriefJson(*v) + " is not one of " +
                     JoinList(std::vector<int>(allowed)));
}

Status ObjectReader::Double(std::string_view key, double* out, double min, double max) {
  const Json* v = Find(key);
  if (v == nullptr) return Status::Ok();
  if (!v->is_number()) return TypeError(key, *v, "a number");
  const double d = v->get<double>();
  if (!(d >= min && d <= max))
    return ConfigError(KeyPath(key) + ": " + BriefJson(*v) + " is out of range; allowed: " +
                       RangeText(min, max));
  *out = d;
  return Status::Ok();
}

Status ObjectReader::String(std::string_view key, std::string* out) {
  const Json* v = Find(key);
  if (v == nullptr) return Status::Ok();
  if (!v->is_string()) return TypeError(key, *v, "a string");
  *out = v->get<std::string>();
  return Status::Ok();
}

Status ObjectReader::Choice(std::string_view key, std::string* out,
                            std::initializer_list<std::string_view> allowed) {
  const Json* v = Find(key);
  if (v == nullptr) return Status::Ok();
  const std::vector<std::string_view> list(allowed);
  if (!v->is_string()) return TypeError(key, *v, "one of " + JoinList(list));
  const std::string lower = LowerString(v->get_ref<const std::string&>());
  if (std::find(list.begin(), list.end(), lower) == list.end())
    return ConfigError(KeyPath(key) + ": " + BriefJson(*v) + " is not one of " + JoinList(list));
  *out = lower;
  return Status::Ok();
}

Status ObjectReader::ByteSize(std::string_view key, uint64_t* out, uint64_t min) {
  const Json* v = Find(key);
  if (v == nullptr) return Status::Ok();
  const char* expected = "a byte size (a number of bytes or a string like \"8GiB\") or \"auto\"";
  uint64_t bytes = 0;
  if (v->is_string() && v->get_ref<const std::string&>().size() > 64) {
    return TypeError(key, *v, expected);  // no size is that long; keep the message short
  } else if (v->is_string()) {
    Result<uint64_t> parsed = ParseByteSize(v->get_ref<const std::string&>());
    if (!parsed.ok()) return ConfigError(KeyPath(key) + ": " + parsed.status().message());
    bytes = *parsed;
  } else if (v->is_number()) {
    // Below 2^63, as a size string must be (and so never the "auto" sentinel, 2^64 - 1).
    STRATA_RETURN_IF_ERROR(Uint(key, &bytes, 0, (uint64_t{1} << 63) - 1));
  } else {
    return TypeError(key, *v, expected);
  }
  if (bytes < min)
    return ConfigError(KeyPath(key) + ": " + BriefJson(*v) + " is too small; allowed: at least " +
                       std::to_string(min) + " bytes, or \"auto\"");
  *out = bytes;
  return Status::Ok();
}

Status ObjectReader::StringList(std::string_view key, std::vector<std::string>* out) {
  const Json* v = Find(key);
  if (v == nullptr) return Status::Ok();
  if (!v->is_array()) return TypeError(key, *v, "a list of strings");
  std::vector<std::string> items;
  for (size_t i = 0; i < v->size(); ++i) {
    const Json& item = (*v)[i];
    const std::string item_path = KeyPath(key) + "[" + std::to_string(i) + "]";
    if (!item.is_string() || item.get_ref<const std::string&>().empty())
      return ConfigError(item_path + ": expected a non-empty string, got " + DescribeJson(item));
    items.push_back(item.get<std::string>());
  }
  *out = std::move(items);
  return Status::Ok();
}

Result<ObjectReader> ObjectReader::Object(std::string_view key) {
  const Json* v = Find(key);
  if (v != nullptr && !v->is_object()) return TypeError(key, *v, "an object");
  return ObjectReader(v, KeyPath(key));
}

Result<std::string> ObjectReader::Alias(std::initializer_list<std::string_view> names) {
  const Json* chosen = nullptr;
  std::string chosen_name(*names.begin());
  for (std::string_view name : names) {
    const Json* v = Find(name);
    if (v == nullptr) continue;
    if (chosen != nullptr && *chosen != *v)
      return ConfigError(KeyPath(name) + ": " + BriefJson(*v) + " contradicts " + KeyPath(chosen_name) +
                         ": " + BriefJson(*chosen) + " (two spellings of one key; give one)");
    if (chosen == nullptr) chosen = v, chosen_name = name;
  }
  return chosen_name;
}

void ObjectReader::Noted(std::initializer_list<std::string_view> keys,
                         std::vector<std::string>* notes) {
  for (std::string_view key : keys) {
    if (Find(key) != nullptr) notes->push_back(KeyPath(key));
  }
}

void ObjectReader::Unimplemented(std::initializer_list<std::string_view> keys,
                                 std::vector<std::string>* warnings) {
  for (std::string_view key : keys) {
    if (Find(key) != nullptr)
      warnings->push_back(KeyPath(key) + ": a DeepSpeed key that Strata does not implement; ignored");
  }
}

Status ObjectReader::CheckUnknownKeys() const {
  if (object_ == nullptr) return Status::Ok();
  for (const auto& item : object_->items()) {
    if (std::find(valid_.begin(), valid_.end(), item.key()) != valid_.end()) continue;
    // A key of any length costs little: the edit distance looks at its start.
    const std::string_view key = std::string_view(item.key()).substr(0, 64);
    return ConfigError(KeyPath(BriefKey(item.key())) + ": unknown key; did you mean '" + NearestKey(key, valid_) +
                       "'?");
  }
  return Status::Ok();
}

}  // namespace strata::config_internal
